"""CE-GPPO inside TRL 1.16.x: training steps, equivalence with TRL's ``dapo`` loss, diagnostics, warnings.

Runs against the real TRL package on CPU with a tiny local char-level model (no mocks, no downloads).
"""

from __future__ import annotations

import warnings

import pytest

pytest.importorskip("trl")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from cegppo.integrations.trl import ON_POLICY_WARNING, CEGPPOConfig, CEGPPOTrainer  # noqa: E402
from conftest import TEST_DEVICE  # noqa: E402

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=256)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    from cegppo.engine.models import build_tiny_model

    out = tmp_path_factory.mktemp("tiny_char")
    build_tiny_model(out, seed=0, **SMALL)
    return str(out)


def _dataset(n: int = 8) -> Dataset:
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": f"What is {i}+{i + 1}?"}] for i in range(n)]})


def digit_reward(completions, **kwargs):
    """Fraction of digits: varies within a group, so advantages are non-zero."""
    return [sum(ch.isdigit() for ch in c[0]["content"]) / max(len(c[0]["content"]), 1) for c in completions]


def _common(tmp_path, **kw):
    return dict(output_dir=str(tmp_path), per_device_train_batch_size=8, gradient_accumulation_steps=1,
                num_generations=4, max_completion_length=16, logging_steps=1, report_to="none", save_strategy="no",
                use_cpu=TEST_DEVICE == "cpu", bf16=False, seed=0, **kw)


def test_two_off_policy_steps_log_our_metrics(tiny_model, tmp_path):
    args = CEGPPOConfig(**_common(tmp_path, max_steps=2, num_iterations=2, learning_rate=3e-2),
                        beta1=0.5, beta2=1.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = CEGPPOTrainer(model=tiny_model, reward_funcs=[digit_reward], args=args, train_dataset=_dataset())
    assert not [w for w in caught if ON_POLICY_WARNING in str(w.message)]
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2
    for h in logs:
        for key in ("clip/low_frac", "clip/high_frac", "clip/dual_frac", "ppo_kl", "ratio/mean", "entropy",
                    "clip_ratio/region_mean", "quadrant/PA_HP/frac", "quadrant/NA_LP/entropy"):
            assert key in h, (key, sorted(h))
        assert "quadrant/PA_HP/dH" not in h  # needs the collision term, which TRL does not compute
        fracs = sum(h[f"quadrant/{q}/frac"] for q in ("PA_HP", "PA_LP", "NA_HP", "NA_LP"))
        assert 0.0 <= fracs <= 1.0 + 1e-6
        assert h["clip_ratio/region_mean"] == pytest.approx(h["clip/low_frac"] + h["clip/high_frac"], abs=1e-6)
    # step 1 is on-policy; step 2 reuses the batch after an update (num_iterations=2): ratio != 1
    assert logs[0]["ppo_kl"] == pytest.approx(0.0, abs=1e-6)
    assert logs[1]["ppo_kl"] != pytest.approx(0.0, abs=1e-6)
    assert logs[1]["clip/low_frac"] + logs[1]["clip/high_frac"] > 0  # the beta regions were reached


def _inputs(trainer, seed: int, B: int = 8, P: int = 6, C: int = 12):
    g = torch.Generator().manual_seed(seed)
    vocab = trainer.model.config.vocab_size
    prompt_ids = torch.randint(3, vocab, (B, P), generator=g)
    prompt_mask = torch.ones(B, P, dtype=torch.long)
    prompt_mask[:2, :2] = 0  # left padding
    completion_ids = torch.randint(3, vocab, (B, C), generator=g)
    lengths = torch.randint(C // 3, C + 1, (B,), generator=g)
    completion_mask = (torch.arange(C)[None, :] < lengths[:, None]).long()
    advantages = torch.randn(B, generator=g)
    advantages[0] = 0.0
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1), C)
    old = logps + torch.randn(B, C, generator=g) * 0.4  # off-policy: ratios spread across the clip interval
    return dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
                completion_mask=completion_mask, advantages=advantages, old_per_token_logps=old,
                num_items_in_batch=completion_mask.sum() * 2)  # as if this were half of the generation batch


def _grads(trainer, inputs) -> tuple[torch.Tensor, torch.Tensor]:
    model = trainer.model
    model.train()
    model.zero_grad(set_to_none=True)
    trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps
    loss = trainer._compute_loss(model, inputs)
    loss.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]), loss.detach()


