"""The entropy autopilot in verl 0.9.x: cegppo's controller steers ``ce_gppo``'s beta1 (and the entropy bonus)
every step on every actor worker, its state saved with verl's checkpoints.

Turn it on (besides the ``ce_gppo`` overrides of :mod:`cegppo.integrations.verl`)::

    trainer.v1.trainer_mode=cegppo_sync
    +actor_rollout_ref.actor.policy_loss.entropy_control.enabled=true
    +actor_rollout_ref.actor.policy_loss.entropy_control.target=0.7      # any EntropyControlConfig field
    +actor_rollout_ref.actor.policy_loss.entropy_control.bonus_gain=0.03  # optional: the bonus lever,
    +actor_rollout_ref.actor.policy_loss.entropy_control.ema=1.0          # ... unsmoothed (docs/algorithm.md §11)

The route (verl 0.9.1's V1 trainer; its policy losses see only the worker's ``ActorConfig``, never the driver):

1. **Driver** (:class:`CEGPPOAutopilotTrainer`, registered as ``cegppo_sync``: verl's ``PPOTrainerSync`` plus
   this): before each actor update, :class:`Autopilot` runs :class:`~cegppo.algorithm.entropy_control.EntropyController`
   on the step's ``actor/entropy`` (computed by verl on the driver from the old-log-prob pass over the whole
   batch, so one number for all ranks), logs ``control/*`` and puts beta1, beta2 and the bonus coefficient into the
   batch's ``extra_info``, which verl hands to every worker as non-tensor data of its shard.
2. **Workers**: the loss the driver installs once with verl's own ``set_loss_fn`` (:class:`AutopilotPPOLoss`)
   reads the three values from each micro-batch, sets them on its ``policy_loss`` config, runs verl's ``ppo_loss``
   and subtracts ``entropy_coeff * H`` (aggregated as verl aggregates its own entropy bonus). A batch without the
   values is an error, never the configured betas.
3. **Checkpoints**: ``entropy_control_state.json`` in each ``global_step_N`` folder, written before verl marks the
   checkpoint as the latest; restored on resume (a run resumed from a checkpoint without it warns and starts the
   controller afresh).

verl's legacy trainer (``trainer.use_v1=False``) has no trainer registry and is not covered.
"""

from __future__ import annotations

import json
import logging
import os
import warnings
from typing import Any

from cegppo.algorithm.entropy_control import EntropyController
from cegppo.errors import ConfigError

_log = logging.getLogger(__name__)

__all__ = ["Autopilot", "AutopilotPPOLoss", "BATCH_KEYS", "STATE_FILE", "TRAINER_MODE", "checkpoint_folder",
           "register_trainers"]

STATE_FILE = "entropy_control_state.json"  # in verl's global_step_N checkpoint folder
TRAINER_MODE = "cegppo_sync"  # trainer.v1.trainer_mode
# the batch's extra_info keys (verl: non-tensor data of every worker's shard and of each micro-batch)
BATCH_KEYS = ("cegppo_beta1", "cegppo_beta2", "cegppo_entropy_coeff")


