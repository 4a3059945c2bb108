"""The entropy autopilot's verl configuration (cegppo.integrations.verl_autopilot): the documented overrides compose
with the authors' recipe and pass verl's validate_config, select cegppo's registered trainer and build the
controller; bad settings fail loudly; the loss refuses to run unsteered. The 2-rank engine run is
tests/test_multiprocess_verl_autopilot.py.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("verl")

import cegppo.integrations.verl as cv  # noqa: E402
from cegppo.errors import ConfigError  # noqa: E402

AUTOPILOT = ["trainer.v1.trainer_mode=cegppo_sync",
             "+actor_rollout_ref.actor.policy_loss.entropy_control.enabled=true",
             "+actor_rollout_ref.actor.policy_loss.entropy_control.target=0.7",
             "+actor_rollout_ref.actor.policy_loss.entropy_control.bonus_gain=0.1"]


def test_documented_overrides_compose_validate_and_select_the_trainer():
    pytest.importorskip("hydra", reason="the [verl] install (.ci/check_extras.sh) runs this test")
    pytest.importorskip("transfer_queue", reason="verl's V1 trainer needs verl's [verl-core] extra")
    import verl
    from hydra import compose, initialize_config_dir
    from test_verl_recipes import _overrides
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.trainer.ppo.v1 import PPOTrainerSync, get_trainer_cls
    from verl.utils.config import omega_conf_to_dataclass, validate_config

    from cegppo.integrations.verl_autopilot import Autopilot, CEGPPOAutopilotMixin

    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=_overrides("run_7b.sh", *AUTOPILOT))
    validate_config(config=cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    # registered by the plugin at `import verl`, looked up as verl's TaskRunnerV1 does
    trainer_cls = get_trainer_cls(cfg.trainer.v1.trainer_mode)
    assert issubclass(trainer_cls, CEGPPOAutopilotMixin) and issubclass(trainer_cls, PPOTrainerSync)
    pilot = Autopilot.from_actor_config(omega_conf_to_dataclass(cfg.actor_rollout_ref.actor))
    c = pilot.controller
    assert (c.cfg.target, c.cfg.bonus_gain, c.beta1_0, c.beta2_0) == (0.7, 0.1, 0.75, 1.0) and pilot.needs_entropy
    metrics = {"actor/entropy": 0.8}
    sent = pilot.step(metrics)  # relative target: 0.7 x 0.8
    assert set(sent) == {"cegppo_beta1", "cegppo_beta2", "cegppo_entropy_coeff"}
    assert metrics["control/target"] == pytest.approx(0.56) and sent["cegppo_beta1"] > 0.75

    # without the trainer mode the stock trainer would ignore the controller: the loss refuses (below)
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=_overrides("run_7b.sh", *AUTOPILOT[1:]))
    assert get_trainer_cls(cfg.trainer.v1.trainer_mode) is PPOTrainerSync


@pytest.mark.parametrize("kwargs, match", [
    (dict(loss_mode="ce_gppo", entropy_control={"enabled": True, "tagret": 0.7}), "tagret"),
    (dict(loss_mode="gppo", entropy_control={"enabled": True}), "loss_mode is 'gppo'"),
    (dict(loss_mode="ce_gppo", beta1=0.75, entropy_control={"enabled": True, "beta1_max": 0.5}), "beta1_max"),
    (dict(loss_mode="ce_gppo", entropy_control={"enabled": True, "target": -1}), "target"),
])
def test_bad_settings_fail_at_config_time(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        cv.CEGPPOPolicyLossConfig(**kwargs)


def test_loss_refuses_to_run_unsteered():
    """entropy_control on but verl's stock trainer: the first actor update fails instead of a run at fixed betas."""
    import torch

    pl = cv.CEGPPOPolicyLossConfig(loss_mode="ce_gppo", entropy_control={"enabled": True, "target": 0.7})
    t = torch.zeros(2, 3)
    args = dict(old_log_prob=t, log_prob=t, advantages=t, response_mask=torch.ones(2, 3), loss_agg_mode="token-mean")
    with pytest.raises(ConfigError, match="trainer_mode=cegppo_sync"):
        cv.compute_policy_loss_ce_gppo(**args, config={"policy_loss": pl, "clip_ratio_c": 10.0})
    pl.beta1, pl._cegppo_steered = 0.3, True  # what the autopilot's loss does on each worker
    loss, _ = cv.compute_policy_loss_ce_gppo(**args, config={"policy_loss": pl, "clip_ratio_c": 10.0})
    assert torch.isfinite(loss)


def test_autopilot_loss_refuses_a_batch_without_values():
    pytest.importorskip("tensordict")
    from types import SimpleNamespace

    from tensordict import TensorDict

    from cegppo.integrations.verl_autopilot import AutopilotPPOLoss

    pl = cv.CEGPPOPolicyLossConfig(loss_mode="ce_gppo", entropy_control={"enabled": True})
    loss_fn = AutopilotPPOLoss(SimpleNamespace(policy_loss=pl))
    with pytest.raises(RuntimeError, match="carries no autopilot values"):
        loss_fn({}, TensorDict({}, batch_size=[0]))
