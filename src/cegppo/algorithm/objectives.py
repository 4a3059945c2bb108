"""Policy objectives: CE-GPPO and the baselines it is compared against.

Every objective maps per-token log-probs of the current policy, the log-probs of the policy that sampled
(``old_log_prob``), advantages and a response mask to a per-token loss (the *negated* objective, so that
minimising it ascends the objective). They share one call shape, in the spirit of verl's policy-loss
registry::

    objective = get_objective("ce_gppo", beta1=0.75, beta2=1.0)
    loss, metrics = objective(log_prob, old_log_prob, advantages, mask, agg="token-mean", num_tokens=N)

Implementation note. Each clipped-surrogate objective is written as a per-token *forward value* and a
per-token *gradient weight* ``F`` (the gradient of the objective w.r.t. ``log pi`` is ``F * A``;
ALGORITHM.md section 3.2). :func:`surrogate` turns the pair into a tensor whose value is the loss and whose
backward is one multiply, so forward + backward is a handful of fused element-wise passes instead of the
``delta / sg(delta)`` autograd graph. ``reference`` keeps the authors' autograd formulation; the tests
check both agree exactly.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import Tensor


__all__ = [
    "AGGREGATIONS",
    "Objective",
    "OBJECTIVES",
    "aggregate",
    "ce_gppo",
    "cispo",
    "get_objective",
    "gspo",
    "ppo_clip",
    "surrogate",
]

# log-ratios are clamped before exp (as verl/OpenRLHF do); exp(20) ~ 5e8 is far outside any clip interval.
LOG_RATIO_CLAMP = 20.0


class _Surrogate(torch.autograd.Function):
    """``loss = value``, ``d loss / d log_prob = grad_weight`` (both precomputed in the forward pass)."""

    @staticmethod
    def forward(ctx: Any, log_prob: Tensor, value: Tensor, grad_weight: Tensor) -> Tensor:
        ctx.save_for_backward(grad_weight)
        return value

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor, None, None]:
        (grad_weight,) = ctx.saved_tensors
        if grad_out.dim() == 0 and grad_out.device.type == "cpu" and grad_out.item() == 1.0:
            # loss.backward() on the aggregated loss: hand our buffer over instead of copying it times one
            # (autograd takes it as the gradient without a copy; saves a full pass). On CPU .item() is no sync.
            return grad_weight, None, None
        return grad_out * grad_weight, None, None


def surrogate(log_prob: Tensor, value: Tensor, grad_weight: Tensor) -> Tensor:
    """A tensor equal to ``value`` whose gradient w.r.t. ``log_prob`` is ``grad_weight`` (element-wise).

    ``value`` and ``grad_weight`` must not require grad; they are treated as functions of ``log_prob``
    whose derivative has already been worked out.
    """
    if not log_prob.requires_grad:
        return value
    return _Surrogate.apply(log_prob, value.detach(), grad_weight.detach())


def _broadcast_advantages(advantages: Tensor, like: Tensor) -> Tensor:
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    if advantages.dim() != 2 or advantages.shape[0] != like.shape[0] or advantages.shape[1] not in (1, like.shape[1]):
        raise ValueError(
            f"advantages must have shape [B], [B, 1] or [B, T] with B, T = {tuple(like.shape)}; "
            f"got {tuple(advantages.shape)}"
        )
    return advantages.to(like.dtype)


# ---------------------------------------------------------------------------------------------------------
# Per-token objectives. Each returns (loss value, d loss / d log_prob), both [B, T], unmasked. Inputs are
# detached; ``advantages`` is already broadcastable to [B, T]. Objective.token_loss glues the pair to the graph.
# ---------------------------------------------------------------------------------------------------------

Terms = tuple[Tensor, Tensor]


def clip_masks(ratio: Tensor, adv: Tensor, eps_low: float, eps_high: float) -> tuple[Tensor, Tensor]:
    """The two regions PPO clips: ``low`` = A < 0 and r < 1 - eps_low (the beta1 region), ``high`` = A > 0 and
    r > 1 + eps_high (the beta2 region). ``ratio`` is per token, or GSPO's per-sequence ratio."""
    return (adv < 0) & (ratio < 1.0 - eps_low), (adv > 0) & (ratio > 1.0 + eps_high)


