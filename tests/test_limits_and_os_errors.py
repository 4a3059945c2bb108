"""Issue 41, class 7: absurd values and errno-only errors. Every key that sizes work has an upper bound from what a
machine can hold (and temperatures a positive minimum), refused before anything loads in one line naming the key and
the accepted range; an OS error (a full disk, a symbolic link to nothing, an unwritable cache) names the file and the
setting it came from (docs/reliability.md)."""

import errno
import os
import re
from pathlib import Path

import pytest

from cegppo.cli import example_config, main
from cegppo.config import ConfigError, load_config
from fixtures.cli import error_line

CLI = ["tiny", "reward.fn=fixtures.rewards:digit_overlap", "logging.progress=false", "data.num_test=0"]


@pytest.mark.parametrize("override,says", [
    ("rollout.n=100000000", "rollout.n must be in 1..65536, got 100000000"),
    ("eval.k=5000000", "eval.k must be an integer in 1..65536, got 5000000"),
    ("rollout.temperature=1e-300", "rollout.temperature must be a finite number >= 0.0001 (logits are divided by it"),
    ("eval.temperature=1e-300", "eval.temperature must be 0 or a finite number >= 0.0001 (0 = greedy; "),
    ("rollout.max_new_tokens=10000000", "rollout.max_new_tokens must be in 1..1048576, got 10000000"),
    ("rollout.max_prompt_tokens=10000000", "rollout.max_prompt_tokens must be in 1..1048576"),
    ("eval.max_new_tokens=10000000", "eval.max_new_tokens must be an integer in 1..1048576"),
    ("train.prompts_per_step=100000000", "train.prompts_per_step must be in 1..1048576"),
    ("train.gen_prompts_per_step=100000000", "train.gen_prompts_per_step must be in 0..1048576"),
    ("train.micro_batch_size=100000000", "train.micro_batch_size must be in 1..1048576"),
    ("sft.batch_size=100000000", "sft.batch_size must be in 1..1048576"),
    ("data.num_train=1000000000", "data.num_train must be in 1..1048576"),
    ("reward.correct_score=1e300", "reward.correct_score must be a finite number >= -1000000 and <= 1000000"),
    ("reward.overlong_penalty=1e300", "reward.overlong_penalty must be a finite number >= 0 and <= 1000000"),
    # in range one by one, too much together: the step's generation batch
    ("rollout.n=65536 train.prompts_per_step=1024",
     "train.prompts_per_step=1024 x rollout.n=65536 sequences x (rollout.max_prompt_tokens=160 + "
     "rollout.max_new_tokens=24) tokens = 12348030976 tokens in one step's generation; expected at most 2147483648"),
    ("eval.k=65536 eval.temperature=1 eval.max_new_tokens=4096",
     "prompts per held-out batch=16 x eval.k=65536 sequences x (rollout.max_prompt_tokens=160 + "
     "eval.max_new_tokens=4096) tokens"),
])
def test_absurd_values_are_refused_naming_the_key_and_range(override, says, tmp_path, capsys, no_model):
    overrides = override.split()
    with pytest.raises(ConfigError) as e:
        load_config(example_config("tiny"), overrides)
    assert says in str(e.value), str(e.value)
    assert main(["train", *CLI, f"output_dir={tmp_path / 'run'}", *overrides]) == 2
    assert says in error_line(capsys.readouterr().err)
    assert not (tmp_path / "run").exists()


def test_the_bounds_themselves_are_accepted():
    cfg = load_config(example_config("tiny"), ["rollout.n=65536", "train.prompts_per_step=1", "eval.k=65536",
                                               "eval.temperature=0.0001", "rollout.temperature=0.0001",
                                               "reward.correct_score=1000000", "train.micro_batch_size=1048576"])
    assert cfg.rollout.n == 65536 and cfg.eval.temperature == 1e-4
    cfg = load_config(example_config("tiny"), ["rollout.max_new_tokens=1048576", "rollout.max_prompt_tokens=1048576",
                                               "eval.max_new_tokens=1048576"])
    assert cfg.rollout.max_new_tokens == 1 << 20


