"""Policy objectives: CE-GPPO and the baselines it is compared against (docs/algorithm.md, "Objectives").

An objective maps the per-token log-probs of the policy being trained, those of the policy that sampled
(``old_log_prob``), advantages and the response mask to a differentiable per-token loss ``[B, T]`` (the *negated*
objective: minimising it ascends the objective). One signature for all, as in verl's policy-loss registry::

    objective = get_objective("ce_gppo", beta1=0.75, beta2=1.0)
    per_token = objective.token_loss(log_prob, old_log_prob, advantages, mask)

A new objective is a plain function of that shape, written with ordinary autograd, added with
:func:`register_objective`. The clipped family (``ce_gppo``, ``ppo_clip``) states its gradient in closed form
instead (:func:`with_gradient`): the same numbers as the ``r / sg(r)`` autograd formulation (the tests check
both to 1e-12) in one fused multiply, measured faster by ``benchmarks/objectives.py``.

Aggregation into a scalar (:func:`aggregate`) and the full loss with its extra terms and metrics
(:func:`cegppo.algorithm.policy_loss.policy_loss`) live beside this module.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import Tensor

from cegppo.algorithm.checks import FLOAT, MASK, check_normaliser, check_tensor
from cegppo.algorithm.clipping import (ClipBounds, broadcast_advantages, clip_masks, clip_ratio, dual_clip_mask,
                                       log_ratio)

__all__ = ["AGGREGATIONS", "OBJECTIVES", "Objective", "aggregate", "ce_gppo", "check_hparams", "check_normaliser",
           "cispo", "clip_cov", "get_objective", "gspo", "kl_cov", "ppo_clip", "register_objective", "with_gradient"]


class _WithGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, log_prob: Tensor, value: Tensor, grad: Tensor) -> Tensor:
        ctx.save_for_backward(grad)
        return value

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor, None, None]:
        (grad,) = ctx.saved_tensors
        return grad_out * grad, None, None


def with_gradient(log_prob: Tensor, value: Tensor, grad: Tensor) -> Tensor:
    """A tensor equal to ``value`` whose gradient w.r.t. ``log_prob`` is ``grad`` (element-wise, worked out by hand)."""
    if not log_prob.requires_grad:
        return value
    return _WithGradient.apply(log_prob, value.detach(), grad.detach())


# ---------------------------------------------------------------------------------------------------------
# Per-token objectives: (log_prob, old_log_prob, adv, mask, **hparams) -> per-token loss [B, T], unmasked.
# ``adv`` already broadcasts to [B, T]; ``old_log_prob`` carries no gradient.
# ---------------------------------------------------------------------------------------------------------


def ce_gppo(log_prob: Tensor, old_log_prob: Tensor, adv: Tensor, mask: Tensor, *, eps_low: float = 0.2,
            eps_high: float = 0.2, beta1: float = 0.75, beta2: float = 1.0, clip_ratio_c: float | None = 10.0) -> Tensor:
    """CE-GPPO. With ``r = pi / pi_old`` and gradient weight ``F`` (d objective / d log pi = F A):

    =======================================  ==========================  =====================
    region                                   objective (= -loss)         F
    =======================================  ==========================  =====================
    A < 0, r < 1 - eps_low   (beta1 region)  beta1 (1 - eps_low) A       beta1 (1 - eps_low)
    A > 0, r > 1 + eps_high  (beta2 region)  beta2 (1 + eps_high) A      beta2 (1 + eps_high)
    A < 0, r > c             (dual clip)     c A                         0
    otherwise                                r A                         r
    =======================================  ==========================  =====================

    Out-of-clip tokens keep a bounded gradient, ``beta (1 +- eps) (r / sg(r)) A``, instead of PPO's zero.
    ``beta1 = beta2 = 0`` gives PPO-clip's gradient, ``beta1 = beta2 = 1`` GPPO.
    """
    ratio = log_ratio(log_prob.detach(), old_log_prob).exp()
    low, high = clip_masks(ratio, adv, eps_low, eps_high)
    weight = torch.where(low, beta1 * (1.0 - eps_low), torch.where(high, beta2 * (1.0 + eps_high), ratio))
    if clip_ratio_c is None:
        return with_gradient(log_prob, -adv * weight, -adv * weight)
    dual = dual_clip_mask(ratio, adv, clip_ratio_c)
    return with_gradient(log_prob, -adv * torch.where(dual, clip_ratio_c, weight), torch.where(dual, 0.0, -adv * weight))


def ppo_clip(log_prob: Tensor, old_log_prob: Tensor, adv: Tensor, mask: Tensor, *, eps_low: float = 0.2,
             eps_high: float = 0.2, clip_ratio_c: float | None = None) -> Tensor:
    """PPO's clipped surrogate ``-min(r A, clip(r, 1-eps_low, 1+eps_high) A)``, optional dual clip for A < 0.
    Out-of-clip tokens get the clipped (constant) value and no gradient. eps 0.2/0.2 = GRPO, 0.2/0.28 = DAPO."""
    ratio = log_ratio(log_prob.detach(), old_log_prob).exp()
    low, high = clip_masks(ratio, adv, eps_low, eps_high)
    value = torch.where(low, 1.0 - eps_low, torch.where(high, 1.0 + eps_high, ratio))
    grad = torch.where(low | high, 0.0, ratio)
    if clip_ratio_c is not None:
        dual = dual_clip_mask(ratio, adv, clip_ratio_c)
        value, grad = torch.where(dual, clip_ratio_c, value), torch.where(dual, 0.0, grad)
    return with_gradient(log_prob, -adv * value, -adv * grad)


def cispo(log_prob: Tensor, old_log_prob: Tensor, adv: Tensor, mask: Tensor, *, eps_low: float = 0.2,
          eps_high: float = 0.28) -> Tensor:
    """CISPO (MiniMax-M1): ``-sg(clamp(r, 1-eps_low, 1+eps_high)) A log pi``: every token keeps a gradient.
    Clamped on both sides, as verl's ``cispo`` (TRL clamps only from above)."""
    weight = log_ratio(log_prob, old_log_prob).exp().clamp(1.0 - eps_low, 1.0 + eps_high).detach()
    return -adv * weight * log_prob


