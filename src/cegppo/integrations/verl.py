"""CE-GPPO as a verl 0.9.x policy loss.

Importing this module registers two losses in verl's policy-loss registry
(``verl.trainer.ppo.core_algos.POLICY_LOSS_REGISTRY``):

- ``ce_gppo``: CE-GPPO, beta1 / beta2 read from ``actor.policy_loss`` (see :class:`CEGPPOPolicyLossConfig`);
- ``gppo``: GPPO (Klear-Reasoner), i.e. CE-GPPO with beta1 = beta2 = 1.

Both take the clip bounds from the actor config exactly as verl's ``vanilla`` loss does (``clip_ratio_low`` /
``clip_ratio_high``, falling back to ``clip_ratio``; dual clip ``clip_ratio_c``, verl default 3.0, the authors
use 10), weight tokens by ``rollout_is_weights`` when verl passes them, and aggregate with verl's own
``agg_loss`` using the global batch info verl puts into ``config.global_batch_info``. The loss is
:func:`cegppo.algorithm.policy_loss.policy_loss`, as in cegppo's own trainer; this module only translates
verl's arguments. verl adds its KL and entropy terms outside the policy loss, so they are not passed here.

How the module gets imported (in the driver *and* in every Ray worker):

1. the ``verl.plugins`` entry point declared by this package (loaded at ``import verl`` unless
   ``VERL_USE_EXTERNAL_PLUGINS=none`` or an allow-list without ``cegppo``);
2. ``VERL_USE_EXTERNAL_MODULES=cegppo.integrations.verl`` (for multi-node runs, pass it to the workers via
   ``+ray_kwargs.ray_init.runtime_env.env_vars.VERL_USE_EXTERNAL_MODULES=cegppo.integrations.verl``).

verl swallows plugin import errors at DEBUG level, which would surface much later as "Unsupported loss
mode: ce_gppo". This module therefore logs at ERROR level and emits a ``RuntimeWarning`` before re-raising
when it cannot load, and :func:`check` raises a clear error when the losses are not reachable.

Hyperparameters (Hydra overrides)::

    actor_rollout_ref.actor.policy_loss._target_=cegppo.integrations.verl.CEGPPOPolicyLossConfig
    actor_rollout_ref.actor.policy_loss.loss_mode=ce_gppo
    +actor_rollout_ref.actor.policy_loss.beta1=0.75
    +actor_rollout_ref.actor.policy_loss.beta2=1.0
    actor_rollout_ref.actor.clip_ratio_low=0.2 actor_rollout_ref.actor.clip_ratio_high=0.2
    actor_rollout_ref.actor.clip_ratio_c=10.0
"""

from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass
from typing import Any, Optional

_log = logging.getLogger(__name__)

LOSS_NAMES = ("ce_gppo", "gppo")
# Modules verl 0.9.1's trainers import that verl itself does not require: they come with its [verl-core] extra,
# which cegppo's [verl] extra installs. Without them `python -m verl.trainer.main_ppo` dies right after Ray starts.
TRAINER_DEPENDENCIES = {
    "transfer_queue": "verl's default V1 trainer (verl.trainer.ppo.v1)",
    "cachetools": "verl's legacy trainer, trainer.use_v1=False (verl.workers.rollout.router)",
}
ENTRY_POINT_GROUP = "verl.plugins"
ENTRY_POINT_NAME = "cegppo"

try:
    import torch

    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY, agg_loss, register_policy_loss
    from verl.workers.config import PolicyLossConfig

    from cegppo.algorithm.entropy_control import EntropyControlConfig, validate_entropy_control
    from cegppo.algorithm.objectives import OBJECTIVES, check_hparams, get_objective
    from cegppo.algorithm.policy_loss import policy_loss
    from cegppo.errors import ConfigError
except Exception as _exc:  # noqa: BLE001 - re-raised below; verl would otherwise hide it at DEBUG level
    _msg = (
        f"cegppo: could not load the verl plugin {__name__} ({type(_exc).__name__}: {_exc}). The 'ce_gppo' and "
        "'gppo' policy losses are NOT registered; a run with actor.policy_loss.loss_mode=ce_gppo will fail with "
        "'Unsupported loss mode'. Requirements: verl 0.9.x importable (pip install -e \".[verl]\" installs it with its "
        "dependencies) and an intact cegppo install."
    )
    _log.error(_msg)
    warnings.warn(_msg, RuntimeWarning, stacklevel=2)
    raise

