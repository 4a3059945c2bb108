"""Reference formulations of the clipped objectives, written the way papers and the authors' code write them.

Not used for training. The tests check :mod:`cegppo.algorithm.objectives` against these (values and gradients), and
``benchmarks/objectives.py`` times them side by side:

- :func:`ce_gppo_masked` follows the authors' ``compute_gppo_loss_general_beta``: boolean masks scatter the
  three cases into a ``zeros_like`` tensor, with the ``(1 +- eps) / sg(r) * r`` stop-gradient factor
  (here written as ``exp(logp - sg(logp))`` so that it stays finite when ``r`` underflows).
- :func:`ce_gppo_where` is the same math with ``torch.where`` and plain autograd.
- :func:`ppo_clip_where` is verl's ``vanilla`` loss (max of the two surrogates, then the dual clip).
"""

from __future__ import annotations

import torch
from torch import Tensor

CLAMP = 20.0


def _adv(advantages: Tensor, like: Tensor) -> Tensor:
    return (advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages).expand_as(like)


def ce_gppo_masked(log_prob, old_log_prob, advantages, eps_low=0.2, eps_high=0.2, beta1=0.75, beta2=1.0, c=10.0):
    adv = _adv(advantages, log_prob)
    ratio = torch.exp((log_prob - old_log_prob).clamp(-CLAMP, CLAMP))
    unit = torch.exp(log_prob - log_prob.detach())  # == 1, gradient d log pi
    low = (adv < 0) & (ratio < 1 - eps_low)
    high = (adv > 0) & (ratio > 1 + eps_high)
    other = ~(low | high)
    loss = torch.zeros_like(log_prob)
    loss[low] = -beta1 * (1 - eps_low) * unit[low] * adv[low]
    loss[high] = -beta2 * (1 + eps_high) * unit[high] * adv[high]
    loss[other] = -ratio[other] * adv[other]
    if c is not None:
        dual = adv < 0
        loss[dual] = torch.minimum(loss[dual], -adv[dual] * c)
    return loss


def ce_gppo_where(log_prob, old_log_prob, advantages, eps_low=0.2, eps_high=0.2, beta1=0.75, beta2=1.0, c=10.0):
    adv = _adv(advantages, log_prob)
    ratio = torch.exp((log_prob - old_log_prob).clamp(-CLAMP, CLAMP))
    unit = torch.exp(log_prob - log_prob.detach())
    low = (adv < 0) & (ratio < 1 - eps_low)
    high = (adv > 0) & (ratio > 1 + eps_high)
    loss = torch.where(
        low, -beta1 * (1 - eps_low) * unit * adv, torch.where(high, -beta2 * (1 + eps_high) * unit * adv, -ratio * adv)
    )
    if c is not None:
        loss = torch.where(adv < 0, torch.minimum(loss, -adv * c), loss)
    return loss


def ppo_clip_where(log_prob, old_log_prob, advantages, eps_low=0.2, eps_high=0.2, c=None):
    adv = _adv(advantages, log_prob)
    ratio = torch.exp((log_prob - old_log_prob).clamp(-CLAMP, CLAMP))
    loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - eps_low, 1 + eps_high))
    if c is not None:
        loss = torch.where(adv < 0, torch.minimum(loss, -adv * c), loss)
    return loss


def cispo_autograd(log_prob, old_log_prob, advantages, eps_low=0.2, eps_high=0.28):
    """MiniMax-M1's CISPO as written there: -sg(clip(r)) * A * log pi."""
    adv = _adv(advantages, log_prob)
    ratio = torch.exp((log_prob - old_log_prob).clamp(-CLAMP, CLAMP))
    return -(ratio.clamp(1 - eps_low, 1 + eps_high).detach() * adv * log_prob)


def gspo_token(log_prob, old_log_prob, advantages, mask, eps_low=3e-4, eps_high=4e-4):
    """GSPO-token as in the Qwen paper and verl's ``gspo`` loss: s_i,t = sg(s_i) * pi / sg(pi), then PPO's max of
    the clipped and unclipped surrogates (no dual clip)."""
    adv = _adv(advantages, log_prob)
    log_r = (log_prob - old_log_prob).clamp(-CLAMP, CLAMP)
    m = mask.to(log_prob.dtype)
    seq = (log_r * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1.0)
    s = torch.exp(seq.detach() + log_prob - log_prob.detach())
    return torch.maximum(-adv * s, -adv * s.clamp(1 - eps_low, 1 + eps_high))


def erc_where(per_token_loss, entropy, old_entropy, mask, low=0.95, high=1.05):
    """ERC as Kwai-Klear/ERC's ``gppo_erc`` / ``grpo_erc`` write it: the entropy ratio's band keeps the gradient,
    outside it the loss is detached (value kept)."""
    entropy_ratio = (entropy + 1e-8) / (old_entropy + 1e-8)
    balanced = ((entropy_ratio > low) & (entropy_ratio < high)) & mask.bool()
    return torch.where(balanced, per_token_loss, per_token_loss.detach())