def gspo(log_prob: Tensor, old_log_prob: Tensor, adv: Tensor, mask: Tensor, *, eps_low: float = 3e-4,
         eps_high: float = 4e-4) -> Tensor:
    """GSPO (Qwen): the sequence ratio ``s = exp(mean_t log r_t)`` clipped per sequence, in the token form
    ``sg(s) pi / sg(pi)``: each token of an unclipped sequence has gradient weight ``s``."""
    s = clip_ratio(log_prob.detach(), old_log_prob, mask, ClipBounds(eps_low, eps_high, sequence_level=True))
    low, high = clip_masks(s, adv, eps_low, eps_high)
    token_form = s * (log_prob - log_prob.detach()).exp()  # == s, gradient s d log pi
    return -adv * torch.where(low, 1.0 - eps_low, torch.where(high, 1.0 + eps_high, token_form))


def sapo(log_prob: Tensor, old_log_prob: Tensor, adv: Tensor, mask: Tensor, *, tau_pos: float = 1.0,
         tau_neg: float = 1.05) -> Tensor:
    """SAPO (Qwen, arXiv 2511.20347), as TRL 1.16's ``loss_type="sapo"``: a soft gate instead of the hard clip,
    ``-(4 / tau) sigmoid(tau (r - 1)) A`` with ``tau = tau_pos`` where A > 0, else ``tau_neg``: gradient weight
    ``4 r sigmoid'(tau (r - 1))``, 1 at r = 1, decaying smoothly as r leaves 1 on either side."""
    tau = torch.where(adv > 0, tau_pos, tau_neg).to(log_prob.dtype)
    ratio = log_ratio(log_prob, old_log_prob).exp()
    return -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * adv


def _masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    # verl_F.masked_mean, epsilon included; where, not a product alone, so a masked NaN stays out
    return torch.where(mask != 0, values * mask, 0.0).sum() / (mask.sum() + 1e-8)


