"""The hand-fused C kernel (cegppo.kernels) against the Python definitions in cegppo.objectives."""

import math
import warnings

import pytest
import torch

from cegppo import kernels
from cegppo.objectives import get_objective

# every clipped-family objective and setting the kernel must reproduce
CASES = [
    ("ce_gppo", {}),
    ("ce_gppo", dict(beta1=0.0, beta2=0.0)),
    ("ce_gppo", dict(beta1=0.5, beta2=1.5, eps_high=0.28, clip_ratio_c=3.0)),
    ("ce_gppo", dict(clip_ratio_c=None)),
    ("gppo", {}),
    ("ppo_clip", {}),
    ("ppo_clip", dict(clip_ratio_c=3.0)),
    ("grpo", {}),
    ("dapo", {}),
]


def batch(B=6, T=37, spread=1.5, seed=0, per_token=False):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g) * 3
    lp = old + torch.randn(B, T, generator=g) * spread  # many tokens in every region, some past the dual clip
    adv = torch.randn(B, T if per_token else 1, generator=g)
    adv[0] = 0.0  # A = 0 rows (and tokens) take their own path in the kernel
    if per_token:
        adv[1, ::3] = 0.0
    lens = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None] < lens[:, None]).float()
    return lp, old, adv, mask


def run(obj, lp, old, adv, mask, **kw):
    x = lp.clone().requires_grad_(True)
    loss, metrics = obj(x, old, adv, mask, **kw)
    loss.backward()
    return loss.detach(), x.grad, metrics


# these tests do not need a working kernel; every other test here is skipped on machines without a C compiler
NEEDS_NO_KERNEL = {"test_kernel_builds_in_ci", "test_missing_compiler_warns_once_and_falls_back", "test_switch_off"}


@pytest.fixture(autouse=True)
def need_kernel(request):
    if request.node.originalname not in NEEDS_NO_KERNEL and not kernels.available():
        pytest.skip("no C compiler here")


def test_kernel_builds_in_ci():
    # CI's machine has gcc (Inductor needs it too): there the kernel must build, not be skipped
    assert kernels.available()


