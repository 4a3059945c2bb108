"""Skywork-OR1's adaptive entropy bonus (``cegppo.algorithm.entropy_control.AdaptiveEntropyBonus``): the rule, its
config, the trainer that applies it, and the same coefficient sequence as TRL 1.16's implementation, run for real."""

from __future__ import annotations

import math

import pytest

from cegppo.algorithm.entropy_control import AdaptiveEntropyBonus, AdaptiveEntropyConfig
from cegppo.config import ConfigError, load_config
from cegppo.recipes import train_loop


def replay(entropies: list[float | None], **cfg) -> tuple[list[float], list[float]]:
    """(coefficient after each step, bonus applied at each step) of the rule fed ``entropies``."""
    rule = AdaptiveEntropyBonus(AdaptiveEntropyConfig(enabled=True, **cfg))
    coefs, applied = [], []
    for h in entropies:
        applied.append(rule.update(h)["entropy_coeff"])
        coefs.append(rule.coef)
    return coefs, applied


def test_the_rule_steps_up_below_the_target_and_down_above_within_its_bounds():
    coefs, applied = replay([0.5, 0.4, 0.3, 0.1, 0.1, 0.6, 0.6, 0.6], target=0.35, coef_delta=0.01, coef_max=0.025,
                            coef_init=0.0)
    assert coefs == pytest.approx([0.0, 0.0, 0.01, 0.02, 0.025, 0.015, 0.005, 0.0])
    # the bonus is the coefficient while the entropy is at or below the target, else nothing
    assert applied == pytest.approx([0.0, 0.0, 0.01, 0.02, 0.025, 0.0, 0.0, 0.0])


def test_relative_target_is_the_absolute_rule_at_a_fraction_of_the_first_entropy():
    hs = [0.8, 0.7, 0.9, 0.5, 0.75, 0.81]
    assert replay(hs, target=0.9, target_mode="relative", coef_delta=0.01) == \
        replay(hs, target=0.9 * 0.8, target_mode="absolute", coef_delta=0.01)


def test_missing_or_zero_entropy_changes_nothing():
    assert replay([None, math.nan, 0.1], target=0.2, coef_delta=0.01) == ([0.0, 0.0, 0.01], [0.0, 0.0, 0.01])
    # relative target: a zero first entropy sets no target (as the autopilot), the first positive one does
    assert replay([0.0, 0.5, 0.4], target=1.0, target_mode="relative", coef_delta=0.01) == \
        ([0.0, 0.01, 0.02], [0.0, 0.01, 0.02])


def test_state_round_trips():
    a = AdaptiveEntropyBonus(AdaptiveEntropyConfig(enabled=True, target=0.9, target_mode="relative", coef_delta=0.01))
    for h in (0.8, 0.6, 0.9):
        a.update(h)
    b = AdaptiveEntropyBonus(a.cfg)
    b.load_state_dict(a.state_dict())
    assert [a.update(0.5), a.update(0.9)] == [b.update(0.5), b.update(0.9)]


@pytest.mark.parametrize("overrides,match", [
    (["algorithm.adaptive_entropy.target=0"], "target"),
    (["algorithm.adaptive_entropy.target_mode=fraction"], "target_mode"),
    (["algorithm.adaptive_entropy.coef_delta=-0.1"], "coef_delta"),
    (["algorithm.adaptive_entropy.coef_min=0.5", "algorithm.adaptive_entropy.coef_max=0.1"], "coef_min / coef_max"),
    (["algorithm.entropy_control.enabled=true"], "enable one of them"),
])
def test_bad_config_is_refused_naming_the_key(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, ["algorithm.adaptive_entropy.enabled=true"] + overrides)


# ---------------------------------------------------------------------------------------------------------
# TRL 1.16's implementation, run for real: the same coefficient sequence on the same entropy sequence
# ---------------------------------------------------------------------------------------------------------


