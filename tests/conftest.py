import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # so `fixtures.rewards:digit_overlap` imports as a user reward would
# the benchmark scripts and their shared package `common`, as a script run from benchmarks/ sees them (the one
# place the tests put benchmarks/ on the path; last, so that it shadows nothing)
sys.path.append(str(ROOT / "benchmarks"))

AIME_LAYOUTS = ("interleaved", "blocked")
# The device the objective-family, prompt-sharing and TRL-adapter tests put their tensors and models on: cpu here and
# in CI; benchmarks/gpu_check.sh runs them with CEGPPO_TEST_DEVICE=cuda on a GPU machine.
TEST_DEVICE = os.environ.get("CEGPPO_TEST_DEVICE", "cpu")


def write_x32(src: Path, dst: Path, layout: str = "interleaved") -> Path:
    """Rebuild the released 960-row layout (30 prompts x 32 copies) from a 30-row file.

    interleaved: the whole file repeated 32 times; blocked: each row repeated 32 times in a row.
    """
    lines = [ln for ln in src.read_text().splitlines() if ln.strip()]
    reps = 32 * 30 // len(lines)
    rows = lines * reps if layout == "interleaved" else [ln for ln in lines for _ in range(reps)]
    dst.write_text("\n".join(rows) + "\n")
    return dst


@pytest.fixture(params=AIME_LAYOUTS)
def aime24_x32(request, tmp_path) -> Path:
    """Path of the bundled AIME 24 file repeated 32 times (both layouts)."""
    from cegppo.data.evalsets import resolve_dataset

    return write_x32(resolve_dataset("aime24"), tmp_path / f"aime24_x32_{request.param}.jsonl", request.param)


@pytest.fixture
def tiny_config(tmp_path):
    """Build a validated `tiny` config in tmp_path: tiny_config("train.steps=2", ...)."""
    from cegppo.cli import example_config
    from cegppo.config import load_config

    def make(*overrides: str, out: Path | None = None):
        base = [
            f"output_dir={out or tmp_path / 'run'}",
            "reward.fn=fixtures.rewards:digit_overlap",
            "sft.steps=0",
            "data.num_test=4",
            "eval.num_problems=4",
            "logging.progress=false",
        ]
        return load_config(example_config("tiny"), base + list(overrides))

    return make


@pytest.fixture
def no_model(monkeypatch):
    """Any model load fails the test: a refusal must come before the model is built."""
    from cegppo import recipes
    from cegppo.engine import trainer

    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the refusal")

    monkeypatch.setattr(recipes, "build_policy", refuse)
    monkeypatch.setattr(trainer, "build_policy", refuse)
