"""Rollout: turn chat prompts into sampled responses, behind a small interface so other generators can plug in.

A backend implements :class:`Generator`: ``generate(prompts, n, sampling) -> RolloutBatch`` and
``sync(policy)`` (copy the trained weights in). :class:`HFGenerator` decodes a Hugging Face model with a KV cache
(:mod:`cegppo.engine.decode`: what ``generate`` draws, with less work). Where the generation dtype differs from
the policy's (bf16 where bf16 is fast: a GPU, a CPU with native bf16) it runs on a separate copy of the policy in
that dtype, the way verl runs vLLM beside its trainer; where it is the same (fp32 on AVX2-only CPUs) it runs on
the policy itself: no second copy of the weights to hold or to sync. The log-probs that enter the objective are
recomputed by the trained policy, so the generator's precision only changes which samples are drawn.
"""

from __future__ import annotations

from copy import deepcopy
from dataclasses import dataclass, fields, replace
from functools import cached_property
from typing import Protocol

import torch
from torch import Tensor

from cegppo.engine.decode import OnToken, decode, shared_prefill


@dataclass
class Sampling:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 128


@dataclass
class RolloutBatch:
    """``n`` responses per prompt, consecutive (rows ``i*n .. i*n+n-1`` answer prompt ``i``)."""

    input_ids: Tensor  # [B, P + T]: left-padded prompt, then the response (right-padded)
    attention_mask: Tensor  # [B, P + T]
    response_mask: Tensor  # [B, T]: response tokens up to and including the first EOS
    texts: list[str]  # decoded responses (special tokens stripped)
    truncated: Tensor  # [B] bool: no EOS within max_new_tokens
    sampled_log_prob: Tensor | None = None  # [B, T]: the generator's log-probs of the sampled tokens (vLLM), else None

    @property
    def response_len(self) -> int:
        return self.response_mask.shape[1]

    @staticmethod
    def concat(parts: list["RolloutBatch"], pad_id: int) -> "RolloutBatch":
        """One batch from several (e.g. dynamic-sampling rounds): prompts re-padded on the left to the widest
        prompt, responses on the right to the longest response."""
        P = max(p.input_ids.shape[1] - p.response_len for p in parts)
        T = max(p.response_len for p in parts)

        def fit(x: Tensor, left: int, right: int, value: int) -> Tensor:
            return torch.nn.functional.pad(x, (left, right), value=value)

        widths = [(P - (p.input_ids.shape[1] - p.response_len), T - p.response_len) for p in parts]
        return RolloutBatch(
            torch.cat([fit(p.input_ids, left, right, pad_id) for p, (left, right) in zip(parts, widths)]),
            torch.cat([fit(p.attention_mask, left, right, 0) for p, (left, right) in zip(parts, widths)]),
            torch.cat([fit(p.response_mask, 0, right, 0) for p, (_, right) in zip(parts, widths)]),
            [t for p in parts for t in p.texts],
            torch.cat([p.truncated for p in parts]),
            None if any(p.sampled_log_prob is None for p in parts) else
            torch.cat([fit(p.sampled_log_prob, 0, right, 0) for p, (_, right) in zip(parts, widths)]),
        )

    @cached_property
    def lengths(self) -> tuple[list[int], list[int]]:
        """Per row: prompt tokens (without the left padding) and response tokens (through the first EOS), as
        host integers, computed once."""
        prompt = self.attention_mask[:, : self.input_ids.shape[1] - self.response_len].sum(-1)
        return prompt.tolist(), self.response_mask.sum(-1).tolist()

    @cached_property
    def prompt_group(self) -> list[int]:
        """Per row: an id shared by exactly the rows with the same prompt (tokens and padding), computed once."""
        width = self.input_ids.shape[1] - self.response_len
        prompts = torch.cat([self.input_ids[:, :width], self.attention_mask[:, :width].long()], 1)
        return torch.unique(prompts, dim=0, return_inverse=True)[1].tolist()

    def to(self, device: torch.device | str) -> "RolloutBatch":
        """The batch's tensors on ``device`` (the trainer's: the generators return host tensors)."""
        return replace(self, **{f.name: getattr(self, f.name).to(device) for f in fields(self)
                                if isinstance(getattr(self, f.name), Tensor)})

    def select(self, rows: Tensor | list[int]) -> "RolloutBatch":
        idx = torch.as_tensor(rows, dtype=torch.long)
        return RolloutBatch(
            self.input_ids[idx], self.attention_mask[idx], self.response_mask[idx],
            [self.texts[i] for i in idx.tolist()], self.truncated[idx],
            None if self.sampled_log_prob is None else self.sampled_log_prob[idx],
        )


class Generator(Protocol):
    def generate(self, prompts: list[list[dict]], n: int, sampling: Sampling,
                 on_token: OnToken | None = None) -> RolloutBatch: ...

    def sync(self, policy: torch.nn.Module) -> None: ...


def encode_prompts(tokenizer, prompts: list[list[dict]], max_prompt_tokens: int) -> tuple[Tensor, Tensor]:
    """Chat-template, tokenize and left-pad prompts; over-long prompts keep their last tokens (left truncation)."""
    texts = [tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False) for p in prompts]
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"][-max_prompt_tokens:] for t in texts]
    width = max(len(x) for x in ids)
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids], dtype=torch.long)
    attention = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids], dtype=torch.long)
    return input_ids, attention


def eos_ids(tokenizer, model) -> list[int]:
    ids = model.generation_config.eos_token_id if model.generation_config is not None else None
    ids = ids if isinstance(ids, list) else [ids] if ids is not None else []
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids


