"""Per-token log-probs and entropy from temperature-scaled logits, in row chunks.

The LM head's logits ``[N, V]`` (V = 49k for SmolLM2, 152k for Qwen) are the memory peak of an RL step.
:func:`token_stats` never holds a float32 softmax of the whole batch: each chunk of rows is upcast,
normalised, reduced to three numbers per row and dropped; the backward pass recomputes the chunk's softmax
from the saved per-row log-normaliser. Entropy is taken on the same temperature-scaled distribution that
was sampled from.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

DEFAULT_CHUNK_ROWS = 1024


class _TokenStats(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: Tensor, tokens: Tensor, temperature: float, chunk: int, want_collision: bool):
        n = logits.shape[0]
        log_prob = logits.new_empty(n, dtype=torch.float32)
        entropy = logits.new_empty(n, dtype=torch.float32)
        lse = logits.new_empty(n, dtype=torch.float32)
        collision = logits.new_empty(n if want_collision else 0, dtype=torch.float32)
        for s in range(0, n, chunk):
            z = logits[s : s + chunk].float() / temperature
            l = torch.logsumexp(z, -1)
            logp = z - l.unsqueeze(-1)
            p = logp.exp()
            h = -(p * logp).sum(-1)  # = lse - sum p z
            lse[s : s + chunk] = l
            entropy[s : s + chunk] = h
            log_prob[s : s + chunk] = logp.gather(-1, tokens[s : s + chunk].unsqueeze(-1)).squeeze(-1)
            if want_collision:  # C = sum_b p_b^2 (log p_b + H), for the first-order entropy-change diagnostic
                collision[s : s + chunk] = (p * p * (logp + h.unsqueeze(-1))).sum(-1)
        ctx.save_for_backward(logits, tokens, lse, entropy)
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.mark_non_differentiable(collision)
        return log_prob, entropy, collision

    @staticmethod
    def backward(ctx: Any, g_logp: Tensor | None, g_ent: Tensor | None, _g_col: Tensor | None):
        logits, tokens, lse, entropy = ctx.saved_tensors
        t, chunk = ctx.temperature, ctx.chunk
        grad = torch.empty_like(logits)
        for s in range(0, logits.shape[0], chunk):
            sl = slice(s, s + chunk)
            logp = logits[sl].float() / t - lse[sl].unsqueeze(-1)
            p = logp.exp()
            g = torch.zeros_like(p)
            if g_logp is not None:  # d log p_a / dz = onehot(a) - p
                gl = g_logp[sl].unsqueeze(-1)
                g = g - gl * p
                g.scatter_add_(-1, tokens[sl].unsqueeze(-1), gl)
            if g_ent is not None:  # dH / dz = -p (log p + H)
                g = g - g_ent[sl].unsqueeze(-1) * p * (logp + entropy[sl].unsqueeze(-1))
            grad[sl] = (g / t).to(grad.dtype)
        return grad, None, None, None, None


def token_stats(
    logits: Tensor,
    tokens: Tensor,
    temperature: float = 1.0,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
    collision: bool = False,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Log-prob of ``tokens`` and entropy under ``softmax(logits / temperature)``, float32, shape ``tokens.shape``.

    ``logits`` has shape ``[..., V]`` matching ``tokens``; gradients flow to ``logits`` through both the
    log-prob and the entropy. With ``collision=True`` also returns ``C = sum_b p_b^2 (log p_b + H)``
    (no gradient), used by :func:`cegppo.algorithm.diagnostics.entropy_change_terms`.
    """
    shape = tokens.shape
    flat_logits = logits.reshape(-1, logits.shape[-1])
    lp, ent, col = _TokenStats.apply(flat_logits, tokens.reshape(-1), float(temperature), int(chunk_rows), collision)
    return lp.view(shape), ent.view(shape), (col.view(shape) if collision else None)


def response_logits(model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor, response_len: int) -> Tensor:
    """Logits predicting the last ``response_len`` tokens of ``input_ids`` (prompt left-padded, response right-padded)."""
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        logits_to_keep=response_len + 1,
        use_cache=False,
    )
    return out.logits[:, :-1]


def sequence_token_stats(
    model: torch.nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    response_len: int,
    temperature: float = 1.0,
    collision: bool = False,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Per-token log-prob / entropy (/ collision) of the response part of ``input_ids``: ``[B, response_len]``."""
    logits = response_logits(model, input_ids, attention_mask, response_len)
    return token_stats(logits, input_ids[:, -response_len:], temperature, chunk_rows, collision)
