"""Per-token log-probs and entropy from temperature-scaled logits, in row chunks.

The LM head's logits ``[N, V]`` (V = 49k for SmolLM2, 152k for Qwen) are the memory peak of an RL step.
:func:`token_stats` never holds a float32 softmax of the whole batch: each chunk of rows is upcast,
normalised, reduced to three numbers per row and dropped; the backward pass recomputes the chunk's softmax
from the saved per-row log-normaliser. Entropy is taken on the same temperature-scaled distribution that
was sampled from.

:func:`linear_token_stats` goes one step further and never holds the logits at all: it takes the hidden states
and the output layer's weight, projects one chunk of rows at a time, and recomputes each chunk's logits in the
backward pass (the idea behind Liger's fused linear cross-entropy).

Only tensors in, tensors out: running a model to get its logits or hidden states is the engine's
(:mod:`cegppo.engine.model_forward`, whose ``sequence_token_stats`` calls these two).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

DEFAULT_CHUNK_ROWS = 1024
# linear_token_stats' default chunk: as many rows as keep one float32 chunk of logits under this many elements
# (2^25 floats = 128 MiB; 512 rows at vocabulary 49,152, 128 rows at 151,936) ...
FUSED_CHUNK_ELEMENTS = 1 << 25
# ... and on a CPU 2^22 (16 MiB; 64 rows at 49,152): glibc maps each block of 32 MiB or more afresh and unmaps it when
# freed, so every chunk's logits paid a page fault per 4 KiB; under that size the heap reuses the memory. Measured on
# the step: docs/speed.md, "The LM head's chunk on a CPU".
FUSED_CHUNK_ELEMENTS_CPU = 1 << 22
# In a low-precision matmul, the weight gradient of a chunk is formed this many elements of [V, D] at a time
# before being added into the float32 sum, so no whole [V, D] temporary is made.
_GRAD_W_BLOCK_ELEMENTS = 1 << 21


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


def _bdot(a: Tensor, b: Tensor) -> Tensor:
    """Row-wise dot product of two ``[n, V]`` tensors without an ``[n, V]`` temporary."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).view(-1)