def test_the_coefficient_sequence_is_trls_on_trls_own_entropies(tmp_path):
    """TRL's ``GRPOTrainer(use_adaptive_entropy=True)`` trains the tiny model for 10 optimizer steps; after each, a
    callback reads the entropy TRL's controller measured and the coefficient it set. Fed the same entropies, our rule
    gives the same coefficients (exactly: the same float operations). The target is set between the entropies TRL
    measures, so both branches and both bounds are exercised (asserted)."""
    pytest.importorskip("trl")
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from cegppo.engine.models import build_tiny_model

    model = tmp_path / "tiny"
    build_tiny_model(model, seed=0, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=256)
    data = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"What is {i}+{i + 1}?"}] for i in range(40)]})

    def digit_reward(completions, **kwargs):
        return [sum(ch.isdigit() for ch in c[0]["content"]) / max(len(c[0]["content"]), 1) for c in completions]

    rule = dict(target=4.3, coef_init=0.004, coef_delta=0.003, coef_min=0.001, coef_max=0.01)
    args = GRPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=8, gradient_accumulation_steps=1,
                      num_generations=4, max_completion_length=16, logging_steps=1, report_to="none",
                      save_strategy="no", use_cpu=True, bf16=False, seed=0, max_steps=10, learning_rate=3e-2,
                      use_adaptive_entropy=True, entropy_coef=rule["coef_init"], entropy_target=rule["target"],
                      entropy_coef_delta=rule["coef_delta"], entropy_coef_min=rule["coef_min"],
                      entropy_coef_max=rule["coef_max"])
    trainer = GRPOTrainer(model=str(model), reward_funcs=[digit_reward], args=args, train_dataset=data)
    seen = []

    class Record(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            seen.append((trainer._last_world_entropy, trainer.entropy_coef))

    trainer.add_callback(Record())
    trainer.train()
    entropies, trl_coefs = [h for h, _ in seen], [c for _, c in seen]
    assert len(seen) == 10
    print("TRL entropies", entropies, "coefficients", trl_coefs)
    ours, applied = replay(entropies, **rule)
    assert ours == trl_coefs
    below = [h <= rule["target"] for h in entropies]
    assert any(below) and not all(below), f"the target {rule['target']} does not split TRL's entropies {entropies}"
    # TRL applies the coefficient set by step t at step t + 1 (it measures during the update); ours at step t
    assert applied == [c if b else 0.0 for c, b in zip(trl_coefs, below)]


# ---------------------------------------------------------------------------------------------------------
# the trainer
# ---------------------------------------------------------------------------------------------------------

ADAPTIVE = ["algorithm.adaptive_entropy.enabled=true", "algorithm.adaptive_entropy.target_mode=relative",
            "algorithm.adaptive_entropy.target=1.0", "algorithm.adaptive_entropy.coef_delta=0.01"]


def test_trainer_applies_the_bonus_it_logs_and_resumes_exactly(tiny_config, tmp_path, monkeypatch):
    import cegppo.engine.trainer as trainer_module
    from cegppo.io import read_jsonl

    seen = []
    entropy_coeff = trainer_module.Trainer.entropy_coeff

    def recording_entropy_coeff(self):  # called once per loss pass, in the loss expression of Trainer.update
        seen.append(entropy_coeff(self))
        return seen[-1]

    monkeypatch.setattr(trainer_module.Trainer, "entropy_coeff", recording_entropy_coeff)
    with trainer_module.Trainer(tiny_config("train.steps=4", "train.save_every=2", "train.mini_batches=2",
                                            "algorithm.entropy_coeff=0.001", *ADAPTIVE, out=tmp_path / "full")) as full:
        rows = train_loop(full)
    entropies = [r["entropy"] for r in rows]
    coefs, applied = replay(entropies, target=1.0, target_mode="relative", coef_delta=0.01)
    assert [r["control/adaptive_coef"] for r in rows] == coefs
    assert [r["control/entropy_coeff"] for r in rows] == applied
    assert rows[0]["control/target"] == entropies[0] and applied[0] == 0.01  # H_1 <= 1.0 x H_1: the bonus is on
    # every loss pass of step t (2 mini-batches) carried the configured bonus plus step t's adaptive bonus
    per_pass = [0.001 + a for a in applied for _ in range(2)]
    assert seen == pytest.approx(per_pass, abs=1e-12)
    with trainer_module.Trainer(tiny_config("train.steps=2", "train.save_every=2", "train.mini_batches=2",
                                            "algorithm.entropy_coeff=0.001", *ADAPTIVE, out=tmp_path / "part")) as part:
        train_loop(part)
    with trainer_module.Trainer(tiny_config("train.steps=4", "train.save_every=2", "train.mini_batches=2",
                                            "algorithm.entropy_coeff=0.001", *ADAPTIVE, out=tmp_path / "part"),
                                resume=True) as resumed:
        assert resumed.adaptive_bonus.updates == 2 and resumed.adaptive_bonus.coef == coefs[1]
        train_loop(resumed)
    part_rows = read_jsonl(tmp_path / "part" / "metrics.jsonl")
    for a, b in zip(part_rows, rows):
        for k in ("entropy", "pg_loss", "control/adaptive_coef", "control/entropy_coeff", "control/target"):
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-7), k