def clip_cov(log_prob: Tensor, old_log_prob: Tensor, adv: Tensor, mask: Tensor, *, eps_low: float = 0.2,
             eps_high: float = 0.2, clip_cov_ratio: float = 2e-4, clip_cov_lb: float = 1.0,
             clip_cov_ub: float = 5.0) -> Tensor:
    """Clip-Cov (Cui et al. 2025, "The Entropy Mechanism of RL for Reasoning LMs"), as verl's ``clip_cov``.

    PPO-clip, plus: among the tokens the clip leaves alone, those whose centred covariance
    ``(A - mean A) (log pi - mean log pi)`` (means over the masked tokens of this batch) lies in
    ``(clip_cov_lb, clip_cov_ub)`` are candidates; ``max(1, int(clip_cov_ratio * n_tokens))`` of them, drawn
    at random with ``torch.randperm`` (torch's global generator, as verl), get zero loss and no gradient.
    The draw is per call: the diagnostics' re-evaluation (``gradient_weight``) draws its own subset.
    """
    ratio = log_ratio(log_prob, old_log_prob).exp()
    pg1 = -adv * ratio
    pg2 = -adv * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    valid = mask > 0
    clipped = (pg2 > pg1) & valid
    with torch.no_grad():
        cov = (adv - _masked_mean(adv, mask)) * (log_prob - _masked_mean(log_prob, mask))
        cov = cov.masked_fill(~valid | clipped, -torch.inf)
        candidates = torch.nonzero((cov < clip_cov_ub) & (cov > clip_cov_lb) & valid)
        n_clip = max(int(clip_cov_ratio * valid.sum().item()), 1)
        corr = torch.ones_like(pg1)
        if len(candidates):
            chosen = candidates[torch.randperm(len(candidates))[:n_clip]]
            corr[chosen[:, 0], chosen[:, 1]] = 0.0
    return torch.maximum(pg1, pg2) * corr


def kl_cov(log_prob: Tensor, old_log_prob: Tensor, adv: Tensor, mask: Tensor, *, kl_cov_ratio: float = 2e-4,
           ppo_kl_coef: float = 0.1) -> Tensor:
    """KL-Cov (Cui et al. 2025), as verl's ``kl_cov``: the unclipped surrogate ``-A r``, plus
    ``ppo_kl_coef * |log r|`` on the ``max(1, int(kl_cov_ratio * n_tokens))`` masked tokens of largest centred
    covariance ``(A - mean A) (log pi - mean log pi)`` (plain means over the masked tokens of this batch)."""
    lr = log_ratio(log_prob, old_log_prob)
    loss = -adv * lr.exp()
    adv = adv.expand_as(log_prob)
    valid = mask > 0
    n = int(valid.sum().item())
    if n == 0:
        return loss
    with torch.no_grad():
        a, lp = adv[valid], log_prob[valid]
        cov = (a - a.mean()) * (lp - lp.mean())
        top = torch.topk(cov, max(1, int(n * kl_cov_ratio)), largest=True).indices
        sel = torch.zeros(n, dtype=torch.bool, device=log_prob.device)
        sel[top] = True
        penalised = torch.zeros_like(valid).masked_scatter(valid, sel)
    return torch.where(penalised, loss + ppo_kl_coef * lr.abs(), loss)


# ---------------------------------------------------------------------------------------------------------
# Aggregation, with global normalisers so that micro-batch losses sum exactly to the mini-batch loss.
# ---------------------------------------------------------------------------------------------------------

