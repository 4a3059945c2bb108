"""Issue 41, class 4: outputs under concurrency. `cegppo eval --out`, `compare --out` and `sft --out` claim their
output (an OS lock on a hidden sibling) from the check that it is new until it is written, and write it whole
without replacing anything: a second command with the same --out is refused in one line naming the path and the
holder; nothing is half-written or mixed (docs/reliability.md)."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import cegppo.reporting.compare as compare
from cegppo.cli import main
from cegppo.engine.runlock import OUTPUT_LOCK_SUFFIX, OutputInUseError, OutputLock
from cegppo.io import create_new_file
from fixtures.cli import error_line

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"


def env() -> dict:
    e = {k: v for k, v in os.environ.items() if k != "CEGPPO_FAILPOINT"}
    e["PYTHONPATH"] = os.pathsep.join([str(TESTS), str(ROOT / "src")] + ([e["PYTHONPATH"]] if e.get("PYTHONPATH") else []))
    return e


def lock_of(path: Path) -> Path:
    return path.parent / f".{path.name}{OUTPUT_LOCK_SUFFIX}"


def wait_for(cond, timeout: float = 120.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.05)


class Holder:
    """Another process holding the claim on ``path`` (as a running command does) until stopped."""

    def __init__(self, path: Path):
        code = ("import sys; from cegppo.engine.runlock import OutputLock; l = OutputLock(sys.argv[1]).acquire(); "
                "print('held', flush=True); sys.stdin.read()")
        self.proc = subprocess.Popen([sys.executable, "-c", code, str(path)], env=env(), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "held"

    def stop(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def make_runs(tmp_path: Path) -> list[str]:
    runs = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text('{"step": 1, "entropy": 1.0, "reward/mean": 0.1}\n'
                                                       '{"step": 2, "entropy": 0.9, "reward/mean": 0.2}\n')
        runs.append(str(tmp_path / name))
    return runs


@pytest.mark.parametrize("command", ["eval", "compare", "sft"])
def test_an_output_another_command_holds_is_refused_naming_it(command, tmp_path, capsys, no_model):
    """A second command whose --out another process is writing: one line naming the path and the holder, before any
    model loads, nothing written; once the holder is gone the same command goes ahead."""
    out = tmp_path / {"eval": "res.jsonl", "compare": "cmp", "sft": "model"}[command]
    argv = {"eval": ["eval", "--model", "tiny", "--data", "arithmetic", "--out", str(out)],
            "compare": ["compare", *make_runs(tmp_path), "--out", str(out)],
            "sft": ["sft", "tiny", "sft.steps=1", "--out", str(out)]}[command]
    holder = Holder(out)
    try:
        before = sorted(p.name for p in tmp_path.iterdir())
        assert main(argv) == 2
        line = error_line(capsys.readouterr().err)
        assert line.startswith(f"cegppo {command}: error: --out {out} is being written by another cegppo command "
                               f"(pid {holder.proc.pid} on {socket.gethostname()}, since "), line
        assert line.endswith("); wait for it to finish, or choose another path")
        assert sorted(p.name for p in tmp_path.iterdir()) == before and not out.exists()
    finally:
        holder.stop()
    assert not lock_of(out).exists()  # released and removed by its holder
    if command == "compare":
        assert main(argv) == 0
        assert (out / "summary.md").is_file() and not lock_of(out).exists()


GATE_REWARD = """import os, time
def gated(completion, ground_truth):
    while not os.path.exists(os.environ["GATE"]):  # hold the first command between its check and its write
        time.sleep(0.05)
    return ground_truth[-1] in completion