def response_mask_from(responses: Tensor, eos: list[int]) -> tuple[Tensor, Tensor]:
    """Mask through the first EOS (inclusive) and a per-row 'no EOS' flag."""
    is_eos = torch.isin(responses, torch.tensor(eos, dtype=responses.dtype))
    seen_before = (is_eos.long().cumsum(-1) - is_eos.long()) > 0  # an EOS strictly earlier in the row
    return (~seen_before).long(), ~is_eos.any(-1)


def rollout_batch(tokenizer, prompt_ids: Tensor, prompt_mask: Tensor, responses: Tensor, eos: list[int],
                  sampled_log_prob: Tensor | None = None) -> RolloutBatch:
    """A batch from each row's left-padded prompt and right-padded raw response (a generator's output): everything
    after a response's first EOS becomes padding, and the masks, truncation flags and texts follow from that."""
    response_mask, truncated = response_mask_from(responses, eos)
    responses = torch.where(response_mask.bool(), responses, tokenizer.pad_token_id)
    return RolloutBatch(
        input_ids=torch.cat([prompt_ids, responses], 1),
        attention_mask=torch.cat([prompt_mask, response_mask], 1),
        response_mask=response_mask,
        texts=tokenizer.batch_decode(responses, skip_special_tokens=True),
        truncated=truncated,
        sampled_log_prob=None if sampled_log_prob is None else sampled_log_prob * response_mask,
    )


def _empty_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` whose parameters hold no data (a released copy's weights are cast in at each rollout):
    copying the weights themselves would take another full-precision copy of the model, however briefly."""
    params = list(model.parameters())
    data = [p.data for p in params]
    try:
        for p in params:
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        return deepcopy(model)
    finally:
        for p, d in zip(params, data):
            p.data = d


class HFGenerator:
    """A Hugging Face model decoding in ``dtype`` (batched, left padding), with one prefill per prompt shared by its
    samples, a static KV cache, inverse-CDF sampling and ended rows dropped (:mod:`cegppo.engine.decode`; measured
    in docs/speed.md).

    ``copy=None``: on a copy of the policy when ``dtype`` differs from the policy's, else on the policy itself;
    ``copy=True``: always a copy; ``copy=False``: the policy itself, cast in place (for callers that only
    generate, like ``cegppo eval``).

    A copy holds its weights only while it generates (``release=True``, the default): each :meth:`generate` casts
    the policy's current weights into it and frees them afterwards, so the updates never hold a second copy of the
    model, the way vLLM's sleep mode frees its weights between rollouts (a cast of the weights per rollout)."""

    def __init__(self, policy: torch.nn.Module, tokenizer, max_prompt_tokens: int = 512,
                 dtype: torch.dtype = torch.bfloat16, max_batch: int = 64, copy: bool | None = None,
                 release: bool = True):
        self.tokenizer = tokenizer
        self.max_prompt_tokens = max_prompt_tokens
        self.max_batch = max_batch
        self.dtype = dtype
        if copy is None:
            copy = any(p.dtype != dtype for p in policy.parameters())
        released = copy and release
        self.model = (_empty_copy(policy) if released else deepcopy(policy) if copy else policy).to(dtype)
        self.eos = eos_ids(tokenizer, policy)
        self.policy = policy if released else None  # where a released copy takes its weights from

    @torch.no_grad()
    def sync(self, policy: torch.nn.Module) -> None:
        if policy is self.model or self.policy is not None:  # the policy itself, or a copy loaded at each rollout
            return
        for dst, src in zip(self.model.parameters(), policy.parameters()):
            dst.copy_(src.detach())

    @torch.no_grad()
    def _hold(self, weights: bool) -> None:
        """A released copy: cast the policy's weights in (``True``) or free them (``False``); else nothing."""
        if self.policy is None:
            return
        for dst, src in zip(self.model.parameters(), self.policy.parameters()):  # tied weights: one Parameter
            dst.data = src.detach().to(self.dtype) if weights else torch.empty(0, dtype=self.dtype, device=src.device)

    @torch.no_grad()
    def generate(self, prompts: list[list[dict]], n: int, sampling: Sampling,
                 on_token: OnToken | None = None) -> RolloutBatch:
        unique_ids, unique_mask = encode_prompts(self.tokenizer, prompts, self.max_prompt_tokens)
        prompt_ids, prompt_mask = unique_ids.repeat_interleave(n, 0), unique_mask.repeat_interleave(n, 0)
        # prompts per call: a prompt's samples stay together (in one call of n rows when n > max_batch)
        per_call = max(1, self.max_batch // n)
        outs, training, device = [], self.model.training, next(self.model.parameters()).device
        self.model.eval()  # the policy itself may be in training mode (dropout)
        self._hold(True)
        try:
            for s in range(0, unique_ids.shape[0], per_call):
                unique = slice(s, s + per_call)
                cache = shared_prefill(self.model, unique_ids[unique].to(device), unique_mask[unique].to(device), n,
                                       sampling.max_new_tokens)
                rows = slice(s * n, (s + per_call) * n)  # the n copies of those prompts
                out = decode(self.model, prompt_ids[rows].to(device), prompt_mask[rows].to(device), cache, sampling,
                             self.eos, self.tokenizer.pad_token_id, on_token)
                outs.append(out.cpu())  # a batch lives on the host; the trainer moves it
        finally:
            self._hold(False)
            self.model.train(training)
        width = max(o.shape[1] for o in outs)
        pad = self.tokenizer.pad_token_id
        responses = torch.cat([torch.nn.functional.pad(o, (0, width - o.shape[1]), value=pad) for o in outs])
        return rollout_batch(self.tokenizer, prompt_ids, prompt_mask, responses, self.eos)