class _LinearTokenStats(torch.autograd.Function):
    """:class:`_TokenStats` of ``logits = hidden @ weight.T (+ bias)``, projected a chunk of rows at a time.

    Saves only ``hidden``, ``weight`` (, ``bias``), ``tokens`` and two floats per row; the backward pass
    recomputes each chunk's logits. Matmuls run in ``compute_dtype`` (the autocast dtype, as ``nn.Linear``
    would under autocast), the softmax in float32 (float64 when ``compute_dtype`` is float64).
    """

    @staticmethod
    def forward(ctx: Any, hidden: Tensor, weight: Tensor, bias: Tensor | None, tokens: Tensor, temperature: float,
                chunk: int, want_collision: bool, compute_dtype: torch.dtype):
        ctx.set_materialize_grads(False)  # an output that is not in the graph (often the entropy) costs nothing
        n = hidden.shape[0]
        sd = torch.promote_types(compute_dtype, torch.float32)  # softmax dtype
        log_prob = hidden.new_empty(n, dtype=sd)
        entropy = hidden.new_empty(n, dtype=sd)
        lse = hidden.new_empty(n, dtype=sd)
        collision = hidden.new_empty(n if want_collision else 0, dtype=sd)
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(compute_dtype)
            b = None if bias is None else bias.to(compute_dtype)
            for s in range(0, n, chunk):
                sl = slice(s, s + chunk)
                z = F.linear(hidden[sl].to(compute_dtype), w, b).to(sd)
                if temperature != 1.0:
                    z = z / temperature
                l = torch.logsumexp(z, -1)
                logp = z.sub_(l.unsqueeze(-1))
                p = logp.exp()
                h = -(p * logp).sum(-1)  # token_stats' reduction: the same entropy, bit for bit, from the same logits
                lse[sl] = l
                entropy[sl] = h
                log_prob[sl] = logp.gather(-1, tokens[sl].unsqueeze(-1)).squeeze(-1)
                if want_collision:  # C = sum_b p_b^2 (log p_b + H)
                    collision[sl] = _bdot(p.square_(), logp.add_(h.unsqueeze(-1)))
                del z, logp, p
        ctx.save_for_backward(hidden, weight, bias, tokens, lse, entropy)
        ctx.temperature, ctx.chunk, ctx.compute_dtype = temperature, chunk, compute_dtype
        ctx.mark_non_differentiable(collision)
        return log_prob, entropy, collision

    @staticmethod
    def backward(ctx: Any, g_logp: Tensor | None, g_ent: Tensor | None, _g_col: Tensor | None):
        hidden, weight, bias, tokens, lse, entropy = ctx.saved_tensors
        t, chunk, cd = ctx.temperature, ctx.chunk, ctx.compute_dtype
        sd = lse.dtype
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        if g_logp is None and g_ent is None:
            return (None,) * 8
        grad_h = torch.empty_like(hidden) if need_h else None
        # weight/bias gradients summed over chunks in float32 (or float64), whatever the matmul dtype
        grad_w = torch.zeros(weight.shape, dtype=sd, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=sd, device=bias.device) if need_b else None
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(cd)
            b = None if bias is None else bias.to(cd)
            for s in range(0, hidden.shape[0], chunk):
                sl = slice(s, s + chunk)
                hc = hidden[sl].to(cd)
                logp = F.linear(hc, w, b).to(sd)
                if t != 1.0:
                    logp = logp / t
                logp.sub_(lse[sl].unsqueeze(-1))
                p = logp.exp()
                # dL/dz = g_logp (onehot(a) - p) - g_ent p (log p + H)
                #       = p * (-g_ent (log p + H) - g_logp) + g_logp onehot(a)
                if g_ent is not None:
                    g = logp.add_(entropy[sl].unsqueeze(-1)).mul_(-g_ent[sl].unsqueeze(-1))
                    if g_logp is not None:
                        g.sub_(g_logp[sl].unsqueeze(-1))
                    g.mul_(p)
                else:
                    g = p.mul_(-g_logp[sl].unsqueeze(-1))
                if g_logp is not None:
                    g.scatter_add_(-1, tokens[sl].unsqueeze(-1), g_logp[sl].unsqueeze(-1))
                if t != 1.0:
                    g.div_(t)
                if grad_b is not None:
                    grad_b += g.sum(0)
                g = g.to(cd)  # the logits' gradient in the logits' dtype, as nn.Linear's backward would see it
                if grad_h is not None:
                    grad_h[sl] = g @ w
                if grad_w is not None:
                    if cd == sd:
                        grad_w.addmm_(g.T, hc)
                    else:  # a low-precision product, as nn.Linear's backward makes it, summed in float32
                        vb = max(1, _GRAD_W_BLOCK_ELEMENTS // hc.shape[1])
                        for v in range(0, grad_w.shape[0], vb):
                            grad_w[v : v + vb] += g[:, v : v + vb].T @ hc
                del logp, p, g
        if grad_w is not None:
            grad_w = grad_w.to(weight.dtype)
        if grad_b is not None:
            grad_b = grad_b.to(bias.dtype)
        return grad_h, grad_w, grad_b, None, None, None, None, None


def fused_chunk_rows(vocab: int, device_type: str = "cpu") -> int:
    """Default row chunk of :func:`linear_token_stats`: a power of two with ``rows x vocab <= FUSED_CHUNK_ELEMENTS``
    (``FUSED_CHUNK_ELEMENTS_CPU`` on a CPU)."""
    elements = FUSED_CHUNK_ELEMENTS_CPU if device_type == "cpu" else FUSED_CHUNK_ELEMENTS
    rows = max(1, elements // max(vocab, 1))
    return 1 << (rows.bit_length() - 1)


def linear_token_stats(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    tokens: Tensor,
    temperature: float = 1.0,
    chunk_rows: int | None = None,
    collision: bool = False,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """:func:`token_stats` of ``logits = hidden @ weight.T (+ bias)``, without ever holding those logits.

    ``hidden`` is ``[..., D]`` matching ``tokens`` ``[...]``; ``weight`` ``[V, D]`` (an output layer's weight,
    possibly tied to the input embeddings), ``bias`` ``[V]`` or None. Returns float32 (float64 for float64
    inputs) log-prob, entropy (and, with ``collision=True``, the no-gradient collision term) of shape
    ``tokens.shape``. Gradients flow to
    ``hidden``, ``weight`` and ``bias``. Rows are projected ``chunk_rows`` at a time (default
    :func:`fused_chunk_rows`) and re-projected in the backward pass. Under ``torch.autocast`` the matmuls run
    in the autocast dtype, as the model's ``nn.Linear`` head would, and the softmax in float32.
    """
    shape = tokens.shape
    flat = hidden.reshape(-1, hidden.shape[-1])
    dev = flat.device.type
    floats = (torch.float32, torch.float16, torch.bfloat16)
    if torch.is_autocast_enabled(dev) and flat.dtype in floats and weight.dtype in floats:
        compute_dtype = torch.get_autocast_dtype(dev)
    else:
        compute_dtype = torch.promote_types(flat.dtype, weight.dtype)
    rows = int(chunk_rows) if chunk_rows else fused_chunk_rows(weight.shape[0], weight.device.type)
    lp, ent, col = _LinearTokenStats.apply(flat, weight, bias, tokens.reshape(-1), float(temperature), rows,
                                           collision, compute_dtype)
    return lp.view(shape), ent.view(shape), (col.view(shape) if collision else None)
