"""Clip geometry shared by the objectives and the diagnostics (docs/algorithm.md §1 and §2.1-§2.2).

The importance ratio ``r = pi / pi_old`` (log-ratio clamped before ``exp``), GSPO's sequence ratio, and the regions
where PPO-style clipping acts:

- ``low``:  A < 0 and r < 1 - eps_low   (CE-GPPO's beta1 region)
- ``high``: A > 0 and r > 1 + eps_high  (CE-GPPO's beta2 region)
- ``dual``: A < 0 and r > c             (dual clip: constant loss, no gradient)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

# log-ratios are clamped before exp (as verl and OpenRLHF do); exp(20) ~ 5e8 is far outside any clip interval
LOG_RATIO_CLAMP = 20.0


@dataclass(frozen=True)
class ClipBounds:
    """Where an objective clips: ``eps_low``/``eps_high`` around 1, the dual-clip bound ``c`` (None: off), and
    whether the ratio is per sequence (GSPO) rather than per token."""

    eps_low: float
    eps_high: float
    clip_ratio_c: float | None = None
    sequence_level: bool = False


def broadcast_advantages(advantages: Tensor, like: Tensor) -> Tensor:
    """Advantages ``[B]``, ``[B, 1]`` or ``[B, T]`` as a tensor that broadcasts against ``like`` (``[B, T]``)."""
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    if advantages.dim() != 2 or advantages.shape[0] != like.shape[0] or advantages.shape[1] not in (1, like.shape[1]):
        raise ValueError(
            f"advantages must have shape [B], [B, 1] or [B, T] with B, T = {tuple(like.shape)}; "
            f"got {tuple(advantages.shape)}"
        )
    return advantages.to(like.dtype)


def log_ratio(log_prob: Tensor, old_log_prob: Tensor) -> Tensor:
    """``log pi - log pi_old``, clamped to +-LOG_RATIO_CLAMP so that ``exp`` stays finite."""
    return (log_prob - old_log_prob).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def sequence_log_ratio(log_prob: Tensor, old_log_prob: Tensor, mask: Tensor) -> Tensor:
    """GSPO's ``log s_i``: the mean token log-ratio of each sequence over its mask, ``[B, 1]``."""
    m = mask.to(log_prob.dtype)
    # where, not a product: a NaN/Inf at a masked position must not reach its sequence's ratio
    masked = torch.where(m != 0, log_ratio(log_prob, old_log_prob) * m, 0.0)
    return masked.sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1.0)


def clip_ratio(log_prob: Tensor, old_log_prob: Tensor, mask: Tensor, bounds: ClipBounds) -> Tensor:
    """The ratio the clip acts on, ``[B, T]``: per token, or the sequence ratio broadcast to its tokens."""
    if bounds.sequence_level:
        return sequence_log_ratio(log_prob, old_log_prob, mask).exp().expand_as(log_prob)
    return log_ratio(log_prob, old_log_prob).exp()


def clip_masks(ratio: Tensor, adv: Tensor, eps_low: float, eps_high: float) -> tuple[Tensor, Tensor]:
    """The two regions PPO clips: ``low`` (A < 0, r < 1 - eps_low) and ``high`` (A > 0, r > 1 + eps_high)."""
    return (adv < 0) & (ratio < 1.0 - eps_low), (adv > 0) & (ratio > 1.0 + eps_high)


def dual_clip_mask(ratio: Tensor, adv: Tensor, clip_ratio_c: float) -> Tensor:
    """Tokens the dual clip holds constant: A < 0 and r > c."""
    return (adv < 0) & (ratio > clip_ratio_c)