__all__ = ["CEGPPOPolicyLossConfig", "LOSS_NAMES", "TRAINER_DEPENDENCIES", "check", "compute_policy_loss_ce_gppo",
           "compute_policy_loss_gppo", "register", "trainer_problems"]

_DEFAULT_BETA1 = OBJECTIVES["ce_gppo"].defaults["beta1"]
_DEFAULT_BETA2 = OBJECTIVES["ce_gppo"].defaults["beta2"]


@dataclass
class CEGPPOPolicyLossConfig(PolicyLossConfig):
    """verl's ``PolicyLossConfig`` plus CE-GPPO's beta1 (A < 0, r < 1 - eps_low) and beta2 (A > 0, r > 1 + eps_high).

    Select it with ``actor_rollout_ref.actor.policy_loss._target_=cegppo.integrations.verl.CEGPPOPolicyLossConfig``
    (verl's config dataclasses are strict: ``policy_loss.beta1`` is rejected on the stock class). The authors
    used beta1 = 0.5 for 1.5B models and 0.75 for 7B, beta2 = 1.

    ``entropy_control``: the fields of :class:`cegppo.algorithm.entropy_control.EntropyControlConfig` (the entropy
    autopilot, run by cegppo's verl trainer ``trainer.v1.trainer_mode=cegppo_sync``:
    :mod:`cegppo.integrations.verl_autopilot`). beta1 / beta2 are the controller's starting values; the workers'
    loss sets them each step from the batch (hence mutable here).
    """

    _mutable_fields = PolicyLossConfig._mutable_fields | {"beta1", "beta2", "_cegppo_steered"}

    beta1: float = _DEFAULT_BETA1
    beta2: float = _DEFAULT_BETA2
    entropy_control: Optional[dict[str, Any]] = None

    def __post_init__(self) -> None:
        check_hparams("CEGPPOPolicyLossConfig", {"beta1": self.beta1, "beta2": self.beta2})  # the objectives' own check
        if self.loss_mode != "ce_gppo" and (self.beta1, self.beta2) != (_DEFAULT_BETA1, _DEFAULT_BETA2):
            warnings.warn(
                f"CEGPPOPolicyLossConfig: beta1={self.beta1}, beta2={self.beta2} are only used by "
                f"loss_mode=ce_gppo, but loss_mode={self.loss_mode!r}; set "
                "actor_rollout_ref.actor.policy_loss.loss_mode=ce_gppo",
                UserWarning,
                stacklevel=2,
            )
        self.control_config()  # validates entropy_control

    def control_config(self) -> EntropyControlConfig | None:
        """The validated ``entropy_control`` (``None`` when absent or off; ``ConfigError`` when invalid)."""
        where = "actor_rollout_ref.actor.policy_loss.entropy_control"
        if self.entropy_control is None:
            return None
        try:
            cfg = EntropyControlConfig(**dict(self.entropy_control))
        except TypeError as e:
            raise ConfigError(f"{where}: {e} (keys: {', '.join(EntropyControlConfig.__dataclass_fields__)})") from None
        if cfg.enabled and self.loss_mode != "ce_gppo":
            raise ConfigError(f"{where}: the autopilot steers ce_gppo's beta1/beta2; loss_mode is {self.loss_mode!r} "
                              "(for GPPO use loss_mode=ce_gppo with beta1=beta2=1)")
        validate_entropy_control(cfg, "ce_gppo", {"beta1": self.beta1, "beta2": self.beta2}, where=where)
        return cfg if cfg.enabled else None


# --------------------------------------------------------------------------------------------------------
# hyperparameters from verl's actor config
# --------------------------------------------------------------------------------------------------------

_warned_default_betas = False


def _cfg_get(cfg: Any, key: str, default: Any = None) -> Any:
    if cfg is None:
        return default
    getter = getattr(cfg, "get", None)
    if callable(getter):  # verl BaseConfig, OmegaConf DictConfig, dict
        return getter(key, default)
    return getattr(cfg, key, default)


def _clip_bounds(config: Any) -> tuple[float, float, float]:
    """(eps_low, eps_high, clip_ratio_c), resolved as verl's ``compute_policy_loss_vanilla`` does."""
    clip_ratio = _cfg_get(config, "clip_ratio", 0.2)
    low = _cfg_get(config, "clip_ratio_low")
    high = _cfg_get(config, "clip_ratio_high")
    c = _cfg_get(config, "clip_ratio_c", 3.0)
    if not (c is not None and c > 1.0):  # same check as vanilla, which asserts it
        raise ValueError(f"actor.clip_ratio_c (dual-clip bound) must be > 1.0, got {c!r}")
    return (float(clip_ratio if low is None else low), float(clip_ratio if high is None else high), float(c))


