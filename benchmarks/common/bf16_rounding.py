"""The numerics of ``torch.autocast(dtype=torch.bfloat16)`` at fp32 speed, for CPUs without native bf16.

On an AVX2-only CPU a bf16 matmul runs in a slow fallback kernel (results/precision_gradients.md times one against
fp32 on the machine it ran on), so a bf16 warm-start of SmolLM2 would take hours there. :class:`Bf16Rounding` reproduces what autocast does to the numbers instead: the ops CPU
autocast runs in bf16 (linear, the matmul family, scaled-dot-product attention) get their floating inputs rounded to
bf16, compute in float32 (bf16 kernels accumulate in float32 too) and return bf16, so the elementwise ops after them
(SiLU, the gating product) run in bf16 as under autocast, and a residual add promotes back to float32 as under
autocast. Gradients are rounded at the same points on the way back (the backward of each cast). What differs from
a bf16 kernel is the order of the float32 accumulation, and attention's internal probabilities (a bf16 flash kernel
may round them before the product with V); ``tests/test_precision.py`` checks on the tiny model that the emulation's
gradient is much closer to real autocast's than fp32's is.

    with Bf16Rounding(skip=[model.get_output_embeddings().weight]):   # the decoder in bf16, the LM head in fp32
        loss = ...; loss.backward()
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

# the ops CPU autocast runs in its lower precision (torch's autocast op list) that a decoder-only LM calls
BF16_OPS = {F.linear, torch.matmul, torch.mm, torch.bmm, torch.addmm, torch.baddbmm, torch.Tensor.matmul,
            torch.Tensor.__matmul__, torch.Tensor.mm, torch.Tensor.bmm, F.scaled_dot_product_attention}


def _rounded(x):
    if isinstance(x, torch.Tensor) and x.dtype in (torch.float32, torch.bfloat16):
        return x.to(torch.bfloat16).to(torch.float32)
    return x


class Bf16Rounding(TorchFunctionMode):
    """Within this context, :data:`BF16_OPS` see bf16-rounded inputs and return bf16 outputs, computed in float32.
    A call that takes one of the ``skip`` tensors (e.g. the LM head's weight) runs in plain float32."""

    def __init__(self, skip: list[torch.Tensor] | None = None):
        super().__init__()
        self.skip = {id(t) for t in skip or []}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in BF16_OPS:
            return func(*args, **kwargs)
        leaves = [x for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor)]
        if any(id(x) in self.skip for x in leaves):
            return func(*tree_map(lambda x: x.float() if isinstance(x, torch.Tensor) and x.is_floating_point() else x,
                                  args), **kwargs)
        if not any(x.is_floating_point() for x in leaves):
            return func(*args, **kwargs)
        out = func(*tree_map(_rounded, args), **tree_map(_rounded, kwargs))
        return out.to(torch.bfloat16) if isinstance(out, torch.Tensor) and out.is_floating_point() else out


EMULATED = ("bf16 (emulated)", "bf16 (emulated), fp32 head")  # the precision modes this module provides


def precision_context(model: torch.nn.Module, mode: str) -> contextlib.AbstractContextManager:
    """The context a training forward pass of ``mode`` runs in: ``fp32`` (nothing), ``bf16-autocast`` (the real
    autocast) or one of :data:`EMULATED` (:class:`Bf16Rounding`, the LM head's weight skipped for ``fp32 head``)."""
    if mode == "bf16-autocast":
        return torch.autocast(next(model.parameters()).device.type, dtype=torch.bfloat16)
    if mode in EMULATED:
        head = model.get_output_embeddings().weight
        return Bf16Rounding(skip=[head] if mode.endswith("fp32 head") else None)
    if mode != "fp32":
        raise ValueError(f"precision mode {mode!r}: expected fp32, bf16-autocast or one of {EMULATED}")
    return contextlib.nullcontext()
