"""Entropy autopilot: hold a target entropy by steering CE-GPPO's beta1 (and optionally beta2 and an entropy bonus)
during training.

Once per RL step, from the token-mean entropy of the step's rollouts (measured before the updates)::

    controller = EntropyController(EntropyControlConfig(enabled=True, target=0.7), beta1=0.75, beta2=1.0)
    out = controller.update(entropy)   # {"beta1", "beta2", "entropy_coeff", "control/beta1", "control/target", ...}
    objective = objective.with_betas(out["beta1"], out["beta2"])
    # and the loss adds the entropy bonus -out["entropy_coeff"] * H (on top of algorithm.entropy_coeff)

The rule (:meth:`EntropyController.update`) is a proportional-integral controller on the relative error of the
smoothed entropy, ``e = (H_ema - target) / target`` (positive: too much entropy)::

    s      = kp * e + ki * I                      # the control signal, in beta units ("lower the entropy by")
    beta1  = clip(beta1_0 + s, beta1_min, beta1_max)
    beta2  = clip(beta2_0 - (beta1_0 + s - beta1), beta2_min, beta2_max)   # only with move_beta2; else beta2_0
    bonus  = clip(-bonus_gain * s, 0, bonus_max)                           # entropy-bonus coefficient (s < 0 only)

What it rests on: the paper's mechanism, **raising beta1 lowers entropy** (more gradient kept on negative-advantage
tokens below the clip), so entropy above the target raises beta1. At CPU scale our evidence is weak: an earlier
20-batch run (``benchmarks/results/entropy_dynamics_prior.json``, stale: made with a removed API, no commit
recorded) found -8.4e-3 +- 2.4e-3 nats/token for beta1 0 -> 1; the 5-batch rerun at HEAD
(``benchmarks/results/entropy_dynamics.md``) has the same sign inside its noise (-5.5e-3 +- 5.3e-3). beta2 moves only when enabled, and only with
the part of ``s`` that beta1 could not take (beta1 at a bound). Its sign is the paper's claim (a larger beta2
keeps more gradient on positive-advantage tokens past the clip, which raises entropy, so entropy above the target
*lowers* beta2); our measurements did **not** establish it (0 of 3 contrasts beyond 2 SE), hence off by default.

beta1 is a one-sided lever in practice: at beta1 = 0 (beta2 fixed at 1) CE-GPPO is PPO clipping plus the
returned positive-advantage gradients above ``1 + eps_high``, and entropy still falls by itself: in the benchmark's
CPU regime beta1 sat at 0 from step 2-5 in all 6 beta1-only runs, whose entropy fell further than GRPO's
(``benchmarks/results/entropy_control.md``). The entropy bonus is the lever that raises it, so
with ``bonus_gain`` > 0 a negative signal (too little entropy) also adds an entropy bonus ``bonus_gain * |s|``,
capped at ``bonus_max``: the two levers push the same way, beta1 down and the bonus up (off by default).

Choices, all in :meth:`EntropyController.update`:

- Smoothing: an exponential moving average of the measured entropy (``ema`` is the new value's weight; 1 = none).
- Inside the band (``|e| <= band``) the integral is frozen: the proportional term still acts (the output stays
  continuous at the band's edges), but noise around the target does not accumulate into a drift.
- Anti-windup: no integration while the output is saturated (every lever it may move is at a bound) and the error
  pushes further; and the integral term alone never exceeds the output's range, so the output leaves a bound on
  the first step the error changes sign.
- Steps without a measurement (``None``/NaN: no rollout kept) leave everything unchanged.
- A relative target needs a positive first entropy. While the target it would set (``target`` x the measured
  entropy) is below :data:`MIN_ENTROPY` (near-greedy sampling: a rollout temperature near 0 makes the entropy 0),
  no target is set and the step counts as one
  without a measurement: the betas stay at their starting values and ``control/target_pending`` counts those steps
  (the run loop warns); the target is set from the first entropy that gives one. An absolute target is never
  pending. (Dividing by a zero target was the ZeroDivisionError of issue 23.)

The module is pure Python (no torch): the trainer, the TRL adapter and the tests share it. Its state is a small
JSON-able dict (:meth:`EntropyController.state_dict`), checkpointed with the trainer state, so a killed and
resumed run continues exactly.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from cegppo.errors import ConfigError

__all__ = ["CONTROLLED_OBJECTIVES", "AdaptiveEntropyBonus", "AdaptiveEntropyConfig", "EntropyControlConfig",
           "EntropyController", "build_adaptive_entropy", "build_controller", "validate_adaptive_entropy",
           "validate_entropy_control"]

CONTROLLED_OBJECTIVES = ("ce_gppo", "gppo")  # the objectives with beta1 / beta2
MIN_ENTROPY = 1e-9  # nats/token: the smallest relative target it sets (module docstring)


def _key(default: Any, **rule: Any) -> Any:
    """A config key with its declared type-independent rule (``range`` metadata, read by the fuzz tests; the same
    form as :func:`cegppo.config.schema.key`)."""
    return field(default=default, metadata={"range": rule})


@dataclass
class EntropyControlConfig:
    """``algorithm.entropy_control`` in the run config (off by default). Every range holds whether it is on or not;
    the betas' bounds are checked against the objective's starting betas when it is on."""

    enabled: bool = _key(False)
    # relative: a fraction of the entropy measured at the first RL step; absolute: nats/token
    target: float = _key(1.0, gt=0)
    target_mode: str = _key("relative", choices=("relative", "absolute"))  # relative | absolute
    # |H - target| <= band * target counts as on target (no integration there)
    band: float = _key(0.05, ge=0, lt=1)
    kp: float = _key(3.0, ge=0)  # beta per unit relative error
    ki: float = _key(1.0, ge=0)  # beta per unit relative error per step
    ema: float = _key(0.5, gt=0, le=1)  # smoothing: weight of the newest entropy measurement (1 = no smoothing)
    beta1_min: float = _key(0.0, ge=0, cross=("beta1_max",))
    beta1_max: float = _key(2.0, ge=0, cross=("beta1_min",))
    move_beta2: bool = _key(False)  # also move beta2 once beta1 is at a bound (its effect is not established)
    beta2_min: float = _key(0.5, ge=0, cross=("beta2_max",))
    beta2_max: float = _key(1.5, ge=0, cross=("beta2_min",))
    bonus_gain: float = _key(0.0, ge=0)  # entropy-bonus coefficient per unit of negative signal (0: no bonus lever)
    bonus_max: float = _key(0.05, ge=0)  # the largest entropy-bonus coefficient it may apply


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _need(where: str, ok: bool, key: str, what: str, value: Any) -> None:
    if not ok:
        raise ConfigError(f"{where}.{key} must be {what}, got {value!r}")


def _check_target(cfg: Any, where: str) -> None:
    """``target_mode`` and ``target``, shared by both controllers' configs."""
    _need(where, cfg.target_mode in ("relative", "absolute"), "target_mode", "'relative' or 'absolute'",
          cfg.target_mode)
    _need(where, _finite(cfg.target) and cfg.target > 0, "target", "a number > 0", cfg.target)


