"""The model's forward pass for the per-token statistics: the Hugging Face causal-LM calls (logits of the response
positions, or the decoder's hidden states and the output layer for the fused head) that feed the pure-tensor math
of :mod:`cegppo.algorithm.logprobs` (:func:`~cegppo.algorithm.logprobs.token_stats`,
:func:`~cegppo.algorithm.logprobs.linear_token_stats`)."""

from __future__ import annotations

import torch
from torch import Tensor

from cegppo.algorithm.logprobs import DEFAULT_CHUNK_ROWS, linear_token_stats, token_stats

# Causal-LM classes whose logits are exactly ``lm_head(last_hidden_state)`` (no soft-capping or logit scaling),
# so the fused head reproduces them; others are refused rather than silently computed differently.
FUSED_HEAD_MODEL_TYPES = frozenset(
    {"llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "phi3", "olmo2", "gemma"}
)


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


def fused_head_supported(model: torch.nn.Module) -> bool:
    """Whether ``sequence_token_stats(..., fused_head=True)`` can run on ``model``: a model type known to compute
    its logits as a plain ``lm_head(hidden)`` (no soft-capping or scaling after it), with an ``nn.Linear`` head."""
    try:
        output_layer(model)
    except NotImplementedError:
        return False
    return True


def output_layer(model: torch.nn.Module) -> torch.nn.Linear:
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in FUSED_HEAD_MODEL_TYPES:
        raise NotImplementedError(
            f"fused LM head: model type {model_type!r} is not known to compute its logits as a plain "
            f"lm_head(hidden) (supported: {', '.join(sorted(FUSED_HEAD_MODEL_TYPES))}); "
            "set model.fused_lm_head=false")
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        raise NotImplementedError(f"fused LM head: output layer is {type(head).__name__}, not nn.Linear; "
                                  "set model.fused_lm_head=false")
    return head


def response_hidden(model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor, response_len: int) -> Tensor:
    """The decoder's last hidden states at the positions :func:`response_logits` projects: ``[B, response_len, D]``."""
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    out = model.get_decoder()(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=False,
    )
    return out.last_hidden_state[:, -response_len - 1 : -1]


def sequence_token_stats(
    model: torch.nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    response_len: int,
    temperature: float = 1.0,
    collision: bool = False,
    chunk_rows: int | None = None,
    fused_head: bool = False,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Per-token log-prob / entropy (/ collision) of the response part of ``input_ids``: ``[B, response_len]``.

    ``fused_head=False``: the model's logits of the response positions, then :func:`token_stats`
    (``chunk_rows`` default :data:`DEFAULT_CHUNK_ROWS`). ``fused_head=True``: the decoder's hidden states, then
    :func:`linear_token_stats` with the output layer's weight, so no ``[B, T, V]`` logits are ever held
    (``chunk_rows`` default :func:`~cegppo.algorithm.logprobs.fused_chunk_rows`).
    """
    tokens = input_ids[:, -response_len:]
    if fused_head:
        head = output_layer(model)
        hidden = response_hidden(model, input_ids, attention_mask, response_len)
        return linear_token_stats(hidden, head.weight, head.bias, tokens, temperature, chunk_rows, collision)
    if chunk_rows is None:
        chunk_rows = DEFAULT_CHUNK_ROWS
    logits = response_logits(model, input_ids, attention_mask, response_len)
    return token_stats(logits, tokens, temperature, chunk_rows, collision)
