"""``CEGPPOTrainer`` under ``torchrun --nproc_per_node 2`` (gloo, CPU) reproduces a 1-process run on the same
global batch: loss, every gradient, the final weights and the logged (token-weighted) metrics, over an on-policy
step and an off-policy step where the beta regions act.

The reference is one process without gradient accumulation (16 completions per micro-batch); the 2-process run
splits the same 16 completions into 2 processes x 2 accumulated micro-batches of 4, with unequal completion tokens
per process. Completions are replayed deterministically (tests/multiprocess_trl_worker.py); everything else is
TRL's, with a tiny locally built model.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl")

import torch  # noqa: E402

WORKER = Path(__file__).with_name("multiprocess_trl_worker.py")
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=256)
RTOL = 1e-5
# token means over the window; TRL's plain means over micro-batches differed (clip/low_frac 0.3218 vs 0.3267)
WEIGHTED_METRICS = ("clip/low_frac", "clip/high_frac", "clip/dual_frac", "ppo_kl", "ratio/mean", "entropy",
                    "policy_loss", "clip_ratio/region_mean", "quadrant/PA_LP/frac", "quadrant/NA_LP/entropy")


def _run(launcher: list[str], model: str, out: Path, per_device_batch: int, grad_accum: int) -> tuple[dict, dict]:
    out.mkdir(parents=True)
    cmd = launcher + [str(WORKER), model, str(out), str(per_device_batch), str(grad_accum)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads((out / "result.json").read_text()), torch.load(out / "tensors.pt")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_two_processes_equal_one(tmp_path: Path) -> None:
    from cegppo.engine.models import build_tiny_model

    model = str(build_tiny_model(tmp_path / "model", seed=0, **SMALL))
    one, one_t = _run([sys.executable], model, tmp_path / "one", per_device_batch=16, grad_accum=1)
    one_log = one["logs"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    two, two_t = _run(torchrun, model, tmp_path / "two", per_device_batch=4, grad_accum=2)

    tokens = two["tokens_per_rank"]
    assert len(tokens) == 2 and tokens[0] != tokens[1], tokens  # unequal tokens per process
    assert sum(tokens) == one["tokens_per_rank"][0]  # the same completions, split
    assert len(one_log) == len(two["logs"]) == 2 and len(one_t["grads"]) == len(two_t["grads"]) == 2

    for step, (a, b) in enumerate(zip(two["logs"], one_log)):
        assert a["loss"] == pytest.approx(b["loss"], rel=RTOL), step
        for name in WEIGHTED_METRICS:
            assert a[name] == pytest.approx(b[name], rel=RTOL, abs=1e-7), (step, name, a[name], b[name])
    # step 2 reuses the batch after an update (num_iterations=2): off-policy, both beta regions reached
    assert one_log[1]["clip/low_frac"] > 0.05 and one_log[1]["clip/high_frac"] > 0.05, one_log[1]
    assert one_log[0]["ppo_kl"] == 0.0 and one_log[1]["ppo_kl"] != 0.0

    for step, (g2, g1) in enumerate(zip(two_t["grads"], one_t["grads"])):
        assert _rel(g2, g1) < RTOL, (step, _rel(g2, g1))
        torch.testing.assert_close(g2, g1, rtol=RTOL, atol=RTOL * float(g1.abs().max()))
    assert _rel(two_t["weights"], one_t["weights"]) < RTOL
