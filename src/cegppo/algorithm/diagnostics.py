"""Entropy diagnostics: which tokens leave the clip interval, and what each token quadrant does to entropy.

Metric names (stable; used by the trainer, the verl/TRL adapters, ``compare`` and the benchmarks):

==============================  ===========================================================================
``clip/low_frac``               fraction of response tokens in the beta1 region: A < 0 and r < 1 - eps_low
``clip/high_frac``              fraction in the beta2 region: A > 0 and r > 1 + eps_high
``clip/dual_frac``              fraction hit by the dual clip: A < 0 and r > clip_ratio_c
``ppo_kl``                      mean(log pi_old - log pi) over response tokens
``ratio/mean``                  mean importance ratio r
``quadrant/<Q>/frac``           fraction of response tokens in quadrant Q
``quadrant/<Q>/entropy``        mean entropy of the policy at the tokens of Q (0 when Q is empty)
``quadrant/<Q>/dH``             Q's first-order contribution to the entropy change (see :func:`entropy_change_terms`)
``dH/predicted``                sum of the four ``dH`` contributions
==============================  ===========================================================================

Quadrants Q in ``PA_HP, PA_LP, NA_HP, NA_LP``: sign of the advantage (positive / negative; A = 0 tokens belong
to no quadrant) x probability of the sampled token under pi_old (high: >= ``prob_threshold``, default 0.5).

All metrics are 0-d tensors; nothing here synchronises with the host.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from cegppo.algorithm.clipping import ClipBounds, broadcast_advantages, clip_masks, clip_ratio, dual_clip_mask, log_ratio

if TYPE_CHECKING:  # only for the annotation: diagnostics never imports the objectives
    from cegppo.algorithm.objectives import Objective

QUADRANTS = ("PA_HP", "PA_LP", "NA_HP", "NA_LP")


def _masked_sum(values: Tensor, m: Tensor) -> Tensor:
    """``sum(values * m)`` with the positions where ``m == 0`` selected out: a NaN/Inf there stays out (0 * NaN = NaN)."""
    return torch.where(m != 0, values * m, 0.0).sum()


def metric_weight(name: str, metrics: dict[str, Tensor], n_tokens: Tensor) -> Tensor:
    """Weight of one batch's value of metric ``name`` when averaging it over batches (micro-batches, processes):
    its token count, except a quadrant's mean entropy, which counts the tokens of that quadrant only."""
    if name.startswith("quadrant/") and name.endswith("/entropy"):
        return n_tokens * metrics[name.replace("/entropy", "/frac")]
    return n_tokens


@torch.no_grad()
def region_metrics(bounds: ClipBounds, log_prob: Tensor, old_log_prob: Tensor, advantages: Tensor,
                   mask: Tensor) -> dict[str, Tensor]:
    """Fractions of the masked tokens in each clip region, ``ppo_kl`` and the mean ratio."""
    adv = broadcast_advantages(advantages, log_prob)
    m = mask.to(log_prob.dtype)
    n = m.sum().clamp(min=1.0)
    ratio = clip_ratio(log_prob, old_log_prob, mask, bounds)
    low, high = clip_masks(ratio, adv, bounds.eps_low, bounds.eps_high)
    dual = dual_clip_mask(ratio, adv, bounds.clip_ratio_c) if bounds.clip_ratio_c is not None else torch.zeros_like(low)
    out = {name: (region.to(m.dtype) * m).sum() / n
           for name, region in (("clip/low_frac", low), ("clip/high_frac", high), ("clip/dual_frac", dual))}
    out["ppo_kl"] = _masked_sum(-log_ratio(log_prob, old_log_prob), m) / n
    out["ratio/mean"] = _masked_sum(ratio, m) / n
    return out


def entropy_change_terms(
    grad_weight: Tensor, advantages: Tensor, token_prob: Tensor, entropy: Tensor, collision: Tensor
) -> Tensor:
    """Per-token first-order entropy change (docs/algorithm.md §6.2), for a unit step on the logits:

    ``dH_t = -F_t * A_t * (pi_t * (log pi_t + H_t) - C_t)``,  ``C_t = sum_b pi_b^2 (log pi_b + H_t)``.

    Summed over a batch and divided by its token count, this predicts the entropy change of one token-mean
    gradient step of size eta = 1 on each state's logits (tabular softmax). Positive: the token raises entropy.
    """
    return -grad_weight * advantages * (token_prob * (token_prob.clamp(min=1e-30).log() + entropy) - collision)


@torch.no_grad()
def quadrant_metrics(
    objective: "Objective",
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    mask: Tensor,
    entropy: Tensor,
    collision: Tensor | None = None,
    token_prob: Tensor | None = None,
    prob_threshold: float = 0.5,
) -> dict[str, Tensor]:
    """Per-quadrant token fraction, mean entropy and first-order entropy-change contribution.

    ``entropy`` and ``collision`` (``C`` of :func:`entropy_change_terms`, from :func:`cegppo.algorithm.logprobs.token_stats`)
    describe the current policy at each response position. Quadrants use the sampled token's probability
    under pi_old, ``token_prob`` (default ``exp(old_log_prob)``). Without ``collision`` the ``dH`` metrics
    are omitted.
    """
    adv = broadcast_advantages(advantages, log_prob).expand_as(log_prob)
    m = mask.to(log_prob.dtype)
    n = m.sum().clamp(min=1.0)
    p_old = old_log_prob.exp() if token_prob is None else token_prob
    high = p_old >= prob_threshold
    dh = None
    if collision is not None:  # the expansion is around the current policy: pi(a), H and C are pi's
        F = objective.gradient_weight(log_prob, old_log_prob, advantages, mask)
        dh = torch.where(m != 0, entropy_change_terms(F, adv, log_prob.detach().exp(), entropy, collision) * m, 0.0)
    out: dict[str, Tensor] = {}
    total = torch.zeros((), dtype=log_prob.dtype, device=log_prob.device)
    for q in QUADRANTS:
        sel = ((adv > 0) if q[0] == "P" else (adv < 0)) & (high if q[3] == "H" else ~high)
        qm = sel.to(m.dtype) * m
        cnt = qm.sum()
        out[f"quadrant/{q}/frac"] = cnt / n
        out[f"quadrant/{q}/entropy"] = _masked_sum(entropy, qm) / cnt.clamp(min=1.0)
        if dh is not None:
            out[f"quadrant/{q}/dH"] = (dh * sel.to(m.dtype)).sum() / n
            total = total + out[f"quadrant/{q}/dH"]
    if dh is not None:
        out["dH/predicted"] = total
    return out


class MetricAccumulator:
    """Means of metrics over micro-batches, weighted by :func:`metric_weight`; kept as tensors until :meth:`result`."""

    def __init__(self) -> None:
        self.sums: dict[str, Tensor | float] = {}
        self.weights: dict[str, Tensor | float] = {}

    def add(self, metrics: dict[str, Tensor], n_tokens: Tensor) -> None:
        for k, v in metrics.items():
            w = metric_weight(k, metrics, n_tokens)
            self.sums[k] = self.sums.get(k, 0.0) + v.detach() * w
            self.weights[k] = self.weights.get(k, 0.0) + w

    def result(self) -> dict[str, float]:
        return {k: float(s) / float(self.weights[k]) if float(self.weights[k]) > 0 else 0.0 for k, s in self.sums.items()}
