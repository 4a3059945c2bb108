"""Bad input, failures mid-run and security properties (catalogue: docs/reliability.md)."""

import contextlib
import errno
import importlib
import json
import logging
import os
import re
import time
from pathlib import Path

import pytest
import torch

from cegppo.recipes import train_loop
from cegppo.engine import checkpoint as ckpt
from cegppo.engine.checkpoint import CheckpointError
from cegppo.cli import main
from cegppo.config import ConfigError, load_config, load_yaml, parse_overrides
from cegppo.io import read_jsonl
from cegppo.engine.models import ModelLoadError, validate_smollm2_gguf
from cegppo.data.rewards import load_reward
from cegppo.engine.trainer import Trainer, TrainingError

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "cegppo"
SMALL = ("train.prompts_per_step=2", "train.mini_batches=1", "rollout.n=2", "rollout.max_new_tokens=8",
         "data.num_train=8", "data.num_test=0", "train.save_every=0")


def params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten().clone() for p in model.parameters()])


# ---------------------------------------------------------------------------------------------- catalogue


def test_catalogue_matches_tests():
    text = (ROOT / "docs" / "reliability.md").read_text()
    rows = [line for line in text.splitlines() if re.match(r"^\|\s*\d+\s*\|", line)]
    assert len(rows) >= 18, len(rows)
    numbers = [int(r.split("|")[1]) for r in rows]
    assert numbers == list(range(1, len(rows) + 1))
    for row in rows:
        refs = re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", row.split("|")[4])
        assert refs, f"no test referenced in: {row}"
        for path, name in refs:
            assert (ROOT / path).is_file(), path
            module = importlib.import_module(Path(path).stem)
            assert callable(getattr(module, name, None)), f"{path}::{name} does not exist"


# ---------------------------------------------------------------------------------------------- CLI


MALFORMED = json.dumps({"question": "Q", "answer": "1"}) + "\n{oops\n"


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.mark.parametrize("case, expected", [
    ("unknown_key", r"unknown config key 'train\.stepz'"),
    ("bad_yaml", r"bad\.yaml: not valid YAML"),
    ("missing_config", r"config file .*nope\.yaml does not exist"),
    ("malformed_data", r"data\.jsonl:2: malformed JSON"),
    ("model_missing", r"model\.name: model directory '/nonexistent/model' does not exist"),
    ("bad_reward", r"reward\.fn: reward 'no_such_module_xyz:f': cannot import module"),
    ("unwritable_output", r"output directory .* is not writable"),
])
def test_cli_bad_input_is_one_line(case, expected, tmp_path, capsys):
    base = ["tiny", f"output_dir={tmp_path / 'run'}", "reward.fn=fixtures.rewards:digit_overlap", "sft.steps=0",
            "logging.progress=false"]
    args = {
        "unknown_key": base + ["train.stepz=3"],
        "bad_yaml": [str(_write(tmp_path / "bad.yaml", "train: [1, 2\n"))],
        "missing_config": [str(tmp_path / "nope.yaml")],
        "malformed_data": base + [f"data.train_path={_write(tmp_path / 'data.jsonl', MALFORMED)}"],
        "model_missing": base + ["model.name=/nonexistent/model"],
        "bad_reward": base + ["reward.fn=no_such_module_xyz:f"],
        "unwritable_output": base + [f"output_dir={_write(tmp_path / 'a_file', 'x')}/run"],
    }[case]
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1 and lines[0].startswith("cegppo train: error: "), err
    assert re.search(expected, lines[0]), lines[0]
    assert "Traceback" not in err


# ---------------------------------------------------------------------------------------------- checkpoints


def test_disk_full_during_checkpoint(tiny_config, monkeypatch):
    with Trainer(tiny_config(*SMALL[:-1], "train.steps=1", "train.save_every=1")) as tr:
        first = tr.save()  # step 0: a valid checkpoint to fall back on

        def full(*a, **k):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        # the fsync of the finished temp dir (manifest included), where a full disk surfaces last before the rename
        monkeypatch.setattr(ckpt, "_fsync_tree", full)
        with pytest.raises(CheckpointError, match=r"could not write checkpoint .*step_000001: No space left on device"):
            train_loop(tr)
        root = tr.run.checkpoints
    assert ckpt.latest_valid_checkpoint(root) == first and ckpt.list_checkpoints(root) == [first]
    assert not ckpt.stale_temp_dirs(root) and not list(root.glob(".tmp*"))


