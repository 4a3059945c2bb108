"""Lean activations: the decoder's RMSNorm and SwiGLU MLP computed by autograd functions that keep less for the
backward pass (``model.lean_activations``).

Autograd keeps every intermediate of a module's forward that some backward formula reads. For a Llama-style layer
that is, per token: the RMSNorm's float32 input *and* its normalised output, and the MLP's input cast to the
autocast dtype once per projection, the gate's output, its SiLU, the up projection and their product (about five
tensors' worth of the MLP's width, counted on SmolLM2: docs/speed.md). These functions keep the norm's input (and
one number per token) and the MLP's input, gate and up outputs, and recompute the rest in backward: elementwise
work, no matmul is repeated.

Alone, each gives the values of the Hugging Face module it replaces bit for bit, forward and backward: the same
operations in the same order, and the backward formulas autograd would run (``aten.silu_backward``, the composite
derivative of ``x * rsqrt(mean(x^2) + eps)``, the same casts). In a model the forward is still bit for bit; the
gradients agree to float32 rounding, as autograd adds a residual's and a norm's gradient in another order
(``tests/test_lean_layers.py``).

Only module classes known to compute exactly these formulas are replaced (:data:`LEAN_NORMS`, :data:`LEAN_MLPS`:
Llama, Mistral, Qwen2/3 and their MoE dense MLPs; no bias, SiLU gate), and only inside :func:`lean_layers`, around
the trainer's forward passes: the generator, checkpoints and other code see the model as loaded.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor
from torch.nn import functional as F

# classes whose forward is ``weight * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(x.dtype)`` (Olmo2 multiplies
# before the cast and Gemma by 1 + weight: not these)
LEAN_NORMS = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "Qwen2MoeRMSNorm",
                        "Qwen3MoeRMSNorm", "Phi3RMSNorm"})
# classes whose forward is ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``; replaced when act_fn is SiLU and no
# projection has a bias
LEAN_MLPS = frozenset({"LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP", "Qwen2MoeMLP", "Qwen3MoeMLP", "Olmo2MLP"})


class _RMSNorm(torch.autograd.Function):
    """``weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)`` in float32, keeping x and the per-token rsqrt."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        x32 = x.to(torch.float32)
        rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return weight * (x32 * rstd).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight, rstd = ctx.saved_tensors
        x32 = x.to(torch.float32)
        normed = (x32 * rstd).to(x.dtype)
        # autograd's composite derivative, term by term: weight * n; n = x * r; r = rsqrt(v + eps); v = mean(x^2)
        grad_weight = (grad * normed).sum_to_size(weight.shape) if ctx.needs_input_grad[1] else None
        grad_n = (grad * weight).to(x.dtype).to(torch.float32)  # through the cast to x's dtype, as autograd
        grad_r = (grad_n * x32).sum(-1, keepdim=True)
        grad_v = grad_r * (-0.5 * rstd.pow(3))
        grad_x = grad_n * rstd + 2.0 * x32 * (grad_v / x.shape[-1]).expand_as(x32)
        return grad_x.to(x.dtype), grad_weight, None


class _SwiGLU(torch.autograd.Function):
    """``down(silu(gate(x)) * up(x))`` with bias-free projections, keeping x (cast once), the gate and up outputs.

    Under autocast the projections run in the autocast dtype, as ``nn.Linear`` would; each weight's gradient comes
    back in the weight's own dtype (float32 master weights), as through autocast's cast."""

    @staticmethod
    def forward(ctx, x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor, dtype: torch.dtype | None) -> Tensor:
        with torch.autocast(x.device.type, enabled=False):
            xc, wg, wu, wd = (t if dtype is None else t.to(dtype) for t in (x, w_gate, w_up, w_down))
            gate, up = F.linear(xc, wg), F.linear(xc, wu)
            out = F.linear(F.silu(gate) * up, wd)
        ctx.save_for_backward(xc, gate, up, wg, wu, wd)
        ctx.x_dtype, ctx.x_shape = x.dtype, x.shape
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        xc, gate, up, wg, wu, wd = ctx.saved_tensors
        # on rows flattened to 2-D, as autograd runs a linear's backward (the same kernels: the same roundings)
        grad, xc = grad.to(wd.dtype).reshape(-1, wd.shape[0]), xc.reshape(-1, xc.shape[-1])
        gate, up = gate.reshape(-1, gate.shape[-1]), up.reshape(-1, up.shape[-1])
        act = F.silu(gate)
        grad_wd = grad.t().mm(act * up)
        grad_hidden = grad.mm(wd)
        grad_gate = torch.ops.aten.silu_backward(grad_hidden * up, gate)
        grad_up = grad_hidden * act
        # autograd adds the two uses of x after casting each back to x's dtype
        grad_x = grad_up.mm(wu).to(ctx.x_dtype) + grad_gate.mm(wg).to(ctx.x_dtype)
        return (grad_x.reshape(ctx.x_shape), grad_gate.t().mm(xc), grad_up.t().mm(xc), grad_wd, None)


def _norm_forward(self, hidden_states: Tensor) -> Tensor:
    return _RMSNorm.apply(hidden_states, self.weight, self.variance_epsilon)


def _mlp_forward(self, x: Tensor) -> Tensor:
    dev = x.device.type
    dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None
    return _SwiGLU.apply(x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight, dtype)


def lean_modules(model: torch.nn.Module) -> list[tuple[torch.nn.Module, object]]:
    """The modules of ``model`` that :func:`lean_layers` replaces, each with its lean forward."""
    out = []
    for module in model.modules():
        name = type(module).__name__
        if name in LEAN_NORMS and hasattr(module, "variance_epsilon"):
            out.append((module, _norm_forward))
        elif (name in LEAN_MLPS and type(getattr(module, "act_fn", None)).__name__ in ("SiLU", "SiLUActivation")
              and all(getattr(module, p).bias is None for p in ("gate_proj", "up_proj", "down_proj"))):
            out.append((module, _mlp_forward))
    return out


@contextlib.contextmanager
def lean_layers(model: torch.nn.Module) -> Iterator[int]:
    """Within the block, ``model``'s known RMSNorms and SwiGLU MLPs run the lean functions; yields how many modules
    were replaced (0: a model with none of them, unchanged). The backward of a forward run inside may run after."""
    replaced = lean_modules(model)
    for module, forward in replaced:
        module.forward = forward.__get__(module)
    try:
        yield len(replaced)
    finally:
        for module, _ in replaced:
            del module.forward
