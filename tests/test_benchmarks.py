"""No benchmark rots again: every script in benchmarks/ runs its ``--quick`` smoke mode (the locally built tiny model,
tiny sizes) as a subprocess into a temporary directory, exits 0, and writes its results file with the commit, the
command, the date and the machine (CPU model and ISA, load) it ran on. Part of the normal ``python -m pytest -q`` (CI):
a script whose code paths break with the package fails here, not months later in a results file.

The subprocesses run with one torch thread: tiny matrices gain nothing from two, and on a loaded machine two threads
made a tiny forward pass 20x slower (measured while writing this test).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
HELPERS = {"common.py", "bf16_rounding.py"}  # imported by the scripts, not benchmarks

# script -> (extra arguments beside --quick and --out, results files it must write into --out)
QUICK = {
    "base_accuracy.py": ([], ["base_accuracy.json", "base_accuracy.md"]),
    "entropy_control.py": (["--runs-dir", "{tmp}/runs"], ["entropy_control.json", "entropy_control.md"]),
    "entropy_regime.py": (["--runs-dir", "{tmp}/runs"], ["entropy_regime.json", "entropy_regime.md"]),
    "entropy_plant.py": ([], ["entropy_plant.json", "entropy_plant.md"]),
    "generation.py": ([], ["generation.json", "generation.md"]),
    "logits_memory.py": ([], ["logits_memory.json"]),
    "objectives.py": ([], ["objectives.json"]),
    "roofline.py": ([], ["roofline.json", "roofline.md"]),
    "reproduce_entropy.py": ([], ["entropy_dynamics.json", "entropy_dynamics.md"]),
    "step_throughput.py": ([], ["step_throughput.json", "step_throughput.md"]),
    "quickstart_seeds.py": (["--seeds", "0", "--runs-dir", "{tmp}/runs", "--set", "eval.num_problems=4"], ["quickstart_seeds.json", "quickstart_seeds.md"]),
    "precision_gradients.py": ([], ["precision_gradients.json", "precision_gradients.md"]),
    "precision_warmstart.py": ([], ["precision_warmstart.json", "precision_warmstart.md"]),
}


def test_every_benchmark_script_has_a_quick_test():
    scripts = {p.name for p in BENCH.glob("*.py")} - HELPERS
    assert scripts == set(QUICK), f"benchmarks/ scripts without a --quick test here: {sorted(scripts - set(QUICK))}"


def check_provenance(result: dict, script: str) -> None:
    commit = result.get("commit")
    assert isinstance(commit, str) and commit, f"{script}: no commit recorded"
    if (ROOT / ".git").exists():  # a checkout: the short commit, perhaps -dirty
        assert re.match(r"^[0-9a-f]{7}", commit), f"{script}: commit {commit!r} is not a git commit"
    assert script in result.get("command", ""), f"{script}: command {result.get('command')!r} does not name the script"
    datetime.fromisoformat(result["date"])
    m = result.get("machine") or {}
    for key in ("cpu", "isa", "cores", "torch", "threads", "load_1min"):
        assert m.get(key) not in (None, ""), f"{script}: machine.{key} not recorded ({m})"
    assert result.get("precision"), f"{script}: precision not recorded"


@pytest.mark.parametrize("script", sorted(QUICK))
def test_quick_mode_writes_results_with_provenance(script, tmp_path):
    extra, files = QUICK[script]
    out = tmp_path / "out"
    cmd = [sys.executable, str(BENCH / script), "--quick", "--out", str(out),
           *(a.format(tmp=tmp_path) for a in extra)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{shlex.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    for name in files:
        assert (out / name).is_file(), f"{script} --quick did not write {name} (wrote {sorted(os.listdir(out))})"
    result = json.loads((out / files[0]).read_text())
    check_provenance(result, script)
    md = [name for name in files if name.endswith(".md")]
    if md:  # the report names the commit it was made at
        assert result["commit"] in (out / md[0]).read_text()


def test_gpu_check_calls_existing_options():
    """gpu_check.sh runs only on a GPU: check here that every benchmark option it passes still exists."""
    text = (BENCH / "gpu_check.sh").read_text()
    calls = re.findall(r"python3 (benchmarks/\w+\.py)([^\n]*)", text)
    assert calls, "gpu_check.sh calls no benchmark script?"
    for script, args in calls:
        flags = set(re.findall(r"(--[\w-]+)", args))
        helptext = subprocess.run([sys.executable, str(ROOT / script), "--help"], capture_output=True, text=True,
                                  timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert helptext.returncode == 0, helptext.stderr[-2000:]
        missing = {f for f in flags if f not in helptext.stdout}
        assert not missing, f"gpu_check.sh passes {sorted(missing)} to {script}, which no longer has them"
    # and the helper --prepare imports
    assert "smollm2_gguf_path" in text
    from cegppo.engine.models import smollm2_gguf_path  # noqa: F401


def test_results_index_lists_every_results_file():
    """benchmarks/results/README.md names every results file there; a JSON that records no machine says so."""
    results = BENCH / "results"
    index = (results / "README.md").read_text()
    rows = [ln for ln in index.splitlines() if ln.startswith("| `")]
    for path in sorted(results.iterdir()):
        if path.name == "README.md":
            continue
        stem = path.name.split(".")[0]
        row = [ln for ln in rows if re.search(rf"`{re.escape(stem)}[.`/ ]", ln.split("|")[1])]
        assert row, f"benchmarks/results/{path.name} is not in benchmarks/results/README.md"
        if path.suffix == ".json" and not (json.loads(path.read_text()).get("machine")):
            assert "machine not recorded" in row[0], f"{path.name} records no machine; its index line must say so"


def test_entropy_control_restore_gives_a_fresh_checkout_the_committed_runs(tmp_path):
    """runs/ is not committed, so a new checkout has no records to resume from: ``--restore`` writes the committed
    results' runs back as records, and ``--collect`` (as ``--resume``) then finds every one of them unchanged."""
    committed = BENCH / "results" / "entropy_control.json"
    result = json.loads(committed.read_text())
    labels = list(dict.fromkeys(r["label"] for r in result["runs"]))
    seeds = sorted({str(r["seed"]) for r in result["runs"]})
    cmd = [sys.executable, str(BENCH / "entropy_control.py"), "--restore", str(committed), "--collect", "HEAD",
           "--runs-dir", str(tmp_path / "runs"), "--out", str(tmp_path / "out"), "--seeds", *seeds,
           "--noise-batches", "0", "--only", *labels]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, f"{shlex.join(cmd)}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    collected = json.loads((tmp_path / "out" / "entropy_control.json").read_text())

    def key(run: dict) -> tuple:
        return run["label"], run["seed"]

    assert sorted(collected["runs"], key=key) == sorted(result["runs"], key=key)

    # a record of other settings under the same label is not kept: another bonus gain leaves the bonus runs out
    other = [*cmd[:cmd.index("--out")], "--out", str(tmp_path / "other"), *cmd[cmd.index("--out") + 2:],
             "--bonus-gain", "0.5"]
    proc = subprocess.run(other, cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, f"{shlex.join(other)}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    left = json.loads((tmp_path / "other" / "entropy_control.json").read_text())["runs"]
    bonus = {key(r) for r in result["runs"] if r["label"].startswith("Autopilot + bonus")}
    assert bonus and {key(r) for r in left} == {key(r) for r in result["runs"]} - bonus
    assert "made with other settings" in proc.stdout
