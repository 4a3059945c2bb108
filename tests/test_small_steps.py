"""benchmarks/small_steps.py: the pilot's and the verdicts' rules on records whose answer is known, and its --quick
pipeline killed mid-run and continued from its records and checkpoints."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import small_steps as ss  # benchmarks/ (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[1]


def record(method, seed, entropy, final_acc, share=0.0, acc=0.5, stopped=None):
    n = len(entropy)
    steps = {k: [0.0] * n for k in ss.KEEP}
    steps.update({"entropy": list(entropy), "mb_last/clip/low_frac": [share / 2] * n,
                  "mb_last/clip/high_frac": [share / 2] * n, "reward/accuracy": [acc] * n})
    return dict(method=method, lr=1e-5, seed=seed, steps=steps, evals={"0": 0.3, str(n): final_acc}, stopped=stopped)


def ramp(start, end, n=60, wiggle=0.0, seed=0):
    return [start + (end - start) * t / (n - 1) + wiggle * (-1) ** (t + seed) for t in range(n)]


def test_pilot_rule():
    falls = record("GRPO", 0, ramp(1.0, 0.5), 0.5, share=0.02, acc=0.6)
    assert ss.pilot_verdict(falls)["qualifies"]
    assert not ss.pilot_verdict(record("GRPO", 0, ramp(1.0, 0.75), 0.5, share=0.02, acc=0.6))["qualifies"]  # -25 %
    assert not ss.pilot_verdict(record("GRPO", 0, ramp(1.0, 0.5), 0.5, share=0.04, acc=0.6))["qualifies"]  # share
    assert not ss.pilot_verdict(record("GRPO", 0, ramp(1.0, 0.5), 0.5, share=0.02, acc=0.95))["qualifies"]  # saturated
    assert not ss.pilot_verdict(dict(falls, stopped="too large a step"))["qualifies"]
    assert not ss.pilot_verdict(record("GRPO", 0, ramp(1.0, 0.5, n=15), 0.5, share=0.02))["qualifies"]  # no step 20
    low_first = [0.6] + ramp(1.0, 0.5)[1:]  # the start is the mean of three steps, not one noisy step
    assert ss.pilot_verdict(record("GRPO", 0, low_first, 0.5, share=0.02, acc=0.6))["qualifies"]


def test_verdict_rules_on_known_records():
    runs = [record("GRPO", s, ramp(1.0, 0.6, wiggle=0.02, seed=s), 0.50 + 0.01 * s) for s in range(3)]
    runs += [record("DAPO", s, ramp(1.0, 1.2, seed=s), 0.52 + 0.01 * s) for s in range(3)]
    runs += [record("CE-GPPO(0.5,1)", s, ramp(1.0, 0.9, wiggle=0.02, seed=s), 0.70 + 0.01 * s) for s in range(3)]
    runs += [record("CE-GPPO(0.75,1)", s, ramp(1.0, 0.8, seed=s), 0.45 + 0.1 * s) for s in range(3)]
    v = ss.verdicts(runs)
    assert v["GRPO falls"]["met"] and not v["DAPO rises"]["met"]
    assert v["CE-GPPO(0.5,1) holds"]["met"] and not v["CE-GPPO(0.75,1) holds"]["met"]  # -10 % holds, -20 % does not
    assert v["CE-GPPO(0.5,1) beats"]["met"] and not v["CE-GPPO(0.75,1) beats"]["met"]  # 0.71 vs 0.53; 0.55 ± 0.058 vs 0.53
    flat = [dict(r, steps=dict(r["steps"], entropy=ramp(1.0, 0.95))) if r["method"] == "GRPO" else r for r in runs]
    assert not ss.verdicts(flat)["CE-GPPO(0.5,1) holds"]["met"]  # holding means nothing when GRPO does not fall
    assert not ss.verdicts(runs[:1] + runs[3:4] + runs[6:7])["CE-GPPO(0.5,1) beats"]["met"]  # one seed: no SE
    text = ss.report(dict(runs=runs, pilot=[runs[0]], command="x", commit="c", date="d", machine={}, precision="fp32",
                          settings={}))
    assert "- GRPO falls: **MET**" in text and "- CE-GPPO(0.75,1) holds: **NOT MET**" in text
    assert "rovisional" not in text
    short = ss.report(dict(runs=runs[:7], pilot=[], command="x", commit="c", date="d", machine={}, precision="fp32",
                           settings={}))  # CE-GPPO(0.5,1) 1 seed, (0.75,1) none: every verdict provisional
    assert "stand on GRPO 3, DAPO 3, CE-GPPO(0.5,1) 1, CE-GPPO(0.75,1) 0" in short
    assert "- GRPO falls: **MET (provisional)**" in short and "**MET**" not in short


def test_quick_mode_killed_mid_run_continues_from_its_records(tmp_path):
    cmd = [sys.executable, str(ROOT / "benchmarks" / "small_steps.py"), "--quick", "--out", str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    killed = subprocess.run(cmd, env={**env, "CEGPPO_FAILPOINT": "generation:4"}, capture_output=True, text=True,
                            timeout=600)
    assert killed.returncode == -9, killed.stderr[-2000:]  # SIGKILL in the first run's step 4: its step-2 checkpoint
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads((tmp_path / "small_steps.json").read_text())
    assert [r["method"] for r in result["runs"]] == ["GRPO", "CE-GPPO(0.75,1)"]
    first = result["runs"][0]
    assert [s["from_step"] for s in first["sessions"]] == [0, 2] and len(first["steps"]["entropy"]) == 6
    assert sorted(first["evals"], key=int) == ["0", "3", "6"] and (tmp_path / "small_steps.png").exists()
    assert "## Verdicts" in (tmp_path / "small_steps.md").read_text()


def test_beats_says_when_the_baseline_is_at_the_ceiling_and_the_report_shows_each_eval_step():
    runs = [record(m, s, ramp(1.0, 0.6), 1.0) for m in ss.PAPER_METHODS for s in range(3)]
    for r in runs:
        r["evals"] = {"0": 0.39, "20": 0.2 + 0.3 * ss.PAPER_METHODS.index(r["method"]) / 3, "40": 1.0, "60": 1.0}
    v = ss.verdicts(runs)
    assert not v["CE-GPPO(0.75,1) beats"]["met"] and "at the ceiling" in v["CE-GPPO(0.75,1) beats"]["why"]
    below = [dict(r, evals=dict(r["evals"], **{"60": 0.9})) if r["method"] in ("GRPO", "DAPO") else r
             for r in runs]
    assert "ceiling" not in ss.verdicts(below)["CE-GPPO(0.75,1) beats"]["why"]  # room above the baseline: no note
    table = ss.held_out_table(runs)
    assert table[0] == "| method | step 0 | step 20 | step 40 | step 60 |"
    assert table[2] == "| GRPO | 0.390 ± 0.000 | 0.200 ± 0.000 | 1.000 ± 0.000 | 1.000 ± 0.000 |"
    assert table[5].startswith("| CE-GPPO(0.75,1) | 0.390 ± 0.000 | 0.500 ± 0.000 |")


def test_two_benchmarks_sharing_one_out_keep_each_others_records(tmp_path):
    """Each process re-reads the records file under its lock before writing, so neither overwrites the other's
    finished runs: here two processes write 60 records each, interleaved, into one file."""
    records = tmp_path / "small_steps.json"
    ss.keep_record(records, "runs", dict(method="GRPO", lr=5e-6, seed=0), {"settings": {}})
    script = ("import sys; sys.path.insert(0, sys.argv[1]); import small_steps as ss; from pathlib import Path\n"
              "for i in range(60):\n"
              "    ss.keep_record(Path(sys.argv[2]), 'runs', dict(method='DAPO', lr=5e-6, seed=int(sys.argv[3]) + i),"
              " {'settings': {}})\n")
    procs = [subprocess.Popen([sys.executable, "-c", script, str(ROOT / "benchmarks"), str(records), str(base)])
             for base in (100, 200)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    seeds = sorted(r["seed"] for r in json.loads(records.read_text())["runs"])
    assert seeds == [0, *range(100, 160), *range(200, 260)]


def test_descriptive_columns_on_known_records():
    """The entropy ratio at the first evaluated step and the response length first -> last, on records of known answer
    (steps without an entropy are skipped inside the window, not counted as zero)."""
    entropy = [2.0, 2.0, 2.0] + [1.0] * 17 + [None] * 40
    assert ss.ratio_at(entropy, 20) == 0.5  # steps 16-20 at 1.0 against a start of 2.0
    assert ss.ratio_at(entropy, 40) != ss.ratio_at(entropy, 40)  # nothing measured in steps 36-40: NaN
    assert ss.ratio_at([2.0, None, 2.0, 2.0, None, 1.0, 1.0], 7) == 0.75  # steps 3-7: mean 1.5; start: the first 3 measured
    assert abs(ss.ratio_at([3.0, 2.0, 1.0, 1.0, 1.0], 5) - 0.8) < 1e-12  # S is the mean of three steps (2.0), not two
    runs = []
    for seed, (mid, length_last) in enumerate([(0.5, 8.0), (0.7, 10.0)]):
        r = record("GRPO", seed, [1.0] * 15 + [mid] * 45, 1.0)
        r["evals"] = {"0": 0.4, "20": 0.9, "40": 1.0, "60": 1.0}
        r["steps"]["response_length/mean"] = [40.0] * 55 + [length_last] * 5
        runs.append(r)
    assert ss.first_eval_step(runs) == 20
    s = ss.method_stats(runs, "GRPO")
    assert abs(s["mid_ratio"][0] - 0.6) < 1e-12 and abs(s["mid_ratio"][1] - 0.1) < 1e-12
    assert s["length_first"] == (40.0, 0.0) and s["length_last"][0] == 9.0
    text = ss.report(dict(runs=runs, pilot=[], command="x", commit="c", date="d", machine={}, precision="fp32",
                          settings={}))
    assert "| 0.600 ± 0.100 (step 20) | 40.0 ± 0.0 -> 9.0 ± 1.0 |" in text