"""


def test_two_concurrent_evals_with_the_same_out(tmp_path):
    """Two real `cegppo eval` processes with the same --out, the first held (by its reward) between its check and its
    write until the second has ended: the second is refused naming the path; the first writes it whole."""
    out, gate = tmp_path / "out" / "res.jsonl", tmp_path / "gate"
    out.parent.mkdir()
    (tmp_path / "gate_reward.py").write_text(GATE_REWARD)
    e = {**env(), "GATE": str(gate)}
    e["PYTHONPATH"] = os.pathsep.join([str(tmp_path), e["PYTHONPATH"]])
    cmd = [sys.executable, "-m", "cegppo.cli", "eval", "--model", "tiny", "--data", "arithmetic", "--num-problems",
           "4", "--reward", "gate_reward:gated", "--out", str(out)]
    first = subprocess.Popen(cmd, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: lock_of(out).exists() or first.poll() is not None)
        second = subprocess.run(cmd, env=e, capture_output=True, text=True, timeout=300)
        gate.write_text("go")
        out1, err1 = first.communicate(timeout=300)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 0, err1[-2000:]
    assert second.returncode == 2, second.stderr[-2000:]
    line = error_line(second.stderr)
    assert f"--out {out} is being written by another cegppo command (pid {first.pid} " in line, line
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(rows) == 4 and json.loads(out.with_suffix(".summary.json").read_text())["arithmetic"]["num_problems"] == 4
    assert sorted(p.name for p in out.parent.iterdir()) == ["res.jsonl", "res.summary.json"]  # no lock, no temporary


def test_new_files_never_replace_one_that_appeared(tmp_path):
    """The final write of an output creates it: a file that appeared at its path meanwhile (another writer) is kept
    and the write refused naming the path; a failed write leaves neither the file nor a temporary."""
    path = tmp_path / "res.jsonl"
    path.write_text("theirs\n")
    with pytest.raises(FileExistsError, match="created by something else while this command ran; not overwritten") as e:
        create_new_file(path, b"mine\n")
    assert e.value.filename == str(path) and path.read_text() == "theirs\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["res.jsonl"]
    new = tmp_path / "new.jsonl"
    create_new_file(new, b"mine\n")
    assert new.read_text() == "mine\n" and sorted(p.name for p in tmp_path.iterdir()) == ["new.jsonl", "res.jsonl"]


def test_a_claim_is_exclusive_and_taken_over_after_its_holder_died(tmp_path, caplog):
    out = tmp_path / "res.jsonl"
    with OutputLock(out):
        with pytest.raises(OutputInUseError, match=f"--out {out} is being written by another cegppo command"):
            OutputLock(out).acquire()  # a second claim, even in this process
    assert not lock_of(out).exists()
    proc = subprocess.run([sys.executable, "-c", "import os, sys; from cegppo.engine.runlock import OutputLock; "
                           "held = OutputLock(sys.argv[1]).acquire(); os._exit(0)", str(out)], env=env(), timeout=60)
    assert proc.returncode == 0 and lock_of(out).exists()  # died holding it: the OS dropped the lock, the file stays
    with OutputLock(out) as lock:
        assert lock.held
    assert any("took over the claim of process" in r.getMessage() for r in caplog.records)
    assert not lock_of(out).exists()


def test_compare_output_is_whole_or_absent(tmp_path, monkeypatch):
    """A comparison that fails midway leaves no partial output directory and no temporary one; one that succeeds
    into an existing directory adds its files beside the others."""
    runs = [Path(r) for r in make_runs(tmp_path)]
    out = tmp_path / "cmp"
    real, calls = compare.save_png, []

    def fail_second(fig, path):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(28, "No space left on device", str(path))
        return real(fig, path)

    monkeypatch.setattr(compare, "save_png", fail_second)
    with pytest.raises(OSError, match="No space left"):
        compare.compare_runs(runs, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]  # no cmp/, no .tmp-cmp-*, no lock
    monkeypatch.setattr(compare, "save_png", real)
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    written = compare.compare_runs(runs, out)
    assert written[-1] == out / "summary.md" and all(p.is_file() for p in written)
    assert (out / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "cmp"]
