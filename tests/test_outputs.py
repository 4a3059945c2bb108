"""Issue 23, class 1: outputs never overwrite inputs or finished work. Every command that writes (train, sft, eval,
compare) checks its outputs before the expensive part; --overwrite removes only what a run recorded writing; a
--resume that cannot continue a run never replaces it (docs/reliability.md, docs/runs.md)."""

import json
from pathlib import Path

import pytest

import cegppo.recipes as recipes
from cegppo.cli import main
from cegppo.config import ConfigError
from cegppo.config.validation import RUN_PATH_HEADROOM
from cegppo.engine.rundir import RUN_FILES
from cegppo.engine.trainer import Trainer, TrainingError
from cegppo.recipes import train_loop
from fixtures.cli import error_line

SMALL = ("train.prompts_per_step=2", "train.mini_batches=1", "rollout.n=2", "rollout.max_new_tokens=8",
         "data.num_train=8", "data.num_test=0")
CLI = ["tiny", "reward.fn=fixtures.rewards:digit_overlap", "logging.progress=false", *SMALL]


def snapshot(d: Path) -> dict:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


# --------------------------------------------------------------------------------------------------- sft


def test_sft_refuses_an_existing_output_before_loading_the_model(tmp_path, capsys, no_model):
    out = tmp_path / "model"
    out.write_text("precious")
    assert main(["sft", *CLI, "sft.steps=1", "--out", str(out)]) == 2
    assert error_line(capsys.readouterr().err) == (
        f"cegppo sft: error: --out {out} is an existing file; it would be overwritten: choose a new path (or "
        f"remove it)")
    assert out.read_text() == "precious"
    full = tmp_path / "full"
    full.mkdir()
    (full / "config.json").write_text("{}")
    assert main(["sft", *CLI, "sft.steps=1", "--out", str(full)]) == 2
    assert "is a directory holding config.json; it would be overwritten" in capsys.readouterr().err
    assert main(["sft", *CLI, "sft.steps=1", "--out", str(tmp_path / ("x" * 300))]) == 2
    assert "NAME_MAX" in capsys.readouterr().err


def test_sft_writes_a_new_directory_whole(tmp_path, capsys):
    out = tmp_path / "empty"
    out.mkdir()  # an empty directory is a new output
    assert main(["sft", *CLI, "sft.steps=1", "sft.batch_size=2", "--out", str(out)]) == 0
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]  # no temporary directory left


# --------------------------------------------------------------------------------------------------- eval


@pytest.mark.parametrize("case", ["input", "directory", "directory-slash", "existing", "summary-exists"])
def test_eval_out_is_checked_before_the_evaluation(case, tmp_path, capsys, no_model):
    data = tmp_path / "data.jsonl"
    data.write_text('{"question": "1+1?", "answer": "2"}\n')
    (tmp_path / "dir").mkdir()
    (tmp_path / "old.jsonl").write_text("old\n")
    (tmp_path / "res.summary.json").write_text("{}")
    out, expected = {
        "input": (str(data), f"--out {data} is also an input (--data {data} {data})"),
        "directory": (str(tmp_path / "dir"), f"--out {tmp_path / 'dir'} is a directory; give the path of a new file"),
        "directory-slash": (str(tmp_path / "new") + "/", "names a directory; give the path of a new .jsonl file"),
        "existing": (str(tmp_path / "old.jsonl"), "is an existing file; it would be overwritten"),
        "summary-exists": (str(tmp_path / "res.jsonl"), f"--out {tmp_path / 'res.summary.json'} is an existing file"),
    }[case]
    before = snapshot(tmp_path)
    assert main(["eval", "--model", "tiny", "--data", str(data), "--out", out]) == 2
    assert expected in error_line(capsys.readouterr().err)
    assert snapshot(tmp_path) == before  # nothing written, the dataset intact


@pytest.mark.parametrize("flag,value", [("--batch-prompts", "-1"), ("--batch-prompts", "0"),
                                        ("--max-prompt-tokens", "0"), ("--difficulty", "9")])
def test_eval_refuses_settings_that_evaluate_nothing(flag, value, capsys, no_model):
    assert main(["eval", "--model", "tiny", "--data", "arithmetic", flag, value]) == 2
    assert error_line(capsys.readouterr().err).startswith(f"cegppo eval: error: {flag} must be ")


# --------------------------------------------------------------------------------------------------- compare


def test_compare_never_writes_into_a_run_or_over_an_earlier_comparison(tmp_path, capsys):
    runs = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text('{"step": 1, "entropy": 1.0, "reward/mean": 0.1}\n')
        runs.append(str(tmp_path / name))
    before = snapshot(tmp_path)
    assert main(["compare", *runs, "--out", runs[0]]) == 2
    assert f"--out {runs[0]} is inside the compared run {runs[0]} (an input)" in error_line(capsys.readouterr().err)
    assert main(["compare", *runs, "--out", str(tmp_path / "a" / "cmp")]) == 2
    capsys.readouterr()
    earlier = tmp_path / "cmp"
    earlier.mkdir()
    (earlier / "summary.md").write_text("mine")
    assert main(["compare", *runs, "--out", str(earlier)]) == 2
    assert "already holds summary.md (an earlier comparison?)" in error_line(capsys.readouterr().err)
    assert snapshot(tmp_path) == {**before, "cmp/summary.md": b"mine"}


