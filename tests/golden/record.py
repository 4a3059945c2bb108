"""Record the golden metrics of `cegppo train tiny` (the regression snapshot of tests/test_regression_snapshot.py): python tests/golden/record.py

Run from the repository root. Rewrites tests/golden/*.jsonl; do this only when a change is *meant* to change the
numbers, and say so in the commit message.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # fixtures.rewards

# name -> overrides on top of the bundled `tiny` config. `plain`: the config as shipped (a short warm-start, a reward
# that gives the tiny model mixed groups); `full_loss`: every term of the policy loss and dynamic sampling on.
CASES = {
    "plain": ["reward.fn=fixtures.rewards:digit_overlap", "sft.steps=4"],
    "full_loss": ["reward.fn=fixtures.rewards:digit_overlap", "sft.steps=4", "algorithm.kl_coeff=0.05",
                  "algorithm.entropy_coeff=0.01", "algorithm.positive_loss_coeff=0.1",
                  "algorithm.dynamic_sampling=true", "algorithm.max_num_gen_batches=2"],
}
COMMON = ["train.threads=1", "train.deterministic=true", "logging.progress=false"]


def run(case: str, out: Path) -> None:
    from cegppo.cli import main

    rc = main(["train", "tiny", f"output_dir={out}", *COMMON, *CASES[case]])
    if rc != 0:
        raise SystemExit(f"cegppo train tiny ({case}) exited {rc}")


if __name__ == "__main__":
    for case in CASES:
        with tempfile.TemporaryDirectory() as d:
            run(case, Path(d))
            for name in ("metrics.jsonl", "eval.jsonl"):
                (HERE / f"{case}.{name}").write_text((Path(d) / name).read_text())
        print("recorded", case)
