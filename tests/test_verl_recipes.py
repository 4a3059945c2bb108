"""The authors' recipes as verl launch scripts (src/cegppo/examples/verl/): their overrides compose with verl's own
Hydra config and pass verl's own ``validate_config``, exactly as ``python -m verl.trainer.main_ppo`` checks them
before it starts Ray; the paper's hyperparameters reach the config; the reward function they name
(cegppo.integrations.verl_reward) scores +1 / -1.

The composition needs hydra-core (the [verl] install, where .ci/check_extras.sh runs this file); the script and
reward checks run everywhere.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

RECIPES = Path(__file__).resolve().parents[1] / "src" / "cegppo" / "examples" / "verl"
SCRIPTS = {"run_1p5b.sh": 0.5, "run_7b.sh": 0.75}  # the authors' beta1 per model size


def _overrides(script: str, *extra: str, **env: str) -> list[str]:
    run_env = {**os.environ, "PYTHON": sys.executable, "CEGPPO_PRINT_OVERRIDES": "1",
               "TRAIN_FILE": "/data/train.parquet", "VAL_FILE": "/data/aime24.parquet", **env}
    run_env.pop("MODEL_PATH", None)
    proc = subprocess.run(["bash", str(RECIPES / script), *extra], env=run_env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_script_prints_the_papers_overrides(script):
    lines = _overrides(script, "trainer.total_epochs=1")
    beta1 = SCRIPTS[script]
    assert f"+actor_rollout_ref.actor.policy_loss.beta1={beta1}" in lines
    for expected in ("actor_rollout_ref.actor.policy_loss.loss_mode=ce_gppo", "actor_rollout_ref.rollout.name=vllm",
                     "actor_rollout_ref.actor.optim.lr=1e-6", "actor_rollout_ref.actor.ppo_mini_batch_size=16",
                     "data.train_batch_size=128", "actor_rollout_ref.rollout.n=8"):
        assert expected in lines, expected
    assert any(ln.startswith("actor_rollout_ref.model.path=deepseek-ai/DeepSeek-R1-Distill-Qwen-") for ln in lines)
    assert lines[-1] == "trainer.total_epochs=1"  # the caller's overrides come last, so they win


def test_script_refuses_to_start_without_data():
    env = {k: v for k, v in os.environ.items() if k not in ("TRAIN_FILE", "VAL_FILE")}
    proc = subprocess.run(["bash", str(RECIPES / "run_7b.sh")], env={**env, "CEGPPO_PRINT_OVERRIDES": "1",
                                                                     "PYTHON": sys.executable},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "TRAIN_FILE" in proc.stderr


def test_reward_function():
    """Loaded by path, as verl loads `reward.custom_reward_function.path`."""
    pytest.importorskip("math_verify")
    path = next(ln for ln in _overrides("run_7b.sh") if ln.startswith("reward.custom_reward_function.path="))
    spec = importlib.util.spec_from_file_location("custom_module", path.partition("=")[2])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.compute_score("aime", "so the answer is $\\boxed{204}$", "204") == {"score": 1.0, "acc": True}
    assert module.compute_score("aime", "the answer is \\boxed{17}", "204") == {"score": -1.0, "acc": False}


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_composes_and_passes_verls_validate_config(script):
    pytest.importorskip("verl")
    pytest.importorskip("hydra", reason="verl's Hydra config needs hydra-core: the [verl] install "
                                        "(.ci/check_extras.sh) runs this test; the test environment installs verl "
                                        "--no-deps")
    import verl
    from hydra import compose, initialize_config_dir
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass, validate_config

    import cegppo.integrations.verl as cv

    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=_overrides(script))
    # what verl.trainer.main_ppo.main runs before it starts Ray
    validate_config(config=cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    assert isinstance(actor.policy_loss, cv.CEGPPOPolicyLossConfig)
    assert (actor.policy_loss.loss_mode, actor.policy_loss.beta1, actor.policy_loss.beta2) == ("ce_gppo",
                                                                                             SCRIPTS[script], 1.0)
    assert (actor.clip_ratio_low, actor.clip_ratio_high, actor.clip_ratio_c) == (0.2, 0.2, 10.0)
    assert not need_reference_policy(cfg) and not need_critic(cfg)
    assert cfg.actor_rollout_ref.rollout.name == "vllm" and cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node == 128
    assert cfg.data.gen_batch_size == 256 and cfg.algorithm.filter_groups.enable

    # and verl's check is not a formality: without a micro-batch setting it rejects the recipe
    broken = [o for o in _overrides(script) if "use_dynamic_bsz" not in o and "max_token_len" not in o]
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=broken)
    with pytest.raises(Exception, match="micro_batch_size"):  # raised through Hydra's InstantiationException
        validate_config(config=cfg, use_reference_policy=False, use_critic=False)
