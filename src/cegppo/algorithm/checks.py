"""Argument checks of the public algorithm API (``policy_loss``, ``aggregate``, ``get_objective``,
``group_advantages``): one ``ValueError`` naming the function, the argument and what was expected.

They run in the training hot path, so they read metadata only (shape, dtype, device) and Python numbers. A
tensor's *values* are read only where that costs no device sync: a CPU tensor, or once per step
(:func:`check_normaliser` explains what happens to a normaliser that lives on an accelerator;
:func:`check_mask_values` does not read a mask that lives on one).
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch
from torch import Tensor

# dtype kinds a tensor argument may have
FLOAT = "floating"
REAL = "real (floating or integer)"
MASK = "bool, integer or floating"


def _kind_ok(x: Tensor, kind: str) -> bool:
    if kind == FLOAT:
        return x.is_floating_point()
    if x.is_complex():
        return False
    return kind == MASK or x.dtype != torch.bool  # REAL: anything numeric but bool


def describe(x: Any) -> str:
    """A short description of an argument for a message: dtype and shape of a tensor, else its type."""
    if isinstance(x, Tensor):
        return f"a {x.dtype} tensor of shape {tuple(x.shape)}"
    return f"{type(x).__name__} {x!r}"[:200]


def check_tensor(fn: str, name: str, x: Any, shapes: tuple[int, ...] | list[tuple[int, ...]] | None, kind: str, *,
                 like: Tensor | None = None, like_name: str = "log_prob") -> None:
    """``x`` must be a tensor of dtype ``kind``, of one of ``shapes`` (None: 2-D, any size) and on ``like``'s device.

    Shape mismatches are refused rather than broadcast: a ``[1, T]`` or ``[T]`` tensor against ``[B, T]`` would
    silently apply one row to every row."""
    if not isinstance(x, Tensor):
        raise ValueError(f"{fn}: {name} must be a tensor, got {describe(x)}")
    if shapes is None:
        if x.dim() != 2:
            raise ValueError(f"{fn}: {name} has shape {tuple(x.shape)}; expected 2 dimensions [B, T]")
    else:
        allowed = [shapes] if isinstance(shapes, tuple) else shapes
        if tuple(x.shape) not in allowed:
            expected = " or ".join(str(s) for s in allowed)
            if like is not None:
                expected += (f", the shape of {like_name}" if allowed == [tuple(like.shape)]
                             else f" ({like_name} has shape {tuple(like.shape)})")
            raise ValueError(f"{fn}: {name} has shape {tuple(x.shape)}; expected {expected}")
    if not _kind_ok(x, kind):
        raise ValueError(f"{fn}: {name} must be {kind}, got dtype {x.dtype}")
    if like is not None and x.device != like.device:
        raise ValueError(f"{fn}: {name} is on {x.device}; expected {like.device}, the device of {like_name}")


def check_mask_values(fn: str, name: str, mask: Tensor) -> None:
    """A mask (checked by :func:`check_tensor` first) holds only 0 and 1: it selects tokens, it does not weigh them
    (``-mask`` would flip the loss's sign, ``0.5 * mask`` halve a term); else one ``ValueError``.

    A bool mask is always fine. The values are read only on the CPU: on an accelerator they are not read (that
    would wait for the device at every micro-batch), so there a weighted or negative mask is not detected; the
    trainer and the integrations build their masks as bool or 0/1 tensors.
    """
    if mask.dtype == torch.bool or mask.device.type != "cpu":
        return
    bad = (mask != 0) & (mask != 1)  # NaN is neither
    if bool(bad.any()):
        value = mask[bad][0].item()
        raise ValueError(f"{fn}: {name} must hold only 0 and 1 (bool or 0/1: a mask selects tokens, it does not "
                         f"weigh them), got {value!r} at {tuple(int(i) for i in bad.nonzero()[0])}")


def check_number(fn: str, name: str, value: Any, *, low: float = -math.inf, high: float = math.inf,
                 low_open: bool = False, what: str = "a finite number") -> float:
    """A Python number (not bool) that is finite and within [low, high] (``low_open``: above ``low``)."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value) or not (
            (value > low if low_open else value >= low) and value <= high):
        raise ValueError(f"{fn}: {name} must be {what}, got {describe(value)}")
    return float(value)


def nan_unless_positive(value: Tensor) -> Tensor:
    """``value`` where it is positive and finite, else NaN: computed on the tensor's device, never read."""
    return torch.where((value > 0) & torch.isfinite(value), value, math.nan)


def check_normaliser(fn: str, name: str, value: float | Tensor | None) -> float | Tensor | None:
    """``value`` as a divisor: None, a positive finite number, or a 0-d real tensor; else ``ValueError``.

    A number, or a tensor on the CPU, is checked here. A tensor on an accelerator is not read (that would wait
    for the device at every micro-batch): a value that is not positive and finite comes back as NaN, so the loss
    is NaN, which the trainer's non-finite-loss guard logs and skips (docs/reliability.md). Zero is refused:
    callers pass ``count.clamp(min=1)``, so a batch without response tokens has loss 0, not 0/0.
    """
    if value is None:
        return None
    hint = "a positive finite number (a count over the whole batch; clamp it to >= 1 for a batch without tokens)"
    if isinstance(value, Tensor):
        if value.dim() != 0 or not _kind_ok(value, REAL):
            raise ValueError(f"{fn}: {name} must be {hint} or a 0-d real tensor, got {describe(value)}")
        if value.device.type != "cpu":
            return nan_unless_positive(value)
        v = float(value)  # a CPU scalar: no device to wait for
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):
        v = float(value)
    else:
        raise ValueError(f"{fn}: {name} must be {hint}, got {describe(value)}")
    if not (math.isfinite(v) and v > 0):
        raise ValueError(f"{fn}: {name} must be {hint}, got {v!r}")
    return value