def test_corrupt_metrics_file_is_reported_on_resume(tiny_config, tmp_path):
    with Trainer(tiny_config(*SMALL[:-1], "train.save_every=1")) as tr:  # kept open: refused with the lock shared
        tr.save()
        (tr.run.path / "metrics.jsonl").write_text('{"step": 1}\n{broken\n{"step": 2}\n')
        with pytest.raises(TrainingError, match=r"metrics\.jsonl:2: not valid JSON; repair or remove"):
            Trainer(tiny_config(*SMALL[:-1], "train.save_every=1"), resume=True)


def test_torn_last_metrics_line_is_dropped_on_resume(tiny_config):
    with contextlib.ExitStack() as stack:  # both trainers open together (the lock shared), both closed at the end
        tr = stack.enter_context(Trainer(tiny_config(*SMALL[:-1], "train.save_every=1")))
        tr.state["step"] = 2
        assert tr.save().name == "step_000002"  # resume point: rows up to step 2 are kept, later ones dropped
        rows = [{"step": 1, "x": 1}, {"step": 2, "x": 2}, {"step": 3, "x": 3}]
        metrics = tr.run.path / "metrics.jsonl"
        metrics.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 2, "x"')  # kill mid-append
        assert read_jsonl(metrics) == rows  # ignored on read
        (tr.run.path / "eval.jsonl").write_text('{"step": 0, "tag": "base"}\n{"step": 2, "tag": "periodic"}\n'
                                               '{"step": 2, "tag": "final"}\n{"step": 3, "tag": "periodic"}\n')
        resumed = stack.enter_context(Trainer(tiny_config(*SMALL[:-1], "train.save_every=1"), resume=True))
        assert resumed.state["step"] == 2
        text = metrics.read_text()  # dropped on resume: whole rows only, each newline-terminated
        assert text.endswith("\n") and [json.loads(line) for line in text.splitlines()] == rows[:2], text
        assert read_jsonl(metrics) == rows[:2]
        assert read_jsonl(tr.run.path / "eval.jsonl") == [{"step": 0, "tag": "base"}, {"step": 2, "tag": "periodic"}]


def test_resume_without_checkpoint_starts_fresh(tiny_config, caplog):
    with caplog.at_level(logging.WARNING), Trainer(tiny_config(*SMALL), resume=True) as tr:
        assert tr.state["step"] == 0 and "no valid checkpoint" in caplog.text


# ---------------------------------------------------------------------------------------------- failures mid-run


@pytest.mark.parametrize("fn", ["raises", "nan_reward", "hangs"])
def test_reward_failures_are_counted_and_the_run_continues(fn, tiny_config, caplog):
    with Trainer(tiny_config(*SMALL, "train.steps=1", f"reward.fn=fixtures.rewards:{fn}",
                             "reward.timeout_s=0.05")) as tr:
        with caplog.at_level(logging.WARNING, logger="cegppo.engine.trainer"):
            (row,) = train_loop(tr)
        assert row["reward/failures"] == 4 and row["reward/accuracy"] == 0 and row["reward/mean"] == -1
        assert "reward failure at step 1" in caplog.text
        assert read_jsonl(tr.run.metrics)[0]["reward/failures"] == 4


def test_nan_loss_skips_the_update_and_recovers(tiny_config, caplog, monkeypatch):
    import cegppo.engine.trainer as trainer_module

    with Trainer(tiny_config(*SMALL, "train.steps=2", "train.max_bad_steps=2")) as tr:
        real_loss = trainer_module.policy_loss

        def nan_on_step_1(*a, **k):
            loss, m = real_loss(*a, **k)
            return (loss * torch.nan if tr.state["step"] == 0 else loss), m

        monkeypatch.setattr(trainer_module, "policy_loss", nan_on_step_1)
        before, after_step = params(tr.model), {}
        with caplog.at_level(logging.WARNING, logger="cegppo.engine.trainer"):
            rows = train_loop(tr, on_step=lambda t, row: after_step.setdefault(row["step"], params(t.model)))
        assert "step 1: non-finite loss; update skipped" in caplog.text
        assert [r["train/skipped_updates"] for r in rows] == [1, 0] and tr.state["bad_steps"] == 0
    assert torch.equal(after_step[1], before) and not torch.equal(after_step[2], before)


