import json
import re

import pytest
import torch

from cegppo.recipes import train_loop
from cegppo.cli import main
from cegppo.config import ConfigError, load_config
from cegppo.cli import example_config
from cegppo.io import read_jsonl
from cegppo.engine.trainer import Trainer


def test_tiny_run_end_to_end_via_cli(tmp_path, capsys):
    out = tmp_path / "run"
    rc = main(["train", "tiny", f"output_dir={out}", "reward.fn=fixtures.rewards:digit_overlap",
               "train.steps=3", "sft.steps=2", "data.num_test=4", "eval.num_problems=4", "train.save_every=2"])
    assert rc == 0
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for key in ("reward/mean", "reward/accuracy", "response_length/mean", "response_length/clip_ratio", "entropy",
                "pg_loss", "grad_norm", "lr", "ppo_kl", "clip/low_frac", "clip/high_frac", "clip/dual_frac",
                "quadrant/PA_LP/dH", "quadrant/NA_HP/frac", "quadrant/NA_LP/entropy", "dH/predicted"):
        assert key in rows[-1], key
    assert (out / "config.yaml").exists() and (out / "training_curves.png").stat().st_size > 10_000
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["heldout_accuracy"]) == {"base", "warm-start", "final"}
    assert summary["machine"]["cpu"] and summary["machine"]["isa"]  # the figures name the machine they ran on
    ckpts = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert ckpts[-1] == "step_000003"
    assert (out / "checkpoints" / "step_000003" / "model.safetensors").exists()


def test_resume_continues_exactly(tiny_config, tmp_path):
    with Trainer(tiny_config("train.steps=4", "train.save_every=2", out=tmp_path / "full")) as full:
        full_rows = train_loop(full)
    with Trainer(tiny_config("train.steps=2", "train.save_every=2", out=tmp_path / "part")) as part:
        train_loop(part)
    with Trainer(tiny_config("train.steps=4", "train.save_every=2", out=tmp_path / "part"), resume=True) as resumed:
        assert resumed.state["step"] == 2
        train_loop(resumed)
    rows = read_jsonl(tmp_path / "part" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for a, b in zip(rows, full_rows):
        for k in ("reward/mean", "entropy", "pg_loss", "grad_norm", "clip/low_frac"):
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-7), k


def test_clipping_occurs_when_minibatches_go_off_policy(tiny_config):
    with Trainer(tiny_config("train.steps=2", "train.mini_batches=4", "optim.lr=3e-3", "train.save_every=0")) as tr:
        rows = train_loop(tr)
    assert max(r["clip/low_frac"] + r["clip/high_frac"] for r in rows) > 0
    with Trainer(tiny_config("train.steps=1", "train.mini_batches=1", "train.save_every=0",
                             out=tr.run.path.parent / "onpolicy")) as on_policy:
        r = train_loop(on_policy)[0]
    assert r["clip/low_frac"] == 0 and r["clip/high_frac"] == 0 and abs(r["ppo_kl"]) < 1e-6


@pytest.mark.parametrize("other", ["train.micro_batch_size=3", "train.micro_batch_tokens=150",
                                   "train.shared_prompt_tokens=0", "train.shared_prompt_tokens=150"])
def test_micro_batch_invariance_of_the_update(tiny_config, tmp_path, other):
    """Micro-batching and prompt sharing change how the update is computed, not the update."""
    params = []
    for name, micro in (("m16", "train.micro_batch_size=16"), ("other", other)):
        with Trainer(tiny_config("train.steps=1", "train.mini_batches=2", micro,
                                 "train.save_every=0", out=tmp_path / name)) as tr:
            train_loop(tr)
            params.append(torch.cat([p.detach().flatten() for p in tr.model.parameters()]))
    # AdamW moves each weight by at most lr (1e-3) per step: 1e-5 is 1% of one update. Float sums grouped
    # differently (16 vs 3 rows) move a normalised update by ~1e-6, but AdamW's first step divides each gradient
    # by its own size (+ eps 1e-8), so a weight whose gradient is near eps can move by a few % of lr: seen on 1
    # weight of 801,792. Every weight within 10% of one update, all but 1 in 10^5 within 1%.
    diff = (params[0] - params[1]).abs()
    assert diff.max() < 1e-4, float(diff.max())
    assert (diff > 1e-5).sum() <= diff.numel() // 100_000, int((diff > 1e-5).sum())