def clip_regions(log_prob: Tensor, old_log_prob: Tensor, adv: Tensor, eps_low: float, eps_high: float):
    """ratio = pi / pi_old (log-ratio clamped before exp), and its :func:`clip_masks`."""
    ratio = (log_prob - old_log_prob).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    return ratio, *clip_masks(ratio, adv, eps_low, eps_high)


def ce_gppo(
    log_prob: Tensor,
    old_log_prob: Tensor,
    adv: Tensor,
    mask: Tensor | None = None,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    beta1: float = 0.75,
    beta2: float = 1.0,
    clip_ratio_c: float | None = 10.0,
) -> Terms:
    """CE-GPPO per-token loss and gradient (ALGORITHM.md 3.1-3.4), with ``r = pi / pi_old``:

    =======================================  ==========================  =====================
    region                                   objective (= -loss)         gradient weight F
    =======================================  ==========================  =====================
    A < 0, r < 1 - eps_low   (beta1 region)  beta1 (1 - eps_low) A       beta1 (1 - eps_low)
    A > 0, r > 1 + eps_high  (beta2 region)  beta2 (1 + eps_high) A      beta2 (1 + eps_high)
    A < 0, r > c             (dual clip)     c A                         0
    otherwise                                r A                         r
    =======================================  ==========================  =====================

    with d objective / d log pi = F A. On the out-of-clip tokens this is ``beta (1 +- eps) (r / sg(r)) A``:
    their gradient is kept, bounded, instead of zeroed as in PPO. ``beta1 = beta2 = 0`` gives PPO-clip's
    gradient, ``beta1 = beta2 = 1`` GPPO. Value and weight coincide except under the dual clip.
    """
    ratio, low, high = clip_regions(log_prob, old_log_prob, adv, eps_low, eps_high)
    weight = torch.where(low, beta1 * (1.0 - eps_low), torch.where(high, beta2 * (1.0 + eps_high), ratio))
    if clip_ratio_c is None:
        return -adv * weight, -adv * weight
    dual = (adv < 0) & (ratio > clip_ratio_c)
    return -adv * torch.where(dual, clip_ratio_c, weight), torch.where(dual, 0.0, -adv * weight)


def ppo_clip(
    log_prob: Tensor,
    old_log_prob: Tensor,
    adv: Tensor,
    mask: Tensor | None = None,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    clip_ratio_c: float | None = None,
) -> Terms:
    """PPO clipped surrogate ``-min(r A, clip(r, 1-eps_low, 1+eps_high) A)``, optional dual clip for A < 0.

    Symmetric eps = GRPO; eps_high = 0.28 = DAPO clip-higher. Out-of-clip tokens get the clipped (constant)
    value and zero gradient.
    """
    ratio, low, high = clip_regions(log_prob, old_log_prob, adv, eps_low, eps_high)
    value = torch.where(low, 1.0 - eps_low, torch.where(high, 1.0 + eps_high, ratio))
    grad = torch.where(low | high, 0.0, ratio)
    if clip_ratio_c is not None:
        dual = (adv < 0) & (ratio > clip_ratio_c)
        value = torch.where(dual, clip_ratio_c, value)
        grad = torch.where(dual, 0.0, grad)
    return -adv * value, -adv * grad


def cispo(
    log_prob: Tensor,
    old_log_prob: Tensor,
    adv: Tensor,
    mask: Tensor | None = None,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
) -> Terms:
    """CISPO (MiniMax-M1): ``-sg(clamp(r, 1-eps_low, 1+eps_high)) * A * log pi``; every token keeps a gradient.

    The weight is clamped on both sides, as in verl's ``cispo`` (TRL clamps only from above).
    """
    weight = (log_prob - old_log_prob).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp().clamp(1.0 - eps_low, 1.0 + eps_high)
    return -adv * weight * log_prob, -adv * weight


def gspo(
    log_prob: Tensor,
    old_log_prob: Tensor,
    adv: Tensor,
    mask: Tensor,
    *,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
) -> Terms:
    """GSPO (Qwen): sequence ratio ``s_i = exp(mean_t log r_it)`` clipped at the sequence level, written in
    the token form ``sg(s_i) * pi / sg(pi)``: every token of an unclipped sequence gets gradient weight s_i.
    """
    m = mask.to(log_prob.dtype)
    seq_log_ratio = ((log_prob - old_log_prob) * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1.0)
    s = seq_log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp().expand_as(log_prob)
    low, high = clip_masks(s, adv, eps_low, eps_high)
    value = torch.where(low, 1.0 - eps_low, torch.where(high, 1.0 + eps_high, s))
    grad = torch.where(low | high, 0.0, s)
    return -adv * value, -adv * grad