def test_nan_logits_stop_training_after_max_bad_steps(tiny_config):
    with Trainer(tiny_config(*SMALL, "train.steps=5", "train.max_bad_steps=2")) as tr:
        # NaN hidden states in the loss passes only (generation and the old-log-prob pass run without grad)
        tr.model.get_decoder().norm.register_forward_hook(
            lambda mod, inp, out: out * torch.nan if torch.is_grad_enabled() else out)
        before = params(tr.model)
        with pytest.raises(TrainingError, match=r"2 consecutive steps had a non-finite loss or gradient "
                                                r"\(train\.max_bad_steps=2\); stopping"):
            train_loop(tr)
        rows = read_jsonl(tr.run.metrics)
        assert [r["train/skipped_updates"] for r in rows] == [1, 1]
        assert torch.equal(params(tr.model), before)


# ---------------------------------------------------------------------------------------------- security


def test_checkpoints_are_safetensors(tiny_config):
    with Trainer(tiny_config(*SMALL[:-1], "train.save_every=1")) as tr:
        path = tr.save()
    names = {p.name for p in path.iterdir()}
    assert "model.safetensors" in names and "pytorch_model.bin" not in names
    assert not [n for n in names if n.endswith((".bin", ".pkl", ".pickle"))]
    assert {n for n in names if n.endswith(".pt")} == {"optimizer.pt", "scheduler.pt"}


class _Exploit:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.makedirs, (str(self.marker),))


def test_malicious_optimizer_state_is_refused(tiny_config, tmp_path):
    with Trainer(tiny_config(*SMALL[:-1], "train.save_every=1")) as tr:  # kept open while the resume is refused
        path = tr.save()
        marker = tmp_path / "pwned"
        opt = path / "optimizer.pt"
        torch.save({"state": {0: _Exploit(marker)}, "param_groups": []}, opt)
        manifest = json.loads((path / ckpt.MANIFEST).read_text())  # a consistent manifest: only unpickling catches it
        manifest["files"]["optimizer.pt"] = {"bytes": opt.stat().st_size, "sha256": ckpt.sha256_file(opt)}
        (path / ckpt.MANIFEST).write_text(json.dumps(manifest))
        assert ckpt.verify_checkpoint(path) is None
        with pytest.raises(CheckpointError, match=r"optimizer\.pt: refused to load \(UnpicklingError"):
            Trainer(tiny_config(*SMALL[:-1], "train.save_every=1"), resume=True)
    assert not marker.exists()


def test_torch_load_is_weights_only_everywhere():
    for f in SRC.rglob("*.py"):
        text = f.read_text()
        for call in re.findall(r"torch\.load\([^)]*\)", text):
            assert "weights_only=True" in call, f"{f}: {call}"
        assert not re.search(r"\bpickle\.loads?\(|weights_only=False|trust_remote_code=True", text), f


def test_no_eval_or_exec_in_src():
    """No call of the builtins eval / exec / compile anywhere in the package (read with ast: a message that says
    "eval (" is not a call; re.compile and torch.compile are attributes, allowed)."""
    import ast

    banned = {"eval", "exec", "compile"}
    for f in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.Call):
                fn = node.func
                name = fn.id if isinstance(fn, ast.Name) else (
                    fn.attr if isinstance(fn, ast.Attribute) and isinstance(fn.value, ast.Name)
                    and fn.value.id == "builtins" else None)
                assert name not in banned, f"{f}:{node.lineno}: a call of {name}()"


def test_reward_code_only_from_the_import_path(tmp_path):
    evil = tmp_path / "evil_reward.py"
    evil.write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\ndef f(c, g):\n    return True\n")
    for spec in (f"{evil}:f", "evil_reward:f", f"{tmp_path}/evil_reward:f"):
        with pytest.raises(ValueError, match="cannot import module"):
            load_reward(spec)
    assert not (tmp_path / "ran").exists()


def test_model_directory_code_is_never_imported(tmp_path):
    from cegppo.engine.models import build_tiny_model, load_model

    d = build_tiny_model(tmp_path / "m")
    (d / "evil_code.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\n"
                                    "from transformers import Qwen2ForCausalLM\n"
                                    "class Evil(Qwen2ForCausalLM):\n    pass\n")
    cfg = json.loads((d / "config.json").read_text())
    cfg["auto_map"] = {"AutoModelForCausalLM": "evil_code.Evil"}
    (d / "config.json").write_text(json.dumps(cfg))
    model, _ = load_model(str(d))  # trust_remote_code=False: auto_map is ignored and the directory loads
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert not (tmp_path / "ran").exists()


def test_fake_gguf_with_wrong_contents_is_rejected(tmp_path):
    gguf = pytest.importorskip("gguf")
    import numpy as np

    path = tmp_path / "fake.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(2)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match=r"fake\.gguf: unexpected GGUF contents: llama\.block_count=2 "
                                             r"\(expected 30\).*1 tensors \(expected 272\)"):
        validate_smollm2_gguf(path)
    path.write_bytes(path.read_bytes()[:40])  # truncated
    with pytest.raises(ModelLoadError, match=r"fake\.gguf: not a readable GGUF file"):
        validate_smollm2_gguf(path)