AGGREGATIONS = ("token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def aggregate(loss_mat: Tensor, mask: Tensor, agg: str = "token-mean", num_tokens: float | Tensor | None = None,
              num_seqs: float | Tensor | None = None, norm_length: float | None = None) -> Tensor:
    """Reduce a per-token loss ``[B, T]`` to a scalar over ``mask`` (same shape; bool, integer or floating).

    ``token-mean`` divides by ``num_tokens`` when given (the mask sum of the whole mini-batch), else by this
    batch's mask sum; the ``seq-mean-*`` modes divide by ``num_seqs`` likewise. ``seq-mean-token-sum-norm``
    (Dr. GRPO) divides by the constant ``norm_length`` (default: padded T). Normalisers must be positive and
    finite (:func:`check_normaliser`); masked positions never contribute, even when they hold NaN or Inf.
    """
    if agg not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {agg!r}; valid: {', '.join(AGGREGATIONS)}")
    check_tensor("aggregate", "loss_mat", loss_mat, None, FLOAT)
    check_tensor("aggregate", "mask", mask, tuple(loss_mat.shape), MASK, like=loss_mat, like_name="loss_mat")
    num_tokens = check_normaliser("aggregate", "num_tokens", num_tokens)
    num_seqs = check_normaliser("aggregate", "num_seqs", num_seqs)
    norm_length = check_normaliser("aggregate", "norm_length", norm_length)
    return _aggregate(loss_mat, mask, agg, num_tokens, num_seqs, norm_length)


def _aggregate(loss_mat: Tensor, mask: Tensor, agg: str, num_tokens: float | Tensor | None = None,
               num_seqs: float | Tensor | None = None, norm_length: float | Tensor | None = None) -> Tensor:
    """:func:`aggregate` on checked arguments (policy_loss checks once per call, then reduces several terms)."""
    m = mask.to(loss_mat.dtype)
    # select, then weight: 0 * NaN is NaN, so a product alone would let a masked NaN/Inf into the sum
    masked = torch.where(m != 0, loss_mat * m, 0.0)
    if agg == "token-mean":
        return masked.sum() / (m.sum().clamp(min=1.0) if num_tokens is None else num_tokens)
    if agg == "token-sum":
        return masked.sum()
    if agg == "seq-mean-token-sum-norm":
        return masked.sum() / (max(loss_mat.shape[-1], 1) if norm_length is None else norm_length)
    seq = masked.sum(-1)
    if agg == "seq-mean-token-mean":
        seq = seq / m.sum(-1).clamp(min=1.0)
    elif agg != "seq-mean-token-sum":
        raise ValueError(f"unknown aggregation {agg!r}; valid: {', '.join(AGGREGATIONS)}")
    return seq.sum() / (max(loss_mat.shape[0], 1) if num_seqs is None else num_seqs)


# ---------------------------------------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------------------------------------

TokenLoss = Callable[..., Tensor]


@dataclass(frozen=True)
class ObjectiveSpec:
    fn: TokenLoss
    defaults: dict[str, Any]
    default_agg: str = "token-mean"
    sequence_level: bool = False  # the clip acts on a per-sequence ratio (GSPO)
    doc: str = ""


OBJECTIVES: dict[str, ObjectiveSpec] = {}


def register_objective(name: str, fn: TokenLoss, defaults: dict[str, Any], *, default_agg: str = "token-mean",
                       sequence_level: bool = False, doc: str = "") -> None:
    """Make ``fn(log_prob, old_log_prob, adv, mask, **hparams) -> per-token loss`` available as ``name``.
    ``defaults`` lists every hyperparameter; ``eps_low``/``eps_high`` (and ``clip_ratio_c``) place the clip
    regions that the diagnostics report."""
    OBJECTIVES[name] = ObjectiveSpec(fn, dict(defaults), default_agg, sequence_level, doc)


register_objective("ce_gppo", ce_gppo, dict(eps_low=0.2, eps_high=0.2, beta1=0.75, beta2=1.0, clip_ratio_c=10.0),
                   doc="CE-GPPO; defaults are the authors' 7B script")
register_objective("gppo", ce_gppo, dict(eps_low=0.2, eps_high=0.2, beta1=1.0, beta2=1.0, clip_ratio_c=10.0),
                   doc="GPPO (Klear-Reasoner) = CE-GPPO with beta1 = beta2 = 1")