# ---------------------------------------------------------------------------------------------------------
# Aggregation (ALGORITHM.md 4.1), with optional global normalisers so micro-batches sum to the mini-batch.
# ---------------------------------------------------------------------------------------------------------

AGGREGATIONS = ("token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def aggregate(
    loss_mat: Tensor,
    mask: Tensor,
    agg: str = "token-mean",
    num_tokens: float | Tensor | None = None,
    num_seqs: float | Tensor | None = None,
    norm_length: float | None = None,
) -> Tensor:
    """Reduce a per-token loss ``[B, T]`` to a scalar over ``mask``.

    ``token-mean`` divides by ``num_tokens`` when given (the mask sum of the whole mini-batch), else by this
    batch's mask sum: summing the losses of micro-batches that share ``num_tokens`` gives exactly the
    mini-batch loss and gradient. ``seq-mean-*`` modes likewise divide by ``num_seqs`` when given.
    ``seq-mean-token-sum-norm`` (Dr. GRPO) divides by the constant ``norm_length`` (default: padded T).
    """
    m = mask.to(loss_mat.dtype)
    masked = loss_mat * m
    if agg == "token-mean":
        denom = m.sum().clamp(min=1.0) if num_tokens is None else num_tokens
        return masked.sum() / denom
    if agg == "token-sum":
        return masked.sum()
    if agg == "seq-mean-token-sum-norm":
        return masked.sum() / (loss_mat.shape[-1] if norm_length is None else norm_length)
    seq = masked.sum(-1)
    if agg == "seq-mean-token-mean":
        seq = seq / m.sum(-1).clamp(min=1.0)
    elif agg != "seq-mean-token-sum":
        raise ValueError(f"unknown aggregation {agg!r}; valid: {', '.join(AGGREGATIONS)}")
    return seq.sum() / (loss_mat.shape[0] if num_seqs is None else num_seqs)


# ---------------------------------------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Spec:
    fn: Callable[..., Terms]
    defaults: dict[str, Any]
    default_agg: str = "token-mean"
    doc: str = ""
    # For the clipped-surrogate family: hyperparameters -> ((value, grad weight) in the low region,
    # (value, grad weight) in the high region), i.e. ``fn``'s table, for the fused CPU kernel (cegppo.kernels).
    region_constants: Callable[..., tuple[tuple[float, float], tuple[float, float]]] | None = None


def _ce_gppo_regions(eps_low: float, eps_high: float, beta1: float, beta2: float, **_: Any):
    return (beta1 * (1.0 - eps_low),) * 2, (beta2 * (1.0 + eps_high),) * 2


def _ppo_clip_regions(eps_low: float, eps_high: float, **_: Any):
    return (1.0 - eps_low, 0.0), (1.0 + eps_high, 0.0)


OBJECTIVES: dict[str, _Spec] = {
    "ce_gppo": _Spec(ce_gppo, dict(eps_low=0.2, eps_high=0.2, beta1=0.75, beta2=1.0, clip_ratio_c=10.0),
                     doc="CE-GPPO; defaults are the authors' 7B script", region_constants=_ce_gppo_regions),
    "gppo": _Spec(ce_gppo, dict(eps_low=0.2, eps_high=0.2, beta1=1.0, beta2=1.0, clip_ratio_c=10.0),
                  doc="GPPO (Klear-Reasoner) = CE-GPPO with beta1 = beta2 = 1", region_constants=_ce_gppo_regions),
    "ppo_clip": _Spec(ppo_clip, dict(eps_low=0.2, eps_high=0.2, clip_ratio_c=None), doc="PPO clipped surrogate",
                      region_constants=_ppo_clip_regions),
    "grpo": _Spec(ppo_clip, dict(eps_low=0.2, eps_high=0.2, clip_ratio_c=None), doc="ppo_clip with eps 0.2/0.2",
                  region_constants=_ppo_clip_regions),
    "dapo": _Spec(ppo_clip, dict(eps_low=0.2, eps_high=0.28, clip_ratio_c=None), doc="ppo_clip, clip-higher 0.28",
                  region_constants=_ppo_clip_regions),
    "cispo": _Spec(cispo, dict(eps_low=0.2, eps_high=0.28), doc="CISPO, two-sided clamp"),
    "gspo": _Spec(gspo, dict(eps_low=3e-4, eps_high=4e-4), default_agg="seq-mean-token-mean",
                  doc="GSPO sequence-level ratio"),
}


