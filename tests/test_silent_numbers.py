"""Numbers that must not go silently wrong (issue 41, classes 1-3; docs/reliability.md rows 64-67):

* maj@k votes over the answers the grader judged, so maj@k <= pass@k and maj@1 = avg@1 for any grader;
* a mask holds 0 and 1 only: the loss's terms refuse anything else (``-mask`` flipped the loss's sign);
* config numbers follow YAML 1.2, in files and overrides alike (YAML 1.1 read ``010`` as 8, ``1:30`` as 90);
* checkpoints are ordered by their step number, and a training state out of range is refused on resume.
"""

from __future__ import annotations

import hashlib
import json
import math
import re

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from cegppo.algorithm.checks import check_mask_values  # noqa: E402
from cegppo.algorithm.objectives import get_objective  # noqa: E402
from cegppo.algorithm.policy_loss import (correct_nll, entropy_bonus, entropy_metrics,  # noqa: E402
                                         entropy_ratio_mask, kl_penalty, policy_loss)
from cegppo.config import load_config, load_yaml, save_config  # noqa: E402
from cegppo.data.problems import Problem  # noqa: E402
from cegppo.data.rewards import RewardFn, load_reward  # noqa: E402
from cegppo.engine import checkpoint as ckpt  # noqa: E402
from cegppo.engine.evaluation import evaluate  # noqa: E402
from cegppo.errors import ConfigError  # noqa: E402
from fixtures.generators import ScriptedGenerator  # noqa: E402

# ------------------------------------------------------------------------------------------------ 1. maj@k


def _problems(n: int) -> list[Problem]:
    return [Problem(id=str(i), messages=[{"role": "user", "content": f"q{i}"}], answer="42", data_source=f"s{i % 2}")
            for i in range(n)]


@pytest.mark.parametrize("spec", ["math", "math-lenient", "math-strict"])
def test_maj_follows_the_reward_of_the_issue_example(spec):
    """`--reward math-lenient`, response `The answer is 42.` (gold 42): maj@1 was 0 beside avg@1 = pass@1 = 1."""
    res = evaluate(ScriptedGenerator({"q0": ["The answer is 42."]}), _problems(1), load_reward(spec), k=1)
    s = res.summary["s0"]
    assert s["maj@k"] == s["avg@k"] == s["pass@k"] == (0.0 if spec == "math-strict" else 1.0)
    # votes over the extraction the grader used: two unboxed 42s outvote one boxed 7 under the lenient reward
    responses = {"q0": ["so 42", "\\boxed{7}", "it is $42$"]}
    res = evaluate(ScriptedGenerator(responses), _problems(1), load_reward(spec), k=3)
    assert res.rows[0]["maj@k"] == (0.0 if spec == "math-strict" else 1.0)
    assert res.rows[0]["extracted"] == ([None, "7", None] if spec == "math-strict" else ["42", "7", "42"])


TEXTS = ["", " ", "a", "a ", " a", "b", "\\boxed{1}", "\\boxed{ 1 }", "\\boxed{2}", "$3$", "x y", "x  y"]
OUTCOMES = [True, False, 1.0, -1.0, 0.5, 2.0, "raise", "garbage", "nan"]
ANSWERS = [None, "", " ", "1", " 1 ", "2", "$3$", "3", "a"]


class RandomGrader:
    """Any grader: a verdict drawn per call (not a function of the answer), and, with ``judge``, any answer."""

    def __init__(self, outcomes: list, answers: list | None):
        self.outcomes, self.answers, self.calls = outcomes, answers, 0
        if answers is not None:
            self.judge = self._judge

    def _next(self):
        i, self.calls = self.calls, self.calls + 1
        return i

    def _verdict(self, i: int):
        out = self.outcomes[i % len(self.outcomes)]
        if out == "raise":
            raise RuntimeError("grader broke")
        return {"garbage": None, "nan": math.nan}.get(out, out) if isinstance(out, str) else out

    def __call__(self, completion: str, ground_truth: str):
        return self._verdict(self._next())

    def _judge(self, completion: str, ground_truth: str):
        i = self._next()
        return self._verdict(i), self.answers[i % len(self.answers)]


@settings(max_examples=150, deadline=None)
@given(k=st.integers(1, 4), n=st.integers(1, 3), data=st.data(),
       outcomes=st.lists(st.sampled_from(OUTCOMES), min_size=1, max_size=7),
       answers=st.one_of(st.none(), st.lists(st.sampled_from(ANSWERS), min_size=1, max_size=7)))
def test_maj_never_exceeds_pass_and_maj1_is_avg1_for_any_grader(k, n, data, outcomes, answers):
    responses = {f"q{i}": data.draw(st.lists(st.sampled_from(TEXTS), min_size=k, max_size=k)) for i in range(n)}
    grader = RewardFn(RandomGrader(outcomes, answers), timeout=None)
    res = evaluate(ScriptedGenerator(responses), _problems(n), grader, k=k, batch_prompts=2)
    for row in res.rows + list(res.summary.values()):
        assert row["maj@k"] <= row["pass@k"] + 1e-12, row
        if k == 1:
            assert row["maj@k"] == row["avg@k"], row


