"""The policy loss of one (micro-)batch, with its metrics: the single assembly that cegppo's trainer, the verl
adapter and the TRL adapter all call (docs/algorithm.md §5, "The full loss"). Each engine only translates its own
arguments (normalisers, per-token weights, coefficients) into these.

    loss = reduce(w * objective)                                             # policy_term
           + positive_loss_coeff * token-mean over fully-correct rollouts of (-log pi)   # correct_nll
           + kl_coeff * reduce(kl_w * k3(ref, pi))                                # kl_term
           - entropy_coeff * reduce(H)                                            # entropy_term
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from cegppo.algorithm.checks import FLOAT, MASK, REAL, check_normaliser, check_number, check_tensor, describe
from cegppo.algorithm.clipping import log_ratio
from cegppo.algorithm.diagnostics import quadrant_metrics, region_metrics
from cegppo.algorithm.objectives import AGGREGATIONS, Objective, _aggregate

Reduce = Callable[[Tensor, Tensor], Tensor]  # (per-token values [B, T], mask [B, T]) -> scalar


def k3_kl(log_prob: Tensor, ref_log_prob: Tensor) -> Tensor:
    """Per-token k3 estimator of KL(pi || pi_ref): ``exp(d) - d - 1`` with ``d = log pi_ref - log pi`` (clamped)."""
    d = log_ratio(ref_log_prob, log_prob)
    return d.exp() - d - 1


def _zero_masked(x: Tensor, keep: Tensor) -> Tensor:
    """``x`` with the positions outside ``keep`` set to 0 (dtype kept); the gradient there is exactly 0."""
    return torch.where(keep, x, x.new_zeros(()))


def policy_loss(
    objective: Objective,
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    agg: str | None = None,
    num_tokens: float | Tensor | None = None,
    num_seqs: float | Tensor | None = None,
    reduce: Reduce | None = None,
    token_weights: Tensor | None = None,
    entropy: Tensor | None = None,
    collision: Tensor | None = None,
    entropy_coeff: float = 0.0,
    ref_log_prob: Tensor | None = None,
    kl_coeff: float = 0.0,
    kl_weights: Tensor | None = None,
    correct: Tensor | None = None,
    positive_loss_coeff: float = 0.0,
    num_correct_tokens: float | Tensor | None = None,
    prob_threshold: float = 0.5,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Scalar loss and 0-d metric tensors (token means over this batch; nothing synchronises with the host).

    Shapes: ``log_prob``, ``old_log_prob``, ``mask`` and the optional per-token tensors are ``[B, T]``;
    ``advantages`` is ``[B]``, ``[B, 1]`` or ``[B, T]``; ``correct`` is ``[B]`` bool. Nothing is broadcast: any
    other shape, a non-floating ``log_prob``/``old_log_prob``/``entropy``/``collision``/``ref_log_prob``, a
    complex mask, a tensor on another device, a normaliser that is not positive and finite or a non-finite
    coefficient raises ``ValueError`` naming the argument (:mod:`cegppo.algorithm.checks`). Masked positions
    (``mask == 0``) never contribute to the loss, its gradient or the metrics, even when they hold NaN or Inf.

    - Reduction: ``reduce(values, mask)`` when given (an engine's own aggregation), else :func:`aggregate` with
      ``agg`` (default: the objective's) and the global normalisers ``num_tokens`` / ``num_seqs``.
    - ``token_weights`` multiply the objective per token (importance-sampling corrections, masks).
    - ``entropy`` (of the temperature-scaled policy) adds the quadrant metrics, with ``collision`` their
      first-order entropy change; with ``entropy_coeff`` > 0 also an entropy bonus.
    - ``ref_log_prob`` with ``kl_coeff`` > 0 adds the k3 KL to the reference policy (times ``kl_weights``).
    - ``correct`` with ``positive_loss_coeff`` > 0 adds the NLL of fully-correct rollouts, normalised by
      ``num_correct_tokens`` (the authors' scripts; off by default in cegppo).
    """
    if not isinstance(objective, Objective):
        raise ValueError(f"policy_loss: objective must be an Objective (from get_objective), got {describe(objective)}")
    check_tensor("policy_loss", "log_prob", log_prob, None, FLOAT)
    B, T = log_prob.shape
    for name, x, shapes, kind in (
        ("old_log_prob", old_log_prob, (B, T), FLOAT), ("advantages", advantages, [(B,), (B, 1), (B, T)], REAL),
        ("mask", mask, (B, T), MASK), ("token_weights", token_weights, (B, T), MASK), ("entropy", entropy, (B, T), FLOAT),
        ("collision", collision, (B, T), FLOAT), ("ref_log_prob", ref_log_prob, (B, T), FLOAT),
        ("kl_weights", kl_weights, (B, T), MASK), ("correct", correct, (B,), MASK),
    ):
        if x is not None or name in ("old_log_prob", "advantages", "mask"):
            check_tensor("policy_loss", name, x, shapes, kind, like=log_prob)
    for name, v in (("entropy_coeff", entropy_coeff), ("kl_coeff", kl_coeff), ("positive_loss_coeff", positive_loss_coeff)):
        if not isinstance(v, Tensor):  # a tensor coefficient is the caller's (reading it would sync)
            check_number("policy_loss", name, v)
    check_number("policy_loss", "prob_threshold", prob_threshold, low=0.0, high=1.0, what="a number in [0, 1]")
    num_tokens = check_normaliser("policy_loss", "num_tokens", num_tokens)
    num_seqs = check_normaliser("policy_loss", "num_seqs", num_seqs)
    num_correct_tokens = check_normaliser("policy_loss", "num_correct_tokens", num_correct_tokens)
    if reduce is None:
        agg = agg or objective.default_agg
        if agg not in AGGREGATIONS:
            raise ValueError(f"policy_loss: unknown aggregation {agg!r}; valid: {', '.join(AGGREGATIONS)}")

        def reduce(values: Tensor, m: Tensor) -> Tensor:
            return _aggregate(values, m, agg, num_tokens=num_tokens, num_seqs=num_seqs)
    elif not callable(reduce):
        raise ValueError(f"policy_loss: reduce must be callable (values, mask) -> scalar, got {describe(reduce)}")

    # Masked positions are replaced by 0 (selected, not multiplied: 0 * NaN is NaN) before anything reads them,
    # so a NaN/Inf there reaches neither the loss, nor the metrics, nor (through where's backward) the gradient.
    keep = mask if mask.dtype == torch.bool else mask != 0
    row_keep = keep.any(-1)
    log_prob, old_log_prob = _zero_masked(log_prob, keep), _zero_masked(old_log_prob, keep)
    advantages = _zero_masked(advantages, keep if advantages.shape == (B, T) else row_keep.view(advantages.shape))
    token_weights, entropy, collision, ref_log_prob, kl_weights = (
        None if x is None else _zero_masked(x, keep) for x in (token_weights, entropy, collision, ref_log_prob, kl_weights))
    correct = None if correct is None else _zero_masked(correct, row_keep)

    # Each term is a scalar (0.0 where its coefficient is 0 or its input is absent); the loss is their sum, below.
    per_token = objective.token_loss(log_prob, old_log_prob, advantages, mask)
    if token_weights is not None:
        per_token = per_token * token_weights
    policy_term = reduce(per_token, mask)
    metrics = region_metrics(objective.clip_bounds, log_prob, old_log_prob, advantages, mask)
    metrics["pg_loss"] = _aggregate(per_token.detach(), mask, "token-mean")

    correct_nll = kl_term = entropy_term = 0.0
    if positive_loss_coeff > 0 and correct is not None:
        correct_nll = _aggregate(-log_prob, mask * correct[:, None], "token-mean", num_tokens=num_correct_tokens)
        metrics["positive_loss"] = correct_nll.detach()
    if kl_coeff > 0 and ref_log_prob is not None:
        kl = k3_kl(log_prob, ref_log_prob)
        kl_term = reduce(kl if kl_weights is None else kl * kl_weights, mask)
        metrics["kl"] = _aggregate(kl.detach(), mask, "token-mean")
    if entropy is not None:
        metrics["entropy/current"] = _aggregate(entropy.detach(), mask, "token-mean")
        metrics.update(quadrant_metrics(objective, log_prob.detach(), old_log_prob, advantages, mask, entropy.detach(),
                                        collision, prob_threshold=prob_threshold))
        if entropy_coeff > 0:
            entropy_term = reduce(entropy, mask)

    loss = policy_term + positive_loss_coeff * correct_nll + kl_coeff * kl_term - entropy_coeff * entropy_term
    return loss, metrics
