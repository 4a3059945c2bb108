"""A run's life (docs/runs.md): one writer per run directory, no fresh run spliced into an old one, the resume
contract, and every CLI path ending in one line (catalogue: docs/reliability.md)."""

import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from filelock import FileLock

from cegppo.recipes import train_loop
import cegppo.recipes as recipes
from cegppo.cli import main
from cegppo.config import Config
from cegppo.engine import checkpoint as ckpt
from cegppo.engine.rundir import FIXED_KEYS, MUTABLE_KEYS, RUN_FILES, flatten, is_mutable
from cegppo.engine.runlock import LOCK_FILE, OWNER_FILE, RunLock, read_owner
from cegppo.engine.trainer import Trainer, TrainingError
from cegppo.io import read_jsonl

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
SMALL = ("train.prompts_per_step=2", "train.mini_batches=1", "rollout.n=2", "rollout.max_new_tokens=8",
         "data.num_train=8", "data.num_test=0")
CLI_BASE = ["tiny", "reward.fn=fixtures.rewards:digit_overlap", "sft.steps=0", "logging.progress=false", *SMALL]


def cli_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "CEGPPO_FAILPOINT"}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), str(ROOT / "src")] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def lock_is_free(run: Path) -> bool:
    try:
        with FileLock(str(run / LOCK_FILE)).acquire(timeout=0):
            return True
    except Exception:  # noqa: BLE001 - filelock.Timeout
        return False


def error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("cegppo ")]


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


# ---------------------------------------------------------------------------------------------- 1. ownership


def test_second_writer_is_refused_naming_the_holder(tmp_path):
    """The test process holds the lock (the same RunLock API a run uses); a real `cegppo train` started meanwhile,
    fresh or --resume, is refused with one line naming the holder."""
    run = tmp_path / "run"
    run.mkdir()
    with RunLock(run):
        owner = read_owner(run)
        assert owner["pid"] == os.getpid() and owner["host"] == socket.gethostname()
        for extra in ([], ["--resume"]):
            r = subprocess.run([sys.executable, "-m", "cegppo.cli", "train", *CLI_BASE, f"output_dir={run}", *extra],
                               env=cli_env(), capture_output=True, text=True, timeout=300)
            assert r.returncode == 2, r.stderr[-2000:]
            (line,) = error_lines(r.stderr)
            assert line == (f"cegppo train: error: {run} is in use by another cegppo run (pid {os.getpid()} on "
                            f"{socket.gethostname()}, since {owner['since']}); wait for it to finish, or use another "
                            f"output_dir"), line
            assert "Traceback" not in r.stderr
        assert not (run / "config.yaml").exists()  # the refused run wrote nothing
    assert lock_is_free(run) and not (run / OWNER_FILE).exists()