def _betas(config: Any) -> tuple[float, float]:
    """beta1, beta2 from ``config.policy_loss`` (our dataclass or any mapping with those keys)."""
    global _warned_default_betas
    pl = _cfg_get(config, "policy_loss")
    b1, b2 = _cfg_get(pl, "beta1"), _cfg_get(pl, "beta2")
    if b1 is None or b2 is None:
        if not _warned_default_betas:
            _warned_default_betas = True
            msg = (
                "cegppo: loss_mode=ce_gppo but actor.policy_loss has no beta1/beta2 "
                f"({type(pl).__name__}); using beta1={_DEFAULT_BETA1}, beta2={_DEFAULT_BETA2}. Set "
                "actor_rollout_ref.actor.policy_loss._target_=cegppo.integrations.verl.CEGPPOPolicyLossConfig "
                "and +actor_rollout_ref.actor.policy_loss.beta1=... to choose them."
            )
            _log.warning(msg)
            warnings.warn(msg, UserWarning, stacklevel=3)
        b1 = _DEFAULT_BETA1 if b1 is None else b1
        b2 = _DEFAULT_BETA2 if b2 is None else b2
    return float(b1), float(b2)


# --------------------------------------------------------------------------------------------------------
# the losses
# --------------------------------------------------------------------------------------------------------


