"""Where the policy runs and in which precision: ``model.device`` (auto: the GPU when torch sees one), and
``model.precision`` / ``model.rollout_dtype`` (auto: bf16 where bf16 is fast, else fp32), with the autocast
context every training forward pass goes through."""

from __future__ import annotations

import contextlib
from typing import Any

from cegppo.engine.models import ModelLoadError
from cegppo.errors import DEVICES


def fast_bf16(device: str = "cpu") -> bool:
    """Whether bf16 matmuls beat fp32 here: a GPU with bf16, or a CPU with native bf16 (AVX512-BF16 / AMX).
    Elsewhere (AVX2-only CPUs) bf16 is emulated in software, so fp32 is the faster choice there."""
    import torch

    if device.startswith("cuda"):
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def resolve_device(device: str, key: str = "model.device") -> str:
    """``model.device``: ``auto`` is the GPU when torch sees one, else the CPU; a GPU asked for and not there fails."""
    import torch

    if DEVICES.fullmatch(device) is None:
        raise ModelLoadError(f"{key}: {device!r}; expected auto, cpu, cuda or cuda:N")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelLoadError(f"{key}: {device!r}, but this torch ({torch.__version__}) sees no CUDA GPU; use cpu or auto")
    return device


def resolve_precision(precision: str, device: str = "cpu") -> str:
    """``model.precision``: ``auto`` is bf16-autocast where bf16 is fast (:func:`fast_bf16`), else fp32."""
    if precision != "auto":
        return precision
    return "bf16-autocast" if fast_bf16(device) else "fp32"


def resolve_dtype(dtype: str, device: str = "cpu") -> str:
    """``model.rollout_dtype`` / ``cegppo eval --dtype``: ``auto`` is bfloat16 where bf16 is fast, else float32."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if fast_bf16(device) else "float32"


def autocast(precision: str, model: Any) -> contextlib.AbstractContextManager:
    """bf16 autocast on the model's device for ``model.precision = bf16-autocast`` (fp32 master weights, bf16
    matmuls), a no-op for ``fp32``. Every forward pass of training and warm-start goes through this."""
    import torch

    if precision == "bf16-autocast":
        return torch.autocast(next(model.parameters()).device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()
