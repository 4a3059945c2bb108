"""Lean activations (cegppo.engine.lean_layers): the RMSNorm and SwiGLU functions give the Hugging Face modules'
values bit for bit, alone and in a model (gradients there to float32 rounding: autograd adds a layer's residual and
norm gradients in another order), keep less for backward, replace only the modules known to compute their formulas
and put them back; the trainer runs its forward passes under them, except under gradient checkpointing."""

from __future__ import annotations

import contextlib

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

from cegppo.engine.lean_layers import lean_layers, lean_modules

PRECISIONS = [False, True]  # bf16 autocast off / on


def _perturbed(model: torch.nn.Module) -> torch.nn.Module:
    """Weights moved off their initial values (norm weights off 1), so every gradient term shows."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model


def _model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    size = dict(vocab_size=211, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, attn_implementation="sdpa")
    if kind == "qwen3":  # RMSNorms on the queries and keys too
        return _perturbed(Qwen3ForCausalLM(Qwen3Config(head_dim=16, **size)))
    return _perturbed(LlamaForCausalLM(LlamaConfig(**size)))


def _forward_backward(module, inputs, grad_out, autocast: bool, lean_model=None):
    """Output, input gradient and parameter gradients of ``module(inputs)`` (run lean on ``lean_model``'s modules)."""
    module.zero_grad(set_to_none=True)
    x = inputs.clone().requires_grad_(inputs.is_floating_point())
    lean = lean_layers(lean_model) if lean_model is not None else contextlib.nullcontext(1)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), lean as replaced:
        assert replaced
        out = module(x * 1 if x.is_floating_point() else x)  # a non-leaf input, as inside a model
        out = out.logits if hasattr(out, "logits") else out
    out.float().backward(grad_out)
    grads = [x.grad] if x.is_floating_point() else []
    return out.detach(), grads + [p.grad for p in module.parameters()]


@pytest.mark.parametrize("autocast", PRECISIONS)
@pytest.mark.parametrize("module", ["norm", "head norm", "mlp"])
def test_each_module_alone_gives_the_models_values_bit_for_bit(module, autocast):
    """A norm on the float32 residual stream, one on bf16 heads (Qwen3's query and key norms under autocast), and
    the MLP."""
    torch.manual_seed(0)
    m = LlamaMLP(LlamaConfig(hidden_size=64, intermediate_size=160)) if module == "mlp" else LlamaRMSNorm(64)
    _perturbed(m)
    x, g = torch.randn(3, 17, 64), torch.randn(3, 17, 64)
    x = x.to(torch.bfloat16) if module == "head norm" else x
    want_out, want_grads = _forward_backward(m, x, g, autocast)
    got_out, got_grads = _forward_backward(m, x, g, autocast, lean_model=m)
    assert torch.equal(got_out, want_out)
    assert len(got_grads) == len(want_grads)
    for w, v in zip(want_grads, got_grads):
        assert torch.equal(v, w)


@pytest.mark.parametrize("autocast", PRECISIONS)
@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_a_lean_model_gives_the_same_logits_and_gradients(kind, autocast):
    model = _model(kind)
    ids = torch.randint(0, 211, (3, 19), generator=torch.Generator().manual_seed(2))
    weights = torch.randn(3, 19, 211, generator=torch.Generator().manual_seed(3))
    want_out, want_grads = _forward_backward(model, ids, weights, autocast)
    got_out, got_grads = _forward_backward(model, ids, weights, autocast, lean_model=model)
    assert torch.equal(got_out, want_out)  # the forward is the same operations in the same order
    for (name, _), w, v in zip(model.named_parameters(), want_grads, got_grads):
        # float32 rounding only: the sum of a residual's and a norm's gradient taken in another order
        assert (v - w).abs().max() <= 1e-5 * w.abs().max(), name


def _saved_activation_bytes(model, ids, lean: bool) -> int:
    """Bytes autograd keeps for backward in one forward pass, parameters (and casts of them) aside."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    shapes = {tuple(p.shape) for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and tuple(t.shape) not in shapes:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            with lean_layers(model) if lean else contextlib.nullcontext():
                model(ids)
    return sum(seen.values())


def test_lean_layers_keep_less_for_backward():
    model = _model("llama")
    ids = torch.randint(0, 211, (4, 64), generator=torch.Generator().manual_seed(2))
    full, lean = _saved_activation_bytes(model, ids, False), _saved_activation_bytes(model, ids, True)
    # per token and layer: the norms keep their float32 input (not also its normalised copy), the MLP its input
    # once in bf16, the gate and up outputs (not also the SiLU, the product and a second cast of its input)
    assert lean < 0.7 * full, (lean, full)


def test_only_the_known_modules_are_replaced_and_all_are_put_back():
    model = _model("qwen3")
    layers = model.config.num_hidden_layers
    # per layer: 2 norms, the query and key norms, the MLP; and the final norm
    assert len(lean_modules(model)) == 5 * layers + 1
    gelu = LlamaMLP(LlamaConfig(hidden_size=8, intermediate_size=16, num_attention_heads=2, hidden_act="gelu"))
    biased = LlamaMLP(LlamaConfig(hidden_size=8, intermediate_size=16, num_attention_heads=2, mlp_bias=True))
    other = torch.nn.LayerNorm(8)
    assert lean_modules(torch.nn.ModuleList([gelu, biased, other])) == []
    with pytest.raises(RuntimeError, match="inside"):
        with lean_layers(model):
            assert all("forward" in m.__dict__ for m, _ in lean_modules(model))
            raise RuntimeError("inside")
    assert not any("forward" in m.__dict__ for m in model.modules())


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory):
    from cegppo.cli import example_config
    from cegppo.config import load_config

    def build(*overrides: str):
        out = tmp_path_factory.mktemp("lean") / "run"
        return load_config(example_config("tiny"), [f"output_dir={out}", "reward.fn=fixtures.rewards:digit_overlap",
                                                    "sft.steps=0", "data.num_test=4", "eval.num_problems=4",
                                                    "logging.progress=false", "train.prompts_per_step=2",
                                                    "rollout.max_new_tokens=12", "model.device=cpu", *overrides])
    return build


def test_the_trainer_runs_its_passes_lean_but_not_under_checkpointing(tiny_config, monkeypatch):
    import cegppo.engine.trainer as trainer_module
    from cegppo.engine.trainer import Trainer

    with Trainer(tiny_config()) as tr:
        assert tr.lean and len(lean_modules(tr.model)) > 0
        exp, _ = tr.collect(step=1)
        rows = torch.arange(len(exp.rewards))
        params = [p for p in tr.model.parameters() if p.requires_grad]
        entered = []
        real = trainer_module.lean_layers

        def spy(model):
            entered.append(model)
            return real(model)

        monkeypatch.setattr(trainer_module, "lean_layers", spy)
        lean = tr.token_stats(tr.model, exp.rollouts, rows)
        assert entered == [tr.model]
        lean_grads = torch.autograd.grad(lean[0].sum() + lean[1].sum(), params)
        tr.lean = False
        plain = tr.token_stats(tr.model, exp.rollouts, rows)
        assert len(entered) == 1
        plain_grads = torch.autograd.grad(plain[0].sum() + plain[1].sum(), params)
        assert torch.equal(lean[0], plain[0]) and torch.equal(lean[1], plain[1])
        for w, v in zip(plain_grads, lean_grads):
            assert (v - w).abs().max() <= 1e-5 * w.abs().max()
    with Trainer(tiny_config("model.gradient_checkpointing=true")) as tr:
        assert not tr.lean
    with Trainer(tiny_config("model.lean_activations=false")) as tr:
        assert not tr.lean
