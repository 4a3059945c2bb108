import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # so `fixtures.rewards:digit_overlap` imports as a user reward would


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
