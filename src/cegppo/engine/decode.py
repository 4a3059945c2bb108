"""The decode loop behind :class:`cegppo.engine.rollout.HFGenerator`: one prefill per prompt shared by its samples,
a static KV cache, inverse-CDF sampling, and finished rows dropped from the batch as it goes.

It draws what Hugging Face ``generate`` draws on each prompt repeated n times with the same seed (HF's own
warpers, in ``generate``'s order; one uniform per row and step, finished rows included; positions, masks and
padding by ``generate``'s rules: ``tests/test_rollout_sampling.py``). What differs is the work:

- ``generate`` computes every row until the last one ends. Here a row that has ended leaves the batch (its cache
  rows too) once enough rows have ended to pay for the copy: with 64 rows of SmolLM2 the step costs a fixed part
  plus a part per row, and rows that ended are about a sixth of the row-steps of a 64-token rollout.
- ``generate`` encodes each prompt n times; :func:`shared_prefill` encodes it once.
- ``generate(do_sample=True)`` samples with ``torch.multinomial``; :class:`InverseCDFSampler` draws one uniform.
- On a CPU, a model on ``sdpa`` attention decodes with :func:`grouped_decode_attention` (its prefill stays on
  ``sdpa``): PyTorch's CPU kernel is slow for a single query (30% of a bf16 rollout of SmolLM2, profiled by hand).
"""

from __future__ import annotations

import functools
import inspect
from contextlib import contextmanager
from typing import Callable

import torch
from torch import Tensor

OnToken = Callable[[int, int], None]  # (tokens decoded so far, max_new_tokens)


class InverseCDFSampler:
    """Draws the next token from processed scores with one uniform per row, inverting the CDF.

    Why not ``torch.multinomial`` (what ``generate(do_sample=True)`` uses): on a CPU it draws an exponential for
    every vocabulary entry (64 x 49152 per decode step: 16% of a measured 8 x 8 rollout of SmolLM2). The CDF is
    inverted in two levels so that no full-vocabulary cumulative sum (a serial scan) is needed: the block of
    ``block`` tokens the uniform falls in, then the token inside it. Sums are float64: in float32 a token below
    ~3e-8 of probability would round away and could never be drawn."""

    def __init__(self, block: int = 256):
        self.block = block

    def draw(self, scores: Tensor, u: Tensor) -> Tensor:
        """The token (``[rows]``) that each row's uniform ``u`` (``[rows, 1]``, float64 in [0, 1)) picks."""
        rows, vocab = scores.shape
        probs = torch.softmax(scores.float(), -1)
        if vocab % self.block:
            probs = torch.nn.functional.pad(probs, (0, -vocab % self.block))
        blocks = probs.view(rows, -1, self.block)
        block_cdf = blocks.sum(-1, dtype=torch.float64).cumsum(-1)  # [rows, vocab / block]
        u = u * block_cdf[:, -1:]
        block = torch.searchsorted(block_cdf, u, right=True).clamp_(max=block_cdf.shape[1] - 1)
        below = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp(min=0)), 0.0)  # mass of earlier blocks
        inner = blocks.gather(1, block[..., None].expand(-1, -1, self.block)).squeeze(1).double().cumsum(-1)
        # strictly below the block's total, so the first inner cdf above it is a token of nonzero probability
        rest = torch.minimum(u - below, torch.nextafter(inner[:, -1:], torch.zeros_like(below)))
        return (block * self.block + torch.searchsorted(inner, rest, right=True)).squeeze(1)


def sampling_warpers(sampling) -> list:
    """HF's own warpers, in the order ``generate`` applies them when sampling (temperature, top-k, top-p)."""
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    warpers = [TemperatureLogitsWarper(sampling.temperature)] if sampling.temperature != 1.0 else []
    warpers += [TopKLogitsWarper(sampling.top_k)] if sampling.top_k else []
    warpers += [TopPLogitsWarper(sampling.top_p)] if sampling.top_p < 1.0 else []
    return warpers


def _cache_keywords(model: torch.nn.Module, cache) -> dict:
    """The forward's keywords for a KV cache: ``cache`` since transformers 5.2x, ``past_key_values`` before (the
    vLLM and verl extras pin older releases); logits for the last position only, where the model allows it."""
    accepts = inspect.signature(model.forward).parameters
    last_logits = {"logits_to_keep": 1} if "logits_to_keep" in accepts else {}
    return {"cache" if "cache" in accepts else "past_key_values": cache, "use_cache": True, **last_logits}


@torch.no_grad()
def shared_prefill(model: torch.nn.Module, prompt_ids: Tensor, prompt_mask: Tensor, n: int, max_new_tokens: int):
    """A static KV cache holding each prompt but its last token, encoded once and repeated for its ``n`` samples.

    Why: encoding every prompt ``n`` times would spend 7/8 of the prefill on copies (8 samples of a 57-token
    prompt: a third of the rollout's FLOPs). Positions follow ``generate``'s rule for left padding (mask cumsum - 1,
    pads at 0), so the cache holds what ``generate`` would have computed. Static (preallocated): a dynamic cache
    concatenates every layer's keys and values at each decode step (10% of a measured rollout)."""
    from transformers import DynamicCache, StaticCache

    cache = StaticCache(config=model.config, max_cache_len=prompt_ids.shape[1] + max_new_tokens)
    if prompt_ids.shape[1] == 1:  # nothing before the last token: the cache starts empty
        return cache
    mask = prompt_mask[:, :-1]
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    prefix = DynamicCache(config=model.config)
    model(input_ids=prompt_ids[:, :-1], attention_mask=mask, position_ids=positions, **_cache_keywords(model, prefix))
    for i, layer in enumerate(prefix.layers):
        cache.update(layer.keys.repeat_interleave(n, 0), layer.values.repeat_interleave(n, 0), i)
    return cache


