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

if TYPE_CHECKING:
    from cegppo.algorithm.objectives import Objective

QUADRANTS = ("PA_HP", "PA_LP", "NA_HP", "NA_LP")


def metric_weight(name: str, metrics: dict[str, Tensor], n_tokens: Tensor) -> Tensor:
    """Weight of one batch's value of metric ``name`` when averaging it over batches (micro-batches, processes):
    its token count, except a quadrant's mean entropy, which counts the tokens of that quadrant only."""
    if name.startswith("quadrant/") and name.endswith("/entropy"):
        return n_tokens * metrics[name.replace("/entropy", "/frac")]
    return n_tokens


def region_sums(
    log_prob: Tensor,
    old_log_prob: Tensor,
    adv: Tensor,
    mask: Tensor,
    eps_low: float,
    eps_high: float,
    clip_ratio_c: float | None,
    sequence_level: bool = False,
) -> dict[str, Tensor]:
    """Masked *sums* behind :func:`region_metrics` (pure tensor code, so it fuses under torch.compile)."""
    from cegppo.algorithm.objectives import LOG_RATIO_CLAMP, clip_masks

    m = mask.to(log_prob.dtype)
    log_ratio = (log_prob - old_log_prob).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = log_ratio.exp()
    if sequence_level:  # GSPO clips whole sequences
        seq = (log_ratio * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1.0)
        ratio = seq.exp().expand_as(log_prob)
    low, high = clip_masks(ratio, adv, eps_low, eps_high)
    dual = (adv < 0) & (ratio > clip_ratio_c) if clip_ratio_c is not None else torch.zeros_like(low)
    out = {name: (region.to(m.dtype) * m).sum()
           for name, region in (("clip/low_frac", low), ("clip/high_frac", high), ("clip/dual_frac", dual))}
    out["ppo_kl"] = (-log_ratio * m).sum()
    out["ratio/mean"] = (ratio * m).sum()
    return out


@torch.no_grad()
def region_metrics(
    objective: "Objective", log_prob: Tensor, old_log_prob: Tensor, advantages: Tensor, mask: Tensor
) -> dict[str, Tensor]:
    """Clip-region fractions, ``ppo_kl`` and mean ratio over the masked tokens."""
    from cegppo.algorithm.objectives import _broadcast_advantages

    adv = _broadcast_advantages(advantages, log_prob)
    n = mask.to(log_prob.dtype).sum().clamp(min=1.0)
    sums = region_sums(log_prob.detach(), old_log_prob, adv, mask, *objective.region_bounds)
    return {k: v / n for k, v in sums.items()}


def entropy_change_terms(
    grad_weight: Tensor, advantages: Tensor, token_prob: Tensor, entropy: Tensor, collision: Tensor
) -> Tensor:
    """Per-token first-order entropy change (ALGORITHM.md 6.2), for a unit step on the logits:

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
    from cegppo.algorithm.objectives import _broadcast_advantages

    adv = _broadcast_advantages(advantages, log_prob).expand_as(log_prob)
    m = mask.to(log_prob.dtype)
    n = m.sum().clamp(min=1.0)
    p_old = old_log_prob.exp() if token_prob is None else token_prob
    high = p_old >= prob_threshold
    dh = None
    if collision is not None:  # the expansion is around the current policy: pi(a), H and C are pi's
        F = objective.gradient_weight(log_prob, old_log_prob, advantages, mask)
        dh = entropy_change_terms(F, adv, log_prob.detach().exp(), entropy, collision) * m
    out: dict[str, Tensor] = {}
    total = torch.zeros((), dtype=log_prob.dtype, device=log_prob.device)
    for q in QUADRANTS:
        sel = ((adv > 0) if q[0] == "P" else (adv < 0)) & (high if q[3] == "H" else ~high)
        qm = sel.to(m.dtype) * m
        cnt = qm.sum()
        out[f"quadrant/{q}/frac"] = cnt / n
        out[f"quadrant/{q}/entropy"] = (entropy * qm).sum() / cnt.clamp(min=1.0)
        if dh is not None:
            out[f"quadrant/{q}/dH"] = (dh * sel.to(m.dtype)).sum() / n
            total = total + out[f"quadrant/{q}/dH"]
    if dh is not None:
        out["dH/predicted"] = total
    return out
