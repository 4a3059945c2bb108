"""The policy loss of one (micro-)batch, with its metrics: the single assembly that cegppo's trainer, the verl
adapter and the TRL adapter all call (docs/algorithm.md, "The full loss"). Each engine only translates its own
arguments (normalisers, per-token weights, coefficients) into these.

    loss = reduce(w * objective) + kl_coeff * reduce(kl_w * k3(ref, pi)) - entropy_coeff * reduce(H)
           + positive_loss_coeff * token-mean over fully-correct rollouts of (-log pi)
"""

from __future__ import annotations

from typing import Callable

from torch import Tensor

from cegppo.algorithm.clipping import log_ratio
from cegppo.algorithm.diagnostics import quadrant_metrics, region_metrics
from cegppo.algorithm.objectives import Objective, aggregate

Reduce = Callable[[Tensor, Tensor], Tensor]  # (per-token values [B, T], mask [B, T]) -> scalar


def k3_kl(log_prob: Tensor, ref_log_prob: Tensor) -> Tensor:
    """Per-token k3 estimator of KL(pi || pi_ref): ``exp(d) - d - 1`` with ``d = log pi_ref - log pi`` (clamped)."""
    d = log_ratio(ref_log_prob, log_prob)
    return d.exp() - d - 1


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
    ``advantages`` is ``[B]``, ``[B, 1]`` or ``[B, T]``; ``correct`` is ``[B]`` bool.

    - Reduction: ``reduce(values, mask)`` when given (an engine's own aggregation), else :func:`aggregate` with
      ``agg`` (default: the objective's) and the global normalisers ``num_tokens`` / ``num_seqs``.
    - ``token_weights`` multiply the objective per token (importance-sampling corrections, masks).
    - ``entropy`` (of the temperature-scaled policy) adds the quadrant metrics, with ``collision`` their
      first-order entropy change; with ``entropy_coeff`` > 0 also an entropy bonus.
    - ``ref_log_prob`` with ``kl_coeff`` > 0 adds the k3 KL to the reference policy (times ``kl_weights``).
    - ``correct`` with ``positive_loss_coeff`` > 0 adds the NLL of fully-correct rollouts, normalised by
      ``num_correct_tokens`` (the authors' scripts; off by default in cegppo).
    """
    if reduce is None:
        agg = agg or objective.default_agg

        def reduce(values: Tensor, m: Tensor) -> Tensor:
            return aggregate(values, m, agg, num_tokens=num_tokens, num_seqs=num_seqs)

    per_token = objective.token_loss(log_prob, old_log_prob, advantages, mask)
    if token_weights is not None:
        per_token = per_token * token_weights
    loss = reduce(per_token, mask)
    metrics = region_metrics(objective.clip_bounds, log_prob, old_log_prob, advantages, mask)
    metrics["pg_loss"] = aggregate(per_token.detach(), mask, "token-mean")

    if positive_loss_coeff > 0 and correct is not None:
        nll = aggregate(-log_prob, mask * correct[:, None], "token-mean", num_tokens=num_correct_tokens)
        loss = loss + positive_loss_coeff * nll
        metrics["positive_loss"] = nll.detach()
    if kl_coeff > 0 and ref_log_prob is not None:
        kl = k3_kl(log_prob, ref_log_prob)
        loss = loss + kl_coeff * reduce(kl if kl_weights is None else kl * kl_weights, mask)
        metrics["kl"] = aggregate(kl.detach(), mask, "token-mean")
    if entropy is not None:
        metrics["entropy/current"] = aggregate(entropy.detach(), mask, "token-mean")
        metrics.update(quadrant_metrics(objective, log_prob.detach(), old_log_prob, advantages, mask, entropy.detach(),
                                        collision, prob_threshold=prob_threshold))
        if entropy_coeff > 0:
            loss = loss - entropy_coeff * reduce(entropy, mask)
    return loss, metrics