class Autopilot:
    """The driver's side: one controller, one update per actor update, state as JSON."""

    def __init__(self, controller: EntropyController):
        self.controller = controller

    @classmethod
    def from_actor_config(cls, actor_config: Any) -> "Autopilot | None":
        """From verl's ``ActorConfig`` (dataclass): ``None`` unless ``policy_loss.entropy_control.enabled``."""
        from cegppo.integrations.verl import CEGPPOPolicyLossConfig

        pl = actor_config.policy_loss
        if not isinstance(pl, CEGPPOPolicyLossConfig):
            ec = pl.get("entropy_control") if hasattr(pl, "get") else None
            if ec:
                raise ConfigError("actor_rollout_ref.actor.policy_loss.entropy_control needs "
                                  "actor_rollout_ref.actor.policy_loss._target_="
                                  "cegppo.integrations.verl.CEGPPOPolicyLossConfig")
            return None
        cfg = pl.control_config()
        return None if cfg is None else cls(EntropyController(cfg, pl.beta1, pl.beta2))

    @property
    def needs_entropy(self) -> bool:
        """Whether the workers must compute per-token entropy in the update (the bonus lever is on)."""
        return self.controller.cfg.bonus_gain > 0

    def step(self, metrics: dict[str, Any]) -> dict[str, float]:
        """One controller update from ``metrics["actor/entropy"]`` (absent: no change); adds ``control/*`` to
        ``metrics`` and returns the batch's extra_info entries (:data:`BATCH_KEYS`)."""
        entropy = metrics.get("actor/entropy")
        out = self.controller.update(None if entropy is None else float(entropy))
        metrics.update({k: v for k, v in out.items() if k.startswith("control/")})
        return dict(zip(BATCH_KEYS, (float(out["beta1"]), float(out["beta2"]), float(out["entropy_coeff"]))))

    def save(self, folder: str) -> None:
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, STATE_FILE)
        with open(path + ".tmp", "w") as f:
            json.dump(self.controller.state_dict(), f)
        os.replace(path + ".tmp", path)

    def load(self, folder: str) -> bool:
        """Restore from ``folder`` (False, with a warning, when it holds no state)."""
        path = os.path.join(folder, STATE_FILE)
        if not os.path.exists(path):
            msg = (f"cegppo: the checkpoint {folder} has no {STATE_FILE}; the entropy autopilot starts afresh "
                   f"(beta1={self.controller.beta1_0}, target from the next step's entropy when relative)")
            _log.warning(msg)
            warnings.warn(msg, UserWarning, stacklevel=2)
            return False
        with open(path) as f:
            self.controller.load_state_dict(json.load(f))
        return True


class AutopilotPPOLoss:
    """The workers' side: verl's ``ppo_loss`` with beta1 / beta2 / the bonus from the batch. Picklable (verl's
    ``set_loss_fn`` ships it to every actor worker); ``config`` is verl's ``ActorConfig`` with a
    ``CEGPPOPolicyLossConfig``."""

    def __init__(self, config: Any):
        from cegppo.integrations.verl import CEGPPOPolicyLossConfig

        if not isinstance(config.policy_loss, CEGPPOPolicyLossConfig) or config.policy_loss.loss_mode != "ce_gppo":
            raise ConfigError("the entropy autopilot needs actor.policy_loss: CEGPPOPolicyLossConfig, loss_mode=ce_gppo")
        self.config = config

    def __call__(self, model_output: Any, data: Any, dp_group: Any = None) -> tuple[Any, dict[str, Any]]:
        from verl.trainer.ppo.core_algos import agg_loss
        from verl.utils import tensordict_utils as tu
        from verl.workers.utils.losses import ppo_loss
        from verl.workers.utils.padding import no_padding_2_padding

        values = [tu.get_non_tensor_data(data=data, key=k, default=None) for k in BATCH_KEYS]
        if any(v is None for v in values):
            raise RuntimeError(f"cegppo: the batch carries no autopilot values ({', '.join(BATCH_KEYS)}): the actor "
                               f"update must come from cegppo's verl trainer (trainer.v1.trainer_mode={TRAINER_MODE})")
        beta1, beta2, coeff = (float(v) for v in values)
        pl = self.config.policy_loss
        pl.beta1, pl.beta2, pl._cegppo_steered = beta1, beta2, True
        loss, metrics = ppo_loss(self.config, model_output, data, dp_group)
        if coeff != 0.0:  # the bonus lever, on top of verl's own actor.entropy_coeff term
            entropy = model_output.get("entropy", None)
            if entropy is None:
                raise RuntimeError("cegppo: the autopilot's entropy bonus needs the update's entropy "
                                   "(calculate_entropy); cegppo's trainer sets it when bonus_gain > 0")
            entropy = no_padding_2_padding(entropy, data)
            mask = data.select("response_mask").to_padded_tensor()["response_mask"].to(bool)
            bonus = agg_loss(loss_mat=entropy, loss_mask=mask, loss_agg_mode=self.config.loss_agg_mode,
                             **self.config.global_batch_info)
            loss = loss - coeff * bonus
        metrics.update({"control/applied_beta1": beta1, "control/applied_beta2": beta2,
                        "control/applied_entropy_coeff": coeff})
        return loss, metrics