def validate_entropy_control(cfg: EntropyControlConfig, objective: str, hparams: dict[str, Any],
                             where: str = "algorithm.entropy_control") -> None:
    """Range checks (on or off), and when on, that the objective has betas the controller can move (raises
    ``ConfigError``)."""

    need, finite = functools.partial(_need, where), _finite
    _check_target(cfg, where)
    need(finite(cfg.band) and 0 <= cfg.band < 1, "band", "in [0, 1)", cfg.band)
    for key in ("kp", "ki"):
        need(finite(getattr(cfg, key)) and getattr(cfg, key) >= 0, key, "a finite number >= 0", getattr(cfg, key))
    need(finite(cfg.ema) and 0 < cfg.ema <= 1, "ema", "in (0, 1]", cfg.ema)
    for key in ("bonus_gain", "bonus_max"):
        need(finite(getattr(cfg, key)) and getattr(cfg, key) >= 0, key, "a finite number >= 0", getattr(cfg, key))
    for b in ("beta1", "beta2"):
        lo, hi = getattr(cfg, f"{b}_min"), getattr(cfg, f"{b}_max")
        need(finite(lo) and finite(hi) and 0 <= lo <= hi, f"{b}_min / {b}_max", "finite with 0 <= min <= max", (lo, hi))
    if not cfg.enabled:
        return
    if objective not in CONTROLLED_OBJECTIVES:
        raise ConfigError(f"{where}: the entropy controller steers beta1/beta2, which only {CONTROLLED_OBJECTIVES} "
                          f"have; algorithm.objective is {objective!r}")
    from cegppo.algorithm.objectives import OBJECTIVES, get_objective

    hp = {**OBJECTIVES[objective].defaults, **hparams}
    for b in ("beta1", "beta2"):
        lo, hi = getattr(cfg, f"{b}_min"), getattr(cfg, f"{b}_max")
        if b == "beta1" or cfg.move_beta2:
            need(lo <= hp[b] <= hi, f"{b}_min / {b}_max", f"around the starting {b}={hp[b]}", (lo, hi))
    try:  # the largest betas must still be valid hyperparameters (beta1 (1 - eps_low) < clip_ratio_c)
        get_objective(objective, **{**hp, "beta1": cfg.beta1_max, "beta2": cfg.beta2_max})
    except ValueError as e:
        raise ConfigError(f"{where}.beta1_max / beta2_max: {e}") from None