# ------------------------------------------------------------------------------------------------ 2. masks


def _terms(mask: torch.Tensor, correct: torch.Tensor | None = None, gradient_mask: torch.Tensor | None = None):
    lp, obj = torch.full((2, 3), -1.0), get_objective("ce_gppo")
    adv = torch.tensor([1.0, -1.0])
    return {
        "policy_loss": lambda: policy_loss(obj, lp, lp - 0.1, adv, mask, gradient_mask=gradient_mask),
        "correct_nll": lambda: correct_nll(lp, mask, torch.ones(2) if correct is None else correct),
        "kl_penalty": lambda: kl_penalty(lp, lp - 0.2, mask),
        "entropy_bonus": lambda: entropy_bonus(lp.abs(), mask),
        "entropy_metrics": lambda: entropy_metrics(obj, lp, lp - 0.1, adv, mask, lp.abs()),
        "entropy_ratio_mask": lambda: entropy_ratio_mask(lp.abs(), lp.abs(), mask, 0.5, 2.0),
    }


@pytest.mark.parametrize("fn", ["policy_loss", "correct_nll", "kl_penalty", "entropy_bonus", "entropy_metrics",
                                "entropy_ratio_mask"])
@pytest.mark.parametrize("bad", ["negated", "weighted", "nan", "two"])
def test_a_mask_that_is_not_zero_one_is_refused(fn, bad):
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    for good in (mask, mask.bool(), mask.long(), mask.to(torch.float64)):
        _terms(good)[fn]()  # 0/1 of any dtype, and bool: as before
    wrong = {"negated": -mask, "weighted": 0.5 * mask, "nan": mask.masked_fill(mask == 0, math.nan),
             "two": mask.long() * 2}[bad]
    with pytest.raises(ValueError, match=rf"^{fn}: mask must hold only 0 and 1 .*got "):
        _terms(wrong)[fn]()


def test_negated_mask_no_longer_flips_the_loss_and_other_indicators_are_zero_one():
    """The issue's example: ``mask = -mask`` flipped policy_loss's sign; token weights stay free."""
    mask = torch.ones(2, 3)
    loss, _ = _terms(mask)["policy_loss"]()
    with pytest.raises(ValueError, match="policy_loss: mask must hold only 0 and 1"):
        _terms(-mask)["policy_loss"]()
    with pytest.raises(ValueError, match=r"correct_nll: correct must hold only 0 and 1 .*got 2\.0 at \(0,\)"):
        _terms(mask, correct=torch.tensor([2.0, 1.0]))["correct_nll"]()
    with pytest.raises(ValueError, match="policy_loss: gradient_mask must hold only 0 and 1"):
        _terms(mask, gradient_mask=torch.full((2, 3), 0.5))["policy_loss"]()
    lp = torch.full((2, 3), -1.0)
    weighted, _ = policy_loss(get_objective("ce_gppo"), lp, lp - 0.1, torch.tensor([1.0, -1.0]), mask,
                              token_weights=torch.full((2, 3), 3.0))  # weights: any non-negative values
    assert torch.isfinite(weighted) and torch.isfinite(loss)


def test_a_mask_on_an_accelerator_is_never_read():
    """No device sync in the hot path: off the CPU the values are not read. The meta device stands in for CUDA
    (reading it would raise)."""
    check_mask_values("policy_loss", "mask", -torch.ones(2, 3, device="meta"))
    check_mask_values("policy_loss", "mask", torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="policy_loss: mask must hold only 0 and 1"):
        check_mask_values("policy_loss", "mask", -torch.ones(2, 3))


# ------------------------------------------------------------------------------------------------ 3. config


# (YAML text, key, value the config holds; or a ConfigError's pattern)
NUMBERS = [
    ("010", "train.steps", 10),  # YAML 1.1: octal 8
    ("0777", "train.seed", 777),  # YAML 1.1: octal 511
    ("0o17", "train.steps", 15),  # YAML 1.1: the text '0o17', refused
    ("0x1F", "train.steps", 31),
    ("+12", "train.steps", 12),
    ("1e-3", "optim.lr", 0.001),
    ("1E-4", "optim.lr", 0.0001),  # YAML 1.1: the text '1E-4' (no dot), read back as a number by the float keys
    ("1e3", "train.steps", r"train\.steps: expected int, got float 1000\.0"),
    ("1:30", "train.steps", r"train\.steps: expected int, got str '1:30'"),  # YAML 1.1: 90 (sexagesimal)
    ("1:30", "train.seed", r"train\.seed: expected int, got str '1:30'"),
    ("1_000", "train.steps", r"train\.steps: expected int, got str '1_000'"),  # YAML 1.1: 1000
]


def _get(cfg, key: str):
    node = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return node


