import json
import math

import pytest

from cegppo.recipes import train_loop
from cegppo.reporting.compare import compare_runs
from cegppo.data.problems import Problem, load_problems
from cegppo.engine.evaluation import evaluate, majority_correct, pass_at_k
from cegppo.data.rewards import load_reward
from cegppo.engine.rollout import Sampling
from cegppo.engine.trainer import Trainer
from fixtures.generators import ScriptedGenerator


def test_pass_at_k_hand_computed():
    assert pass_at_k(4, 0, 1) == 0.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - math.comb(3, 2) / math.comb(4, 2))  # 0.5
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    assert pass_at_k(5, 2, 3) == pytest.approx(1 - 1 / 10)
    assert pass_at_k(4, 3, 2) == 1.0
    with pytest.raises(ValueError):
        pass_at_k(2, 1, 3)


def test_majority_vote():
    assert majority_correct(["4", "5", "4"], [True, False, True])
    assert not majority_correct(["5", "4", "5"], [False, True, False])
    assert majority_correct(["4", "5"], [True, False])  # tie: first seen wins
    assert not majority_correct([None, None], [False, False])
    assert majority_correct([None, "7", None], [False, True, False])  # no answer never wins


def test_avg_pass_maj_on_scripted_answers():
    probs = [Problem(id="a", messages=[{"role": "user", "content": "qa"}], answer="4", data_source="s1"),
             Problem(id="b", messages=[{"role": "user", "content": "qb"}], answer="9", data_source="s1"),
             Problem(id="c", messages=[{"role": "user", "content": "qc"}], answer="1", data_source="s2")]
    generator = ScriptedGenerator({
        "qa": ["\\boxed{4}", "\\boxed{5}", "\\boxed{4}", "no box 4"],   # 2/4 correct, maj 4 -> correct
        "qb": ["\\boxed{9}", "\\boxed{8}", "\\boxed{8}", "\\boxed{7}"],  # 1/4, maj 8 -> wrong
        "qc": ["\\boxed{2}", "\\boxed{3}", "\\boxed{2}", "\\boxed{5}"],  # 0/4
    })
    res = evaluate(generator, probs, load_reward("math-strict"), k=4, sampling=Sampling(0.6, 0.95))
    s1, s2 = res.summary["s1"], res.summary["s2"]
    assert s1["avg@k"] == pytest.approx((0.5 + 0.25) / 2)
    assert s1["pass@k"] == pytest.approx(1.0)
    assert s1["maj@k"] == pytest.approx(0.5)
    assert s2["avg@k"] == 0 and s2["pass@k"] == 0 and s2["maj@k"] == 0
    assert res.headline("avg@k") == pytest.approx((0.375 + 0) / 2)
    assert [r["num_correct"] for r in res.rows] == [2, 1, 0]


def test_eval_deduplicates_repeated_prompts(aime24_x32):
    # the authors' release repeats each AIME problem 32 times; `aime24_x32` rebuilds that layout
    probs = load_problems(aime24_x32)
    assert len(probs) == 30 and all(p.copies == 32 for p in probs)
    generator = ScriptedGenerator({p.messages[-1]["content"]: [f"\\boxed{{{p.answer}}}"] * 2 for p in probs})
    res = evaluate(generator, probs, load_reward("math-strict"), k=2)
    assert len(res.rows) == 30
    assert res.headline("avg@k") == 1.0


def test_compare_writes_plots_and_table(tiny_config, tmp_path):
    runs = []
    for name, obj in (("grpo", "grpo"), ("cegppo", "ce_gppo")):
        hp = [] if obj == "grpo" else ["algorithm.hparams.beta1=0.5"]
        cfg = tiny_config(f"algorithm.objective={obj}", "train.steps=2", "train.save_every=0", "eval.every=1",
                          *(["algorithm.hparams={}"] if obj == "grpo" else hp), out=tmp_path / name)
        with Trainer(cfg) as tr:
            train_loop(tr)
        runs.append(tmp_path / name)
    paths = compare_runs(runs, tmp_path / "cmp")
    names = {p.name for p in paths}
    assert {"compare.png", "entropy.png", "clip_low_frac.png", "clip_high_frac.png", "val_accuracy.png",
            "quadrant_PA_LP_dH.png", "summary.md"} <= names
    table = (tmp_path / "cmp" / "summary.md").read_text()
    assert "grpo" in table and "ce_gppo (beta1=0.5" in table
    assert all(p.stat().st_size > 1000 for p in paths if p.suffix == ".png")


def test_eval_cli_on_task_and_dataset_file(tmp_path, capsys):
    from cegppo.cli import main
    from cegppo.data.evalsets import resolve_dataset

    out = tmp_path / "res.jsonl"
    rc = main(["eval", "--model", "tiny", "--data", "arithmetic", str(resolve_dataset("aime24")), "--k", "2",
               "--num-problems", "3", "--max-new-tokens", "8", "--dtype", "float32", "--out", str(out)])
    assert rc == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 6 and all(r["k"] == 2 and len(r["responses"]) == 2 for r in rows)
    summary = json.loads(out.with_suffix(".summary.json").read_text())
    assert set(summary) == {"arithmetic", "AIME 2024"}
    printed = capsys.readouterr().out
    assert "avg@2" in printed and "pass@2" in printed and "maj@2" in printed


def test_help_answers(capsys):
    """Bare `cegppo` prints help (the quickstart is `cegppo train`); every flag says what it does and its default;
    the bundled configs, tasks and eval sets are listed."""
    import argparse

    from cegppo.cli import build_parser, main

    assert main([]) == 0
    out = capsys.readouterr().out
    assert "usage: cegppo" in out and "cegppo train" in out
    assert "quickstart, tiny, paper_1p5b, paper_7b" in out and "arithmetic" in out and "aime24 (AIME 2024)" in out
    parser = build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    for name, sp in subs.items():
        for action in sp._actions:
            if action.dest in ("help", "debug"):
                continue
            assert action.help and action.help != argparse.SUPPRESS, f"cegppo {name} {action.dest}: no help"
        assert "(default:" in sp.format_help() or name == "compare"
    eval_help = subs["eval"].format_help()
    assert "temperature 0.6, top-p 0.95" in " ".join(eval_help.split()) and "--greedy" in eval_help