register_objective("ppo_clip", ppo_clip, dict(eps_low=0.2, eps_high=0.2, clip_ratio_c=None), doc="PPO clipped surrogate")
register_objective("grpo", ppo_clip, dict(eps_low=0.2, eps_high=0.2, clip_ratio_c=None), doc="ppo_clip with eps 0.2/0.2")
register_objective("dapo", ppo_clip, dict(eps_low=0.2, eps_high=0.28, clip_ratio_c=None), doc="ppo_clip, clip-higher 0.28")
register_objective("cispo", cispo, dict(eps_low=0.2, eps_high=0.28), doc="CISPO, two-sided clamp")
register_objective("clip_cov", clip_cov, dict(eps_low=0.2, eps_high=0.2, clip_cov_ratio=2e-4, clip_cov_lb=1.0,
                                              clip_cov_ub=5.0), doc="Clip-Cov (Cui et al. 2025), verl's defaults")
register_objective("kl_cov", kl_cov, dict(kl_cov_ratio=2e-4, ppo_kl_coef=0.1),
                   doc="KL-Cov (Cui et al. 2025), verl's defaults; no clip")
# the settings of the authors' scripts (verl-recipe entropy/, 7b_clip_cov.sh and 7b_kl_cov.sh), as named presets:
# Clip-Cov there turns PPO's clip off (eps 1 / 1: r clamped to [0, 2] only) and lets the covariance clip do the work
register_objective("clip_cov_paper", clip_cov, dict(eps_low=1.0, eps_high=1.0, clip_cov_ratio=2e-4, clip_cov_lb=1.0,
                                                    clip_cov_ub=5.0),
                   doc="Clip-Cov with the authors' script settings (eps 1 / 1)")
register_objective("kl_cov_paper", kl_cov, dict(kl_cov_ratio=2e-3, ppo_kl_coef=1.0),
                   doc="KL-Cov with the authors' script settings (ratio 2e-3, coef 1)")
register_objective("gspo", gspo, dict(eps_low=3e-4, eps_high=4e-4), default_agg="seq-mean-token-mean",
                   sequence_level=True, doc="GSPO sequence-level ratio")
register_objective("sapo", sapo, dict(tau_pos=1.0, tau_neg=1.05), default_agg="seq-mean-token-mean",
                   doc="SAPO soft gate; TRL 1.16's defaults and aggregation")


OPTIONAL_HPARAMS = ("clip_ratio_c",)  # None turns the feature off


def check_hparams(name: str, hp: dict[str, Any]) -> None:
    """Raise ``ValueError`` naming the first out-of-range hyperparameter. A key that is present must hold a
    finite number (None is refused: only ``clip_ratio_c`` may be None, to turn the dual clip off)."""
    def finite(v: Any) -> bool:
        return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)

    for key in ("eps_low", "eps_high"):  # 1 is allowed: Clip-Cov's authors clip the ratio only to [0, 2]
        v = hp.get(key)
        if key in hp and not (finite(v) and 0.0 < v <= 1.0):
            raise ValueError(f"{name}: {key} must be a number in (0, 1], got {v!r}")
    for key in ("beta1", "beta2"):
        v = hp.get(key)
        if key in hp and not (finite(v) and v >= 0.0):
            raise ValueError(f"{name}: {key} must be a finite number >= 0, got {v!r}")
    for key in ("clip_cov_ratio", "kl_cov_ratio"):  # Clip-Cov / KL-Cov: share of tokens selected
        v = hp.get(key)
        if key in hp and not (finite(v) and 0.0 < v <= 1.0):
            raise ValueError(f"{name}: {key} must be a number in (0, 1], got {v!r}")
    for key in ("tau_pos", "tau_neg"):  # SAPO's gate temperatures
        v = hp.get(key)
        if key in hp and not (finite(v) and v > 0.0):
            raise ValueError(f"{name}: {key} must be a finite number > 0, got {v!r}")
    if "ppo_kl_coef" in hp and not (finite(hp["ppo_kl_coef"]) and hp["ppo_kl_coef"] >= 0.0):
        raise ValueError(f"{name}: ppo_kl_coef must be a finite number >= 0, got {hp['ppo_kl_coef']!r}")
    if "clip_cov_lb" in hp or "clip_cov_ub" in hp:
        lb, ub = hp.get("clip_cov_lb"), hp.get("clip_cov_ub")
        if not (finite(lb) and finite(ub) and lb < ub):
            raise ValueError(f"{name}: need finite clip_cov_lb < clip_cov_ub, got {lb!r}, {ub!r}")
    c = hp.get("clip_ratio_c")
    if c is not None and not (finite(c) and c > 1.0):
        raise ValueError(f"{name}: clip_ratio_c must be > 1 (or None to disable the dual clip), got {c!r}")
    # The authors apply the dual clip to every A < 0 token; it leaves the beta1 branch alone only while
    # beta1 (1 - eps_low) < c (docs/algorithm.md). Past that the two knobs would silently interfere.
    if c is not None and "beta1" in hp and hp["beta1"] * (1.0 - hp["eps_low"]) >= c:
        raise ValueError(f"{name}: beta1 * (1 - eps_low) must be below clip_ratio_c={c}, got beta1={hp['beta1']}")