def _policy_loss(
    objective_name: str,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str,
    config: Any,
    rollout_is_weights: torch.Tensor | None,
) -> tuple[torch.Tensor, dict[str, float]]:
    if config is None:
        raise ValueError(f"{objective_name}: verl must pass the actor config (config=None)")
    eps_low, eps_high, c = _clip_bounds(config)
    hp: dict[str, Any] = dict(eps_low=eps_low, eps_high=eps_high, clip_ratio_c=c)
    if objective_name == "ce_gppo":
        hp["beta1"], hp["beta2"] = _betas(config)
        pl = _cfg_get(config, "policy_loss")
        if isinstance(pl, CEGPPOPolicyLossConfig) and pl.entropy_control and dict(pl.entropy_control).get(
                "enabled") and not getattr(pl, "_cegppo_steered", False):
            raise ConfigError("actor_rollout_ref.actor.policy_loss.entropy_control.enabled=true, but nothing steers "
                              "beta1: the autopilot runs in cegppo's verl trainer, trainer.v1.trainer_mode=cegppo_sync "
                              "(cegppo.integrations.verl_autopilot)")
    objective = get_objective(objective_name, **hp)

    # verl normalises across its data-parallel ranks itself: its own agg_loss with the global batch info it passes
    global_batch_info = _cfg_get(config, "global_batch_info", None) or {}

    def reduce(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return agg_loss(loss_mat=values, loss_mask=mask, loss_agg_mode=loss_agg_mode, **global_batch_info)

    pg_loss, m = policy_loss(objective, log_prob, old_log_prob, advantages, response_mask, reduce=reduce,
                             token_weights=rollout_is_weights)  # per-token rollout-correction weights, as vanilla
    # one host sync for all metrics; verl's own losses return python floats (.item())
    low, high, dual, kl = torch.stack(
        [m["clip/low_frac"], m["clip/high_frac"], m["clip/dual_frac"], m["ppo_kl"]]
    ).float().tolist()
    metrics = {
        "actor/pg_clipfrac": low + high,  # verl: tokens where the clipped branch binds (beta1 u beta2 regions)
        "actor/ppo_kl": kl,
        "actor/pg_clipfrac_lower": dual,  # verl's name for the dual-clip fraction (A < 0, r > clip_ratio_c)
        "actor/clip/low_frac": low,
        "actor/clip/high_frac": high,
        "actor/clip/dual_frac": dual,
    }
    return pg_loss, metrics


def compute_policy_loss_ce_gppo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """verl policy loss ``ce_gppo``: CE-GPPO with beta1/beta2 from ``config.policy_loss``."""
    return _policy_loss("ce_gppo", old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
                        rollout_is_weights)


def compute_policy_loss_gppo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """verl policy loss ``gppo``: GPPO = CE-GPPO with beta1 = beta2 = 1."""
    return _policy_loss("gppo", old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
                        rollout_is_weights)


_LOSSES = {"ce_gppo": compute_policy_loss_ce_gppo, "gppo": compute_policy_loss_gppo}


def register() -> None:
    """Put ``ce_gppo`` and ``gppo`` into verl's registry. Idempotent; runs at import."""
    for name, fn in _LOSSES.items():
        current = POLICY_LOSS_REGISTRY.get(name)
        if current is fn:
            continue
        if current is not None and getattr(current, "__qualname__", None) != fn.__qualname__:
            _log.warning("cegppo: replacing the verl policy loss %r registered by %s.%s", name,
                         getattr(current, "__module__", "?"), getattr(current, "__qualname__", "?"))
        register_policy_loss(name)(fn)


def trainer_problems() -> list[str]:
    """One line per module of :data:`TRAINER_DEPENDENCIES` that does not import (empty when verl's trainers can
    start as far as their imports go)."""
    import importlib

    problems = []
    for module, needed_by in TRAINER_DEPENDENCIES.items():
        try:
            importlib.import_module(module)
        except ImportError as exc:
            problems.append(f"verl's trainer cannot start: {type(exc).__name__}: {exc} (needed by {needed_by}); "
                            "install verl's [verl-core] extra: pip install -e \".[verl]\" brings it")
    return problems


def check(trainer: bool = True) -> None:
    """Raise ``RuntimeError`` with the reason when verl cannot resolve ``ce_gppo`` / ``gppo`` to these losses.

    Also checks that a fresh ``import verl`` will load this module (entry point installed and allowed, or
    listed in ``VERL_USE_EXTERNAL_MODULES``), which is what the Ray workers rely on, and, with ``trainer`` (the
    default), that the modules verl's trainers import are installed (:func:`trainer_problems`). ``trainer=False``
    checks only the losses: enough to use them outside verl's trainer (e.g. its engines driven directly).
    """
    from importlib.metadata import entry_points

    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    problems = []
    for name, fn in _LOSSES.items():
        try:
            got = get_policy_loss_fn(name)
        except Exception as exc:  # noqa: BLE001
            problems.append(f"get_policy_loss_fn({name!r}) failed: {exc}")
            continue
        if got is not fn:
            problems.append(f"verl's {name!r} is {getattr(got, '__module__', '?')}.{getattr(got, '__qualname__', '?')}, "
                            f"not {__name__}.{fn.__qualname__}")

    modules = [m.strip() for m in os.getenv("VERL_USE_EXTERNAL_MODULES", "").split(",") if m.strip()]
    policy = os.getenv("VERL_USE_EXTERNAL_PLUGINS", "auto").strip().lower()
    eps = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == ENTRY_POINT_NAME]
    via_module = __name__ in modules
    via_entry_point = bool(eps) and eps[0].value == __name__ and (
        policy == "auto" or (policy != "none" and ENTRY_POINT_NAME in {p.strip() for p in policy.split(",")})
    )
    if not (via_module or via_entry_point):
        if not eps:
            why = f"no '{ENTRY_POINT_NAME}' entry point in group '{ENTRY_POINT_GROUP}' (reinstall: pip install -e .)"
        elif eps[0].value != __name__:
            why = f"the '{ENTRY_POINT_NAME}' entry point points at {eps[0].value!r}"
        else:
            why = f"VERL_USE_EXTERNAL_PLUGINS={policy!r} excludes '{ENTRY_POINT_NAME}'"
        problems.append(f"a fresh `import verl` (e.g. in a Ray worker) will not load {__name__}: {why}, and "
                        f"VERL_USE_EXTERNAL_MODULES does not list it")
    if trainer:
        problems.extend(trainer_problems())
    if problems:
        raise RuntimeError("cegppo verl integration is not usable:\n  - " + "\n  - ".join(problems))


def _register_autopilot_trainer() -> None:
    """``trainer.v1.trainer_mode=cegppo_sync`` (:mod:`cegppo.integrations.verl_autopilot`): registered wherever
    verl's V1 trainer can import (it needs transfer_queue, from verl's [verl-core] extra)."""
    import importlib.util

    if importlib.util.find_spec("transfer_queue") is None:
        return
    try:
        from cegppo.integrations.verl_autopilot import register_trainers

        register_trainers()
    except Exception as exc:  # noqa: BLE001 - the losses stay usable; say why the trainer mode is missing
        _log.error("cegppo: could not register verl trainer_mode=cegppo_sync (the entropy autopilot): %s: %s",
                   type(exc).__name__, exc)


register()
_register_autopilot_trainer()