GROUPED_DECODE = "cegppo_grouped_decode"


def grouped_decode_attention(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                             attention_mask: Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                             **kwargs) -> tuple[Tensor, None]:
    """Attention for one query per row, as two batched matmuls: each key/value head with its group of query heads
    (no copy of the cache per query head), scores and softmax in float32 from matmuls in the model's dtype, as
    Hugging Face's eager attention computes them. Anything else goes to ``sdpa``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    rows, heads, _, dim = query.shape
    groups = key.shape[1]
    # a bias or softcap sdpa applies (or refuses), or a shape other than one query per row: sdpa's own path
    if (query.shape[2] != 1 or dropout or heads % groups or kwargs.get("position_bias") is not None
            or kwargs.get("softcap") is not None):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    scores = torch.matmul(query.view(rows, groups, heads // groups, dim), key.transpose(-1, -2)).float()
    scores = scores * (dim**-0.5 if scaling is None else scaling)
    if attention_mask is not None:  # [rows, 1, 1, keys]: True (or 0) where a key may be seen
        scores = (scores.masked_fill(attention_mask.logical_not(), float("-inf")) if attention_mask.dtype == torch.bool
                  else scores + attention_mask)
    out = torch.matmul(torch.softmax(scores, -1).to(value.dtype), value)  # [rows, groups, heads / groups, dim]
    return out.reshape(rows, 1, heads, value.shape[-1]), None


@functools.cache
def _register_grouped_decode() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(GROUPED_DECODE, grouped_decode_attention)
    AttentionMaskInterface.register(GROUPED_DECODE, sdpa_mask)


@contextmanager
def _decode_attention(model: torch.nn.Module, device: torch.device):
    """The model on :func:`grouped_decode_attention` while it decodes on a CPU, where it was on ``sdpa``."""
    swap = device.type == "cpu" and getattr(model.config, "_attn_implementation", None) == "sdpa"
    if swap:
        _register_grouped_decode()
        model.set_attn_implementation(GROUPED_DECODE)
    try:
        yield
    finally:
        if swap:
            model.set_attn_implementation("sdpa")


def _keep_rows(cache, rows: Tensor) -> None:
    """Keep only ``rows`` of every layer of a static cache (its write position is shared by all rows)."""
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys.index_select(0, rows), layer.values.index_select(0, rows)


@torch.no_grad()
def decode(model: torch.nn.Module, prompt_ids: Tensor, prompt_mask: Tensor, cache, sampling, eos: list[int],
           pad_id: int, on_token: OnToken | None = None, drop_share: float = 0.125) -> Tensor:
    """The responses (``[rows, steps]``, pad after a row's first EOS) to left-padded prompts whose prefix is in
    ``cache`` (:func:`shared_prefill`: everything but each row's last prompt token).

    A row that ended keeps being fed pads, as in ``generate``, until the rows that ended make up ``drop_share`` of
    the batch; then they leave it. ``drop_share=0`` drops them at once (the tests use it); 1 never drops them."""
    rows, width = prompt_ids.shape
    device, max_new = prompt_ids.device, sampling.max_new_tokens
    sampler, cache_keywords = InverseCDFSampler(), _cache_keywords(model, cache)
    warpers = sampling_warpers(sampling) if sampling.temperature > 0 else None
    eos_ids = torch.tensor(eos, dtype=torch.long, device=device)
    responses = torch.full((rows, max_new), pad_id, dtype=torch.long, device=device)
    live = torch.arange(rows, device=device)  # the original row of each row still in the batch
    mask = torch.cat([prompt_mask, prompt_mask.new_ones(rows, max_new)], 1)
    position = prompt_mask.sum(-1, keepdim=True) - 1  # the last prompt token's, by generate's rule
    token = prompt_ids[:, -1:]
    ended = torch.zeros(rows, dtype=torch.bool, device=device)
    steps = 0
    with _decode_attention(model, device):
        for step in range(max_new):
            logits = model(input_ids=token, attention_mask=mask[:, : width + step], position_ids=position + step,
                           **cache_keywords).logits
            scores = logits[:, -1].float()  # as generate: processors see float32 logits
            if warpers is None:
                chosen = scores.argmax(-1)
            else:
                seen = torch.cat([prompt_ids, responses[:, :step]], 1).index_select(0, live)
                for warp in warpers:
                    scores = warp(seen, scores)
                # one uniform per original row, ended or gone: the stream generate on every row would draw
                u = torch.rand(rows, 1, dtype=torch.float64, device=device).index_select(0, live)
                chosen = sampler.draw(scores, u)
            chosen = chosen.masked_fill(ended, pad_id)
            responses[:, step].index_copy_(0, live, chosen)
            ended |= torch.isin(chosen, eos_ids)
            steps = step + 1
            if on_token is not None:
                on_token(steps, max_new)
            n_ended = int(ended.sum())  # one sync per step, as generate's own stopping check
            if n_ended == live.numel():
                break
            if n_ended and n_ended >= drop_share * live.numel():
                keep = (~ended).nonzero().squeeze(1)
                live, position, mask, chosen, ended = (x.index_select(0, keep) for x in (live, position, mask, chosen,
                                                                                        ended))
                _keep_rows(cache, keep)
            token = chosen[:, None]
    return responses[:, :steps]