def test_dynamic_sampling_keeps_only_mixed_groups(tiny_config):
    with Trainer(tiny_config("algorithm.dynamic_sampling=true", "algorithm.max_num_gen_batches=3",
                             "train.prompts_per_step=4", "train.save_every=0")) as tr:
        exp, stats = tr.collect(step=1)
        n = tr.cfg.rollout.n
        assert exp is not None and stats["train/kept_groups"] == len(exp.rewards) // n <= 4
        groups = exp.correct.view(-1, n).float()
        assert ((groups.max(-1).values - groups.min(-1).values) > 0).all()
        assert 1 <= stats["train/num_gen_batches"] <= 3
        assert tr.state["cursor"] == 4 * stats["train/num_gen_batches"]


@pytest.mark.parametrize(
    "override,match",
    [
        ("algorithm.bogus=1", "unknown config key 'algorithm.bogus'"),
        ("train.steps=abc", "train.steps: expected int"),
        ("optim.lr=-1", "optim.lr must be"),
        ("algorithm.hparams.beta1=-0.5", "beta1"),
        ("algorithm.objective=ppo", "valid objectives"),
        ("rollout.top_p=1.5", "rollout.top_p"),
        ("train.mini_batches=0", "train.mini_batches"),
    ],
)
def test_config_validation_errors(override, match):
    with pytest.raises(ConfigError, match=match) as e:
        load_config(example_config("tiny"), [override])
    assert "tiny.yaml" in str(e.value)


def test_config_file_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  stepz: 3\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: unknown config key 'train.stepz'"):
        load_config(bad)


