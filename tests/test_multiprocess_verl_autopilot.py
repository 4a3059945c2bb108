"""The entropy autopilot in verl 0.9.1 (cegppo.integrations.verl_autopilot) through verl's FSDP2 engine on 2
data-parallel ranks (torchrun, gloo, CPU; tests/multiprocess_verl_autopilot_worker.py): over 3 steps the
controller moves beta1 and the entropy bonus, every rank applies in every micro-batch exactly the values the
driver sent, the 2-rank run equals a 1-rank run (entropy, betas, bonus, loss, grad norm, clip metrics to 1e-5;
losses, which cancel to near 0, to 1e-6 absolute), and a run resumed from verl's checkpoint plus the controller
state after step 1 continues the same sequence bit for bit.

Needs verl with Hydra (the [verl] install, where .ci/check_extras.sh runs this file); skipped elsewhere.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("verl")
pytest.importorskip("hydra", reason="verl's Hydra config needs hydra-core: the [verl] install (.ci/check_extras.sh) "
                                    "runs this test; the test environment installs verl --no-deps")

from test_multiprocess_verl import SMALL  # noqa: E402

WORKER = Path(__file__).with_name("multiprocess_verl_autopilot_worker.py")
RTOL = 1e-5
KEYS = ("cegppo_beta1", "cegppo_beta2", "cegppo_entropy_coeff")
METRICS = ("loss", "grad_norm", "actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/clip/low_frac",
           "actor/clip/high_frac", "actor/entropy_loss")


def _run(model: str, out: Path, ranks: int, first: int, last: int, *extra: str) -> tuple[list[dict], dict]:
    out.mkdir(parents=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
           str(WORKER), model, str(out), str(first), str(last), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VERL_ENGINE_DEVICE": "cuda", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-8000:]}"
    rows = json.loads((out / "result.json").read_text())
    return rows[:-1], rows[-1]["state"]


def _applied_everywhere(rows: list[dict], ranks: int) -> None:
    """Every rank, in every micro-batch of both updates, applied exactly what the driver sent."""
    for row in rows:
        sent = row["extra_info"]
        for update in ("update0", "update1"):
            for key, name in zip(KEYS, ("beta1", "beta2", "entropy_coeff")):
                per_rank = row[update][f"control/applied_{name}"]
                assert len(per_rank) == ranks, (row["step"], update, name, per_rank)
                for r, values in enumerate(per_rank):
                    assert values and all(v == sent[key] for v in values), (row["step"], update, r, name, values, sent)


def test_autopilot_two_ranks_equal_one_and_resumes(tmp_path: Path) -> None:
    from cegppo.engine.models import build_tiny_model

    model = str(build_tiny_model(tmp_path / "model", seed=0, **SMALL))
    two, two_state = _run(model, tmp_path / "two", 2, 1, 3, "--save-after", "1")
    one, one_state = _run(model, tmp_path / "one", 1, 1, 3)
    resumed, resumed_state = _run(model, tmp_path / "resumed", 2, 2, 3, "--resume", str(tmp_path / "two" / "ckpt"))

    # the controller steered: beta1 moved every step (inside its bounds) and the bonus lever acted
    beta1 = [row["extra_info"]["cegppo_beta1"] for row in two]
    assert len(set(beta1)) == 3 and all(0.0 < b < 0.5 for b in beta1), beta1
    assert all(row["extra_info"]["cegppo_entropy_coeff"] > 0 for row in two), two
    assert all(row["update1"]["actor/clip/low_frac"] > 0.05 for row in two), "beta1's region must be non-empty"
    _applied_everywhere(two, 2)
    _applied_everywhere(one, 1)
    _applied_everywhere(resumed, 2)

    # 2 ranks = 1 rank: the same entropy, so the same betas, so the same updates
    for a, b in zip(two, one, strict=True):
        assert a["actor/entropy"] == pytest.approx(b["actor/entropy"], rel=RTOL), a["step"]
        for key in KEYS:
            assert a["extra_info"][key] == pytest.approx(b["extra_info"][key], rel=RTOL, abs=1e-8), (a["step"], key)
        for update in ("update0", "update1"):
            for name in METRICS:
                assert a[update][name] == pytest.approx(b[update][name], rel=RTOL, abs=1e-6), (a["step"], update, name)
    assert two_state["beta1"] == pytest.approx(one_state["beta1"], rel=RTOL)

    # resumed after step 1 (verl's checkpoint + entropy_control_state.json): steps 2-3 as in the uninterrupted run
    assert (tmp_path / "two" / "ckpt" / "entropy_control_state.json").is_file()
    assert [row["step"] for row in resumed] == [2, 3]
    for a, b in zip(resumed, two[1:], strict=True):
        assert a["actor/entropy"] == b["actor/entropy"], a["step"]
        assert a["extra_info"] == b["extra_info"], a["step"]
        for update in ("update0", "update1"):
            for name in METRICS:
                assert a[update][name] == b[update][name], (a["step"], update, name)
    assert resumed_state == two_state and two_state["updates"] == 3