def test_lock_held_by_another_process_refuses_trainer_and_cli(tiny_config, tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    other = FileLock(str(run / LOCK_FILE))  # a separate lock handle: to flock, another owner
    other.acquire(timeout=0)
    (run / OWNER_FILE).write_text(json.dumps({"pid": 4242, "host": "gpu-7", "since": "2025-01-01T00:00:00+00:00"}))
    try:
        with pytest.raises(TrainingError, match=r"in use by another cegppo run \(pid 4242 on gpu-7, since "
                                                r"2025-01-01T00:00:00\+00:00\)"):
            Trainer(tiny_config(*SMALL, out=run))
        assert main(["train", *CLI_BASE, f"output_dir={run}", "--resume"]) == 2
        (line,) = error_lines(capsys.readouterr().err)
        assert "pid 4242 on gpu-7" in line
    finally:
        other.release()


def test_stale_lock_of_dead_process_is_reclaimed(tiny_config, tmp_path, caplog):
    run = tmp_path / "run"
    run.mkdir()
    pid = dead_pid()
    (run / OWNER_FILE).write_text(json.dumps({"pid": pid, "host": socket.gethostname(), "since": "2025-01-01"}))
    with caplog.at_level(logging.WARNING, logger="cegppo.engine.runlock"), Trainer(tiny_config(*SMALL, out=run)):
        assert f"reclaimed the lock of dead process {pid}" in caplog.text
        assert read_owner(run)["pid"] == os.getpid() and not lock_is_free(run)
    assert lock_is_free(run) and not (run / OWNER_FILE).exists()


def test_lock_is_released_on_errors(tiny_config, tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    # an error while the Trainer is being built (the model cannot be loaded)
    assert main(["train", *CLI_BASE, f"output_dir={run}", "model.name=/nonexistent/model"]) == 2
    (line,) = error_lines(capsys.readouterr().err)
    assert "model directory '/nonexistent/model' does not exist" in line
    assert lock_is_free(run) and not (run / OWNER_FILE).exists()
    assert not (run / "config.yaml").exists()  # a failed start leaves no run behind: a plain retry is not refused

    def boom(trainer, on_step=None):
        raise RuntimeError("boom")

    monkeypatch.setattr(recipes, "train_loop", boom)  # the run loop (it replaced Trainer.train)
    with pytest.raises(RuntimeError, match="boom"):
        recipes.run_training(tiny_config(*SMALL, "train.save_every=0", out=run))
    assert lock_is_free(run) and not (run / OWNER_FILE).exists()
    assert main(["train", *CLI_BASE, f"output_dir={run}", "--resume"]) == 1  # unexpected error: one line, exit 1
    (line,) = error_lines(capsys.readouterr().err)
    assert line == "cegppo train: error: RuntimeError: boom (unexpected; rerun with --debug for the traceback)"
    assert lock_is_free(run)


# ---------------------------------------------------------------------------------------------- 2. no splicing


def test_fresh_run_into_a_non_empty_run_directory_is_refused(tmp_path, capsys):
    run = tmp_path / "run"
    (run / "checkpoints" / "step_000002").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    (run / "config.yaml").write_text("train: {steps: 2}\n")
    (run / "run.json").write_text('{"run_id": "x"}')  # the run's own record (an older one: no file list)
    assert main(["train", *CLI_BASE, f"output_dir={run}"]) == 2
    (line,) = error_lines(capsys.readouterr().err)
    assert line == (f"cegppo train: error: {run} already holds a run (run.json, config.yaml, metrics.jsonl, checkpoints/); "
                    f"pass --resume to continue it, or --overwrite to delete it and start over")
    assert (run / "metrics.jsonl").read_text() == '{"step": 1}\n'  # untouched
    assert main(["train", *CLI_BASE, f"output_dir={run}", "--resume", "--overwrite"]) == 2
    assert "pass one of them" in capsys.readouterr().err


def test_overwrite_removes_the_previous_runs_files_and_says_so(tiny_config, tmp_path, caplog):
    run = tmp_path / "run"
    with Trainer(tiny_config(*SMALL, out=run)) as old:
        old.save()
        old_id = old.state["run_id"]
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    (run / "notes.txt").write_text("mine")  # not a run file: kept
    with caplog.at_level(logging.WARNING, logger="cegppo.engine.rundir"), \
            Trainer(tiny_config(*SMALL, out=run), overwrite=True) as tr:
        assert (f"--overwrite: removing the previous run's files from {run}: run.json, config.yaml, metrics.jsonl, "
                f"checkpoints/") in caplog.text
        assert not (run / "checkpoints").exists() and not (run / "metrics.jsonl").exists()
        assert (run / "notes.txt").read_text() == "mine"
        assert (tr.state["run_id"] != old_id
                and json.loads((run / "run.json").read_text())["run_id"] == tr.state["run_id"])


def test_pruning_never_deletes_another_runs_checkpoints(tiny_config, tmp_path):
    with Trainer(tiny_config(*SMALL, "train.keep_checkpoints=1", out=tmp_path / "run")) as tr:
        mine = tr.state["run_id"]
        tr.state["run_id"] = "another-run"
        foreign = tr.save()  # step 0, written by "another run"
        tr.state["run_id"] = mine
        for step in (1, 2):
            tr.state["step"] = step
            tr.save()
        root = tr.run.checkpoints
        assert [p.name for p in ckpt.list_checkpoints(root)] == ["step_000000", "step_000002"]
        assert (ckpt.checkpoint_run_id(foreign) == "another-run"
                and ckpt.checkpoint_run_id(root / "step_000002") == mine)
        (root / "step_000009").mkdir()  # no readable manifest: owner unknown, never pruned
        tr.state["step"] = 3
        tr.save()
        assert [p.name for p in ckpt.list_checkpoints(root)] == ["step_000000", "step_000003", "step_000009"]


def test_resumed_run_keeps_the_run_id_of_its_checkpoint(tiny_config, tmp_path):
    with Trainer(tiny_config(*SMALL, out=tmp_path / "run")) as tr:
        run_id = tr.state["run_id"]
        assert json.loads((tr.run.path / "run.json").read_text())["run_id"] == run_id
        assert json.loads((tr.save() / ckpt.MANIFEST).read_text())["run_id"] == run_id
    with Trainer(tiny_config(*SMALL, out=tmp_path / "run"), resume=True) as resumed:
        assert resumed.state["run_id"] == run_id
        resumed.state["step"] = 1
        assert ckpt.checkpoint_run_id(resumed.save()) == run_id


# ---------------------------------------------------------------------------------------------- 3. resume contract


def test_config_keys_are_classified_and_documented():
    keys = flatten(Config().to_dict()) | {"algorithm.hparams.beta1": 0.5}
    for key in keys:
        fixed = any(re.fullmatch(p.replace(".", r"\.").replace("*", ".*"), key) for p in FIXED_KEYS)
        mutable = any(re.fullmatch(p.replace(".", r"\.").replace("*", ".*"), key) for p in MUTABLE_KEYS)
        assert fixed != mutable, f"{key}: classify it in FIXED_KEYS or MUTABLE_KEYS (cegppo/engine/rundir.py)"
        assert is_mutable(key) == mutable
    assert not is_mutable("train.some_future_key")  # unlisted keys are fixed
    doc = (ROOT / "docs" / "runs.md").read_text()
    for pattern in FIXED_KEYS + MUTABLE_KEYS + RUN_FILES:
        assert f"`{pattern}`" in doc, f"docs/runs.md does not list {pattern}"


def test_resume_refuses_changes_to_fixed_keys(tiny_config, tmp_path, capsys):
    run = tmp_path / "run"
    with Trainer(tiny_config(*SMALL, out=run)) as tr:
        tr.save()
    with pytest.raises(TrainingError) as e:
        Trainer(tiny_config(*SMALL, "rollout.n=4", "algorithm.hparams.beta1=0.5", "optim.weight_decay=0.0",
                            "optim.lr=2e-3", out=run), resume=True)
    assert str(e.value) == (
        "--resume refused: the config changes what this run is: algorithm.hparams.beta1 0.75 -> 0.5, "
        "optim.weight_decay 0.1 -> 0.0, rollout.n 2 -> 4 (fixed for the life of a run, docs/runs.md); resume with "
        "the run's values, or start a new run in another output_dir (or with --overwrite)")
    assert main(["train", *CLI_BASE, f"output_dir={run}", "train.seed=1", "--resume"]) == 2
    (line,) = error_lines(capsys.readouterr().err)
    assert "train.seed 0 -> 1" in line and lock_is_free(run)
    assert not (run / "config_changes.jsonl").exists()


def test_resume_applies_and_records_mutable_changes(tiny_config, tmp_path):
    run = tmp_path / "run"
    base = (*SMALL, "train.save_every=1", "optim.warmup_steps=4", "optim.lr=1e-3")
    with Trainer(tiny_config(*base, "train.steps=1", out=run)) as first:
        assert train_loop(first)[0]["lr"] == 0.0  # step 1 runs at multiplier 0/4
    original = (run / "config.yaml").read_text()
    with Trainer(tiny_config(*base, "train.steps=2", "optim.lr=2e-3", "optim.grad_clip=0.5", out=run),
                 resume=True) as tr:
        # the new lr reached the loaded optimizer and scheduler: base 2e-3 at the warm-up multiplier of step 1
        group = tr.optimizer.param_groups[0]
        assert group["initial_lr"] == 2e-3 and tr.scheduler.base_lrs == [2e-3]
        assert group["lr"] == pytest.approx(2e-3 * 1 / 4)
        (row,) = train_loop(tr)
        assert row["step"] == 2 and row["lr"] == pytest.approx(2e-3 / 4)
        assert tr.optimizer.param_groups[0]["lr"] == pytest.approx(2e-3 * 2 / 4)
    changes = [{k: r[k] for k in ("step", "key", "old", "new")} for r in read_jsonl(run / "config_changes.jsonl")]
    assert changes == [{"step": 1, "key": "optim.grad_clip", "old": 1.0, "new": 0.5},
                       {"step": 1, "key": "optim.lr", "old": 1e-3, "new": 2e-3},
                       {"step": 1, "key": "train.steps", "old": 1, "new": 2}]
    assert (run / "config.yaml").read_text() == original  # the original config stays
    saved = ckpt.read_trainer_state(run / "checkpoints" / "step_000002")
    assert saved["config"]["optim"]["lr"] == 2e-3  # the config in force, compared on the next --resume
    # resuming again from step 2 with the same config records nothing new; a rolled-back session's rows go
    with Trainer(tiny_config(*base, "train.steps=2", "optim.lr=2e-3", "optim.grad_clip=0.5", out=run), resume=True):
        pass  # constructing the resumed trainer is what records (or rolls back) config changes
    assert len(read_jsonl(run / "config_changes.jsonl")) == 3
    shutil.rmtree(run / "checkpoints" / "step_000002")
    with Trainer(tiny_config(*base, "train.steps=3", out=run), resume=True):  # from step 1, the original lr
        pass
    assert [(r["step"], r["key"]) for r in read_jsonl(run / "config_changes.jsonl")] == [(1, "train.steps")]


# ---------------------------------------------------------------------------------------------- 7. one line


def test_ctrl_c_in_train_prints_the_step_and_releases_the_lock(tiny_config, tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    real_step = Trainer.step

    def step(self):
        if self.state["step"] == 1:
            raise KeyboardInterrupt
        return real_step(self)

    monkeypatch.setattr(Trainer, "step", step)
    assert main(["train", *CLI_BASE, f"output_dir={run}", "train.steps=3", "train.save_every=1"]) == 130
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == "cegppo train: interrupted at step 1; continue with --resume", err
    assert "Traceback" not in err and lock_is_free(run) and not (run / OWNER_FILE).exists()
    with pytest.raises(KeyboardInterrupt):  # --debug: the exception itself, traceback and all
        main(["--debug", "train", *CLI_BASE, f"output_dir={run}", "train.steps=3", "--resume"])
    assert lock_is_free(run)


def test_sigint_ends_cegppo_train_in_one_line(tmp_path):
    """A real Ctrl-C (SIGINT) to a running `cegppo train`."""
    run = tmp_path / "run"
    log_file = tmp_path / "stderr.txt"
    with open(log_file, "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "cegppo.cli", "train", *CLI_BASE, f"output_dir={run}",
                                 "train.steps=1000", "train.save_every=1"], env=cli_env(), stdout=subprocess.DEVNULL,
                                stderr=stderr,
                                # as from a terminal: a suite started in the background (`pytest &`) inherits SIGINT
                                # ignored, and Python keeps it ignored, so the Ctrl-C would never arrive
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        try:
            deadline = time.monotonic() + 240
            while not read_jsonl(run / "metrics.jsonl") and time.monotonic() < deadline and proc.poll() is None:
                time.sleep(0.2)
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
    err = log_file.read_text()
    assert proc.returncode == 130, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert re.fullmatch(r"cegppo train: interrupted at step \d+; continue with --resume", last), last
    assert "Traceback" not in err and lock_is_free(run) and not (run / OWNER_FILE).exists()


@pytest.mark.parametrize("command", ["eval", "sft", "compare"])
def test_ctrl_c_in_other_commands_prints_interrupted(command, tmp_path, monkeypatch, capsys):
    import cegppo.reporting.compare as compare

    def interrupt(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr({"eval": recipes, "sft": recipes, "compare": compare}[command],
                        {"eval": "run_eval", "sft": "run_sft", "compare": "compare_runs"}[command], interrupt)
    argv = {"eval": ["eval", "--model", "tiny", "--data", "arithmetic"],
            "sft": ["sft", "tiny", "--out", str(tmp_path / "m")],
            "compare": ["compare", str(tmp_path), "--out", str(tmp_path / "cmp")]}[command]
    assert main(argv) == 130
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == f"cegppo {command}: interrupted" and "Traceback" not in err


def test_debug_shows_the_traceback(tmp_path, capsys):
    from cegppo.config import ConfigError

    assert main(["train", str(tmp_path / "nope.yaml")]) == 2
    assert "Traceback" not in capsys.readouterr().err
    for argv in (["--debug", "train", str(tmp_path / "nope.yaml")], ["train", "--debug", str(tmp_path / "nope.yaml")]):
        with pytest.raises(ConfigError, match="does not exist"):
            main(argv)


def test_compare_out_existing_file_is_one_line(tmp_path, capsys):
    out = tmp_path / "report.txt"
    out.write_text("keep me")
    assert main(["compare", str(tmp_path), "--out", str(out)]) == 2
    (line,) = error_lines(capsys.readouterr().err)
    assert line == (f"cegppo compare: error: --out {out} is an existing file; give a directory (it will hold "
                    f"compare.png, one PNG per metric and summary.md)")
    assert out.read_text() == "keep me"
    assert main(["compare", str(tmp_path / "not_a_run"), "--out", str(tmp_path / "cmp")]) == 2
    (line,) = error_lines(capsys.readouterr().err)
    assert "is not a cegppo run directory" in line


# ---------------------------------------------------------------------------------------------- 6. eval manifest


def test_eval_refuses_a_checkpoint_that_no_longer_matches_its_manifest(tiny_config, tmp_path, capsys, caplog):
    with Trainer(tiny_config(*SMALL, out=tmp_path / "run")) as tr:
        path = tr.save()
    with caplog.at_level(logging.INFO, logger="cegppo"):
        recipes.verify_model_dir(str(path))  # intact: accepted
    assert "checkpoint verified against its manifest" in caplog.text
    weights = path / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-10] ^= 0xFF
    weights.write_bytes(bytes(data))
    assert main(["eval", "--model", str(path), "--data", "arithmetic", "--num-problems", "1"]) == 2
    (line,) = error_lines(capsys.readouterr().err)
    assert line == (f"cegppo eval: error: --model {path}: this checkpoint no longer matches its manifest "
                    f"(model.safetensors does not match its SHA-256); refusing to evaluate it")


def test_provenance_outside_a_git_checkout(tmp_path, monkeypatch):
    """A copy of the tree (a GPU check's) names its commit in CEGPPO_COMMIT, which wins over a .git there: the H200's
    copy held a .git at an older commit than its tree (benchmarks/results/gpu_h200/README.md)."""
    from cegppo.engine import provenance

    monkeypatch.setenv("CEGPPO_COMMIT", "0123456789abcdef")
    assert provenance.provenance() | {"command": "", "cegppo_version": ""} == {
        "command": "", "cegppo_version": "", "commit": "0123456789abcdef", "uncommitted_changes": False}
    monkeypatch.setattr(provenance, "__file__", str(tmp_path / "a" / "src" / "cegppo" / "engine" / "provenance.py"))
    assert provenance.commit_label() == "0123456"
    monkeypatch.delenv("CEGPPO_COMMIT")
    assert provenance.commit_label() == "unknown"


def test_recorded_commands_hold_no_path_of_this_machine(monkeypatch, tmp_path):
    """Paths inside the checkout are recorded relative to it, any other absolute path as <local>; `python -m
    cegppo.cli` is recorded as `cegppo`."""
    from cegppo.engine import provenance

    root = Path(provenance.__file__).resolve().parents[3]
    assert provenance.portable_path(str(tmp_path / "out")) == "<local>"
    assert provenance.portable_path(f"output_dir={tmp_path}") == "output_dir=<local>"
    assert provenance.portable_path(str(root / "benchmarks" / "x.py")) == "benchmarks/x.py"
    assert provenance.portable_path("train.steps=5") == "train.steps=5"
    monkeypatch.setattr("sys.argv", [str(root / "src" / "cegppo" / "cli.py"), "train", f"output_dir={tmp_path}"])
    assert provenance.provenance()["command"] == "cegppo train output_dir=<local>"