def _validate(name: str, hp: dict[str, Any]) -> None:
    for key in ("eps_low", "eps_high"):
        v = hp.get(key)
        if v is not None and not (isinstance(v, (int, float)) and 0.0 < v < 1.0):
            raise ValueError(f"{name}: {key} must be a number in (0, 1), got {v!r}")
    for key in ("beta1", "beta2"):
        v = hp.get(key)
        if v is not None and not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0.0):
            raise ValueError(f"{name}: {key} must be a finite number >= 0, got {v!r}")
    c = hp.get("clip_ratio_c")
    if c is not None and not (isinstance(c, (int, float)) and c > 1.0):
        raise ValueError(f"{name}: clip_ratio_c must be > 1 (or None to disable the dual clip), got {c!r}")
    # The authors apply the dual clip to every A < 0 token; it leaves the beta1 branch alone only while
    # beta1 (1 - eps_low) < c (ALGORITHM.md 3.4). Past that the two knobs would silently interfere.
    if c is not None and "beta1" in hp and hp["beta1"] * (1.0 - hp["eps_low"]) >= c:
        raise ValueError(f"{name}: beta1 * (1 - eps_low) must be below clip_ratio_c={c}, got beta1={hp['beta1']}")


_SCALAR_DIVISOR_AGGS = ("token-mean", "token-sum", "seq-mean-token-sum-norm")
_FUSED_CACHE: dict[tuple, Callable] = {}


def _fused_kernel(name: str, hparams: dict[str, Any]) -> Callable:
    """torch.compile'd (loss, d loss / d log_prob) of a whole masked, scalar-normalised batch: one fused pass."""
    key = (name, tuple(sorted(hparams.items())))
    if key not in _FUSED_CACHE:
        from cegppo.algorithm.diagnostics import region_sums

        fn = functools.partial(OBJECTIVES[name].fn, **hparams)
        bounds = Objective(name, hparams).region_bounds

        def kernel(lp: Tensor, old: Tensor, adv: Tensor, mask: Tensor, denom: Tensor):
            value, grad = fn(lp, old, adv, mask)
            m = mask.to(value.dtype)
            n = m.sum().clamp(min=1.0)
            metrics = {k: v / n for k, v in region_sums(lp, old, adv, m, *bounds).items()}
            return (value * m).sum() / denom, grad * m / denom, metrics

        # shapes become dynamic after the first recompile (torch.compile's default)
        _FUSED_CACHE[key] = torch.compile(kernel)
    return _FUSED_CACHE[key]


