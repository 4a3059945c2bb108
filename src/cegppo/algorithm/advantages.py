"""From rewards to advantages: group advantages of responses to the same prompt, the DAPO group filter (dynamic
sampling) and overlong reward shaping."""

from __future__ import annotations

import numbers

import torch
from torch import Tensor

from cegppo.algorithm.checks import MASK, check_number, check_tensor, describe

ESTIMATORS = ("grpo", "dr_grpo", "rloo")


def group_advantages(rewards: Tensor, group_size: int, estimator: str = "grpo", eps: float = 1e-6) -> Tensor:
    """Per-response advantages ``[N]`` for ``rewards`` ``[N]`` laid out as consecutive groups of ``group_size``.

    - ``grpo``: ``(R - mean) / (std + eps)`` with the *unbiased* std, as the authors' code (``torch.std``);
      a group of one gets advantage 0 (mean = R, std := 1).
    - ``dr_grpo``: ``R - mean`` (Dr. GRPO: no std division, no difficulty bias).
    - ``rloo``: ``R - mean of the other responses`` = ``n/(n-1) (R - mean)``.

    ``rewards`` must be 1-D, real (bool counts as 0/1) and finite; ``group_size`` an integer >= 1 that divides
    N; ``eps`` finite, and > 0 for ``grpo`` (an all-equal group would be 0/0). Else ``ValueError``. Called once
    per generation batch, so reading the rewards' values (one host sync) is not on the micro-batch hot path.
    """
    if not isinstance(estimator, str) or estimator not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {estimator!r}; valid: {', '.join(ESTIMATORS)}")
    if not isinstance(rewards, Tensor) or rewards.dim() != 1:
        raise ValueError(f"group_advantages: rewards must be a 1-D tensor [N] (groups of group_size consecutive "
                         f"responses), got {describe(rewards)}")
    check_tensor("group_advantages", "rewards", rewards, (rewards.numel(),), MASK)
    if not isinstance(group_size, numbers.Integral) or isinstance(group_size, bool) or group_size < 1:
        raise ValueError(f"group_advantages: group_size must be an integer >= 1, got {describe(group_size)}")
    check_number("group_advantages", "eps", eps, low=0.0, low_open=estimator == "grpo",
                 what="a finite number > 0" if estimator == "grpo" else "a finite number >= 0")
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    bad = ~torch.isfinite(rewards.float())
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(f"group_advantages: rewards must be finite; {int(bad.sum())} of {rewards.numel()} are not "
                         f"(first: rewards[{i}] = {float(rewards[i])})")
    if group_size == 1:
        return torch.zeros_like(rewards, dtype=torch.float32)
    r = rewards.float().view(-1, group_size)
    centred = r - r.mean(-1, keepdim=True)
    if estimator == "grpo":
        adv = centred / (r.std(-1, keepdim=True) + eps)
    elif estimator == "dr_grpo":
        adv = centred
    else:
        adv = centred * group_size / (group_size - 1)
    return adv.reshape(-1)


def mixed_groups(correct: Tensor, group_size: int) -> Tensor:
    """DAPO dynamic sampling: bool ``[num_groups]``, True where the group's accuracy has non-zero variance."""
    c = correct.float().view(-1, group_size)
    return (c.max(-1).values != c.min(-1).values) | (group_size == 1)


def overlong_penalty(length: Tensor, max_new_tokens: int, buffer: int, factor: float = 1.0) -> Tensor:
    """DAPO's overlong reward shaping of responses of ``length`` tokens: ``min(-(len - (L_max - L_buf)) / L_buf *
    factor, 0)``, zero when ``buffer`` (L_buf) is 0."""
    if buffer == 0:
        return torch.zeros_like(length)
    return torch.clamp(-(length - (max_new_tokens - buffer)) / buffer * factor, max=0.0)
