"""The terms of the policy loss, each a small checked function of per-token tensors
(docs/algorithm.md §5, "The full loss"). A trainer writes the full loss as one expression of them, as cegppo's does:

    loss = (policy_loss(objective, lp, old, adv, mask, reduce=reduce, token_weights=tis)[0]
            + positive_loss_coeff * correct_nll(lp, mask, correct, num_tokens=n_correct)
            + kl_coeff * kl_penalty(lp, ref, mask, reduce=reduce)
            - entropy_coeff * entropy_bonus(entropy, mask, reduce=reduce))

``reduce`` is an engine's aggregation ``(values [B, T], mask [B, T]) -> scalar``: :func:`aggregator` builds ours
(token-mean over the whole mini-batch's tokens, ...); verl and TRL pass their own. Every term treats the positions
where ``mask == 0`` as absent: their values are selected out before anything reads them (a NaN or Inf there reaches
neither the loss, nor the metrics, nor the gradient), and nothing synchronises with the host. A mask holds 0 and 1
only (bool, integer or floating): other values are refused (read on the CPU only, ``checks.check_mask_values``);
``token_weights`` and ``kl_penalty``'s ``weights`` are the place for per-token weights.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import Tensor

from cegppo.algorithm.checks import (FLOAT, MASK, REAL, check_mask_values, check_normaliser, check_number,
                                    check_tensor, describe)
from cegppo.algorithm.clipping import log_ratio
from cegppo.algorithm.diagnostics import quadrant_metrics, region_metrics
from cegppo.algorithm.objectives import AGGREGATIONS, Objective, _aggregate

Reduce = Callable[[Tensor, Tensor], Tensor]  # (per-token values [B, T], mask [B, T]) -> scalar


def aggregator(agg: str = "token-mean", *, num_tokens: float | Tensor | None = None,
               num_seqs: float | Tensor | None = None) -> Reduce:
    """The reduction ``(values, mask) -> scalar`` of aggregation ``agg`` (:data:`AGGREGATIONS`) with the global
    normalisers of the whole mini-batch (its token count, its sequence count), checked once here."""
    if agg not in AGGREGATIONS:
        raise ValueError(f"aggregator: unknown aggregation {agg!r}; valid: {', '.join(AGGREGATIONS)}")
    num_tokens = check_normaliser("aggregator", "num_tokens", num_tokens)
    num_seqs = check_normaliser("aggregator", "num_seqs", num_seqs)

    def reduce(values: Tensor, mask: Tensor) -> Tensor:
        return _aggregate(values, mask, agg, num_tokens=num_tokens, num_seqs=num_seqs)

    return reduce


def k3_kl(log_prob: Tensor, ref_log_prob: Tensor) -> Tensor:
    """Per-token k3 estimator of KL(pi || pi_ref): ``exp(d) - d - 1`` with ``d = log pi_ref - log pi`` (clamped)."""
    d = log_ratio(ref_log_prob, log_prob)
    return d.exp() - d - 1


def _keep(mask: Tensor) -> Tensor:
    return mask if mask.dtype == torch.bool else mask != 0


def _zero_masked(x: Tensor, keep: Tensor) -> Tensor:
    """``x`` with the positions outside ``keep`` set to 0 (dtype kept); the gradient there is exactly 0."""
    return torch.where(keep, x, x.new_zeros(()))


def _check(fn: str, log_prob: Tensor, mask: Tensor, *others: tuple[str, Tensor | None, object, str]) -> None:
    check_tensor(fn, "log_prob", log_prob, None, FLOAT)
    B, T = log_prob.shape
    check_tensor(fn, "mask", mask, (B, T), MASK, like=log_prob)
    check_mask_values(fn, "mask", mask)
    for name, x, shapes, kind in others:
        if x is not None:
            check_tensor(fn, name, x, (B, T) if shapes is None else shapes, kind, like=log_prob)
            if name in ZERO_ONE:
                check_mask_values(fn, name, x)


ZERO_ONE = ("gradient_mask", "correct")  # the other indicator arguments: 0/1 like the mask (weights may be any)


def _reduce_or_token_mean(fn: str, reduce: Reduce | None) -> Reduce:
    if reduce is None:
        return aggregator("token-mean")
    if not callable(reduce):
        raise ValueError(f"{fn}: reduce must be callable (values, mask) -> scalar, got {describe(reduce)}")
    return reduce


def policy_loss(objective: Objective, log_prob: Tensor, old_log_prob: Tensor, advantages: Tensor, mask: Tensor, *,
                reduce: Reduce | None = None, token_weights: Tensor | None = None,
                gradient_mask: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """The objective's term, ``reduce(token_weights * objective.token_loss(...))``, and its metrics (the clip
    regions' shares, ``ppo_kl``, the mean ratio, ``pg_loss``: token means over this batch, 0-d tensors).

    Shapes: ``log_prob``, ``old_log_prob``, ``mask``, ``token_weights`` ``[B, T]``; ``advantages`` ``[B]``,
    ``[B, 1]`` or ``[B, T]``. Nothing is broadcast: another shape, a non-floating log-prob, a complex mask, a
    mask (or ``gradient_mask``) holding values other than 0 and 1, or a tensor on another device raises
    ``ValueError`` naming the argument. ``reduce`` defaults to the objective's own aggregation over this batch
    (token-mean; GSPO: seq-mean-token-mean). ``token_weights`` (any non-negative weights) multiply the objective
    per token (truncated importance sampling, :func:`tis_weights`). ``gradient_mask`` (bool ``[B, T]``) keeps the
    gradient of the tokens where it is true and stops it elsewhere, the loss's value unchanged (ERC,
    :func:`entropy_ratio_mask`).
    """
    if not isinstance(objective, Objective):
        raise ValueError(f"policy_loss: objective must be an Objective (from get_objective), got {describe(objective)}")
    check_tensor("policy_loss", "log_prob", log_prob, None, FLOAT)
    B, T = log_prob.shape
    check_tensor("policy_loss", "old_log_prob", old_log_prob, (B, T), FLOAT, like=log_prob)
    check_tensor("policy_loss", "advantages", advantages, [(B,), (B, 1), (B, T)], REAL, like=log_prob)
    _check("policy_loss", log_prob, mask, ("token_weights", token_weights, None, MASK),
           ("gradient_mask", gradient_mask, None, MASK))
    reduce = aggregator(objective.default_agg) if reduce is None else _reduce_or_token_mean("policy_loss", reduce)
    keep = _keep(mask)
    log_prob, old_log_prob = _zero_masked(log_prob, keep), _zero_masked(old_log_prob, keep)
    advantages = _zero_masked(advantages, keep if advantages.shape == (B, T) else keep.any(-1).view(advantages.shape))
    per_token = objective.token_loss(log_prob, old_log_prob, advantages, mask)
    if token_weights is not None:
        per_token = per_token * _zero_masked(token_weights, keep)
    if gradient_mask is not None:
        per_token = torch.where(gradient_mask.bool(), per_token, per_token.detach())
    metrics = region_metrics(objective.clip_bounds, log_prob, old_log_prob, advantages, mask)
    metrics["pg_loss"] = _aggregate(per_token.detach(), mask, "token-mean")
    return reduce(per_token, mask), metrics


def correct_nll(log_prob: Tensor, mask: Tensor, correct: Tensor, *,
                num_tokens: float | Tensor | None = None) -> Tensor:
    """NLL of the fully-correct rollouts (``correct`` ``[B]``), token-mean over their tokens (``num_tokens``: the
    whole mini-batch's count of them): the authors' scripts' ``positive_loss`` (0.1 there; off in cegppo)."""
    _check("correct_nll", log_prob, mask, ("correct", correct, (log_prob.shape[0],), MASK))
    num_tokens = check_normaliser("correct_nll", "num_tokens", num_tokens)
    keep = _keep(mask)
    rows = _zero_masked(correct, keep.any(-1)).to(log_prob.dtype)
    return _aggregate(-_zero_masked(log_prob, keep), mask * rows[:, None], "token-mean", num_tokens=num_tokens)


def kl_penalty(log_prob: Tensor, ref_log_prob: Tensor | None, mask: Tensor, *, reduce: Reduce | None = None,
               weights: Tensor | None = None) -> Tensor:
    """``reduce(weights * k3(pi, pi_ref))``, the KL penalty to a frozen reference policy; 0 without one."""
    _check("kl_penalty", log_prob, mask, ("ref_log_prob", ref_log_prob, None, FLOAT), ("kl_weights", weights, None, MASK))
    if ref_log_prob is None:
        return log_prob.new_zeros(())
    keep = _keep(mask)
    kl = k3_kl(_zero_masked(log_prob, keep), _zero_masked(ref_log_prob, keep))
    return _reduce_or_token_mean("kl_penalty", reduce)(kl if weights is None else kl * _zero_masked(weights, keep), mask)


def entropy_bonus(entropy: Tensor | None, mask: Tensor, *, reduce: Reduce | None = None) -> Tensor:
    """``reduce(H)``, the policy's entropy (at the sampling temperature) to reward; 0 without it."""
    if entropy is None:
        return mask.new_zeros((), dtype=torch.float32)
    check_tensor("entropy_bonus", "mask", mask, None, MASK)
    check_mask_values("entropy_bonus", "mask", mask)
    check_tensor("entropy_bonus", "entropy", entropy, tuple(mask.shape), FLOAT, like=mask, like_name="mask")
    return _reduce_or_token_mean("entropy_bonus", reduce)(_zero_masked(entropy, _keep(mask)), mask)


def kl_metric(log_prob: Tensor, ref_log_prob: Tensor, mask: Tensor) -> Tensor:
    """``kl``: the token mean of k3(pi, pi_ref) over this batch, detached (for the logs)."""
    keep = _keep(mask)
    return _aggregate(k3_kl(_zero_masked(log_prob, keep), _zero_masked(ref_log_prob, keep)).detach(), mask, "token-mean")


def entropy_metrics(objective: Objective, log_prob: Tensor, old_log_prob: Tensor, advantages: Tensor, mask: Tensor,
                    entropy: Tensor, *, collision: Tensor | None = None,
                    prob_threshold: float = 0.5) -> dict[str, Tensor]:
    """``entropy/current`` and the per-quadrant metrics (:func:`quadrant_metrics`; with ``collision``, each
    quadrant's first-order entropy change ``dH``)."""
    check_tensor("entropy_metrics", "log_prob", log_prob, None, FLOAT)
    B, T = log_prob.shape
    check_tensor("entropy_metrics", "old_log_prob", old_log_prob, (B, T), FLOAT, like=log_prob)
    check_tensor("entropy_metrics", "advantages", advantages, [(B,), (B, 1), (B, T)], REAL, like=log_prob)
    _check("entropy_metrics", log_prob, mask, ("entropy", entropy, None, FLOAT), ("collision", collision, None, FLOAT))
    check_number("entropy_metrics", "prob_threshold", prob_threshold, low=0.0, high=1.0, what="a number in [0, 1]")
    keep = _keep(mask)
    lp, old, ent = (_zero_masked(x, keep).detach() for x in (log_prob, old_log_prob, entropy))
    adv = _zero_masked(advantages, keep if advantages.shape == (B, T) else keep.any(-1).view(advantages.shape))
    col = None if collision is None else _zero_masked(collision, keep)
    return {"entropy/current": _aggregate(ent, mask, "token-mean"),
            **quadrant_metrics(objective, lp, old, adv, mask, ent, col, prob_threshold=prob_threshold)}


def entropy_ratio_mask(entropy: Tensor, old_entropy: Tensor, mask: Tensor, low: float, high: float) -> Tensor:
    """ERC (Su et al., arXiv 2512.05591; ``Kwai-Klear/ERC``'s ``gppo_erc`` / ``grpo_erc``): the tokens whose entropy
    ratio ``(H + 1e-8) / (H_old + 1e-8)`` to the sampling policy lies strictly inside ``(low, high)`` keep their
    gradient; the rest get none (pass it as :func:`policy_loss`'s ``gradient_mask``)."""
    check_tensor("entropy_ratio_mask", "entropy", entropy, None, FLOAT)
    check_tensor("entropy_ratio_mask", "old_entropy", old_entropy, tuple(entropy.shape), FLOAT, like=entropy,
                 like_name="entropy")
    check_tensor("entropy_ratio_mask", "mask", mask, tuple(entropy.shape), MASK, like=entropy, like_name="entropy")
    check_mask_values("entropy_ratio_mask", "mask", mask)
    ratio = (entropy.detach() + 1e-8) / (old_entropy + 1e-8)
    return (ratio > low) & (ratio < high) & _keep(mask)


def tis_weights(old_log_prob: Tensor, sampled_log_prob: Tensor, cap: float) -> Tensor:
    """Truncated importance-sampling weights ``min(pi_old / pi_sampler, cap)`` per token, against the mismatch
    between the trainer's policy and the engine that sampled (vLLM's own log-probs)."""
    check_number("tis_weights", "cap", cap, low=1.0, what="a number >= 1")
    return torch.exp((old_log_prob - sampled_log_prob).clamp(max=math.log(cap)))
