"""No benchmark rots again: every script in benchmarks/ runs its ``--quick`` smoke mode (the locally built tiny model,
tiny sizes) as a subprocess into a temporary directory, exits 0, and writes its results file with the commit, the
command, the date and the machine (CPU model and ISA, load) it ran on. Part of the normal ``python -m pytest -q`` (CI):
a script whose code paths break with the package fails here, not months later in a results file.

The subprocesses run with one torch thread: tiny matrices gain nothing from two, and on a loaded machine two threads
made a tiny forward pass 20x slower (measured while writing this test).

And benchmarks/ stays an evidence base: no script imports another (shared code lives in the package
``benchmarks/common/``, which the tests find through tests/conftest.py), no file there changes ``sys.path``, every
committed ``command`` is a command line without its notes, the results index names every file, and
benchmarks/README.md's table of claims names files and scripts that exist, covering every results file the README
cites.
"""

from __future__ import annotations

import ast
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
RESULTS = BENCH / "results"

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
    "stability_map.py": ([], ["stability_map.json", "stability_map.md"]),
    "small_steps.py": ([], ["small_steps.json", "small_steps.md"]),
}


def test_every_benchmark_script_has_a_quick_test():
    scripts = {p.name for p in BENCH.glob("*.py")}  # shared code lives in benchmarks/common/, not beside them
    assert scripts == set(QUICK), f"benchmarks/ scripts without a --quick test here: {sorted(scripts - set(QUICK))}"


def check_provenance(result: dict, script: str) -> None:
    commit = result.get("commit")
    assert isinstance(commit, str) and commit, f"{script}: no commit recorded"
    if (ROOT / ".git").exists():  # a checkout: the short commit, perhaps -dirty
        assert re.match(r"^[0-9a-f]{7}", commit), f"{script}: commit {commit!r} is not a git commit"
    assert script in result.get("command", ""), f"{script}: command {result.get('command')!r} does not name the script"
    datetime.fromisoformat(result["date"])
    m = result.get("machine") or {}
    for key in ("cpu", "isa", "cores", "torch", "threads", "load_1min", "kernel_isa"):
        assert m.get(key) not in (None, ""), f"{script}: machine.{key} not recorded ({m})"
    assert result.get("precision"), f"{script}: precision not recorded"


