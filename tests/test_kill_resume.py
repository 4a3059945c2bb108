"""Kill -9 at each failpoint, resume, and get exactly the metrics of an uninterrupted run.

Each run is a real `python -m cegppo.cli train tiny ...` subprocess killed by `cegppo.faults.failpoint`
(SIGKILL: no cleanup, no flush). The reference is computed once per module.
"""

import logging
import math
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from cegppo.engine import checkpoint as ckpt
from cegppo.io import read_jsonl

TESTS = Path(__file__).resolve().parent
STEPS = 4
KILL_AT = 3
ARGS = [
    "reward.fn=fixtures.rewards:digit_overlap", "sft.steps=0", "data.num_train=16", "data.num_test=0",
    f"train.steps={STEPS}", "train.save_every=1", "train.keep_checkpoints=2", "train.threads=1",
    "train.deterministic=true", "train.prompts_per_step=2", "train.mini_batches=2", "rollout.max_new_tokens=16",
    "logging.progress=false",
]
FAILPOINTS = ["generation", "optimizer-step", "checkpoint-write", "checkpoint-renamed"]


def run_cli(out: Path, failpoint: str | None = None, resume: bool = False) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "CEGPPO_FAILPOINT"}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    if failpoint:
        env["CEGPPO_FAILPOINT"] = failpoint
    cmd = [sys.executable, "-m", "cegppo.cli", "train", "tiny", f"output_dir={out}", *ARGS]
    return subprocess.run(cmd + (["--resume"] if resume else []), env=env, capture_output=True, text=True,
                          timeout=300)


def assert_same_metrics(run: Path, reference: list[dict]) -> None:
    rows = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for got, want in zip(rows, reference):
        keys = {k for k in want if not k.startswith("time/")}
        assert keys == {k for k in got if not k.startswith("time/")}
        for k in sorted(keys):
            a, b = got[k], want[k]
            assert math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-12), f"step {want['step']} {k}: {a} != {b}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("kill-resume") / "reference"
    r = run_cli(out)
    assert r.returncode == 0, r.stderr[-3000:]
    return out, read_jsonl(out / "metrics.jsonl")


@pytest.mark.parametrize("point", FAILPOINTS)
def test_kill_and_resume_is_exact(point, reference, tmp_path):
    out = tmp_path / "run"
    killed = run_cli(out, failpoint=f"{point}:{KILL_AT}")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    logged = [r["step"] for r in read_jsonl(out / "metrics.jsonl")]
    newest = ckpt.latest_valid_checkpoint(out / "checkpoints")
    if point in ("checkpoint-write", "checkpoint-renamed"):
        assert logged == [1, 2, 3]  # the step's row was appended before its checkpoint
    else:
        assert logged == [1, 2]
    assert newest.name == f"step_{(KILL_AT if point == 'checkpoint-renamed' else KILL_AT - 1):06d}"
    if point == "checkpoint-write":
        assert ckpt.stale_temp_dirs(out / "checkpoints")  # the half-written directory is still there

    resumed = run_cli(out, resume=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {newest}" in resumed.stderr
    assert_same_metrics(out, reference[1])
    assert not ckpt.stale_temp_dirs(out / "checkpoints")
    assert [p.name for p in ckpt.list_checkpoints(out / "checkpoints")] == ["step_000003", "step_000004"]
    assert ckpt.latest_valid_checkpoint(out / "checkpoints").name == "step_000004"


def _corrupt(run: Path) -> Path:
    """Flip a byte in the newest checkpoint's weights and leave a half-written temporary directory."""
    root = run / "checkpoints"
    weights = root / "step_000004" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-10] ^= 0xFF
    weights.write_bytes(bytes(data))
    half = root / ".tmp-step_000005-999999"
    half.mkdir()
    (half / "model.safetensors").write_bytes(b"\0" * 100)
    return root


def test_corrupted_newest_and_half_written_checkpoints_are_skipped(reference, tmp_path, caplog):
    run = tmp_path / "run"
    shutil.copytree(reference[0], run)
    root = _corrupt(run)
    with caplog.at_level(logging.WARNING, logger="cegppo.engine.checkpoint"):
        assert ckpt.latest_valid_checkpoint(root) == root / "step_000003"
    text = caplog.text
    assert "skipping half-written checkpoint directory" in text and ".tmp-step_000005-999999" in text
    assert "skipping checkpoint" in text and "step_000004" in text and "model.safetensors does not match" in text
    # truncation is caught by the size check
    w = root / "step_000003" / "model.safetensors"
    w.write_bytes(w.read_bytes()[:-1])
    assert "bytes, manifest says" in ckpt.verify_checkpoint(root / "step_000003")
    (root / "step_000003" / ckpt.MANIFEST).unlink()
    assert ckpt.verify_checkpoint(root / "step_000003") == "no manifest (write was interrupted)"
    assert ckpt.latest_valid_checkpoint(root) is None


def test_resume_past_a_corrupted_checkpoint_is_exact(reference, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(reference[0], run)
    _corrupt(run)
    r = run_cli(run, resume=True)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "skipping checkpoint" in r.stderr and "resumed from" in r.stderr and "step_000003" in r.stderr
    assert_same_metrics(run, reference[1])
    assert ckpt.latest_valid_checkpoint(run / "checkpoints").name == "step_000004"
    assert not ckpt.stale_temp_dirs(run / "checkpoints")
