import math

import pytest
import torch

import reference
from conftest import TEST_DEVICE
from cegppo.algorithm.policy_loss import aggregator, policy_loss
from cegppo.algorithm.objectives import AGGREGATIONS, OBJECTIVES, aggregate, get_objective



@pytest.fixture(autouse=True)
def float64_by_default():
    """These tests compare formulations to 1e-12: float64, for this module only (not a collection-time global);
    on CEGPPO_TEST_DEVICE (cpu unless benchmarks/gpu_check.sh asks for cuda)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    with torch.device(TEST_DEVICE):
        yield
    torch.set_default_dtype(before)


def one_token(obj, ratio, adv):
    """(loss value, dJ/dlogp) for a single token, in the regions of docs/algorithm.md §2.2."""
    lp = torch.tensor([[math.log(ratio)]], requires_grad=True)
    old = torch.zeros(1, 1)
    loss = obj.token_loss(lp, old, torch.tensor([adv]), torch.ones(1, 1))
    loss.sum().backward()
    return loss.item(), -lp.grad.item()


# docs/algorithm.md §2.2: ratio, A, PPO (loss, dJ), CE-GPPO .75/1 (loss, dJ), CE-GPPO .5/1 (loss, dJ), clipfrac, lower
TABLE = [
    (0.70, -1, (0.80, 0), (0.60, -0.60), (0.40, -0.40)),
    (0.70, +1, (-0.70, 0.70), (-0.70, 0.70), (-0.70, 0.70)),
    (0.95, +1, (-0.95, 0.95), (-0.95, 0.95), (-0.95, 0.95)),
    (0.95, -1, (0.95, -0.95), (0.95, -0.95), (0.95, -0.95)),
    (1.30, +1, (-1.20, 0), (-1.20, 1.20), (-1.20, 1.20)),
    (1.30, -1, (1.30, -1.30), (1.30, -1.30), (1.30, -1.30)),
    (12.0, -1, (10.0, 0), (10.0, 0), (10.0, 0)),
]


@pytest.mark.parametrize("ratio,adv,ppo,ce75,ce50", TABLE)
def test_algorithm_table(ratio, adv, ppo, ce75, ce50):
    objs = {
        "ppo": get_objective("ppo_clip", clip_ratio_c=10.0),
        "ce75": get_objective("ce_gppo", beta1=0.75, beta2=1.0),
        "ce50": get_objective("ce_gppo", beta1=0.5, beta2=1.0),
    }
    for key, expect in (("ppo", ppo), ("ce75", ce75), ("ce50", ce50)):
        value, grad = one_token(objs[key], ratio, adv)
        assert value == pytest.approx(expect[0], abs=1e-12), key
        assert grad == pytest.approx(expect[1], abs=1e-12), key


def random_batch(B=16, T=24, spread=0.6, seed=0):
    # drawn on the CPU whatever the test device, so every device sees the same numbers
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, device="cpu") * 3
    lp = old + torch.randn(B, T, generator=g, device="cpu") * spread
    adv = torch.randn(B, generator=g, device="cpu")
    lens = torch.randint(1, T + 1, (B,), generator=g, device="cpu")
    mask = (torch.arange(T, device="cpu")[None] < lens[:, None]).to(torch.float64)
    return tuple(t.to(TEST_DEVICE) for t in (lp, old, adv, mask))


def grads(fn, lp, *args, **kw):
    x = lp.clone().requires_grad_(True)
    val = fn(x, *args, **kw)
    val.sum().backward()
    return val.detach(), x.grad


@pytest.mark.parametrize("beta1,beta2", [(0.75, 1.0), (0.5, 1.0), (0.0, 0.0), (1.0, 0.5), (2.0, 3.0)])
@pytest.mark.parametrize("c", [10.0, 3.0, None])
def test_ce_gppo_matches_authors_formulation(beta1, beta2, c):
    lp, old, adv, _ = random_batch(spread=1.5)
    obj = get_objective("ce_gppo", beta1=beta1, beta2=beta2, clip_ratio_c=c, eps_low=0.2, eps_high=0.28)
    v1, g1 = grads(obj.token_loss, lp, old, adv, None)
    v2, g2 = grads(reference.ce_gppo_masked, lp, old, adv, 0.2, 0.28, beta1, beta2, c)
    v3, g3 = grads(reference.ce_gppo_where, lp, old, adv, 0.2, 0.28, beta1, beta2, c)
    torch.testing.assert_close(v1, v2, rtol=0, atol=1e-12)
    torch.testing.assert_close(g1, g2, rtol=0, atol=1e-12)
    torch.testing.assert_close(v1, v3, rtol=0, atol=1e-12)
    torch.testing.assert_close(g1, g3, rtol=0, atol=1e-12)


def test_ppo_clip_matches_verl_vanilla():
    lp, old, adv, _ = random_batch(spread=1.5)
    for c in (None, 3.0):
        obj = get_objective("ppo_clip", eps_low=0.2, eps_high=0.28, clip_ratio_c=c)
        v1, g1 = grads(obj.token_loss, lp, old, adv, None)
        v2, g2 = grads(reference.ppo_clip_where, lp, old, adv, 0.2, 0.28, c)
        torch.testing.assert_close(v1, v2, rtol=0, atol=1e-12)
        torch.testing.assert_close(g1, g2, rtol=0, atol=1e-12)


def test_beta_zero_is_ppo_gradient_and_beta_one_is_gppo():
    lp, old, adv, _ = random_batch(spread=1.0)
    ppo = get_objective("ppo_clip", clip_ratio_c=10.0)
    ce0 = get_objective("ce_gppo", beta1=0.0, beta2=0.0)
    ce1 = get_objective("ce_gppo", beta1=1.0, beta2=1.0)
    gppo = get_objective("gppo")
    v_ppo, g_ppo = grads(ppo.token_loss, lp, old, adv, None)
    v0, g0 = grads(ce0.token_loss, lp, old, adv, None)
    torch.testing.assert_close(g0, g_ppo, rtol=0, atol=0)
    assert not torch.equal(v0, v_ppo)  # forward values differ on out-of-clip tokens (0 vs clipped constant)
    v1, g1 = grads(ce1.token_loss, lp, old, adv, None)
    vg, gg = grads(gppo.token_loss, lp, old, adv, None)
    torch.testing.assert_close(g1, gg, rtol=0, atol=0)
    torch.testing.assert_close(v1, v_ppo, rtol=0, atol=0)  # beta = 1: forward equals PPO-clip


def test_gppo_vs_cispo_gradients_agree_and_differ_where_documented():
    lp, old, adv, mask = random_batch(B=64, spread=1.0)
    gppo = get_objective("gppo", eps_low=0.2, eps_high=0.28, clip_ratio_c=None)
    cis = get_objective("cispo", eps_low=0.2, eps_high=0.28)
    _, g_gppo = grads(gppo.token_loss, lp, old, adv, None)
    _, g_cis = grads(cis.token_loss, lp, old, adv, None)
    a = adv[:, None].expand_as(lp)
    r = (lp - old).exp()
    unclipped_side = ((a < 0) & (r > 1.28)) | ((a > 0) & (r < 0.8))
    assert unclipped_side.any() and (~unclipped_side).any()
    torch.testing.assert_close(g_gppo[~unclipped_side], g_cis[~unclipped_side], rtol=0, atol=1e-12)
    assert (g_gppo[unclipped_side] - g_cis[unclipped_side]).abs().min() > 1e-6


def test_gspo_sequence_ratio_gradient():
    lp, old, adv, mask = random_batch(spread=0.001)
    obj = get_objective("gspo")
    x = lp.clone().requires_grad_(True)
    loss, _ = policy_loss(obj, x, old, adv, mask)
    loss.backward()
    # reference: J = mean_i min(s_i A_i, clip(s_i) A_i) with s_i = exp(mean_t log r); autograd through s directly
    y = lp.clone().requires_grad_(True)
    s = (((y - old) * mask).sum(-1) / mask.sum(-1)).exp()
    ref = torch.maximum(-adv * s, -adv * s.clamp(1 - 3e-4, 1 + 4e-4)).mean()
    ref.backward()
    torch.testing.assert_close(loss.detach(), ref.detach(), rtol=0, atol=1e-12)
    torch.testing.assert_close(x.grad * mask, y.grad * mask, rtol=0, atol=1e-12)


@pytest.mark.parametrize("agg", AGGREGATIONS)
@pytest.mark.parametrize("name", ["ce_gppo", "ppo_clip", "cispo", "gspo"])
def test_micro_batch_invariance(agg, name):
    lp, old, adv, mask = random_batch(B=12, spread=0.8, seed=3)
    obj = get_objective(name)
    x = lp.clone().requires_grad_(True)
    whole, _ = policy_loss(obj, x, old, adv, mask, reduce=aggregator(agg))
    whole.backward()
    y = lp.clone().requires_grad_(True)
    total = 0.0
    n_tok, n_seq = mask.sum(), mask.shape[0]
    for sl in (slice(0, 5), slice(5, 6), slice(6, 12)):
        part, _ = policy_loss(obj, y[sl], old[sl], adv[sl], mask[sl],
                              reduce=aggregator(agg, num_tokens=n_tok, num_seqs=n_seq))
        part.backward()
        total = total + part.detach()
    torch.testing.assert_close(total, whole.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(y.grad, x.grad, rtol=1e-12, atol=1e-12)


def test_aggregation_formulas():
    L = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    m = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    assert aggregate(L, m, "token-mean").item() == pytest.approx(18 / 5)
    assert aggregate(L, m, "token-sum").item() == pytest.approx(18)
    assert aggregate(L, m, "seq-mean-token-mean").item() == pytest.approx((1.5 + 5) / 2)
    assert aggregate(L, m, "seq-mean-token-sum").item() == pytest.approx((3 + 15) / 2)
    assert aggregate(L, m, "seq-mean-token-sum-norm").item() == pytest.approx(18 / 3)
    assert aggregate(L, m, "token-mean", num_tokens=10).item() == pytest.approx(1.8)
    with pytest.raises(ValueError, match="token-mean"):
        aggregate(L, m, "bogus")


@pytest.mark.parametrize("name", list(OBJECTIVES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_finite_at_extreme_log_ratios(name, dtype):
    lp = torch.tensor([[-200.0, 200.0, 0.0, -0.01], [200.0, -200.0, -1e-4, -50.0]], dtype=dtype)
    old = torch.tensor([[0.0, 0.0, -200.0, -0.01], [-0.5, -0.5, -200.0, -50.0]], dtype=dtype)
    mask = torch.ones_like(lp)
    for adv in (torch.tensor([1.0, -1.0], dtype=dtype), torch.tensor([-1.0, 1.0], dtype=dtype)):
        x = lp.clone().requires_grad_(True)
        loss, metrics = policy_loss(get_objective(name), x, old, adv, mask)
        loss.backward()
        assert torch.isfinite(loss), name
        assert torch.isfinite(x.grad).all(), name
        assert all(torch.isfinite(v) for v in metrics.values())


def test_advantage_shapes_equivalent():
    lp, old, adv, mask = random_batch()
    obj = get_objective("ce_gppo")
    a = obj.token_loss(lp, old, adv, mask)
    b = obj.token_loss(lp, old, adv[:, None], mask)
    c = obj.token_loss(lp, old, adv[:, None].expand_as(lp), mask)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(a, c, rtol=0, atol=0)
    with pytest.raises(ValueError, match="advantages"):
        obj.token_loss(lp, old, adv[:3], mask)


@pytest.mark.parametrize(
    "name,kw,match",
    [
        ("ce_gpo", {}, "valid objectives"),
        ("ce_gppo", {"eps_low": 0.0}, "eps_low"),
        ("ce_gppo", {"eps_high": 1.01}, "eps_high"),  # 1 is allowed (no clip on that side)
        ("ce_gppo", {"beta1": -0.1}, "beta1"),
        ("ce_gppo", {"beta2": float("nan")}, "beta2"),
        ("ce_gppo", {"clip_ratio_c": 1.0}, "clip_ratio_c"),
        ("ppo_clip", {"clip_ratio_c": 0.5}, "clip_ratio_c"),
        ("ce_gppo", {"beta1": 2.0, "clip_ratio_c": 1.5}, "below clip_ratio_c"),
        ("ce_gppo", {"beta3": 1.0}, "unknown hyperparameter"),
        ("cispo", {"beta1": 1.0}, "unknown hyperparameter"),
    ],
)
def test_invalid_hyperparameters(name, kw, match):
    with pytest.raises(ValueError, match=match):
        get_objective(name, **kw)


def test_defaults_are_authors_7b_script():
    assert get_objective("ce_gppo").hparams == dict(eps_low=0.2, eps_high=0.2, beta1=0.75, beta2=1.0, clip_ratio_c=10.0)
    assert get_objective("dapo").hparams["eps_high"] == 0.28


def test_metrics_are_tensors_and_region_fractions_correct():
    lp = torch.log(torch.tensor([[0.7, 0.7, 1.3, 1.3, 12.0, 1.0]]))
    old = torch.zeros_like(lp)
    adv = torch.tensor([[-1.0, 1.0, 1.0, -1.0, -1.0, 1.0]])
    mask = torch.ones_like(lp)
    _, m = policy_loss(get_objective("ce_gppo"), lp, old, adv, mask)
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in m.values())
    assert m["clip/low_frac"].item() == pytest.approx(1 / 6)
    assert m["clip/high_frac"].item() == pytest.approx(1 / 6)
    assert m["clip/dual_frac"].item() == pytest.approx(1 / 6)
    assert m["ppo_kl"].item() == pytest.approx(-lp.mean().item())


@pytest.mark.parametrize("spread", [0.5, 1.5])
def test_cispo_matches_minimax_formulation(spread):
    lp, old, adv, mask = random_batch(spread=spread)
    v1, g1 = grads(get_objective("cispo").token_loss, lp, old, adv, mask)
    v2, g2 = grads(reference.cispo_autograd, lp, old, adv, 0.2, 0.28)
    torch.testing.assert_close(v1, v2, rtol=0, atol=1e-12)
    torch.testing.assert_close(g1, g2, rtol=0, atol=1e-12)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gspo_matches_the_papers_token_formulation(seed):
    lp, old, adv, mask = random_batch(B=32, spread=0.004, seed=seed)  # sequence ratios on both sides of 1 +- eps
    s = ((lp - old) * mask).sum(-1) / mask.sum(-1)
    assert (s.abs() > 4e-4).any() and (s.abs() < 3e-4).any()
    v1, g1 = grads(get_objective("gspo").token_loss, lp, old, adv, mask)
    v2, g2 = grads(reference.gspo_token, lp, old, adv, mask)
    torch.testing.assert_close(v1, v2, rtol=0, atol=1e-12)
    torch.testing.assert_close(g1, g2, rtol=0, atol=1e-12)


def test_registering_a_plain_autograd_objective():
    """A new objective needs no hand-derived gradient: vanilla policy gradient, -A log pi."""
    from cegppo.algorithm.objectives import OBJECTIVES, register_objective

    def vanilla_pg(log_prob, old_log_prob, adv, mask, *, eps_low=0.2, eps_high=0.2):
        return -adv * log_prob

    register_objective("test_vanilla_pg", vanilla_pg, dict(eps_low=0.2, eps_high=0.2))
    try:
        lp, old, adv, mask = random_batch()
        obj = get_objective("test_vanilla_pg")
        x = lp.clone().requires_grad_(True)
        loss, m = policy_loss(obj, x, old, adv, mask)
        loss.backward()
        torch.testing.assert_close(x.grad, -adv[:, None] * mask / mask.sum(), rtol=0, atol=1e-12)
        F = obj.gradient_weight(lp, old, adv, mask)
        torch.testing.assert_close(F, torch.ones_like(F), rtol=0, atol=1e-12)  # d J / d log pi = 1 * A
        assert {"clip/low_frac", "clip/high_frac", "ppo_kl"} <= set(m)
    finally:
        del OBJECTIVES["test_vanilla_pg"]


# ---------------------------------------------------------------------------------------------------------
# Clip-Cov / KL-Cov against verl's implementations (the same inputs, the same torch seed for Clip-Cov's draw)
# ---------------------------------------------------------------------------------------------------------


def _cov_batch(seed: int, B: int = 8, T: int = 40):
    """Token-level advantages and log-probs spread enough that many tokens have covariance in (1, 5)."""
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(B, T, generator=g, dtype=torch.float64, device="cpu") * 4 - 0.05
    old = lp + torch.randn(B, T, generator=g, dtype=torch.float64, device="cpu") * 0.3
    adv = torch.randn(B, T, generator=g, dtype=torch.float64, device="cpu") * 2
    lengths = torch.randint(T // 3, T + 1, (B,), generator=g, device="cpu")
    mask = torch.arange(T, device="cpu")[None, :] < lengths[:, None]
    return tuple(t.to(TEST_DEVICE) for t in (lp, old, adv, mask))


def _verl_cov_config(eps_low: float = 0.2, eps_high: float = 0.2, **policy_loss):
    from verl.workers.config import ActorConfig, PolicyLossConfig

    return ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, ppo_mini_batch_size=1,
                       clip_ratio_low=eps_low, clip_ratio_high=eps_high, policy_loss=PolicyLossConfig(**policy_loss))


@pytest.mark.parametrize("name,hp", [
    ("clip_cov", {}),  # verl's defaults: one token (2e-4 of ~200) drawn among the candidates
    ("clip_cov", {"clip_cov_ratio": 0.05}),
    ("clip_cov", {"clip_cov_ratio": 0.5, "clip_cov_lb": 0.5, "clip_cov_ub": 3.0}),  # more candidates than drawn
    ("kl_cov", {}),
    ("kl_cov", {"kl_cov_ratio": 0.1, "ppo_kl_coef": 1.0}),
    ("clip_cov_paper", {}),  # the authors' settings: verl's loss under their script's config
    ("kl_cov_paper", {}),
])
def test_cov_objectives_match_verl(name, hp):
    pytest.importorskip("verl")
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    ours = get_objective(name, **hp)
    verl_fn = get_policy_loss_fn(name.removesuffix("_paper"))
    hp = ours.hparams  # every hyperparameter, the preset's included, goes into verl's config
    for seed in range(4):
        lp, old, adv, mask = _cov_batch(seed)
        x_ref, x = lp.clone().requires_grad_(True), lp.clone().requires_grad_(True)
        torch.manual_seed(seed)
        ref, _ = verl_fn(old_log_prob=old, log_prob=x_ref, advantages=adv, response_mask=mask,
                         loss_agg_mode="token-mean", config=_verl_cov_config(**hp))
        ref.backward()
        torch.manual_seed(seed)
        loss = aggregate(ours.token_loss(x, old, adv, mask), mask, "token-mean")
        loss.backward()
        torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-15)
        torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-12, atol=1e-15)
        # the selection acted: some masked tokens differ from the plain (unclipped / clipped) surrogate
        plain = (get_objective("ppo_clip", eps_low=hp["eps_low"], eps_high=hp["eps_high"]).token_loss(lp, old, adv, mask)
                 if name.startswith("clip_cov") else -adv * (lp - old).exp())
        assert ((ours.token_loss(lp, old, adv, mask) - plain).abs() * mask).sum() > 0


def test_cov_objectives_select_the_documented_tokens():
    lp, old, adv, mask = _cov_batch(0)
    m = mask.double()
    # KL-Cov: the top-k centred covariances over the masked tokens get + coef * |log r|
    k = max(1, int(m.sum().item() * 0.1))
    per = get_objective("kl_cov", kl_cov_ratio=0.1, ppo_kl_coef=1.0).token_loss(lp, old, adv, mask)
    extra = (per - (-adv * (lp - old).exp())) * m
    cov = (adv[mask] - adv[mask].mean()) * (lp[mask] - lp[mask].mean())
    top = torch.topk(cov, k).indices
    assert set(torch.nonzero(extra[mask]).flatten().tolist()) == set(top.tolist())
    torch.testing.assert_close(extra[mask][top], (lp - old).abs()[mask][top])
    # Clip-Cov: exactly max(1, int(ratio * n)) tokens zeroed, all with covariance in (lb, ub), none clipped by PPO
    per = get_objective("clip_cov", clip_cov_ratio=0.05).token_loss(lp, old, adv, mask)
    zeroed = (per == 0) & mask & (adv != 0)
    assert int(zeroed.sum()) == max(1, int(0.05 * m.sum().item()))
    c = (adv - (adv * m).sum() / m.sum()) * (lp - (lp * m).sum() / m.sum())
    assert ((c[zeroed] > 1.0) & (c[zeroed] < 5.0)).all()


@pytest.mark.parametrize("objective,ref", [("gppo", "ce_gppo_masked"), ("grpo", "ppo_clip_where")])
def test_erc_matches_the_authors_gppo_erc_and_grpo_erc(objective, ref):
    """ERC as a gradient mask on any objective: our policy_loss(..., gradient_mask=entropy_ratio_mask(...)) against
    the authors' formulation (tests/reference.py::erc_where over the objective's reference), value and gradient;
    with entropy ratios on both sides of the band."""
    from cegppo.algorithm.policy_loss import entropy_ratio_mask

    lp, old, adv, mask = random_batch(spread=0.4, seed=5)
    g = torch.Generator().manual_seed(6)
    old_ent = torch.rand(lp.shape, generator=g, device="cpu").to(TEST_DEVICE) + 0.1
    ent = old_ent * (1 + (torch.rand(lp.shape, generator=g, device="cpu").to(TEST_DEVICE) - 0.5) * 0.2)  # ratios 0.9-1.1
    gate = entropy_ratio_mask(ent, old_ent, mask, 0.95, 1.05)
    assert 0.2 < gate.double().mean() < 0.8  # both sides of the band are exercised
    hp = get_objective(objective).hparams
    x = lp.clone().requires_grad_(True)
    ours, _ = policy_loss(get_objective(objective), x, old, adv, mask, gradient_mask=gate)
    ours.backward()
    y = lp.clone().requires_grad_(True)
    per_token = (reference.ce_gppo_masked(y, old, adv, hp["eps_low"], hp["eps_high"], hp["beta1"], hp["beta2"],
                                          hp["clip_ratio_c"]) if ref == "ce_gppo_masked"
                 else reference.ppo_clip_where(y, old, adv, hp["eps_low"], hp["eps_high"], hp["clip_ratio_c"]))
    theirs = (reference.erc_where(per_token, ent, old_ent, mask) * mask).sum() / mask.sum()
    theirs.backward()
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x.grad, y.grad, rtol=1e-12, atol=1e-12)
    assert (x.grad[~gate] == 0).all() and (x.grad[gate & (mask != 0)] != 0).any()
