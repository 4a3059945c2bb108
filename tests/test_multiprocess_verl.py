"""verl 0.9.1's FSDP2 engine with the registered ``ce_gppo`` on 2 data-parallel ranks (torchrun, gloo, CPU)
reproduces 1 rank on the same global batch over two updates (on-policy, then off-policy): loss, grad norm, clip
metrics and final weights to 1e-5 relative. The ranks hold unequal token counts, so this holds only if each rank
normalises by the global token count.

Needs verl with its own dependencies (hydra-core for verl's config, its pinned transformers / tensordict): the
[verl] install, where .ci/check_extras.sh runs this file. The README's test environment installs verl --no-deps
without Hydra, and skips it there.
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

import torch  # noqa: E402

WORKER = Path(__file__).with_name("multiprocess_verl_worker.py")
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=256)
RTOL = 1e-5
METRICS = ("loss", "grad_norm", "actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower",
           "actor/clip/low_frac", "actor/clip/high_frac", "actor/clip/dual_frac")


def _run(model: str, out: Path, ranks: int) -> tuple[list[dict], dict[str, torch.Tensor]]:
    out.mkdir(parents=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
           str(WORKER), model, str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VERL_ENGINE_DEVICE": "cuda", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-8000:]}"
    return json.loads((out / "result.json").read_text()), torch.load(out / "weights.pt")


def test_fsdp2_engine_two_ranks_equal_one(tmp_path: Path) -> None:
    from cegppo.engine.models import build_tiny_model

    model = str(build_tiny_model(tmp_path / "model", seed=0, **SMALL))
    one, one_w = _run(model, tmp_path / "one", 1)
    two, two_w = _run(model, tmp_path / "two", 2)

    tokens = two[0]["tokens_per_rank"]
    assert len(tokens) == 2 and tokens[0] != tokens[1] and sum(tokens) == one[0]["tokens_per_rank"][0], tokens
    assert len(one) == len(two) == 2
    for update, (a, b) in enumerate(zip(two, one)):
        for name in METRICS:
            assert a[name] == pytest.approx(b[name], rel=RTOL, abs=1e-8), (update, name, a[name], b[name])
    # update 1 is on-policy; update 2 reuses the old log-probs from before update 1: both beta regions act
    assert one[0]["actor/ppo_kl"] == 0.0 and one[0]["actor/pg_clipfrac"] == 0.0
    assert one[1]["actor/clip/low_frac"] > 0.05 and one[1]["actor/clip/high_frac"] > 0.05, one[1]

    assert one_w.keys() == two_w.keys()
    for name, w1 in one_w.items():
        rel = float((two_w[name] - w1).norm() / w1.norm())
        assert rel < RTOL, (name, rel)
    # and the updates did move the weights
    from safetensors.torch import load_file

    initial = load_file(str(Path(model) / "model.safetensors"))
    moved = [name for name in initial if name in one_w and not torch.equal(initial[name], one_w[name])]
    assert len(moved) > len(initial) // 2, moved