# --------------------------------------------------------------------------------------------------- train


def test_hand_written_config_is_neither_a_run_nor_deleted(tiny_config, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("# my notes\ntrain: {steps: 2}\n")
    for overwrite in (False, True):
        with pytest.raises(TrainingError) as e:
            Trainer(tiny_config(*SMALL, out=run), overwrite=overwrite)
        assert str(e.value) == (
            f"{run} holds config.yaml, which no cegppo run recorded writing (no run.json lists it); a run would "
            f"replace it, so it is refused (even with --overwrite, which deletes only a run's recorded files): move "
            f"it away, or choose another output_dir")
        assert "already holds a run" not in str(e.value)
        assert (run / "config.yaml").read_text() == "# my notes\ntrain: {steps: 2}\n"


def test_overwrite_removes_only_the_recorded_files(tiny_config, tmp_path):
    run = tmp_path / "run"
    with Trainer(tiny_config(*SMALL, out=run)):
        pass
    record = json.loads((run / "run.json").read_text())
    assert record["files"] == list(RUN_FILES)  # the run's own record of what it writes
    (run / "notes.txt").write_text("mine")
    with Trainer(tiny_config(*SMALL, out=run), overwrite=True) as tr:
        assert json.loads((run / "run.json").read_text())["run_id"] == tr.state["run_id"] != record["run_id"]
    assert (run / "notes.txt").read_text() == "mine"


def test_resume_that_cannot_continue_never_replaces_the_run(tiny_config, tmp_path):
    run = tmp_path / "run"
    with Trainer(tiny_config(*SMALL, "train.steps=1", "train.save_every=0", out=run)) as tr:
        train_loop(tr)  # a finished run without a checkpoint
    before = snapshot(run)
    changed = ("algorithm.objective=grpo", "algorithm.hparams={}")
    for extra in (changed, ()):  # a changed objective, or the same config: nothing to continue from either way
        with pytest.raises(TrainingError) as e:
            Trainer(tiny_config(*SMALL, "train.steps=2", "train.save_every=0", *extra, out=run), resume=True)
        assert str(e.value).startswith(f"--resume refused: {run} holds a run with work in metrics.jsonl but no "
                                       f"checkpoint was written (train.save_every=0 writes none")
        assert snapshot(run) == before  # metrics, config, run id intact


def test_resume_of_a_run_without_work_checks_the_contract(tiny_config, tmp_path):
    run = tmp_path / "run"
    with Trainer(tiny_config(*SMALL, "train.save_every=0", out=run)) as tr:
        first = tr.state["run_id"]  # started, nothing done (killed before its first step)
    with pytest.raises(TrainingError, match=r"--resume refused: the config changes what this run is: .*"
                                            r"algorithm.objective \"ce_gppo\" -> \"grpo\""):
        Trainer(tiny_config(*SMALL, "algorithm.objective=grpo", "algorithm.hparams={}", out=run), resume=True)
    with Trainer(tiny_config(*SMALL, out=run), resume=True) as tr:  # the same run: starts it over, nothing lost
        assert tr.state["step"] == 0 and tr.state["run_id"] != first


def test_inputs_inside_the_run_files_are_refused(tiny_config, tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    data = run / "checkpoints" / "data.jsonl"
    data.write_text('{"question": "1+1?", "answer": "2", "solution": "2"}\n')
    with pytest.raises(TrainingError, match=r"data.train_path .* is inside this run's checkpoints"):
        Trainer(tiny_config(*SMALL, f"data.train_path={data}", "data.task=null", out=run), overwrite=True)
    assert data.exists()


def test_long_output_dir_is_refused_up_front_and_the_headroom_holds(tiny_config, tmp_path):
    deep = str(tmp_path / "/".join(["d" * 250] * 16))
    with pytest.raises(ConfigError, match=r"output_dir is \d+ bytes long .* over the 4095-byte limit here "
                                          r"\(PATH_MAX\): use a shorter path"):
        tiny_config(out=Path(deep))
    run = tmp_path / "run"
    with Trainer(tiny_config(*SMALL, out=run)) as tr:
        tr.save()
    longest = max(len(str(p.relative_to(run))) for p in run.rglob("*"))
    tmp_name = f".tmp-step_000000-{4194304}"  # the longest temporary checkpoint name (pid_max on Linux)
    assert longest + len(tmp_name) - len("step_000000") + 1 <= RUN_PATH_HEADROOM, longest