def checkpoint_folder(trainer_config: Any, global_steps: int) -> str:
    """The ``global_step_N`` folder verl's V1 trainer resumes from / saves to (its own resolution)."""
    if trainer_config.resume_mode == "resume_path" and trainer_config.get("resume_from_path"):
        folder = str(trainer_config.resume_from_path)
    else:
        folder = os.path.join(str(trainer_config.default_local_dir), f"global_step_{global_steps}")
    return folder if os.path.isabs(folder) else os.path.join(os.getcwd(), folder)


class CEGPPOAutopilotMixin:
    """Put before a verl V1 ``PPOTrainer`` subclass: controller on the driver, betas in the batch."""

    def __init__(self, config: Any, *args: Any, **kwargs: Any):
        from verl.trainer.distillation import is_distillation_enabled
        from verl.utils.config import omega_conf_to_dataclass

        self._actor_config = omega_conf_to_dataclass(config.actor_rollout_ref.actor)
        self.autopilot = Autopilot.from_actor_config(self._actor_config)
        if self.autopilot is None:
            warnings.warn(f"cegppo: trainer_mode={TRAINER_MODE} without actor_rollout_ref.actor.policy_loss."
                          "entropy_control.enabled=true: a plain verl sync trainer", UserWarning, stacklevel=2)
        elif is_distillation_enabled(config.get("distillation")):
            raise ConfigError("the entropy autopilot does not support verl's distillation loss")
        elif self.autopilot.needs_entropy:  # verl's _update_actor asks the workers for entropy when this is set
            config.actor_rollout_ref.actor.calculate_entropy = True
        super().__init__(config, *args, **kwargs)

    def _setup(self) -> None:
        super()._setup()
        if self.autopilot is not None:  # replaces the workers' partial(ppo_loss, config=actor_config)
            self.actor_rollout_wg.set_loss_fn(AutopilotPPOLoss(self._actor_config))

    def _update_actor(self, batch: Any, metrics: dict) -> Any:
        if self.autopilot is not None:
            batch.extra_info.update(self.autopilot.step(metrics))
        return super()._update_actor(batch, metrics)

    def _save_checkpoint(self) -> None:
        if self.autopilot is not None:  # before verl writes latest_checkpointed_iteration.txt
            self.autopilot.save(checkpoint_folder(self.config.trainer, self.global_steps))
        super()._save_checkpoint()

    def _load_checkpoint(self) -> None:
        super()._load_checkpoint()  # sets self.global_steps to the checkpoint's step (0: from scratch)
        if self.autopilot is not None and self.global_steps > 0:
            self.autopilot.load(checkpoint_folder(self.config.trainer, self.global_steps))


CEGPPOAutopilotTrainer = None  # the registered class, once register_trainers() ran


def register_trainers() -> None:
    """Register ``cegppo_sync`` in verl's V1 trainer registry (idempotent). The plugin module calls it at
    ``import verl`` when verl's V1 trainer can import (transfer_queue installed)."""
    global CEGPPOAutopilotTrainer
    from verl.trainer.ppo.v1 import PPOTrainerSync, register_trainer
    from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY

    existing = TRAINER_REGISTRY.get(TRAINER_MODE)
    if existing is not None and existing.__module__ == __name__:  # registered already (e.g. a module reload)
        CEGPPOAutopilotTrainer = existing
        return

    class _CEGPPOAutopilotTrainer(CEGPPOAutopilotMixin, PPOTrainerSync):
        """verl's synchronous V1 trainer with cegppo's entropy autopilot."""

    _CEGPPOAutopilotTrainer.__name__ = _CEGPPOAutopilotTrainer.__qualname__ = "CEGPPOAutopilotTrainer"
    CEGPPOAutopilotTrainer = register_trainer(TRAINER_MODE)(_CEGPPOAutopilotTrainer)