@pytest.mark.parametrize("text,key,want", NUMBERS)
@pytest.mark.parametrize("where", ["file", "override"])
def test_config_numbers_follow_yaml_1_2_in_files_and_overrides(tmp_path, text, key, want, where):
    section, name = key.split(".")
    path = tmp_path / "c.yaml"
    path.write_text(f"{section}:\n  {name}: {text}\n" if where == "file" else "{}\n")
    overrides = [f"{key}={text}"] if where == "override" else []
    if isinstance(want, str):
        with pytest.raises(ConfigError) as e:
            load_config(path, overrides)
        assert "\n" not in str(e.value) and str(e.value).startswith(f"{path}: ")
        assert re.search(want, str(e.value)), str(e.value)
    else:
        assert _get(load_config(path, overrides), key) == want


def test_saved_config_reads_back_the_same_text(tmp_path):
    """Text that YAML 1.2 (or 1.1) would read as a number is quoted when saved: a path '0o17' stays text."""
    cfg = load_config(None, ["train.steps=3"])
    cfg.data.train_path, cfg.data.test_path = "0o17", "1:30"
    save_config(cfg, tmp_path / "c.yaml")
    raw = (tmp_path / "c.yaml").read_text()
    assert "'0o17'" in raw and "'1:30'" in raw
    tree = load_yaml(raw, "c.yaml")
    assert (tree["data"]["train_path"], tree["data"]["test_path"], tree["train"]["steps"]) == ("0o17", "1:30", 3)


# ------------------------------------------------------------------------------------------------ 4. checkpoints


class _Saves:
    """Stands in for the model and the tokenizer (``save_pretrained``)."""

    def save_pretrained(self, path, **_):
        (path / "weights.bin").write_bytes(b"w")


def _save(root, step, keep=2, run_id="r"):
    lin = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return ckpt.save_checkpoint(root, step, _Saves(), _Saves(), opt, sched, {"step": step, "cursor": 0,
                                                                             "run_id": run_id}, keep=keep)


def test_checkpoints_are_ordered_by_step_number_past_a_million(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (999_998, 999_999, 1_000_000, 1_000_001):
        _save(root, step)
    assert [p.name for p in ckpt.list_checkpoints(root)] == ["step_1000000", "step_1000001"]  # the newest kept
    assert ckpt.latest_valid_checkpoint(root).name == "step_1000001"
    (root / "step_000010.bak").mkdir()  # not a checkpoint's name: neither listed nor pruned
    _save(root, 1_000_002)
    assert [p.name for p in ckpt.list_checkpoints(root)] == ["step_1000001", "step_1000002"]
    assert (root / "step_000010.bak").is_dir()
    assert [ckpt.checkpoint_step(root / n) for n in ("step_000007", "step_1000000", "step_x", "step_-5")] == [
        7, 1_000_000, None, None]


def _rehash(path):
    """Edit trainer_state.json and re-hash the manifest, as a hostile user would: the manifest still matches."""
    manifest = json.loads((path / ckpt.MANIFEST).read_text())
    f = path / "trainer_state.json"
    manifest["files"]["trainer_state.json"] = {"bytes": f.stat().st_size,
                                               "sha256": hashlib.sha256(f.read_bytes()).hexdigest()}
    (path / ckpt.MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.parametrize("key,value", [("step", -5), ("step", 2.5), ("step", "3"), ("step", True), ("step", None),
                                       ("cursor", -1), ("cursor", 1.0), ("bad_steps", -2)])
def test_training_state_out_of_range_is_refused_naming_the_file(tmp_path, key, value):
    path = _save(tmp_path / "checkpoints", 3)
    state = json.loads((path / "trainer_state.json").read_text())
    state[key] = value
    (path / "trainer_state.json").write_text(json.dumps(state))
    _rehash(path)
    assert ckpt.verify_checkpoint(path) is None  # the manifest matches: only the range check catches it
    lin = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    pattern = rf"^{path / 'trainer_state.json'}: '{key}' must be an integer >= 0, got "
    with pytest.raises(ckpt.CheckpointError, match=pattern.replace(".", r"\.")):
        ckpt.read_trainer_state(path)
    with pytest.raises(ckpt.CheckpointError, match=pattern.replace(".", r"\.")):
        ckpt.load_training_state(path, opt, sched)


def test_resume_from_a_negative_step_is_refused_before_the_model_loads(tiny_config, tmp_path, monkeypatch):
    """The issue's example: a re-hashed ``step: -5`` resumed "at step -5" and truncated the metrics."""
    from cegppo.engine import trainer as trainer_mod
    from cegppo.engine.trainer import Trainer

    small = ("train.prompts_per_step=2", "train.mini_batches=1", "rollout.n=2", "rollout.max_new_tokens=8",
             "data.num_train=8", "data.num_test=0")
    with Trainer(tiny_config(*small)) as tr:
        path = tr.save()
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 1}\n')
    state = json.loads((path / "trainer_state.json").read_text())
    state["step"] = -5
    (path / "trainer_state.json").write_text(json.dumps(state))
    _rehash(path)

    def no_model(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(trainer_mod, "build_policy", no_model)
    with pytest.raises(ckpt.CheckpointError, match=r"trainer_state\.json: 'step' must be an integer >= 0, got -5"):
        Trainer(tiny_config(*small), resume=True)
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == '{"step": 1}\n'  # nothing truncated
