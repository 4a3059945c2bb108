"""The responses to one prompt, computed with the prompt once.

GRPO samples n responses per prompt, and a padded row per response makes the update's forward and backward passes
(and the old-log-prob pass) run each prompt n times: with the quickstart's short answers, half of the tokens computed
are prompt copies. A *pack* holds the prompt's tokens once, then several of its responses one after another (the
idea of PrefixGrouper, 2025). A 4-D attention mask lets each response token see the prompt and the earlier tokens of
its own response, nothing else, and its position ids continue from the prompt as in its own row. Every response
token so has the context and positions it has in its padded row, and its log-prob and entropy are the same function
of the weights; the gradient through the shared prompt is the sum of the responses' gradients, which is what the
padded rows sum to. ``tests/test_prompt_sharing.py`` checks log-probs, entropies and gradients against
:func:`cegppo.engine.batching.column_token_stats`.

Attention over a pack is quadratic in its length, so a pack holds at most ``train.shared_prompt_tokens`` tokens: a
response that would pass it starts a new pack with the prompt again. With long responses that leaves one response
per pack, which costs what the padded row costs (without its padding).

Only model types known to take a custom 4-D mask and explicit position ids as given (full attention in every layer)
are packed; the others run the padded rows (:func:`prompt_sharing_supported`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from cegppo.algorithm.logprobs import DEFAULT_CHUNK_ROWS, linear_token_stats, token_stats
from cegppo.engine.model_forward import fused_head_supported, output_layer
from cegppo.engine.precision import autocast
from cegppo.engine.rollout import RolloutBatch

SHARED_PROMPT_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3"})
_MASKS = {"sdpa": "bool", "eager": "additive"}  # attention implementations whose mask we can write


def prompt_sharing_supported(model: torch.nn.Module) -> bool:
    """Whether :func:`shared_prompt_token_stats` can run on ``model``: a Llama-like decoder with full attention in
    every layer, an output layer the fused head can use (:func:`fused_head_supported`), and the ``sdpa`` or
    ``eager`` attention implementation."""
    cfg = getattr(model, "config", None)
    if getattr(cfg, "model_type", None) not in SHARED_PROMPT_MODEL_TYPES:
        return False
    if getattr(cfg, "_attn_implementation", None) not in _MASKS:
        return False
    if any(t != "full_attention" for t in getattr(cfg, "layer_types", None) or ()):
        return False
    return fused_head_supported(model)


@dataclass(frozen=True)
class Pack:
    """One prompt (that of row ``rows[0]``) followed by the responses of ``rows``: ``length`` tokens."""

    rows: tuple[int, ...]
    length: int


def packs(rb: RolloutBatch, rows: list[int], max_tokens: int, max_rows: int = 0) -> list[Pack]:
    """``rows`` grouped by prompt (in order of first appearance), each group cut greedily into packs of at most
    ``max_tokens`` tokens and (``max_rows`` > 0) responses; a pack takes at least one response, however long.

    A response of r tokens adds r - 1 to its pack: its first token is predicted from the prompt's last position and
    its last token predicts nothing."""
    prompt_len, response_len = rb.lengths
    group_of = rb.prompt_group
    groups: dict[int, list[int]] = {}
    for i in rows:
        groups.setdefault(group_of[i], []).append(i)
    out: list[Pack] = []
    for members in groups.values():
        start = prompt_len[members[0]]
        cur: list[int] = []
        length = start
        for i in members:
            add = max(response_len[i], 1) - 1
            if cur and (length + add > max_tokens or (max_rows and len(cur) >= max_rows)):
                out.append(Pack(tuple(cur), length))
                cur, length = [], start
            cur.append(i)
            length += add
        out.append(Pack(tuple(cur), length))
    return out


def shared_prompt_micro_batches(rb: RolloutBatch, rows: Tensor, max_rows: int, max_tokens: int,
                                pack_tokens: int) -> list[Tensor]:
    """``rows`` in micro-batches of whole packs (longest first): at most ``max_rows`` responses and, with
    ``max_tokens`` > 0, at most that many tokens in the forward pass (packs x the longest pack).

    A micro-batch holds at most one pack of each prompt, so that :func:`packs` of its rows (what
    :func:`shared_prompt_token_stats` computes on) gives back exactly its packs: two packs of one prompt would be
    re-cut, and the token budget checked here would no longer be the one computed."""
    units = sorted(packs(rb, rows.tolist(), pack_tokens, max_rows), key=lambda p: -p.length)
    group_of = rb.prompt_group
    out: list[list[Pack]] = []
    for p in units:
        last = out[-1] if out else None
        if (last and sum(len(q.rows) for q in last) + len(p.rows) <= max_rows
                and all(group_of[q.rows[0]] != group_of[p.rows[0]] for q in last)
                and not (max_tokens and (len(last) + 1) * last[0].length > max_tokens)):
            last.append(p)
        else:
            out.append([p])
    return [torch.tensor([i for p in mb for i in p.rows], dtype=torch.long) for mb in out]


def _attention_mask(segment: Tensor, kind: str, dtype: torch.dtype) -> Tensor:
    """``[n, 1, L, L]``: query q sees key k <= q of the prompt (segment 0) or of its own response; padding
    (segment -1) sees only itself, so that no row of the softmax is empty."""
    L = segment.shape[1]
    q, k = segment[:, :, None], segment[:, None, :]
    causal = torch.ones(L, L, dtype=torch.bool, device=segment.device).tril()
    allowed = causal & (k >= 0) & ((k == 0) | (k == q))
    allowed |= torch.eye(L, dtype=torch.bool, device=segment.device)
    if kind == "bool":
        return allowed[:, None]
    return torch.zeros(allowed.shape, dtype=dtype, device=segment.device).masked_fill_(
        ~allowed, torch.finfo(dtype).min)[:, None]


def shared_prompt_token_stats(model: torch.nn.Module, rb: RolloutBatch, rows: Tensor, temperature: float,
                              precision: str, fused_head: bool, pack_tokens: int,
                              collision: bool = False) -> tuple[Tensor, Tensor, Tensor | None]:
    """:func:`cegppo.engine.batching.column_token_stats` of ``rows`` (``[len(rows), T]``; zero past each response),
    computed on :func:`packs` of at most ``pack_tokens`` tokens."""
    prompt_len, response_len = rb.lengths
    width = rb.input_ids.shape[1] - rb.response_len  # the batch's prompt width (prompts are left-padded)
    idx = rows.tolist()
    plan = packs(rb, idx, pack_tokens)
    n, L, T = len(plan), max(p.length for p in plan), rb.response_len
    device, host_ids = rb.input_ids.device, rb.input_ids.cpu()  # the packs are laid out on the host, then moved
    ids = torch.zeros(n, L, dtype=torch.long)
    positions = torch.zeros(n, L, dtype=torch.long)
    segment = torch.full((n, L), -1, dtype=torch.long)
    source: list[Tensor] = []  # per response: the flat pack positions whose hidden states predict its tokens
    token: list[Tensor] = []  # per response: its tokens' flat positions in the batch's [B * T] responses
    target: list[Tensor] = []  # per response: where its tokens' statistics go in the flat [len(rows) * T] output
    out_row = {i: r for r, i in enumerate(idx)}
    for k, pack in enumerate(plan):
        P = prompt_len[pack.rows[0]]
        ids[k, :P] = host_ids[pack.rows[0], width - P : width]
        positions[k, :P] = torch.arange(P)
        segment[k, :P] = 0
        at = P
        for s, i in enumerate(pack.rows, 1):
            r = max(response_len[i], 1)  # as column_token_stats: an empty response still yields one (masked) token
            ids[k, at : at + r - 1] = host_ids[i, width : width + r - 1]
            positions[k, at : at + r - 1] = torch.arange(P, P + r - 1)
            segment[k, at : at + r - 1] = s
            source.append(torch.cat([torch.tensor([P - 1]), torch.arange(at, at + r - 1)]) + k * L)
            token.append(torch.arange(r) + i * T)
            target.append(torch.arange(r) + out_row[i] * T)
            at += r - 1
    source_idx, target_idx = torch.cat(source).to(device), torch.cat(target).to(device)
    tokens = host_ids[:, width:].reshape(-1)[torch.cat(token)].to(device)
    ids, positions, segment = ids.to(device), positions.to(device), segment.to(device)
    mask = _attention_mask(segment, _MASKS[model.config._attn_implementation], next(model.parameters()).dtype)
    with autocast(precision, model):
        hidden = model.get_decoder()(input_ids=ids, attention_mask=mask, position_ids=positions,
                                     use_cache=False).last_hidden_state
        hidden = hidden.reshape(n * L, -1).index_select(0, source_idx)
        head = output_layer(model)
        if fused_head:
            stats = linear_token_stats(hidden, head.weight, head.bias, tokens, temperature, None, collision)
        else:
            stats = token_stats(head(hidden), tokens, temperature, DEFAULT_CHUNK_ROWS, collision)

    def place(x: Tensor | None) -> Tensor | None:
        if x is None:
            return None
        return x.new_zeros(len(idx) * T).index_copy(0, target_idx, x).view(len(idx), T)

    return tuple(place(x) for x in stats)