@pytest.mark.parametrize("name,hp", CASES)
@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("agg", ["token-mean", "token-sum", "seq-mean-token-sum-norm"])
def test_matches_python_definition(name, hp, per_token, agg):
    lp, old, adv, mask = batch(per_token=per_token)
    fused = get_objective(name, compile=True, **hp)
    assert fused._cpu_kernel_applies(lp)
    ref = run(get_objective(name, **hp), lp.double(), old.double(), adv.double(), mask.double(), agg=agg)
    out = run(fused, lp, old, adv, mask, agg=agg)
    torch.testing.assert_close(out[0].double(), ref[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out[1].double(), ref[1], rtol=1e-5, atol=1e-8)
    assert out[2].keys() == ref[2].keys()
    for k in ref[2]:
        if k != "loss":
            torch.testing.assert_close(out[2][k].double(), ref[2][k], rtol=1e-5, atol=1e-6, msg=k)


def test_every_region_is_exercised():
    lp, old, adv, mask = batch()
    _, _, m = run(get_objective("ce_gppo", clip_ratio_c=3.0, compile=True), lp, old, adv, mask)
    assert min(m["clip/low_frac"], m["clip/high_frac"], m["clip/dual_frac"]) > 0


def test_exp_accuracy_over_the_clamp_range():
    x = torch.linspace(-20, 20, 200_001).reshape(1, -1)
    zero, ones = torch.zeros_like(x), torch.ones_like(x)
    # eps_low = 2 and no dual clip put every A < 0 token in the unclipped branch: grad = -A * r = r
    grad, _ = kernels.clip_surrogate(x, zero, -ones, ones, 1.0, eps_low=2.0, eps_high=0.2, low=(0, 0), high=(0, 0),
                                     clip_ratio_c=None)
    rel = (grad.double() / x.double().exp() - 1).abs().max().item()
    assert rel < 3e-7  # about 2 float32 ulp; torch.exp is itself ~1 ulp


def test_extreme_log_ratios_are_clamped_like_python():
    lp, old, adv, mask = batch()
    lp = old + torch.tensor([-200.0, -30.0, 0.0, 30.0, 200.0]).repeat(lp.shape[1] // 5 + 1)[: lp.shape[1]]
    out = run(get_objective("ce_gppo", compile=True), lp, old, adv, mask)
    ref = run(get_objective("ce_gppo"), lp, old, adv, mask)
    assert torch.isfinite(out[1]).all() and torch.isfinite(out[0])
    torch.testing.assert_close(out[1], ref[1], rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(out[2]["ppo_kl"], ref[2]["ppo_kl"])


def test_micro_batches_sum_to_the_mini_batch():
    lp, old, adv, mask = batch(B=8)
    obj = get_objective("ce_gppo", compile=True)
    whole = run(obj, lp, old, adv, mask)
    n = mask.sum()
    parts = [run(obj, lp[s], old[s], adv[s], mask[s], num_tokens=n) for s in (slice(0, 3), slice(3, 8))]
    torch.testing.assert_close(parts[0][0] + parts[1][0], whole[0])
    torch.testing.assert_close(torch.cat([parts[0][1], parts[1][1]]), whole[1])


def test_backward_twice_with_retained_graph_accumulates():
    lp, old, adv, mask = batch()
    x = lp.clone().requires_grad_(True)
    loss, _ = get_objective("ce_gppo", compile=True)(x, old, adv, mask)
    loss.backward(retain_graph=True)
    once = x.grad.clone()
    loss.backward(retain_graph=True)
    torch.testing.assert_close(x.grad, 2 * once)
    x.grad = None
    (3 * loss).backward()  # upstream gradient != 1 multiplies
    torch.testing.assert_close(x.grad, 3 * once)


def test_other_dtypes_and_objectives_do_not_use_the_kernel():
    lp = torch.zeros(2, 3)
    assert not get_objective("ce_gppo", compile=True)._cpu_kernel_applies(lp.bfloat16())
    assert not get_objective("cispo", compile=True)._cpu_kernel_applies(lp)
    assert not get_objective("gspo", compile=True)._cpu_kernel_applies(lp)


def test_build_is_cached_and_atomic(tmp_path):
    first = kernels.build(tmp_path)
    stamp = first.stat().st_mtime_ns
    assert kernels.build(tmp_path) == first and first.stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary files left behind


def test_missing_compiler_warns_once_and_falls_back(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", "no-such-cc")
    monkeypatch.setenv("CEGPPO_CACHE", str(tmp_path))
    monkeypatch.setattr(kernels, "_lib", None)
    monkeypatch.setattr(kernels, "_error", None)
    monkeypatch.setattr(kernels, "_warned", False)
    with pytest.raises(kernels.KernelUnavailable, match="no C compiler 'no-such-cc'"):
        kernels.load()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert not kernels.available() and not kernels.available()
    assert len(w) == 1 and "using torch.compile instead" in str(w[0].message)
    assert not get_objective("ce_gppo", compile=True)._cpu_kernel_applies(torch.zeros(1, 1))


def test_compile_error_is_reported(monkeypatch, tmp_path):
    bad = tmp_path / "bad.c"
    bad.write_text("this is not C")
    monkeypatch.setattr(kernels, "SOURCE", bad)
    with pytest.raises(kernels.KernelUnavailable, match="failed"):
        kernels.build(tmp_path / "cache")
    assert not any((tmp_path / "cache").iterdir())


def test_switch_off(monkeypatch):
    monkeypatch.setenv("CEGPPO_CPU_KERNEL", "0")
    assert not get_objective("ce_gppo", compile=True)._cpu_kernel_applies(torch.zeros(1, 1))


def test_nan_propagates():
    lp, old, adv, mask = batch()
    lp[2, 0] = math.nan
    _, g, m = run(get_objective("ce_gppo", compile=True), lp, old, adv, mask)
    _, g_ref, _ = run(get_objective("ce_gppo"), lp, old, adv, mask)
    assert torch.isnan(g[2, 0]) == torch.isnan(g_ref[2, 0])
    assert torch.isnan(m["ratio/mean"])


def test_bad_shapes_raise_instead_of_reading_past_the_buffers():
    lp, old, adv, mask = batch()
    kw = dict(eps_low=0.2, eps_high=0.2, low=(0.6, 0.6), high=(1.2, 1.2), clip_ratio_c=None)
    with pytest.raises(ValueError, match="one shape"):
        kernels.clip_surrogate(lp, old[:, :-1], adv, mask, 1.0, **kw)
    with pytest.raises(ValueError, match="advantages"):
        kernels.clip_surrogate(lp, old, adv[:-1], mask, 1.0, **kw)


def test_mixed_dtypes_are_converted():
    lp, old, adv, mask = batch()
    obj = get_objective("ce_gppo", compile=True)
    out = run(obj, lp, old.double(), adv.double(), mask.bool())
    ref = run(obj, lp, old, adv, mask)
    torch.testing.assert_close(out[1], ref[1])


def test_damaged_cached_library_is_rebuilt(monkeypatch, tmp_path):
    monkeypatch.setenv("CEGPPO_CACHE", str(tmp_path))
    monkeypatch.setattr(kernels, "_lib", None)
    monkeypatch.setattr(kernels, "_error", None)
    path = kernels.build()
    path.write_bytes(b"not a shared library")  # e.g. a file damaged on disk
    assert kernels.load() is not None
    assert path.read_bytes() != b"not a shared library"