def test_cli_reports_config_error_in_one_line(capsys):
    rc = main(["train", "tiny", "train.steps=-3"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "train.steps must be >= 0" in err and "Traceback" not in err


def test_bundled_configs_validate():
    for name in ("quickstart", "tiny", "paper_1p5b", "paper_7b"):
        load_config(example_config(name))


def test_tensorboard_logging_when_installed(tiny_config):
    pytest.importorskip("tensorboard")
    with Trainer(tiny_config("train.steps=1", "train.save_every=0", "logging.tensorboard=true")) as tr:
        train_loop(tr)
        assert list((tr.run.path / "tensorboard").glob("events.out.tfevents.*"))


def test_dynamic_sampling_concatenates_generation_rounds(tiny_config):
    """Several generation rounds with different prompt / response widths merge into one aligned batch."""
    with Trainer(tiny_config("algorithm.dynamic_sampling=true", "algorithm.max_num_gen_batches=4",
                             "train.prompts_per_step=8", "train.save_every=0", "rollout.n=2")) as tr:
        exp, stats = tr.collect(step=1)
        assert exp is not None and stats["train/num_gen_batches"] > 1
        rb = exp.rollouts
        assert rb.input_ids.shape == rb.attention_mask.shape
        assert (rb.response_mask.shape[1] == rb.response_len
                and rb.input_ids.shape[0] == len(rb.texts) == len(exp.rewards))
        # every kept response decodes back to the text that was graded
        resp = rb.input_ids[:, -rb.response_len:]
        texts = tr.tokenizer.batch_decode(torch.where(rb.response_mask.bool(), resp, tr.tokenizer.pad_token_id),
                                          skip_special_tokens=True)
        assert texts == rb.texts


# ---------------------------------------------------------------------------------------------- validation


def _float_keys(cls=None, where=""):
    import dataclasses
    import typing

    from cegppo.config import Config

    cls = cls or Config
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{where}.{f.name}" if where else f.name
        if dataclasses.is_dataclass(hints[f.name]):
            yield from _float_keys(hints[f.name], key)
        elif hints[f.name] is float:
            yield key


@pytest.mark.parametrize("key", list(_float_keys()) + ["algorithm.hparams.beta1", "algorithm.hparams.clip_ratio_c"])
@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf", "nan", "1e999"])
def test_every_float_rejects_nan_and_inf(key, value):
    with pytest.raises(ConfigError, match=re.escape(key) + " must be a finite number") as e:
        load_config(example_config("tiny"), [f"{key}={value}"])
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("override,match", [
    ("reward.timeout_s=.inf", r"reward\.timeout_s must be a finite number"),
    ("reward.timeout_s=3601", r"reward\.timeout_s must be in \(0, 3600\] seconds"),
    ("reward.timeout_s=0", r"reward\.timeout_s must be in \(0, 3600\]"),
    ("output_dir=", r"output_dir must be a non-empty path, got ''"),
    ("output_dir='  '", r"output_dir must be a non-empty path"),
    ("data.train_path=", r"data\.train_path must be a non-empty path or null"),
    ("eval.num_problems=-1", r"eval\.num_problems must be an integer >= 0 \(0 = all problems\), got -1"),
    ("eval.k=4", r"eval\.k=4 with eval\.temperature=0: greedy decoding gives 4 identical samples"),
    ("rollout.n=1", r"rollout\.n must be >= 2 with algorithm\.advantage=grpo \(the advantage of a group of one"),
    ("algorithm.adv_eps=0", r"algorithm\.adv_eps must be a finite number > 0"),
    ("optim.lr=" + "9" * 400, r"optim\.lr must be a finite number, got an integer of 1329 bits"),
    ("train.seed=" + "9" * 30, r"train\.seed must be an integer that fits 64 bits"),
    ("train.seed=-1", r"train\.seed must be >= 0"),
    ("train.threads=100000", r"train\.threads must be in 0\.\.1024"),
    ("optim.betas=[true, 0.9]", r"optim\.betas must be two numbers in \[0, 1\)"),
    ("optim.betas=[0.9]", r"optim\.betas must be two numbers"),
    ("algorithm.hparams={1: 2}", r"algorithm\.hparams must be a mapping of hyperparameter names to numbers"),
    ("algorithm.hparams.beta1=abc", r"algorithm\.hparams\.beta1 must be a finite number \(or null\), got 'abc'"),
    ("data.prompt_key=''", r"data\.prompt_key must be null or a non-empty"),
    ("sft.lr=-1", r"sft\.lr must be a finite number >= 0"),
    ("sft.batch_size=0", r"sft\.batch_size must be in 1\.\.1048576"),
    ("eval.top_p=0", r"eval\.top_p must be in \(0, 1\]"),
    ("eval.max_new_tokens=0", r"eval\.max_new_tokens must be an integer in 1\.\.1048576"),
    ("reward.fn=''", r"reward\.fn must be"),
    ("model.name=''", r"model\.name must be a preset, a local directory or a hub name"),
    ("rollout.backend=sglang", r"rollout\.backend must be 'hf' or 'vllm'"),
    ("rollout.tis_cap=2", r"rollout\.tis_cap must be 0 unless rollout\.backend=vllm"),
    ("model.fused_lm_head=sometimes", r"model\.fused_lm_head must be true, false or auto"),
    ("model.device=gpu", r"model\.device must be auto, cpu, cuda or cuda:N"),
    ("model.device=cuda:x", r"model\.device must be auto, cpu, cuda or cuda:N"),
    ("reward.overlong_penalty=-1", r"reward\.overlong_penalty must be a finite number >= 0"),
    ("train.steps=" + "x" * 10_000, r"train\.steps: expected int, got str 'xxx"),
    ("a..b=1", r"override key 'a\.\.b': expected dotted names"),
    ("train." * 100 + "x=1", r"override key 'train\.train"),
])
def test_every_key_is_validated(override, match):
    with pytest.raises(ConfigError, match=match) as e:
        load_config(example_config("tiny"), [override])
    assert "\n" not in str(e.value) and len(str(e.value)) <= 1000


def test_unknown_task_is_refused_before_anything_loads_or_is_written(tmp_path):
    """data.task is checked against the data layer's registry (config imports no data module): at the start of a
    run, before the data, the model or any run file."""
    from cegppo.engine.trainer import Trainer

    cfg = load_config(example_config("tiny"), ["data.task=nope", f"output_dir={tmp_path / 'run'}"])
    with pytest.raises(ConfigError, match=r"data\.task must be null or one of \['arithmetic'\], got 'nope'"):
        Trainer(cfg)
    assert not [p.name for p in (tmp_path / "run").glob("*") if not p.name.startswith(".")]


def test_degenerate_settings_allowed_when_meaningful():
    # sampled evaluation may take k > 1; greedy takes k = 1
    load_config(example_config("tiny"), ["eval.k=4", "eval.temperature=0.6"])
    cfg = load_config(example_config("tiny"), ["rollout.n=2"])
    assert cfg.rollout.n == 2


def test_paths_are_expanded(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = load_config(example_config("tiny"), ["output_dir=~/run", "data.train_path=~/d.jsonl", "data.test_path=~/t.jsonl",
                                               "model.name=~/models/m"])
    assert cfg.output_dir == str(tmp_path / "run")
    assert (cfg.data.train_path, cfg.data.test_path) == (str(tmp_path / "d.jsonl"), str(tmp_path / "t.jsonl"))
    assert cfg.model.name == str(tmp_path / "models" / "m")
    assert load_config(example_config("tiny"), ["model.name=org/name"]).model.name == "org/name"


def test_eval_num_problems_zero_means_all():
    from cegppo.config import CLI_EVAL_KEYS, check_eval_settings, eval_limit

    assert load_config(example_config("tiny"), ["eval.num_problems=0"]).eval.num_problems == 0
    problems = list(range(10))
    assert problems[: eval_limit(0)] == problems and problems[: eval_limit(3)] == [0, 1, 2]
    for bad in (-1, True, 1.5, "3"):
        with pytest.raises(ConfigError, match=r"--num-problems must be an integer >= 0 \(0 = all problems\)"):
            eval_limit(bad, "--num-problems")
    check_eval_settings(num_problems=0, k=4, temperature=0.6, top_p=0.95, max_new_tokens=8, keys=CLI_EVAL_KEYS)
    with pytest.raises(ConfigError, match=r"--k=4 with --temperature=0: greedy"):
        check_eval_settings(num_problems=0, k=4, temperature=0.0, top_p=0.95, max_new_tokens=8, keys=CLI_EVAL_KEYS)


def test_check_data_sft_needs_solutions():
    from cegppo.config import check_data
    from cegppo.data.problems import Problem

    with_sol = Problem(id="a", messages=[{"role": "user", "content": "Q"}], answer="1", solution="\\boxed{1}")
    without = Problem(id="b", messages=[{"role": "user", "content": "R"}], answer="2")
    cfg = load_config(example_config("tiny"), ["data.task=null", "data.train_path=/data/x.jsonl"])
    assert cfg.sft.steps == 20
    check_data(cfg, [with_sol])
    with pytest.raises(ConfigError, match=r"sft\.steps=20 needs a reference 'solution' on every training problem; "
                                          r"1 of 2 in data\.train_path /data/x\.jsonl have none \(first: id 'b'\)"):
        check_data(cfg, [with_sol, without])
    check_data(load_config(example_config("tiny"), ["sft.steps=0"]), [without])


def test_check_prompt_budget():
    from cegppo.config import check_prompt_budget, prompt_budget_cuts
    from cegppo.data.problems import Problem
    from cegppo.engine.models import build_char_tokenizer

    tok = build_char_tokenizer()
    short = Problem(id="s", messages=[{"role": "user", "content": "What is 1 + 1?"}], answer="2")
    long = Problem(id="l", messages=[{"role": "system", "content": "S" * 50},
                                     {"role": "user", "content": "What is 12 + 30?" * 5}], answer="42")
    # char-level tokens: `long` is 159 tokens, its question starts at token 66 (after the system prompt)
    assert prompt_budget_cuts(tok, [short, long], 200) == []
    assert prompt_budget_cuts(tok, [short, long], 159 - 66) == []  # only the system prompt is cut: fine
    assert prompt_budget_cuts(tok, [short, long], 159 - 67) == [(long, 159, 66)]  # one question token cut
    check_prompt_budget(tok, [short, long], 120)
    with pytest.raises(ConfigError, match=r"rollout\.max_prompt_tokens=60 cuts the question of 1 prompt\(s\) "
                                          r"\(left truncation; e\.g\. id 'l': 159 tokens, its question from token 66\); expected >= 93"):
        check_prompt_budget(tok, [short, long], 60)
    with pytest.raises(ConfigError, match=r"--max-prompt-tokens=10 cuts the question of 2 prompt"):
        check_prompt_budget(tok, [short, long], 10, key="--max-prompt-tokens")


def test_on_policy_mini_batch_needs_no_separate_old_log_prob_pass(tiny_config, tmp_path):
    """The first mini-batch's old log-probs and entropy come from its own loss pass: the same update, old
    log-probs and entropy as with a separate pass over every row."""
    import copy

    from cegppo.algorithm.diagnostics import MetricAccumulator

    with Trainer(tiny_config("train.steps=1", "train.mini_batches=2", "train.micro_batch_size=5", "optim.lr=3e-3",
                             "train.save_every=0")) as tr:
        exp, _ = tr.collect(step=1)
        first = torch.arange(len(exp.rewards)).tensor_split(2)[0]
        start = copy.deepcopy(tr.model.state_dict())
        results = []
        for skip in (first[:0], first):
            tr.model.load_state_dict(start)
            tr.optimizer.state.clear()
            tr.model.train()
            e = copy.copy(exp)
            entropy = tr.old_log_probs(e, skip=skip)
            assert tr.update(e, first, MetricAccumulator(), 1, entropy if len(skip) else None)
            params = torch.cat([p.detach().flatten() for p in tr.model.parameters()])
            results.append((params, e.old_log_prob * e.mask, float(entropy[0] / entropy[1])))
    (p_full, old_full, h_full), (p_lean, old_lean, h_lean) = results
    torch.testing.assert_close(old_lean, old_full, rtol=1e-5, atol=1e-6)
    assert h_lean == pytest.approx(h_full, rel=1e-5)
    torch.testing.assert_close(p_lean, p_full, rtol=1e-5, atol=1e-6)