@pytest.mark.parametrize("epsilon_high", [None, 0.28])
def test_beta_zero_gradient_equals_trl_dapo(tiny_model, tmp_path, epsilon_high):
    common = _common(tmp_path, max_steps=1, epsilon=0.2, epsilon_high=epsilon_high, steps_per_generation=2)
    # steps_per_generation (2) > gradient_accumulation_steps (1): off-policy, so no on-policy warning
    dapo = GRPOTrainer(model=tiny_model, reward_funcs=[digit_reward], args=GRPOConfig(loss_type="dapo", **common),
                       train_dataset=_dataset())
    ours = CEGPPOTrainer(model=tiny_model, reward_funcs=[digit_reward], train_dataset=_dataset(),
                         args=CEGPPOConfig(beta1=0.0, beta2=0.0, clip_ratio_c=10.0, **common))
    ours_b = CEGPPOTrainer(model=tiny_model, reward_funcs=[digit_reward], train_dataset=_dataset(),
                           args=CEGPPOConfig(beta1=0.75, beta2=1.0, **common))
    ours.model.load_state_dict(dapo.model.state_dict())
    ours_b.model.load_state_dict(dapo.model.state_dict())
    ours_logged = []
    for seed in range(3):
        inputs = _inputs(dapo, seed)
        g_ref, _ = _grads(dapo, inputs)
        g, _ = _grads(ours, inputs)
        torch.testing.assert_close(g, g_ref, rtol=1e-4, atol=1e-7)
        g_b, _ = _grads(ours_b, inputs)
        assert not torch.allclose(g_b, g_ref, rtol=1e-3, atol=1e-6)  # beta > 0 does change the update
        ours.log({})  # one micro-batch per logging window: its token means, comparable with TRL's per-call values
        ours_logged.append(ours.state.log_history[-1])
    # the comparison covered clipped tokens
    assert max(dapo._metrics["train"]["clip_ratio/region_mean"]) > 0.05
    assert [h["clip/low_frac"] for h in ours_logged] == pytest.approx(dapo._metrics["train"]["clip_ratio/low_mean"])
    assert [h["clip/high_frac"] for h in ours_logged] == pytest.approx(dapo._metrics["train"]["clip_ratio/high_mean"])


def test_on_policy_warning(tiny_model, tmp_path):
    with pytest.warns(UserWarning, match="identically 1"):
        CEGPPOTrainer(model=tiny_model, reward_funcs=[digit_reward], train_dataset=_dataset(),
                      args=CEGPPOConfig(**_common(tmp_path, max_steps=1)))


def test_config_validation(tmp_path):
    with pytest.raises(ValueError, match="objective"):
        CEGPPOConfig(**_common(tmp_path), objective="gspo")
    with pytest.raises(ValueError, match="loss_type"):
        CEGPPOConfig(**_common(tmp_path), loss_type="grpo")
    with pytest.raises(ValueError, match="beta1"):
        CEGPPOConfig(**_common(tmp_path), beta1=-1.0)
    obj = CEGPPOConfig(**_common(tmp_path), epsilon=0.2, epsilon_high=0.28, beta1=0.5).build_objective()
    assert obj.hparams == dict(eps_low=0.2, eps_high=0.28, beta1=0.5, beta2=1.0, clip_ratio_c=10.0)
    assert CEGPPOConfig(**_common(tmp_path), objective="gppo").build_objective().hparams["beta1"] == 1.0


def test_entropy_control_steers_logs_and_checkpoints(tiny_model, tmp_path):
    """Two generation batches (num_iterations=2): the controller updates before each, from the previous batch's
    entropy; a target far below the entropy drives beta1 up; its state is in the checkpoint and restores."""
    from cegppo.integrations.trl import CONTROL_STATE

    control = {"enabled": True, "target_mode": "absolute", "target": 0.05, "kp": 0.5, "ki": 0.1}
    args = CEGPPOConfig(**{**_common(tmp_path, max_steps=4, num_iterations=2, learning_rate=3e-2),
                           "save_strategy": "steps", "save_steps": 4}, beta1=0.5, beta2=1.0, entropy_control=control)
    trainer = CEGPPOTrainer(model=tiny_model, reward_funcs=[digit_reward], args=args, train_dataset=_dataset())
    trainer.train()
    ctl = trainer.entropy_controller
    assert ctl.updates == 1  # generation 1: nothing measured yet; generation 2: the first batch's entropy
    assert ctl.beta1 > 0.5 and ctl.beta2 == 1.0 and trainer.objective.hparams["beta1"] == ctl.beta1
    logs = [h for h in trainer.state.log_history if "control/beta1" in h]
    assert [h["control/beta1"] for h in logs][0] == 0.5 and logs[-1]["control/beta1"] == ctl.beta1
    assert logs[-1]["control/error"] > 0  # entropy above the target
    state = tmp_path / "checkpoint-4" / CONTROL_STATE
    assert state.exists()
    fresh = CEGPPOTrainer(model=tiny_model, reward_funcs=[digit_reward], args=args, train_dataset=_dataset())
    fresh._load_entropy_control(str(tmp_path / "checkpoint-4"))
    assert fresh.entropy_controller.state_dict() == ctl.state_dict()
    assert fresh.objective.hparams["beta1"] == ctl.beta1