class EntropyController:
    """The PI rule of the module docstring. ``beta1`` / ``beta2`` are the starting (configured) values."""

    def __init__(self, cfg: EntropyControlConfig, beta1: float, beta2: float):
        self.cfg = cfg
        self.beta1_0, self.beta2_0 = float(beta1), float(beta2)
        self.integral = 0.0  # sum of relative errors outside the band (with anti-windup)
        self.smoothed: float | None = None  # EMA of the measured entropy
        self.target: float | None = cfg.target if cfg.target_mode == "absolute" else None
        self.error = 0.0
        self.beta1, self.beta2 = self.beta1_0, self.beta2_0
        self.entropy_coeff = 0.0  # the entropy bonus it applies (bonus_gain > 0)
        self.updates = 0
        self.pending = 0  # steps whose entropy was too small to set the relative target

    # the range of the control signal s: how far beta1 (then beta2) can move from where they started, and on the
    # low side how far s must go for the bonus to reach bonus_max
    def _signal_range(self) -> tuple[float, float]:
        c = self.cfg
        up, down = c.beta1_max - self.beta1_0, c.beta1_min - self.beta1_0
        if c.move_beta2:
            up, down = up + (self.beta2_0 - c.beta2_min), down - (c.beta2_max - self.beta2_0)
        if c.bonus_gain > 0:
            down = min(down, -c.bonus_max / c.bonus_gain)
        return down, up

    def update(self, entropy: float | None) -> dict[str, float]:
        """One step: new betas from this step's measured token-mean entropy (``None``/NaN: no change)."""
        c = self.cfg
        if entropy is not None and math.isfinite(entropy) and self.target is None and not c.target * entropy >= \
                MIN_ENTROPY:
            self.pending += 1  # a zero first entropy: no relative target yet, nothing changes
        elif entropy is not None and math.isfinite(entropy):
            h = float(entropy)
            self.smoothed = h if self.smoothed is None else (1 - c.ema) * self.smoothed + c.ema * h
            if self.target is None:  # relative target: a fraction of the first measured entropy
                self.target = c.target * h
            e = (self.smoothed - self.target) / self.target  # > 0: too much entropy -> raise beta1
            lo, hi = self._signal_range()
            s = c.kp * e + c.ki * self.integral
            pushing_out = (s >= hi and e > 0) or (s <= lo and e < 0)  # saturated, and the error pushes further
            if c.ki > 0 and abs(e) > c.band and not pushing_out:  # integrate outside the band only
                self.integral = min(max(self.integral + e, lo / c.ki), hi / c.ki)  # ki * I stays in [lo, hi]
            s = min(max(c.kp * e + c.ki * self.integral, lo), hi)
            self.beta1 = min(max(self.beta1_0 + s, c.beta1_min), c.beta1_max)
            if c.move_beta2:  # only what beta1 could not take, with the assumed (unestablished) opposite sign
                self.beta2 = min(max(self.beta2_0 - (self.beta1_0 + s - self.beta1), c.beta2_min), c.beta2_max)
            self.entropy_coeff = min(max(0.0, -c.bonus_gain * s), c.bonus_max)  # too little entropy: a bonus
            self.error = e
            self.updates += 1
        return {"beta1": self.beta1, "beta2": self.beta2, "entropy_coeff": self.entropy_coeff, **self.metrics()}

    def metrics(self) -> dict[str, float]:
        """The ``control/*`` metrics of the current state (target and smoothed entropy once measured)."""
        out = {"control/beta1": self.beta1, "control/beta2": self.beta2, "control/error": self.error,
               "control/integral": self.integral, "control/entropy_coeff": self.entropy_coeff}
        if self.target is not None:
            out["control/target"] = self.target
        if self.smoothed is not None:
            out["control/entropy_smoothed"] = self.smoothed
        if self.target is None and self.pending:
            out["control/target_pending"] = float(self.pending)
        return out

    def state_dict(self) -> dict[str, Any]:
        """JSON-able state (floats round-trip exactly through ``json``)."""
        return {"config": asdict(self.cfg), "beta1_0": self.beta1_0, "beta2_0": self.beta2_0,
                "integral": self.integral, "smoothed": self.smoothed, "target": self.target, "error": self.error,
                "beta1": self.beta1, "beta2": self.beta2, "entropy_coeff": self.entropy_coeff, "updates": self.updates,
                "pending": self.pending}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the dynamic state; the configuration stays this controller's (a resumed run's config wins)."""
        for key in ("beta1_0", "beta2_0", "integral", "smoothed", "target", "error", "beta1", "beta2", "updates"):
            setattr(self, key, state[key])
        self.entropy_coeff = state.get("entropy_coeff", 0.0)  # absent in states saved before the bonus lever
        self.pending = state.get("pending", 0)  # absent in states saved before the zero-entropy rule
        if self.cfg.target_mode == "absolute":
            self.target = self.cfg.target


def build_controller(cfg: EntropyControlConfig | dict | None, hparams: dict[str, Any]) -> EntropyController | None:
    """The controller ``cfg`` asks for (``None`` when absent or off), starting at the betas of the objective's
    bound hyperparameters ``hparams`` (a ``ce_gppo`` / ``gppo`` objective)."""
    if isinstance(cfg, dict):
        cfg = EntropyControlConfig(**cfg)
    if cfg is None or not cfg.enabled:
        return None
    if "beta1" not in hparams or "beta2" not in hparams:
        raise ValueError(f"entropy_control needs an objective with beta1/beta2 ({', '.join(CONTROLLED_OBJECTIVES)})")
    return EntropyController(cfg, hparams["beta1"], hparams["beta2"])


# ---------------------------------------------------------------------------------------------------------
# The incumbent: Skywork-OR1's adaptive entropy bonus (TRL's ``use_adaptive_entropy``), a baseline for the autopilot
# ---------------------------------------------------------------------------------------------------------


@dataclass
class AdaptiveEntropyConfig:
    """``algorithm.adaptive_entropy`` in the run config (off by default): Skywork-OR1's rule, with TRL 1.16's names
    (``entropy_coef`` -> ``coef_init``, ``entropy_coef_delta`` -> ``coef_delta``, ``entropy_target`` -> ``target``)."""

    enabled: bool = _key(False)
    # absolute: nats/token (TRL's entropy_target); relative: a fraction of the first step's measured entropy
    target: float = _key(0.2, gt=0)
    target_mode: str = _key("absolute", choices=("relative", "absolute"))
    coef_init: float = _key(0.0, ge=0)  # the bonus coefficient before the first step (TRL: entropy_coef)
    coef_delta: float = _key(0.005, ge=0)  # the coefficient's move per step
    coef_min: float = _key(0.0, ge=0, cross=("coef_max",))
    coef_max: float = _key(1.0, ge=0, cross=("coef_min",))


def validate_adaptive_entropy(cfg: AdaptiveEntropyConfig, autopilot: EntropyControlConfig,
                              where: str = "algorithm.adaptive_entropy") -> None:
    """Range checks (on or off); when on, the autopilot must be off (two controllers on one bonus would fight)."""
    _check_target(cfg, where)
    for key in ("coef_init", "coef_delta"):
        v = getattr(cfg, key)
        _need(where, _finite(v) and v >= 0, key, "a finite number >= 0", v)
    _need(where, _finite(cfg.coef_min) and _finite(cfg.coef_max) and 0 <= cfg.coef_min <= cfg.coef_max,
          "coef_min / coef_max", "finite with 0 <= min <= max", (cfg.coef_min, cfg.coef_max))
    if cfg.enabled and autopilot.enabled:
        raise ConfigError(f"{where}: the adaptive entropy bonus and the entropy autopilot (algorithm.entropy_control) "
                          "are two controllers of the same entropy: enable one of them")


class AdaptiveEntropyBonus:
    """Skywork-OR1's adaptive entropy bonus (He et al. 2025, as ``use_adaptive_entropy`` in TRL 1.16). Once per RL
    step, from the token-mean entropy ``H`` of the step's rollouts (measured before the updates)::

        coef  = min(coef + delta, coef_max)  if H <= target  else  max(coef - delta, coef_min)
        bonus = coef if H <= target else 0          # the loss adds -bonus * H

    The coefficient sequence is TRL's for the same entropy sequence (``tests/test_adaptive_entropy.py`` runs TRL's
    ``GRPOTrainer`` and replays its entropies here). TRL measures the entropy during the update, so it applies the
    bonus set by step t's entropy at step t + 1; the trainer measures it before the update (as for the autopilot)
    and applies it at step t. A relative target is ``target`` x the first measured entropy (one too small to set,
    :data:`MIN_ENTROPY`, leaves everything unchanged, as the autopilot's); ``None``/NaN entropies change nothing.
    """

    def __init__(self, cfg: AdaptiveEntropyConfig):
        self.cfg = cfg
        self.coef = float(cfg.coef_init)
        self.target: float | None = cfg.target if cfg.target_mode == "absolute" else None
        self.entropy_coeff = 0.0  # the bonus applied at this step
        self.updates = 0

    def update(self, entropy: float | None) -> dict[str, float]:
        """One step; returns ``entropy_coeff`` (the bonus for this step's loss) and the ``control/*`` metrics."""
        c = self.cfg
        if entropy is not None and math.isfinite(entropy):
            if self.target is None and c.target * entropy >= MIN_ENTROPY:
                self.target = c.target * float(entropy)
            if self.target is not None:
                below = entropy <= self.target
                self.coef = min(self.coef + c.coef_delta, c.coef_max) if below else \
                    max(self.coef - c.coef_delta, c.coef_min)
                self.entropy_coeff = self.coef if below else 0.0
                self.updates += 1
        return {"entropy_coeff": self.entropy_coeff, **self.metrics()}

    def metrics(self) -> dict[str, float]:
        out = {"control/entropy_coeff": self.entropy_coeff, "control/adaptive_coef": self.coef}
        if self.target is not None:
            out["control/target"] = self.target
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"config": asdict(self.cfg), "coef": self.coef, "target": self.target,
                "entropy_coeff": self.entropy_coeff, "updates": self.updates}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("coef", "target", "entropy_coeff", "updates"):
            setattr(self, key, state[key])
        if self.cfg.target_mode == "absolute":
            self.target = self.cfg.target


def build_adaptive_entropy(cfg: AdaptiveEntropyConfig | dict | None) -> AdaptiveEntropyBonus | None:
    """The adaptive bonus ``cfg`` asks for (``None`` when absent or off)."""
    if isinstance(cfg, dict):
        cfg = AdaptiveEntropyConfig(**cfg)
    return AdaptiveEntropyBonus(cfg) if cfg is not None and cfg.enabled else None
