"""A step's training data and how the update walks it: :class:`Experience` (rollouts + rewards + advantages +
log-probs), micro-batches of similar length under a row and token budget, and the per-token statistics of a
micro-batch computed on only the columns its rows use."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor

from cegppo.algorithm.policy_loss import tis_weights
from cegppo.engine.model_forward import sequence_token_stats
from cegppo.engine.precision import autocast
from cegppo.engine.rollout import RolloutBatch


def entropy_sum(entropy: Tensor, mask: Tensor) -> Tensor:
    """``[sum of entropy over response tokens, tokens]``: summed over micro-batches, then divided once."""
    return torch.stack([(entropy * mask).sum(), mask.sum()])


def entropy_mean(stats: Tensor) -> float:
    """The token-mean entropy of :func:`entropy_sum` totals (0 when there were no tokens)."""
    return float(stats[0] / stats[1].clamp(min=1))


@dataclass
class Experience:
    """One step's training data: rollouts plus what the update needs, all ``[B, ...]`` tensors."""

    rollouts: RolloutBatch
    rewards: Tensor  # [B]
    correct: Tensor  # [B] bool
    advantages: Tensor  # [B]
    in_loss: Tensor | None = None  # [B] bool: the rows the loss sees (algorithm.overlong_filter); None: all
    old_log_prob: Tensor | None = None  # [B, T]
    old_entropy: Tensor | None = None  # [B, T], the sampling policy's (ERC's entropy ratio)
    ref_log_prob: Tensor | None = None  # [B, T]

    @property
    def mask(self) -> Tensor:
        """Every response token (what the rollout metrics and the entropy measure)."""
        return self.rollouts.response_mask.float()

    @property
    def loss_mask(self) -> Tensor:
        """The response tokens the loss sees: all of them, or those of the rows ``in_loss`` keeps."""
        return self.mask if self.in_loss is None else self.mask * self.in_loss[:, None]

    def to(self, device: torch.device | str) -> Experience:
        """The step's data on the trainer's device (before any log-probs are filled in)."""
        return Experience(self.rollouts.to(device), self.rewards.to(device), self.correct.to(device),
                          self.advantages.to(device), None if self.in_loss is None else self.in_loss.to(device))

    @staticmethod
    def concat(parts: list[Experience], pad_token_id: int) -> Experience:
        """Several generation rounds' kept rows as one batch (before any log-probs are filled in)."""
        if len(parts) == 1:
            return parts[0]
        in_loss = None if parts[0].in_loss is None else torch.cat([e.in_loss for e in parts])
        return Experience(RolloutBatch.concat([e.rollouts for e in parts], pad_token_id),
                          *(torch.cat([getattr(e, f) for e in parts]) for f in ("rewards", "correct", "advantages")),
                          in_loss)


@torch.no_grad()
def fill_old_log_probs(exp: Experience, skip: Tensor, model: torch.nn.Module, ref_model: torch.nn.Module | None,
                       token_stats: Callable, micro_batches: Callable, heartbeat: Callable[[str], None]) -> Tensor:
    """Fill ``exp.old_log_prob`` and ``old_entropy`` (and ``ref_log_prob`` under ``ref_model``) in micro-batches,
    except for the rows ``skip``; returns ``[sum of entropy, tokens]`` over the rows it covered."""
    B, T = exp.rollouts.response_mask.shape
    device = exp.rollouts.response_mask.device
    skipped = set(skip.tolist())
    todo = torch.tensor([i for i in range(B) if i not in skipped], dtype=torch.long)
    exp.old_log_prob, exp.old_entropy = torch.zeros(B, T, device=device), torch.zeros(B, T, device=device)
    entropy = torch.zeros(2, device=device)
    done = 0
    for rows in micro_batches(exp.rollouts, todo):
        heartbeat(f"{done}/{len(todo)} sequences")
        done += len(rows)
        lp, ent, _ = token_stats(model, exp.rollouts, rows)
        exp.old_log_prob[rows], exp.old_entropy[rows] = lp, ent
        entropy += entropy_sum(ent, exp.mask[rows])
    exp.ref_log_prob = None if ref_model is None else torch.zeros(B, T, device=device)
    for rows in micro_batches(exp.rollouts, torch.arange(B)) if ref_model is not None else []:
        exp.ref_log_prob[rows] = token_stats(ref_model, exp.rollouts, rows)[0]
    return entropy


def sampler_correction(exp: Experience, rows: Tensor, tis_cap: float, acc: Any) -> Tensor | None:
    """With a generator that reports its sampling log-probs (vLLM): add ``rollout/logp_diff`` (mean |log pi_old -
    log pi_sampler|) to ``acc`` and, with ``tis_cap`` > 0, return these rows' truncated importance weights
    (:func:`cegppo.algorithm.policy_loss.tis_weights`); else None."""
    sampled = exp.rollouts.sampled_log_prob
    if sampled is None:
        return None
    m, diff = exp.mask[rows], exp.old_log_prob[rows] - sampled[rows]
    acc.add({"rollout/logp_diff": (diff.abs() * m).sum() / m.sum().clamp(min=1)}, m.sum())
    return tis_weights(exp.old_log_prob[rows], sampled[rows], tis_cap) if tis_cap > 0 else None


def micro_batches(rb: RolloutBatch, rows: Tensor, max_rows: int, max_tokens: int = 0) -> list[Tensor]:
    """``rows`` in micro-batches of similar length (longest first), so that little padding is computed on: at
    most ``max_rows`` rows and, with ``max_tokens`` > 0, at most that many tokens in the forward pass (rows x the
    columns :func:`column_token_stats` keeps), which bounds the activations kept for backward."""
    prompt_len, response_len = rb.lengths
    out: list[list[int]] = []
    wp = wr = 0  # the current micro-batch's columns: its longest prompt + its longest response
    for i in sorted(rows.tolist(), key=lambda i: -(prompt_len[i] + response_len[i])):
        p, r = max(wp, prompt_len[i]), max(wr, response_len[i], 1)
        if out and len(out[-1]) < max_rows and not (max_tokens and (len(out[-1]) + 1) * (p + r) > max_tokens):
            out[-1].append(i)
            wp, wr = p, r
        else:  # a new micro-batch (at least one row, however long)
            out.append([i])
            wp, wr = prompt_len[i], max(response_len[i], 1)
    return [torch.tensor(mb, dtype=torch.long) for mb in out]


def column_token_stats(model: torch.nn.Module, rb: RolloutBatch, rows: Tensor, temperature: float, precision: str,
                       fused_head: bool, collision: bool = False) -> tuple[Tensor, Tensor, Tensor | None]:
    """Per-token log-prob, entropy (and collision term) of ``rows`` under ``model``, at the sampling temperature:
    ``[len(rows), T]``. The forward pass sees only the columns these rows use (from their longest prompt to
    their longest response); the response positions past that are zero."""
    prompt_len, response_len = rb.lengths
    idx = rows.tolist()
    width = rb.input_ids.shape[1] - rb.response_len  # the batch's prompt width (prompts are left-padded)
    first = width - max(prompt_len[i] for i in idx)
    keep = max(1, max(response_len[i] for i in idx))
    with autocast(precision, model):
        out = sequence_token_stats(model, rb.input_ids[rows, first : width + keep],
                                   rb.attention_mask[rows, first : width + keep], keep, temperature, collision,
                                   fused_head=fused_head)
    return tuple(x if x is None else torch.nn.functional.pad(x, (0, rb.response_len - keep)) for x in out)