@dataclass(frozen=True)
class Objective:
    """A named objective with bound hyperparameters. Build it with :func:`get_objective`.

    ``compile=True`` fuses loss, mask, aggregation and region metrics into one pass for the aggregations with
    a scalar divisor (token-mean, token-sum, seq-mean-token-sum-norm). For the clipped family (ce_gppo, gppo,
    ppo_clip, grpo, dapo) on float32 CPU tensors that pass is a hand-written C kernel (:mod:`cegppo.kernels`,
    built once in under a second); otherwise it is a ``torch.compile`` kernel (one-off compile of several
    seconds on CPU, per input rank/dtype).
    """

    name: str
    hparams: dict[str, Any] = field(default_factory=dict)
    compile: bool = False

    @property
    def spec(self) -> _Spec:
        return OBJECTIVES[self.name]

    @property
    def default_agg(self) -> str:
        return self.spec.default_agg

    def terms(self, log_prob: Tensor, old_log_prob: Tensor, advantages: Tensor, mask: Tensor) -> Terms:
        """Per-token (loss value, d loss / d log_prob), ``[B, T]`` each, without autograd."""
        adv = _broadcast_advantages(advantages, log_prob)
        return self.spec.fn(log_prob.detach(), old_log_prob.detach(), adv, mask, **self.hparams)

    def token_loss(self, log_prob: Tensor, old_log_prob: Tensor, advantages: Tensor, mask: Tensor) -> Tensor:
        """Per-token loss ``[B, T]`` (the negated objective; not masked, not aggregated), differentiable."""
        return surrogate(log_prob, *self.terms(log_prob, old_log_prob, advantages, mask))

    def __call__(
        self,
        log_prob: Tensor,
        old_log_prob: Tensor,
        advantages: Tensor,
        mask: Tensor,
        agg: str | None = None,
        num_tokens: float | Tensor | None = None,
        num_seqs: float | Tensor | None = None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Aggregated loss and region metrics (0-d tensors; no device sync)."""
        from cegppo.algorithm.diagnostics import region_metrics  # local import: diagnostics imports this module

        agg = agg or self.default_agg
        if self.compile and agg in _SCALAR_DIVISOR_AGGS:
            loss, metrics = self._fused(log_prob, old_log_prob, advantages, mask, agg, num_tokens)
        else:
            loss = aggregate(self.token_loss(log_prob, old_log_prob, advantages, mask), mask, agg, num_tokens, num_seqs)
            metrics = region_metrics(self, log_prob, old_log_prob, advantages, mask)
        metrics["loss"] = loss.detach()
        return loss, metrics

    def _fused(
        self, log_prob: Tensor, old_log_prob: Tensor, advantages: Tensor, mask: Tensor, agg: str, num_tokens: Any
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Loss, gradient and region metrics in one pass: the C kernel (clipped family, float32 CPU) or Inductor."""
        m = mask.to(log_prob.dtype)
        if agg == "token-mean":
            denom = m.sum().clamp(min=1.0) if num_tokens is None else num_tokens
        else:
            denom = 1.0 if agg == "token-sum" else float(mask.shape[-1])
        adv = _broadcast_advantages(advantages, log_prob)
        if self._cpu_kernel_applies(log_prob):
            hp = self.hparams
            low, high = self.spec.region_constants(**hp)
            grad, stats = kernels.clip_surrogate(
                log_prob, old_log_prob, adv, m, float(denom),  # float(): a CPU read, no device sync
                eps_low=hp["eps_low"], eps_high=hp["eps_high"], low=low, high=high, clip_ratio_c=hp["clip_ratio_c"],
            )
            value, *rest = stats.unbind()
            metrics = dict(zip(kernels.STAT_NAMES[1:], rest))
        else:
            denom = torch.as_tensor(denom, dtype=log_prob.dtype, device=log_prob.device)
            kernel = _fused_kernel(self.name, self.hparams)
            value, grad, metrics = kernel(log_prob.detach(), old_log_prob.detach(), adv, m, denom)
        return surrogate(log_prob, value, grad), metrics

    def _cpu_kernel_applies(self, log_prob: Tensor) -> bool:
        """The hand-fused C kernel covers the clipped family on float32 CPU tensors (cegppo.kernels)."""
        return False

    @property
    def region_bounds(self) -> tuple[float, float, float | None, bool]:
        """(eps_low, eps_high, clip_ratio_c, sequence_level) for the region diagnostics; c None = no dual clip."""
        hp = self.hparams
        return hp["eps_low"], hp["eps_high"], hp.get("clip_ratio_c"), self.name == "gspo"

    def gradient_weight(self, log_prob: Tensor, old_log_prob: Tensor, advantages: Tensor, mask: Tensor) -> Tensor:
        """Per-token ``F`` such that d objective / d log pi = F * A (ALGORITHM.md 3.2); 0 where A = 0."""
        _, g = self.terms(log_prob, old_log_prob, advantages, mask)
        adv = _broadcast_advantages(advantages, log_prob)
        return torch.where(adv != 0, -g / torch.where(adv != 0, adv, 1.0), 0.0)


def get_objective(name: str, *, compile: bool = False, **hyperparameters: Any) -> Objective:
    """Build an objective by name. Unknown names, unknown keywords and invalid values raise ``ValueError``."""
    if name not in OBJECTIVES:
        valid = ", ".join(f"{k} ({v.doc})" for k, v in OBJECTIVES.items())
        raise ValueError(f"unknown objective {name!r}; valid objectives: {valid}")
    spec = OBJECTIVES[name]
    unknown = sorted(set(hyperparameters) - set(spec.defaults))
    if unknown:
        raise ValueError(f"{name}: unknown hyperparameter(s) {unknown}; valid: {sorted(spec.defaults)}")
    hp = {**spec.defaults, **hyperparameters}
    _validate(name, hp)
    return Objective(name, hp, compile=bool(compile))
