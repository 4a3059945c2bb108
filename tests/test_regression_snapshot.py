"""A regression snapshot: `cegppo train tiny` with a fixed seed writes the metrics recorded in tests/golden, every
numeric value within 1e-6 (timings excluded). It shows that nothing moved since the recording, not that the numbers
are right: the proof of the loss is the independent oracles (tests/reference.py's formulations in
tests/test_objectives.py, verl's and TRL's own losses in tests/test_verl_integration.py and
tests/test_trl_integration.py). Re-record with tests/golden/record.py only when a change is meant to move the numbers."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

GOLDEN = Path(__file__).resolve().parent / "golden"
_spec = importlib.util.spec_from_file_location("golden_record", GOLDEN / "record.py")
record = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(record)


def _rows(path: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if not k.startswith("time/")}
            for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.parametrize("case", sorted(record.CASES))
def test_tiny_run_matches_its_regression_snapshot(case, tmp_path):
    record.run(case, tmp_path)
    for name in ("metrics.jsonl", "eval.jsonl"):
        want, got = _rows(GOLDEN / f"{case}.{name}"), _rows(tmp_path / name)
        assert len(got) == len(want), name
        for w, g in zip(want, got):
            assert sorted(g) == sorted(w), f"{name} step {w.get('step')}: keys differ"
            for k, v in w.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    assert g[k] == pytest.approx(v, rel=1e-6, abs=1e-6), f"{name} step {w['step']} {k}"
                else:
                    assert g[k] == v, f"{name} step {w.get('step')} {k}"
