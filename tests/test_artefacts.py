"""Artefacts checked for what they will be used as, before any work (issue 41, class 3; docs/reliability.md rows
68-71): the data files of a run fingerprinted into its record and compared on ``--resume``; a model directory's
tokenizer (present, fitting the embedding) and weights (fitting config.json); a checkpoint's optimizer state."""

from __future__ import annotations

import json

import pytest
import torch

from cegppo.cli import main
from cegppo.engine import checkpoint as ckpt
from cegppo.engine.artefacts import optimizer_state_problem
from cegppo.engine.models import ModelLoadError, build_char_tokenizer, build_tiny_model, load_model
from cegppo.engine.rundir import TrainingError

SMALL = ("train.prompts_per_step=2", "train.mini_batches=1", "rollout.n=2", "rollout.max_new_tokens=8",
         "data.task=null", "data.num_test=0", "eval.num_problems=0")


def _rows(n: int, start: int = 0) -> str:
    return "".join(json.dumps({"question": f"What is {i} + 1?", "answer": str(i + 1)}) + "\n"
                   for i in range(start, start + n))


def _no_model(monkeypatch) -> None:
    from cegppo.engine import trainer as trainer_mod

    def no_model(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(trainer_mod, "build_policy", no_model)


def test_resume_on_changed_data_is_refused_unless_accepted(tiny_config, tmp_path, monkeypatch, caplog):
    from cegppo.engine.trainer import Trainer

    data = tmp_path / "train.jsonl"
    data.write_text(_rows(8))
    cfg = tiny_config(*SMALL, f"data.train_path={data}")
    with Trainer(cfg) as tr:
        tr.save()
    record = json.loads((tmp_path / "run" / "run.json").read_text())
    assert record["data"]["data.train_path"]["path"] == str(data) and len(record["data"]["data.train_path"]["sha256"]) == 64
    with Trainer(cfg, resume=True):  # the same contents: resumes
        pass
    data.write_text(_rows(8, start=1))  # other contents under the same path (and the same size class)
    with monkeypatch.context() as m:
        _no_model(m)
        with pytest.raises(TrainingError, match=rf"^--resume refused: the data changed since the run started: "
                                                rf"data\.train_path {str(data)} \(sha256 .*--accept-data-change"):
            Trainer(cfg, resume=True)
    assert json.loads((tmp_path / "run" / "run.json").read_text()) == record  # nothing changed
    with Trainer(cfg, resume=True, accept_data_change=True):  # asked for: continues, and records it
        pass
    after = json.loads((tmp_path / "run" / "run.json").read_text())
    assert after["data"] != record["data"] and after["data_changes"][0]["old"] == record["data"]
    assert "continuing on changed data" in caplog.text
    with Trainer(cfg, resume=True):  # the accepted contents are now the run's
        pass


def test_accept_data_change_is_a_resume_flag(capsys):
    assert main(["train", "tiny", "--accept-data-change"]) == 2
    assert capsys.readouterr().err.strip() == ("cegppo train: error: --accept-data-change applies to --resume (a fresh "
                                               "run fingerprints the data it starts on)")


def test_a_directory_without_a_tokenizer_file_is_refused(tmp_path, capsys):
    """The issue's example: such a directory loaded a 4-token fallback tokenizer; eval graded empty responses."""
    d = build_tiny_model(tmp_path / "m")
    (d / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match=r"has no tokenizer vocabulary file \(one of tokenizer\.json"):
        load_model(str(d))
    assert main(["eval", "--model", str(d), "--data", "arithmetic", "--num-problems", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"cegppo eval: error: --model: directory '{d}' has no tokenizer") and "\n" not in err


def test_a_tokenizer_that_does_not_fit_the_embedding_is_refused(tmp_path):
    d = build_tiny_model(tmp_path / "big")  # a tokenizer with ids past the embedding's rows
    tok = build_char_tokenizer()
    tok.add_tokens([f"<extra_{i}>" for i in range(20)])
    tok.save_pretrained(d)
    with pytest.raises(ModelLoadError, match=r"the tokenizer has 123 tokens but the model's embedding has 103 rows"):
        load_model(str(d))
    d = build_tiny_model(tmp_path / "small")  # another model's embedding: the vocabulary covers under half of it
    model, tok = load_model(str(d))
    model.resize_token_embeddings(300)
    model.save_pretrained(d)
    with pytest.raises(ModelLoadError, match=r"the tokenizer has 103 tokens for the model's 300 embedding rows"):
        load_model(str(d))


@pytest.mark.parametrize("edit,match", [
    ({"num_hidden_layers": 3}, r"12 unexpected \(first: model\.layers\.3\."),  # weights dropped
    ({"num_hidden_layers": 5}, r"\d+ missing \(first: model\.layers\.4\."),  # layers initialised at random
    ({"intermediate_size": 768}, r"the weights do not fit config\.json \(RuntimeError"),  # shapes
])
def test_weights_that_do_not_fit_config_json_are_refused(tmp_path, edit, match):
    d = build_tiny_model(tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg.pop("layer_types", None)
    (d / "config.json").write_text(json.dumps({**cfg, **edit}))
    with pytest.raises(ModelLoadError, match=match):
        load_model(str(d))


class _Saves:
    def save_pretrained(self, path, **_):
        (path / "weights.bin").write_bytes(b"w")


def _adam(shape: tuple[int, int]) -> tuple[torch.optim.Optimizer, object]:
    lin = torch.nn.Linear(*shape)
    opt = torch.optim.AdamW(lin.parameters(), lr=0.1)
    lin(torch.ones(1, shape[0])).sum().backward()
    opt.step()
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)


def test_optimizer_state_of_another_shape_is_refused_naming_the_file(tmp_path):
    opt, sched = _adam((2, 2))
    path = ckpt.save_checkpoint(tmp_path / "checkpoints", 1, _Saves(), _Saves(), opt, sched, {"step": 1, "run_id": "r"})
    same, same_sched = _adam((2, 2))
    assert ckpt.load_training_state(path, same, same_sched)["step"] == 1
    other, other_sched = _adam((2, 3))  # as many parameters, other shapes: torch itself loads it without a word
    with pytest.raises(ckpt.CheckpointError, match=rf"^{str(path / 'optimizer.pt')}: 'exp_avg' of parameter 0 has "
                                                   rf"shape \(2, 2\); the model's parameter has shape \(3, 2\)"):
        ckpt.load_training_state(path, other, other_sched)
    fewer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2, 2))])
    assert "parameter group(s) of [2] parameters" in optimizer_state_problem(opt.state_dict(), [g["params"] for g in
                                                                                                fewer.param_groups])
    assert optimizer_state_problem([1, 2], []).startswith("not an optimizer state")