def test_entropy_control_config_validation(tmp_path):
    with pytest.raises(ValueError, match="only"):
        CEGPPOConfig(**_common(tmp_path), objective="ppo_clip", entropy_control={"enabled": True})
    with pytest.raises(ValueError, match="bogus"):
        CEGPPOConfig(**_common(tmp_path), entropy_control={"enabled": True, "bogus": 1})
    from cegppo.algorithm.entropy_control import EntropyControlConfig

    args = CEGPPOConfig(**_common(tmp_path), entropy_control=EntropyControlConfig(enabled=True, target=0.7))
    assert args.entropy_control["target"] == 0.7 and isinstance(args.entropy_control, dict)


def test_requested_processes_from_the_launch_command(monkeypatch):
    from cegppo.integrations.trl import _num_processes_in_accelerate_command, requested_processes

    accelerate = ["/venv/bin/python", "/venv/bin/accelerate", "launch", "--cpu"]
    assert _num_processes_in_accelerate_command(accelerate + ["--num_processes", "2", "train.py"]) == 2
    assert _num_processes_in_accelerate_command(accelerate + ["--num-processes=4", "train.py"]) == 4
    assert _num_processes_in_accelerate_command(accelerate + ["train.py"]) is None
    assert _num_processes_in_accelerate_command(["python", "train.py", "launch", "--num_processes", "2"]) is None
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert requested_processes() == 8


_ONE_PROCESS_PROBE = """
import sys, warnings
from datasets import Dataset
from cegppo.integrations.trl import CEGPPOConfig, CEGPPOTrainer
warnings.simplefilter("always")
args = CEGPPOConfig(output_dir=sys.argv[2], per_device_train_batch_size=4, num_generations=4, num_iterations=2,
                    max_completion_length=8, report_to="none", save_strategy="no", use_cpu=True, max_steps=1)
ds = Dataset.from_dict({"prompt": [[{"role": "user", "content": "1+1?"}]] * 4})
trainer = CEGPPOTrainer(model=sys.argv[1], reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
                        args=args, train_dataset=ds)
print("PROCESSES", trainer.accelerator.num_processes)
"""