def test_a_capped_instruction_set_is_recorded_and_reported():
    """A run with torch's kernels capped below the CPU (``ATEN_CPU_CAPABILITY=avx2`` on an AVX-512 machine, to stand
    in for an AVX2 one) records the cap and the ISA the kernels used, and its report line says so beside the CPU's
    own ISA: such a figure is not the AVX2 machine's."""
    code = ("import json, sys; sys.path.insert(0, 'benchmarks'); from common import provenance, provenance_line; "
            "r = provenance('x.py', 'fp32'); print(json.dumps([r, provenance_line(r)]))")
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")}
    env.update(ATEN_CPU_CAPABILITY="default", OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    r, line = json.loads(out.stdout.strip().splitlines()[-1])
    m = r["machine"]
    assert m["kernel_isa"] == "DEFAULT" and m["isa_caps"] == {"ATEN_CPU_CAPABILITY": "default"}, m
    assert "kernels capped to DEFAULT by ATEN_CPU_CAPABILITY=default" in line, line
    assert r["command"].startswith("ATEN_CPU_CAPABILITY=default python benchmarks/x.py"), r["command"]
    env.pop("ATEN_CPU_CAPABILITY")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    r, line = json.loads(out.stdout.strip().splitlines()[-1])
    m = r["machine"]
    assert m["isa_caps"] == {} and "capped" not in line and r["command"].startswith("python "), (line, r["command"])


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
    if script == "step_throughput.py":  # each phase is timed, and none counted twice: other_s is what the step's clock
        for run in result["runs"]:     # left after the timed phases, so a phase timed twice makes it negative
            for st in run["steps"]:
                parts = [st[k] for k in ("generate_s", "old_logp_s", "update_s", "other_s")]
                assert min(parts) >= -1e-3 and st["update_s"] > 0, (run["system"], st)
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


def index_rows() -> list[str]:
    return [ln for ln in (RESULTS / "README.md").read_text().splitlines() if ln.startswith("| `")]


def test_results_index_lists_every_results_file():
    """benchmarks/results/README.md names every results file, in its folder (``archive/x.json``: ``archive/x``), or the
    folder it lies in (``gpu_h200/``); a results JSON that records no machine says so in its row."""
    rows = [ln.split("|")[1] for ln in index_rows()]
    for path in sorted(p for p in RESULTS.rglob("*") if p.is_file()):
        rel = path.relative_to(RESULTS)
        if rel.name == "README.md" and rel.parent == Path("."):
            continue
        stem = (rel.parent / rel.name.split(".")[0]).as_posix()
        folders = [f"`{parent.as_posix()}/`" for parent in rel.parents if parent != Path(".")]
        row = [r for r in rows if re.search(rf"`{re.escape(stem)}[.`/ ]", r) or any(f in r for f in folders)]
        assert row, f"benchmarks/results/{rel} is not in benchmarks/results/README.md"
        record = json.loads(path.read_text()) if path.suffix == ".json" else None
        if isinstance(record, dict) and "command" in record and not record.get("machine"):
            full = next(ln for ln in index_rows() if ln.split("|")[1] == row[0])
            assert "machine not recorded" in full, f"{rel} records no machine; its index line must say so"


def commands(obj) -> list:
    """Every ``command`` field in a results record, at any depth (the file's own, its candidates', its runs')."""
    if isinstance(obj, dict):
        return [v for k, v in obj.items() if k == "command"] + [c for v in obj.values() for c in commands(v)]
    if isinstance(obj, list):
        return [c for v in obj for c in commands(v)]
    return []


def test_committed_commands_are_command_lines_without_notes():
    """``command`` holds argv only (a shell-quoted string or a list of strings); prose given with ``--note`` lives in
    the record's notes. One record once held 3,817 characters of notes in its command."""
    for path in sorted(RESULTS.rglob("*.json")):
        for cmd in commands(json.loads(path.read_text())):
            argv = cmd if isinstance(cmd, list) else shlex.split(cmd)  # a string must parse as a command line
            assert all(isinstance(a, str) for a in argv), f"{path}: command {cmd!r}"
            assert not any(a == "--note" or a.startswith("--note=") for a in argv), \
                f"{path.relative_to(ROOT)}: its command holds --note text; notes go in the record's notes"


def test_the_results_command_leaves_notes_out(monkeypatch):
    import common

    monkeypatch.setattr(sys, "argv", ["x.py", "--seeds", "0", "1", "--note", "ran beside a CI job", "--note=alone",
                                      "--out", "a b"])
    assert common.command("x.py") == "python benchmarks/x.py --seeds 0 1 --out 'a b'"
    assert common.command("x.py", {"LD_PRELOAD": "j.so"}) == "LD_PRELOAD=j.so python benchmarks/x.py --seeds 0 1 --out 'a b'"
    assert common.command(str(BENCH / "x.py")) == common.command("x.py")  # no machine's path (a script's __file__)


def imported_modules(path: Path) -> set[str]:
    """The top-level names of every module a file imports, at any depth of its code."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def test_no_script_imports_another_and_none_changes_sys_path():
    scripts = {p.stem for p in BENCH.glob("*.py")}
    for path in sorted(BENCH.glob("*.py")):
        other = imported_modules(path) & (scripts - {path.stem})
        assert not other, f"{path.name} imports the script(s) {sorted(other)}: move what they share to benchmarks/common/"
    for path in sorted(BENCH.rglob("*.py")):
        assert not re.search(r"sys\.path\.(insert|append)|sys\.path\s*(\+|=)", path.read_text()), \
            f"{path.relative_to(ROOT)} changes sys.path: a script finds benchmarks/common/ beside it"


def readme_rows() -> list[list[str]]:
    """The cells of benchmarks/README.md's claims table."""
    lines = (BENCH / "README.md").read_text().split("## Claims", 1)[1].splitlines()
    return [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in lines if ln.startswith("| ")][1:]  # no header


def results_files(cell: str) -> list[str]:
    """``a.{json,md}``, ``b/c.png`` in a cell -> the file paths under benchmarks/results/ it names."""
    out = []
    for name in re.findall(r"`([^`]+)`", cell):
        brace = re.match(r"(.*)\{(.+)\}$", name)
        out += [brace[1] + ext for ext in brace[2].split(",")] if brace else [name]
    return out


def test_benchmarks_readme_table_names_existing_files_scripts_and_commands():
    """Each claim's results files exist, its script exists, and its one command runs that script (or gpu_check.sh) on
    files that exist; every results file the README cites has a claim row."""
    rows = readme_rows()
    assert len(rows) >= 20 and all(len(r) == 8 for r in rows), "benchmarks/README.md's claims table lost its shape"
    named = set()
    for claim, files, script, cmd, how, *_ in rows:
        for name in results_files(files):
            if "*" not in name:
                assert (RESULTS / name).is_file(), f"benchmarks/README.md: {name} ({claim[:40]}) is not in results/"
            named.add(name)
        if script == "none at HEAD":
            continue
        assert (BENCH / script.strip("`")).is_file(), f"benchmarks/README.md: no script {script}"
        argv = shlex.split(cmd.strip("`"))
        assert argv[:2] in (["python", f"benchmarks/{script.strip('`')}"], ["bash", "benchmarks/gpu_check.sh"]), cmd
        for flag in ("--from-json", "--step"):
            if flag in argv:
                assert (ROOT / argv[argv.index(flag) + 1]).is_file(), f"benchmarks/README.md: {cmd} reads no file"
        assert ("--from-json" in argv) == how.startswith("record"), f"benchmarks/README.md: {cmd}: 'how' says {how}"
    cited = re.findall(r"\]\(benchmarks/results/([^)#]+)\)", (ROOT / "README.md").read_text())
    assert cited, "the README cites no results file?"
    for name in (c for c in cited if c != "README.md"):  # the index itself aside
        assert name in named, f"README.md cites benchmarks/results/{name}: it needs a row in benchmarks/README.md"


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


def test_results_record_no_directory_of_the_machine_that_made_them():
    """A results file names paths relative to the checkout or as <local> (``common.settings``, ``common.command``):
    a home, scratch or checkout directory of one machine means nothing on another. System paths (/usr) may stay."""
    machine_dir = re.compile(r"(^|[\s='\"])/(work|tmp|root|home|Users|mnt)/")

    def strings(x):
        if isinstance(x, dict):
            for v in x.values():
                yield from strings(v)
        elif isinstance(x, list):
            for v in x:
                yield from strings(v)
        elif isinstance(x, str):
            yield x

    for path in sorted(RESULTS.rglob("*.json")):
        found = [s for s in strings(json.loads(path.read_text())) if machine_dir.search(s)]
        assert not found, f"{path.relative_to(RESULTS)} records a path of the machine: {found[0][:120]}"