# ---------------------------------------------------------------------------------------------- hostile files


@pytest.mark.parametrize("cut", ["half", "header", "empty", "garbage_header", "huge_header_length"])
def test_corrupt_safetensors_is_one_line(cut, tmp_path):
    import shutil
    import struct

    from cegppo.engine.models import build_tiny_model, load_model

    src = build_tiny_model(tmp_path / "m")
    f = src / "model.safetensors"
    raw = f.read_bytes()
    f.write_bytes({"half": raw[: len(raw) // 2], "header": raw[:100], "empty": b"",
                   "garbage_header": raw[:8] + b"x" * 50 + raw[58:],
                   "huge_header_length": struct.pack("<Q", 2**62) + raw[8:]}[cut])
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: corrupt or truncated safetensors file") as e:
        load_model(str(src))
    assert "\n" not in str(e.value)
    shutil.rmtree(src)


LAUGHS = "a: &a [x,x,x,x,x,x,x,x,x]\n" + "".join(
    f"{c}: &{c} [{','.join(['*' + p] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi"))


@pytest.mark.parametrize("name, content, expected", [
    ("laughs.yaml", LAUGHS, r"laughs\.yaml: YAML expands to more than 100000 nodes"),
    ("list.yaml", "- train\n- steps\n", r"list\.yaml: the top level must be a mapping of config sections .* got list"),
    ("scalar.yaml", "just text\n", r"scalar\.yaml: the top level must be a mapping .* got str"),
    ("self.yaml", "base: self.yaml\n", r"self\.yaml: 'base' cycle self\.yaml -> self\.yaml"),
    ("a.yaml", "base: b.yaml\n", r"b\.yaml: 'base' cycle a\.yaml -> b\.yaml -> a\.yaml"),
    ("rec.yaml", "train: &t {steps: *t}\n", r"rec\.yaml: recursive YAML alias \*'t'"),
    ("deep.yaml", "x: " + "[" * 200 + "]" * 200 + "\n", r"deep\.yaml: YAML nested deeper than 64 levels"),
    ("latin1.yaml", b"output_dir: caf\xe9\n", r"latin1\.yaml:1: not UTF-8 text \(byte 0xe9\)"),
    ("big.yaml", b"#" * (1 << 20) + b"\n", r"big\.yaml: config file larger than 1024 KiB"),
    ("bigint.yaml", "train:\n  steps: " + "9" * 5000 + "\n", r"bigint\.yaml: not valid YAML: ValueError: Exceeds"),
    ("pyobj.yaml", "x: !!python/object/apply:os.system [echo]\n", r"pyobj\.yaml: not valid YAML .*constructor"),
    ("longval.yaml", "train:\n  steps: '" + "z" * 100_000 + "'\n", r"train\.steps: expected int, got str 'zzz"),
    ("longkey.yaml", "train:\n  '" + "k" * 1000 + "': 1\n", r"unknown config key 'train\.kkkk"),
])
def test_hostile_config_files(name, content, expected, tmp_path, capsys):
    """Every hostile config file is refused with one bounded line, cheaply (the laughs in well under a second);
    through the CLI too."""
    (tmp_path / "b.yaml").write_text("base: a.yaml\n")
    p = tmp_path / name
    p.write_bytes(content if isinstance(content, bytes) else content.encode())
    t0 = time.perf_counter()
    with pytest.raises(ConfigError, match=expected) as e:
        load_config(p)
    assert time.perf_counter() - t0 < 0.5
    assert "\n" not in str(e.value) and len(str(e.value)) <= 1000
    assert main(["train", str(p)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and re.search(expected, err) and len(err) < 1100


def test_billion_laughs_fails_fast():
    assert len(LAUGHS) < 400
    nested = "x:\n" + "".join(f"  {line}\n" for line in LAUGHS.splitlines())
    for text in (LAUGHS, nested):
        t0 = time.perf_counter()
        with pytest.raises(ConfigError, match="more than 100000 nodes"):
            load_yaml(text, "laughs")
        assert time.perf_counter() - t0 < 0.1
    with pytest.raises(ConfigError, match="more than 100000 nodes"):  # through an override value too
        parse_overrides(["algorithm.hparams=" + "{" + LAUGHS.replace("\n", ", ").rstrip(", ") + "}"])