def test_accelerate_cpu_num_processes_2_runs_one_process_and_warns(tiny_model, tmp_path):
    """`accelerate launch --cpu --num_processes 2` silently starts ONE process; CEGPPOTrainer says so."""
    import os
    import subprocess
    import sys

    script = tmp_path / "probe.py"
    script.write_text(_ONE_PROCESS_PROBE)
    accelerate = os.path.join(os.path.dirname(sys.executable), "accelerate")
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    proc = subprocess.run([accelerate, "launch", "--cpu", "--num_processes", "2", "--num_machines", "1",
                           "--mixed_precision", "no", "--dynamo_backend", "no", str(script), tiny_model,
                           str(tmp_path / "out")], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.count("PROCESSES 1") == 1, proc.stdout  # one process, not two
    assert "the launcher asked for 2 processes but this run has 1 process" in proc.stderr, proc.stderr[-4000:]


def test_sapo_gradient_equals_trl_sapo(tiny_model, tmp_path):
    """Our `sapo` objective (seq-mean-token-mean) against TRL 1.16's own loss_type="sapo", on the same tensors and
    weights: the same loss and gradient, ratios spread far from 1 so that the soft gate acts."""
    from cegppo.algorithm.objectives import get_objective
    from cegppo.algorithm.policy_loss import aggregator, policy_loss

    trl_sapo = GRPOTrainer(model=tiny_model, reward_funcs=[digit_reward], train_dataset=_dataset(),
                           args=GRPOConfig(loss_type="sapo", **_common(tmp_path, max_steps=1, steps_per_generation=2)))
    model = trl_sapo.model
    for seed in range(3):
        inputs = _inputs(trl_sapo, seed)
        g_ref, loss_ref = _grads(trl_sapo, inputs)
        model.zero_grad(set_to_none=True)
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
        attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
        lp, _, _ = trl_sapo._get_per_token_logps_and_entropies(model, ids, attention, ids.shape[1] - 6)
        loss, _ = policy_loss(get_objective("sapo"), lp, inputs["old_per_token_logps"], inputs["advantages"],
                              inputs["completion_mask"], reduce=aggregator("seq-mean-token-mean"))
        loss = loss / trl_sapo.args.gradient_accumulation_steps
        loss.backward()
        g = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        torch.testing.assert_close(loss.detach(), loss_ref, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(g, g_ref, rtol=1e-4, atol=1e-7)


def test_erc_keeps_the_gradient_of_tokens_inside_the_entropy_band(tiny_model, tmp_path):
    """ERC in the adapter (``CEGPPOConfig(erc=True)``): on the same tensors its gradient is CE-GPPO's with
    :func:`entropy_ratio_mask` as the gradient mask (the trainer's ERC, checked against the authors' ``gppo_erc`` in
    tests/test_objectives.py), and differs from CE-GPPO without it."""
    from cegppo.algorithm.policy_loss import aggregator, entropy_ratio_mask, policy_loss

    common = _common(tmp_path, max_steps=1, steps_per_generation=2)
    erc = CEGPPOTrainer(model=tiny_model, reward_funcs=[digit_reward], train_dataset=_dataset(),
                        args=CEGPPOConfig(beta1=0.75, beta2=1.0, erc=True, **common))
    plain = CEGPPOTrainer(model=tiny_model, reward_funcs=[digit_reward], train_dataset=_dataset(),
                          args=CEGPPOConfig(beta1=0.75, beta2=1.0, **common))
    plain.model.load_state_dict(erc.model.state_dict())
    model, C = erc.model, 12
    for seed in range(3):
        inputs = _inputs(erc, seed, C=C)
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
        attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
        with torch.no_grad():
            _, ent, _ = erc._get_per_token_logps_and_entropies(model, ids, attention, C, compute_entropy=True)
        g = torch.Generator().manual_seed(100 + seed)
        inputs["old_entropies"] = ent * (0.9 + 0.2 * torch.rand(ent.shape, generator=g))  # about half out of band
        g_erc, _ = _grads(erc, inputs)
        g_plain, _ = _grads(plain, inputs)

        model.zero_grad(set_to_none=True)
        lp, ent, _ = erc._get_per_token_logps_and_entropies(model, ids, attention, C, compute_entropy=True)
        keep = entropy_ratio_mask(ent, inputs["old_entropies"], inputs["completion_mask"], 0.95, 1.05)
        assert 0 < int(keep.sum()) < int(inputs["completion_mask"].sum())  # the band drops some tokens, not all
        num_tokens = inputs["num_items_in_batch"] / erc.args.steps_per_generation  # one accumulation window
        loss, _ = policy_loss(erc.objective, lp, inputs["old_per_token_logps"], inputs["advantages"],
                              inputs["completion_mask"], reduce=aggregator("token-mean", num_tokens=num_tokens),
                              gradient_mask=keep)
        loss.backward()
        g_ref = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        torch.testing.assert_close(g_erc, g_ref, rtol=1e-4, atol=1e-7)
        assert not torch.allclose(g_erc, g_plain, rtol=1e-3, atol=1e-6)


def test_erc_takes_the_sampling_policys_entropies_from_trls_old_log_prob_pass(tiny_model, tmp_path):
    """In training, H_old comes from the pass where TRL computes old_per_token_logps: the generation batch's first
    optimizer step (no update since) keeps every token; its second, after an update, drops some (a narrow band: the
    tiny model's entropy is near its maximum and moves little)."""
    args = CEGPPOConfig(**_common(tmp_path, max_steps=2, steps_per_generation=2, learning_rate=3e-2), erc=True,
                        erc_low=0.999, erc_high=1.001)
    trainer = CEGPPOTrainer(model=tiny_model, reward_funcs=[digit_reward], args=args, train_dataset=_dataset())
    trainer.train()
    kept = [h["erc/kept_frac"] for h in trainer.state.log_history if "erc/kept_frac" in h]
    assert len(kept) == 2
    assert kept[0] == pytest.approx(1.0) and kept[1] < 0.99, kept


def test_erc_band_is_validated(tmp_path):
    with pytest.raises(ValueError, match="0 < erc_low < 1 < erc_high"):
        CEGPPOConfig(**_common(tmp_path, max_steps=1, steps_per_generation=2), erc=True, erc_low=1.0)