@pytest.mark.parametrize("flags,says", [
    (["--k", "5000000", "--temperature", "1"], "--k must be an integer in 1..65536, got 5000000"),
    (["--temperature", "1e-300"], "--temperature must be 0 or a finite number >= 0.0001"),
    (["--max-new-tokens", "100000000"], "--max-new-tokens must be an integer in 1..1048576"),
    (["--max-prompt-tokens", "100000000"], "--max-prompt-tokens must be an integer in 1..1048576"),
    (["--batch-prompts", "100000000"], "--batch-prompts must be an integer in 1..1048576"),
    (["--batch-prompts", "100000", "--k", "60000"],
     "--batch-prompts=100000 x --k=60000 sequences x (--max-prompt-tokens=1024 + --max-new-tokens=256) tokens = "
     "7680000000000 tokens in one generation batch; expected at most 2147483648"),
])
def test_eval_flags_have_the_same_bounds(flags, says, capsys, no_model):
    assert main(["eval", "--model", "tiny", "--data", "arithmetic", *flags]) == 2
    assert says in error_line(capsys.readouterr().err)


# ------------------------------------------------------------------------------------------------- OS errors


def make_runs(tmp_path: Path) -> list[str]:
    runs = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text('{"step": 1, "entropy": 1.0, "reward/mean": 0.1}\n')
        runs.append(str(tmp_path / name))
    return runs


def test_a_full_disk_names_the_file_and_the_setting(tmp_path, monkeypatch, capsys):
    """write() on a full disk raises ENOSPC naming no file: the line names the file being written and --out."""
    import cegppo.io as io

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(io.os, "fsync", full)
    out = tmp_path / "cmp"
    assert main(["compare", *make_runs(tmp_path), "--out", str(out)]) == 2
    line = error_line(capsys.readouterr().err)
    assert re.fullmatch(rf"cegppo compare: error: {re.escape(str(tmp_path))}/\.tmp-cmp-\d+/compare\.png: No space "
                        rf"left on device \(ENOSPC\); it is under --out {re.escape(str(out))}: fix that, or set --out "
                        rf"to another path", line), line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]  # nothing half-written


def test_a_dangling_symbolic_link_is_named_as_one(tmp_path, capsys, no_model):
    link = tmp_path / "run"
    link.symlink_to(tmp_path / "gone" / "run")
    assert main(["train", *CLI, f"output_dir={link}"]) == 2
    line = error_line(capsys.readouterr().err)
    assert line == (f"cegppo train: error: output directory {link} is not writable: {link}: a symbolic link to "
                    f"'{tmp_path / 'gone' / 'run'}', which does not exist (EEXIST); it is output_dir {link}: fix "
                    f"that, or set output_dir to another path"), line
    out = tmp_path / "res.jsonl"
    out.symlink_to(tmp_path / "gone.jsonl")  # an output that is a link to nothing is an existing entry: refused
    assert main(["eval", "--model", "tiny", "--data", "arithmetic", "--out", str(out)]) == 2
    assert f"--out {out} is an existing file" in error_line(capsys.readouterr().err)
    cfg = tmp_path / "c.yaml"
    cfg.symlink_to(tmp_path / "gone.yaml")
    assert main(["train", str(cfg)]) == 2
    assert error_line(capsys.readouterr().err) == (f"cegppo train: error: config file {cfg} is a symbolic link to "
                                                   f"'{tmp_path / 'gone.yaml'}', which does not exist")


def test_an_unwritable_model_cache_names_the_setting(tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("CEGPPO_CACHE", str(blocker / "cache"))  # its parent is a file: nothing can be created
    assert main(["eval", "--model", "tiny", "--data", "arithmetic", "--num-problems", "1"]) == 2
    line = error_line(capsys.readouterr().err)
    assert line.startswith(f"cegppo eval: error: --model: preset 'tiny': could not build it in the model cache: "
                           f"{blocker / 'cache'}/models: Not a directory (ENOTDIR); it is under $CEGPPO_CACHE "
                           f"{blocker / 'cache'}: fix that, or set $CEGPPO_CACHE to another path"), line
