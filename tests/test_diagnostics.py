import math

import pytest
import torch

from cegppo.algorithm.diagnostics import QUADRANTS, entropy_change_terms, quadrant_metrics
from cegppo.algorithm.logprobs import token_stats
from cegppo.algorithm.policy_loss import policy_loss
from cegppo.algorithm.objectives import get_objective


def entropy(z):
    p = torch.softmax(z, -1)
    return -(p * torch.log_softmax(z, -1)).sum(-1)


@pytest.mark.parametrize("ratio,adv", [(1.0, 1.0), (1.0, -1.0), (0.5, -1.0), (1.6, 1.0), (0.5, 1.0)])
@pytest.mark.parametrize("objective", ["ce_gppo", "ppo_clip", "gppo", "cispo"])
def test_first_order_dH_matches_true_entropy_change(ratio, adv, objective):
    """One gradient step on a V=50 softmax: the per-token formula predicts the true entropy change."""
    torch.manual_seed(0)
    z = (torch.randn(50, dtype=torch.float64) * 2).requires_grad_(True)
    a = 3
    obj = get_objective(objective)
    lp = torch.log_softmax(z, -1)[a].view(1, 1)
    old = lp.detach() - math.log(ratio)
    A = torch.tensor([adv], dtype=torch.float64)
    loss, _ = policy_loss(obj, lp, old, A, torch.ones(1, 1, dtype=torch.float64))
    loss.backward()
    eta = 1e-3
    dH_true = (entropy(z.detach() - eta * z.grad) - entropy(z.detach())).item()
    logits = z.detach().view(1, 1, 50)
    lp2, H, C = token_stats(logits, torch.tensor([[a]]), collision=True)
    F = obj.gradient_weight(lp2.double(), old, A, torch.ones(1, 1))
    pred = eta * entropy_change_terms(F, A.view(1, 1), lp2.exp().double(), H.double(), C.double()).item()
    if abs(dH_true) < 1e-12:
        assert abs(pred) < 1e-10
    else:
        assert pred == pytest.approx(dH_true, rel=5e-3)


def test_quadrant_signs_on_hand_built_batch():
    """PA&LP and NA&HP raise entropy; PA&HP and NA&LP lower it (docs/algorithm.md §6.1)."""
    V = 20
    z = torch.zeros(4, V)
    z[:, 0] = 4.0  # token 0 dominant (p ~ 0.74), the others rare
    tokens = torch.tensor([[0, 5, 0, 5]])  # PA_HP, PA_LP, NA_HP, NA_LP
    lp, H, C = token_stats(z.view(1, 4, V), tokens, collision=True)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    mask = torch.ones(1, 4)
    obj = get_objective("ppo_clip")
    m = quadrant_metrics(obj, lp, lp, adv, mask, H, C)
    for q in QUADRANTS:
        assert m[f"quadrant/{q}/frac"].item() == pytest.approx(0.25)
        assert m[f"quadrant/{q}/entropy"].item() == pytest.approx(H[0, 0].item(), rel=1e-5)
    assert m["quadrant/PA_HP/dH"] < 0 and m["quadrant/NA_LP/dH"] < 0
    assert m["quadrant/PA_LP/dH"] > 0 and m["quadrant/NA_HP/dH"] > 0
    total = sum(m[f"quadrant/{q}/dH"] for q in QUADRANTS)
    assert m["dH/predicted"].item() == pytest.approx(total.item())


def test_beta_scales_out_of_clip_quadrant_contribution():
    """Out-of-clip NA&LP tokens: PPO contributes 0, CE-GPPO contributes beta1 (1 - eps) times the in-clip weight."""
    V = 20
    z = torch.zeros(1, V)
    z[0, 0] = 4.0
    lp, H, C = token_stats(z.view(1, 1, V), torch.tensor([[5]]), collision=True)
    old = lp + math.log(1 / 0.5)  # ratio 0.5 < 0.8: beta1 region
    adv = torch.tensor([[-1.0]])
    mask = torch.ones(1, 1)
    ppo = quadrant_metrics(get_objective("ppo_clip"), lp, old, adv, mask, H, C, token_prob=torch.full((1, 1), 0.01))
    ce = quadrant_metrics(get_objective("ce_gppo", beta1=0.5), lp, old, adv, mask, H, C, token_prob=torch.full((1, 1), 0.01))
    gp = quadrant_metrics(get_objective("gppo"), lp, old, adv, mask, H, C, token_prob=torch.full((1, 1), 0.01))
    assert ppo["quadrant/NA_LP/dH"].item() == 0.0
    assert ce["quadrant/NA_LP/dH"].item() < 0
    assert ce["quadrant/NA_LP/dH"].item() == pytest.approx(0.5 * gp["quadrant/NA_LP/dH"].item())


def test_empty_quadrants_and_zero_advantage_are_finite():
    lp = torch.full((2, 3), -0.1)
    H = torch.ones(2, 3)
    m = quadrant_metrics(get_objective("ce_gppo"), lp, lp, torch.zeros(2), torch.ones(2, 3), H, torch.zeros(2, 3))
    assert all(torch.isfinite(v) for v in m.values())
    assert sum(m[f"quadrant/{q}/frac"] for q in QUADRANTS).item() == 0.0
