"""benchmarks/stability_map.py: its --quick pipeline end to end, and its collapse definition and report rules on
records whose answer is known."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import stability_map as sm  # benchmarks/ (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[1]


def record(method, lr, seed, final, guard=()):
    steps = {k: [0.1] * 10 for k in sm.KEEP}
    return dict(method=method, lr=lr, seed=seed, steps=steps, base_accuracy=0.5, final_accuracy=final,
                guard=list(guard), collapsed=sm.collapsed(list(guard), final), wall_s=1.0)


def test_collapse_definition_and_largest_safe_step():
    assert sm.collapsed([], 0.19) and not sm.collapsed([], 0.2) and sm.collapsed(["step 3: x"], 0.9)
    runs = [record("GRPO", lr, s, 0.8) for lr in (3e-6, 5e-5) for s in range(3)]
    runs += [record("CE-GPPO(0.75,1)", 3e-6, s, 0.8) for s in range(3)]
    runs += [record("CE-GPPO(0.75,1)", 5e-5, s, f, g) for s, f, g in ((0, 0.9, ()), (1, 0.0, ("step 5: r",)),
                                                                       (2, 0.1, ()))]
    summary = {(s["method"], s["lr"]): s for s in sm.summarize(runs)}
    assert summary[("CE-GPPO(0.75,1)", 5e-5)]["collapsed"] == 2 and summary[("GRPO", 5e-5)]["collapsed"] == 0
    text = sm.report(dict(runs=runs, command="x", commit="c", date="d", settings={"collapse": "c"}, machine={},
                          precision="fp32"))
    assert "- GRPO: 5e-05" in text and "- CE-GPPO(0.75,1): 3e-06" in text
    assert "Provisional" not in text
    assert "- CE-GPPO(0.75,1) lr 5e-05 seed 1: step 5: r (held-out accuracy 0.500 -> 0.000)" in text
    text = sm.report(dict(runs=runs[1:], command="x", commit="c", date="d", settings={"collapse": "c"}, machine={},
                          precision="fp32"))
    assert "Provisional, fewer than 3 seeds (seeds run): GRPO at 3e-06 (2)." in text


def test_the_step_axis_is_measured_on_grpo_per_level():
    """Each learning rate's row gives GRPO's mean last-mini-batch KL and beta1 / beta2 shares (not other methods')."""
    runs = []
    for lr, kl in ((3e-6, 0.001), (5e-5, 0.02)):
        for s in range(2):
            r = record("GRPO", lr, s, 0.8)
            r["steps"].update({"mb_last/ppo_kl": [kl] * 10, "mb_last/clip/low_frac": [kl * 2] * 10,
                               "mb_last/clip/high_frac": [kl * 3] * 10})
            runs.append(r)
    runs.append(record("CE-GPPO(0.75,1)", 5e-5, 0, 0.8))  # its KL 0.1 stays out of GRPO's column
    text = sm.report(dict(runs=runs, command="x", commit="c", date="d", settings={"collapse": "c"}, machine={},
                          precision="fp32"))
    assert "| 3e-06 | 2 | 0.0010 ± 0.0000 | 0.002 / 0.003 | 2 | 0.0010 |" in text
    assert "| 5e-05 | 2 | 0.0200 ± 0.0000 | 0.040 / 0.060 | 3 | 0.0467 |" in text
    assert "| GRPO | 5e-05 | 2 | 0/2 | 0.800 ± 0.000 | 0.020 | 0.040 / 0.060 |" in text


def test_entropy_by_quadrant_sums_steps_and_skips_records_without_it():
    """Each quadrant's dH summed over a run's steps, mean over seeds; records made before they kept dH stay out."""
    runs = []
    for s, na_lp in ((0, -0.01), (1, -0.03)):
        r = record("CE-GPPO(0.75,1)", 2.5e-5, s, 0.8)
        r["steps"].update({"quadrant/PA_HP/dH": [-0.02] * 10, "quadrant/PA_LP/dH": [0.01] * 10,
                           "quadrant/NA_HP/dH": [0.0] * 10, "quadrant/NA_LP/dH": [na_lp] * 10,
                           "dH/predicted": [-0.01 + na_lp] * 10, "entropy": [1.6] + [1.0] * 9})
        runs.append(r)
    old = record("GRPO", 2.5e-5, 0, 0.8)
    for k in [k for k in old["steps"] if "dH" in k]:
        del old["steps"][k]
    text = sm.report(dict(runs=runs + [old], command="x", commit="c", date="d", settings={"collapse": "c"},
                          machine={}, precision="fp32"))
    assert "| CE-GPPO(0.75,1) | 2.5e-05 | 2 | -0.200 | +0.100 | +0.000 | -0.200 | -0.300 | -0.60 |" in text
    assert "| GRPO | 2.5e-05 | 1 | +" not in text
    assert "Where entropy moved" not in sm.report(dict(runs=[old], command="x", commit="c", date="d",
                                                       settings={"collapse": "c"}, machine={}, precision="fp32"))


def test_quick_mode_runs(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "stability_map.py"), "--quick", "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads((tmp_path / "stability_map.json").read_text())
    assert len(result["runs"]) == 2 and (tmp_path / "stability_map.png").exists()


def test_collect_merges_files_stamps_old_records_and_refuses_another_setting(tmp_path):
    """--collect over several runs of the map: one result, a cell found twice keeps the later file's record, a record
    made before records kept their provenance takes its file's, and a file from another setting is refused."""
    def write(name, runs, **settings):
        f = tmp_path / name
        f.write_text(json.dumps(dict(runs=runs, command=f"cmd {name}", commit=name[:1], date="d", precision="fp32",
                                     machine={"cpu": "X", "isa": "avx2", "load_1min": 0.1},
                                     settings={"steps": 10, "device": "cpu", **settings})))
        return f

    new = dict(record("GRPO", 5e-5, 1, 0.7), provenance=dict(commit="b", machine={"cpu": "Y", "isa": "amx",
                                                                                  "load_1min": 1.5}))
    a = write("a.json", [record("GRPO", 5e-5, 0, 0.9), record("GRPO", 5e-5, 1, 0.8)])
    b = write("b.json", [new], device="cuda")  # the device may differ: the setting is the same
    merged = sm.merge([a, b])
    assert sorted((r["seed"], r["final_accuracy"]) for r in merged["runs"]) == [(0, 0.9), (1, 0.7)]
    stamped = next(r for r in merged["runs"] if r["seed"] == 0)["provenance"]
    assert stamped["commit"] == "a" and stamped["command"] == "cmd a.json" and stamped["machine"]["cpu"] == "X"
    line = sm.made_with(merged["runs"])
    assert "a, b" in line and "X (avx2), Y (amx)" in line and "0.1-1.5" in line
    other = write("c.json", [record("GRPO", 5e-5, 2, 0.5)], steps=60)
    with pytest.raises(SystemExit, match="another setting"):
        sm.merge([a, other])