@dataclass(frozen=True)
class Objective:
    """A registered objective with its hyperparameters bound. Build it with :func:`get_objective`."""

    name: str
    hparams: dict[str, Any] = field(default_factory=dict)

    @property
    def spec(self) -> ObjectiveSpec:
        return OBJECTIVES[self.name]

    @property
    def default_agg(self) -> str:
        return self.spec.default_agg

    @property
    def clip_bounds(self) -> ClipBounds:
        """Where the diagnostics place the clip regions; an objective without a clip interval (``kl_cov``) is
        reported against PPO's 0.2 / 0.2, for comparison."""
        hp = self.hparams
        return ClipBounds(hp.get("eps_low", 0.2), hp.get("eps_high", 0.2), hp.get("clip_ratio_c"),
                          self.spec.sequence_level)

    def with_betas(self, beta1: float, beta2: float) -> Objective:
        """This objective with ``beta1`` / ``beta2`` replaced (the entropy autopilot's per-step betas), checked as
        :func:`get_objective` checks them."""
        return get_objective(self.name, **{**self.hparams, "beta1": beta1, "beta2": beta2})

    def token_loss(self, log_prob: Tensor, old_log_prob: Tensor, advantages: Tensor, mask: Tensor) -> Tensor:
        """Per-token loss ``[B, T]`` (the negated objective; not masked, not aggregated), differentiable."""
        adv = broadcast_advantages(advantages, log_prob)
        return self.spec.fn(log_prob, old_log_prob.detach(), adv, mask, **self.hparams)

    def gradient_weight(self, log_prob: Tensor, old_log_prob: Tensor, advantages: Tensor, mask: Tensor) -> Tensor:
        """Per-token ``F`` with d objective / d log pi = F A (0 where A = 0), by autograd for any objective."""
        with torch.enable_grad():
            lp = log_prob.detach().requires_grad_(True)
            (grad,) = torch.autograd.grad(self.token_loss(lp, old_log_prob, advantages, mask).sum(), lp)
        adv = broadcast_advantages(advantages, log_prob)
        return torch.where(adv != 0, -grad / torch.where(adv != 0, adv, 1.0), 0.0)


def get_objective(name: str, **hyperparameters: Any) -> Objective:
    """Build an objective by name. Unknown names, unknown keywords and invalid values raise ``ValueError``."""
    if not isinstance(name, str) or name not in OBJECTIVES:
        valid = ", ".join(f"{k} ({v.doc})" for k, v in OBJECTIVES.items())
        raise ValueError(f"unknown objective {name!r}; valid objectives: {valid}")
    spec = OBJECTIVES[name]
    unknown = sorted(set(hyperparameters) - set(spec.defaults))
    if unknown:
        raise ValueError(f"{name}: unknown hyperparameter(s) {unknown}; valid: {sorted(spec.defaults)}")
    hp = {**spec.defaults, **hyperparameters}
    check_hparams(name, hp)  # the known keys, with their ranges
    # any objective's numeric hyperparameter (registered ones too) must stay a finite number; None only for an
    # off switch (clip_ratio_c)
    for key, default in spec.defaults.items():
        v = hp[key]
        if v is None and key in OPTIONAL_HPARAMS:
            continue
        if isinstance(default, numbers.Real) and not isinstance(default, bool) and not (
                isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)):
            raise ValueError(f"{name}: {key} must be a finite number (default {default!r}), got {v!r}")
    return Objective(name, hp)
