"""Property-based checks of the public algorithm API (issue 23, class 4; docs/reliability.md): ``policy_loss``,
``aggregate``, ``get_objective`` and ``group_advantages`` refuse what they cannot use, with one ``ValueError``
naming the argument, and masked positions never contribute NaN/Inf.

(a) valid inputs give a finite loss equal to a reference computation (tests/reference.py + a hand reduction);
(b) any argument of a wrong shape raises ``ValueError`` naming that argument (nothing is broadcast);
(c) NaN/Inf at masked positions change neither the loss, nor its gradient, nor the metrics;
(d) bad normalisers and hyperparameters raise.
Deterministic by default; CEGPPO_FUZZ_EXAMPLES=2000 runs a longer, randomised search.
"""

from __future__ import annotations

import math
import os
import re

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, assume, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import reference  # noqa: E402
from cegppo.algorithm.advantages import group_advantages  # noqa: E402
from cegppo.algorithm.checks import check_normaliser, nan_unless_positive  # noqa: E402
from cegppo.algorithm.objectives import AGGREGATIONS, OBJECTIVES, aggregate, get_objective  # noqa: E402
from cegppo.algorithm.policy_loss import (aggregator, correct_nll, entropy_bonus, entropy_metrics,  # noqa: E402
                                         k3_kl, kl_penalty, policy_loss)

# which public function takes (and so checks) each argument of the full loss
TAKES = {"old_log_prob": "policy_loss", "advantages": "policy_loss", "mask": "policy_loss",
         "token_weights": "policy_loss", "entropy": "entropy_bonus", "collision": "entropy_metrics",
         "ref_log_prob": "kl_penalty", "kl_weights": "kl_penalty", "correct": "correct_nll",
         "num_tokens": "aggregator", "num_seqs": "aggregator", "num_correct_tokens": "correct_nll"}


def full_loss(objective, *, log_prob, old_log_prob, advantages, mask, agg, num_tokens, num_seqs, token_weights,
              entropy, collision, entropy_coeff, ref_log_prob, kl_coeff, kl_weights, correct, positive_loss_coeff,
              num_correct_tokens):
    """The full loss as cegppo's trainer writes it (Trainer.update): one expression of the public terms."""
    reduce = aggregator(agg, num_tokens=num_tokens, num_seqs=num_seqs)
    pg, metrics = policy_loss(objective, log_prob, old_log_prob, advantages, mask, reduce=reduce,
                              token_weights=token_weights)
    loss = (pg + positive_loss_coeff * correct_nll(log_prob, mask, correct, num_tokens=num_correct_tokens)
            + kl_coeff * kl_penalty(log_prob, ref_log_prob, mask, reduce=reduce, weights=kl_weights)
            - entropy_coeff * entropy_bonus(entropy, mask, reduce=reduce))  # (every term built: all are checked)
    metrics |= entropy_metrics(objective, log_prob, old_log_prob, advantages, mask, entropy, collision=collision)
    return loss, metrics

_DEEP = int(os.environ.get("CEGPPO_FUZZ_EXAMPLES", "0"))
PROPS = settings(max_examples=_DEEP or 60, deadline=None, suppress_health_check=[HealthCheck.too_slow],
                 database=None, derandomize=not _DEEP)
F64 = torch.float64
BAD = (math.nan, math.inf, -math.inf)

# objectives with an independent reference formulation: name -> per-token reference loss
REFERENCES = {
    "ce_gppo": lambda lp, old, adv, m, hp: reference.ce_gppo_where(
        lp, old, adv, hp["eps_low"], hp["eps_high"], hp["beta1"], hp["beta2"], hp["clip_ratio_c"]),
    "gppo": lambda lp, old, adv, m, hp: reference.ce_gppo_where(
        lp, old, adv, hp["eps_low"], hp["eps_high"], hp["beta1"], hp["beta2"], hp["clip_ratio_c"]),
    "ppo_clip": lambda lp, old, adv, m, hp: reference.ppo_clip_where(lp, old, adv, hp["eps_low"], hp["eps_high"],
                                                                     hp["clip_ratio_c"]),
    "dapo": lambda lp, old, adv, m, hp: reference.ppo_clip_where(lp, old, adv, hp["eps_low"], hp["eps_high"],
                                                                 hp["clip_ratio_c"]),
    "cispo": lambda lp, old, adv, m, hp: reference.cispo_autograd(lp, old, adv, hp["eps_low"], hp["eps_high"]),
    "gspo": lambda lp, old, adv, m, hp: reference.gspo_token(lp, old, adv, m, hp["eps_low"], hp["eps_high"]),
}


@st.composite
def batches(draw, objectives=tuple(OBJECTIVES)):
    """A valid policy_loss call: (objective name, kwargs), float64, every optional tensor present."""
    B, T = draw(st.integers(1, 4)), draw(st.integers(1, 6))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=F64) * 4
    lp = old + torch.randn(B, T, generator=g, dtype=F64) * draw(st.sampled_from([0.05, 0.5, 2.0]))
    mask = torch.rand(B, T, generator=g, dtype=F64) < draw(st.sampled_from([0.3, 0.7, 1.0]))
    adv_form = draw(st.sampled_from(["B", "B1", "BT"]))
    adv = torch.randn(*{"B": (B,), "B1": (B, 1), "BT": (B, T)}[adv_form], generator=g, dtype=F64)
    mask_dtype = draw(st.sampled_from([torch.bool, F64, torch.int64]))
    name = draw(st.sampled_from(objectives))
    kw = dict(
        log_prob=lp, old_log_prob=old, advantages=adv, mask=mask.to(mask_dtype),
        agg=draw(st.sampled_from(AGGREGATIONS)),
        num_tokens=draw(st.one_of(st.none(), st.floats(0.5, 50), st.just(torch.tensor(7.0, dtype=F64)))),
        num_seqs=draw(st.one_of(st.none(), st.integers(1, 8))),
        token_weights=torch.rand(B, T, generator=g, dtype=F64) + 0.5,
        entropy=torch.rand(B, T, generator=g, dtype=F64) * 2,
        collision=torch.rand(B, T, generator=g, dtype=F64) * 0.1,
        entropy_coeff=draw(st.sampled_from([0.0, 0.01])),
        ref_log_prob=old + torch.randn(B, T, generator=g, dtype=F64) * 0.3,
        kl_coeff=draw(st.sampled_from([0.0, 0.1])),
        kl_weights=torch.rand(B, T, generator=g, dtype=F64) + 0.5,
        correct=torch.rand(B, generator=g) < 0.5,
        positive_loss_coeff=draw(st.sampled_from([0.0, 0.2])),
        num_correct_tokens=draw(st.one_of(st.none(), st.integers(1, 30))),
    )
    return name, kw


def reference_reduce(values, mask, agg, num_tokens=None, num_seqs=None):
    """docs/algorithm.md §3, written out by hand over the masked tokens."""
    m = mask.to(F64)
    v = values * m
    if agg == "token-mean":
        return v.sum() / (m.sum().clamp(min=1) if num_tokens is None else num_tokens)
    if agg == "token-sum":
        return v.sum()
    if agg == "seq-mean-token-sum-norm":
        return v.sum() / values.shape[-1]
    seq = v.sum(-1) if agg == "seq-mean-token-sum" else v.sum(-1) / m.sum(-1).clamp(min=1)
    return seq.sum() / (values.shape[0] if num_seqs is None else num_seqs)


def run(name, kw, **override):
    torch.manual_seed(0)  # clip_cov draws its tokens from the global generator
    lp = kw["log_prob"].clone().requires_grad_(True)
    loss, metrics = full_loss(get_objective(name), **{**kw, "log_prob": lp, **override})
    loss.backward()
    return loss.detach(), lp.grad, metrics


# (a) -------------------------------------------------------------------------------------------------------

@PROPS
@given(batches(tuple(REFERENCES)))
def test_valid_inputs_give_the_reference_loss(case):
    name, kw = case
    loss, grad, metrics = run(name, kw)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert all(torch.isfinite(v) for v in metrics.values()), metrics
    hp = get_objective(name).hparams
    lp, mask, agg = kw["log_prob"], kw["mask"], kw["agg"]
    red = dict(num_tokens=kw["num_tokens"], num_seqs=kw["num_seqs"])
    want = reference_reduce(REFERENCES[name](lp, kw["old_log_prob"], kw["advantages"], mask, hp) * kw["token_weights"],
                            mask, agg, **red)
    if kw["positive_loss_coeff"] > 0:
        n = kw["num_correct_tokens"]
        nll_mask = mask.to(F64) * kw["correct"][:, None]
        want = want + kw["positive_loss_coeff"] * reference_reduce(-lp, nll_mask, "token-mean", num_tokens=n)
    if kw["kl_coeff"] > 0:
        d = kw["ref_log_prob"] - lp
        want = want + kw["kl_coeff"] * reference_reduce((d.exp() - d - 1) * kw["kl_weights"], mask, agg, **red)
    if kw["entropy_coeff"] > 0:
        want = want - kw["entropy_coeff"] * reference_reduce(kw["entropy"], mask, agg, **red)
    torch.testing.assert_close(loss, want.to(loss.dtype), rtol=1e-10, atol=1e-12)


def test_k3_reference_matches():
    """The KL term of (a) uses the textbook k3; pin it to policy_loss's own k3 so (a) tests the assembly."""
    lp, ref = torch.tensor([[-1.0, -2.0]], dtype=F64), torch.tensor([[-1.5, -0.5]], dtype=F64)
    d = ref - lp
    torch.testing.assert_close(k3_kl(lp, ref), d.exp() - d - 1)


# (b) -------------------------------------------------------------------------------------------------------

SHAPED = ("old_log_prob", "advantages", "mask", "token_weights", "entropy", "collision", "ref_log_prob",
          "kl_weights", "correct")


def allowed_shapes(name, B, T):
    if name == "advantages":
        return {(B,), (B, 1), (B, T)}
    return {(B,)} if name == "correct" else {(B, T)}


@PROPS
@given(batches(), st.sampled_from(SHAPED), st.lists(st.integers(0, 7), min_size=0, max_size=3).map(tuple))
def test_any_wrong_shape_is_refused_naming_the_argument(case, arg, shape):
    name, kw = case
    B, T = kw["log_prob"].shape
    assume(shape not in allowed_shapes(arg, B, T))
    bad = torch.zeros(shape, dtype=kw[arg].dtype)
    with pytest.raises(ValueError, match="^" + re.escape(f"{TAKES[arg]}: {arg} has shape {tuple(shape)}; expected")):
        full_loss(get_objective(name), **{**kw, arg: bad})


def test_issue_examples_are_refused():
    lp, adv, mask = torch.zeros(4, 5), torch.ones(4), torch.ones(4, 5)
    obj = get_objective("ce_gppo")
    with pytest.raises(ValueError, match=r"old_log_prob has shape \(1, 5\); expected \(4, 5\), the shape of log_prob"):
        policy_loss(obj, lp, torch.zeros(1, 5), adv, mask)
    with pytest.raises(ValueError, match=r"mask has shape \(5,\); expected \(4, 5\), the shape of log_prob"):
        policy_loss(obj, lp, lp, adv, torch.ones(5))
    with pytest.raises(ValueError, match=r"advantages has shape \(1,\); expected \(4,\) or \(4, 1\) or \(4, 5\)"):
        policy_loss(obj, lp, lp, torch.ones(1), mask)
    with pytest.raises(ValueError, match="log_prob has shape"):
        policy_loss(obj, torch.zeros(5), torch.zeros(5), adv, torch.ones(5))
    with pytest.raises(ValueError, match="aggregate: mask has shape"):
        aggregate(lp, torch.ones(5))


@pytest.mark.parametrize("arg,value,msg", [
    ("log_prob", torch.zeros(2, 3, dtype=torch.int64), "log_prob must be floating"),
    ("old_log_prob", torch.zeros(2, 3, dtype=torch.int64), "old_log_prob must be floating"),
    ("advantages", torch.ones(2, dtype=torch.bool), "advantages must be real"),
    ("mask", torch.ones(2, 3, dtype=torch.complex64), "mask must be bool, integer or floating"),
    ("advantages", [1.0, -1.0], "advantages must be a tensor, got list"),
])
def test_wrong_dtypes_are_refused(arg, value, msg):
    kw = dict(log_prob=torch.zeros(2, 3), old_log_prob=torch.zeros(2, 3), advantages=torch.ones(2),
              mask=torch.ones(2, 3))
    with pytest.raises(ValueError, match=f"policy_loss: {msg}"):
        policy_loss(get_objective("ce_gppo"), **{**kw, arg: value})
    with pytest.raises(ValueError, match="entropy_bonus: entropy must be floating"):
        entropy_bonus(torch.ones(2, 3, dtype=torch.int32), kw["mask"])


def test_currently_valid_forms_still_work():
    """Integer advantages, int64 / bool / float masks, bool token weights, a 0-d int normaliser: as before."""
    lp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.1, -3.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    obj = get_objective("ce_gppo")
    want, _ = policy_loss(obj, lp, lp - 0.1, torch.tensor([1.0, -1.0]), mask.float())
    for adv in (torch.tensor([1, -1]), torch.tensor([[1.0], [-1.0]]), torch.tensor([[1.0] * 3, [-1.0] * 3])):
        for m in (mask, mask.bool(), mask.float()):
            got, _ = policy_loss(obj, lp, lp - 0.1, adv, m, token_weights=torch.ones(2, 3, dtype=torch.bool),
                                 reduce=aggregator(num_tokens=torch.tensor(3)))
            torch.testing.assert_close(got, want)


# (c) -------------------------------------------------------------------------------------------------------

@PROPS
@given(batches(), st.sampled_from(BAD), st.data())
def test_nan_and_inf_at_masked_positions_change_nothing(case, bad, data):
    name, kw = case
    keep = kw["mask"] != 0
    assume(not keep.all())
    B, T = keep.shape
    dirty = dict(kw)
    for arg in ("log_prob", "old_log_prob", "token_weights", "entropy", "collision", "ref_log_prob", "kl_weights"):
        if data.draw(st.booleans(), label=f"poison {arg}"):
            dirty[arg] = torch.where(keep, kw[arg], bad)
    adv = kw["advantages"]
    if data.draw(st.booleans(), label="poison advantages"):
        # per-token advantages at masked tokens; per-sequence ones on rows without a response token
        dirty["advantages"] = torch.where(keep if adv.shape == (B, T) else keep.any(-1).view(adv.shape), adv, bad)
    loss, grad, metrics = run(name, kw)
    loss2, grad2, metrics2 = run(name, dirty)
    torch.testing.assert_close(loss2, loss, rtol=0, atol=0)
    torch.testing.assert_close(grad2, grad, rtol=0, atol=0)
    assert metrics2.keys() == metrics.keys()
    for k in metrics:
        torch.testing.assert_close(metrics2[k], metrics[k], rtol=0, atol=0, msg=k)


@PROPS
@given(batches(), st.sampled_from(BAD))
def test_aggregate_ignores_nan_at_masked_positions(case, bad):
    _, kw = case
    values, mask = kw["entropy"], kw["mask"]
    assume(not (mask != 0).all())
    dirty = torch.where(mask != 0, values, bad)
    for agg in AGGREGATIONS:
        clean = aggregate(values, mask, agg, num_tokens=kw["num_tokens"], num_seqs=kw["num_seqs"])
        torch.testing.assert_close(aggregate(dirty, mask, agg, num_tokens=kw["num_tokens"], num_seqs=kw["num_seqs"]),
                                   clean, rtol=0, atol=0)


# (d) -------------------------------------------------------------------------------------------------------

BAD_NORMALISERS = [0, 0.0, -10, -1e-9, math.nan, math.inf, -math.inf, True, "3", [4], torch.tensor([3.0, 4.0]),
                   torch.tensor(-10.0), torch.tensor(0), torch.tensor(math.nan), torch.tensor(True)]


@PROPS
@given(batches(), st.sampled_from(["num_tokens", "num_seqs", "num_correct_tokens"]),
       st.sampled_from(range(len(BAD_NORMALISERS))))
def test_bad_normalisers_are_refused(case, arg, i):
    name, kw = case
    named = "num_tokens" if arg == "num_correct_tokens" else arg  # correct_nll's own normaliser
    with pytest.raises(ValueError, match=rf"^{TAKES[arg]}: {named} must be a positive finite number"):
        full_loss(get_objective(name), **{**kw, arg: BAD_NORMALISERS[i]})


@pytest.mark.parametrize("arg", ["num_tokens", "num_seqs", "norm_length"])
@pytest.mark.parametrize("value", BAD_NORMALISERS, ids=repr)
def test_aggregate_refuses_bad_normalisers(arg, value):
    with pytest.raises(ValueError, match=rf"^aggregate: {arg} must be a positive finite number"):
        aggregate(torch.ones(2, 3), torch.ones(2, 3), **{arg: value})


def test_normaliser_on_an_accelerator_is_never_read():
    """Off the CPU a normaliser is not read (no device sync per micro-batch); a bad one becomes NaN, which makes the
    loss NaN for the trainer's non-finite-loss guard. The meta device stands in for CUDA: reading it would raise."""
    out = check_normaliser("policy_loss", "num_tokens", torch.tensor(-10.0, device="meta"))
    assert out.device.type == "meta"
    assert torch.isnan(nan_unless_positive(torch.tensor([-10.0, 0.0, math.inf, math.nan]))).all()
    assert nan_unless_positive(torch.tensor(7)).item() == 7


def test_num_tokens_examples_of_the_issue():
    lp, mask = torch.zeros(2, 3), torch.ones(2, 3)
    for n in (-10, 0):
        with pytest.raises(ValueError, match=f"num_tokens must be a positive finite number.*got {float(n)!r}"):
            policy_loss(get_objective("ce_gppo"), lp, lp, torch.ones(2), mask, reduce=aggregator(num_tokens=n))


@pytest.mark.parametrize("fn,arg,value", [("entropy_metrics", "prob_threshold", 1.5),
                                          ("entropy_metrics", "prob_threshold", math.nan),
                                          ("aggregator", "agg", "mean"), ("policy_loss", "reduce", "token-mean")])
def test_bad_coefficients_are_refused(fn, arg, value):
    """(The loss's coefficients are plain numbers of the caller's expression; the config schema bounds them.)"""
    lp, mask = torch.zeros(2, 3), torch.ones(2, 3)
    obj = get_objective("ce_gppo")
    with pytest.raises(ValueError, match=f"{fn}: .*{arg}|{fn}: unknown aggregation"):
        if fn == "entropy_metrics":
            entropy_metrics(obj, lp, lp, torch.ones(2), mask, lp, prob_threshold=value)
        elif fn == "aggregator":
            aggregator(value)
        else:
            policy_loss(obj, lp, lp, torch.ones(2), mask, reduce=value)


def _bad_hparams(key):
    bad = [None, math.nan, math.inf, -math.inf, True, "0.2"] + ([] if key == "clip_cov_lb" else [-1.0])
    if key.startswith("eps"):
        bad += [0.0, 1.0 + 1e-9, 1.5]
    if key == "clip_ratio_c":
        bad = [v for v in bad if v is not None] + [1.0, 0.5]
    if key.endswith("_ratio") and key != "clip_ratio_c":
        bad += [0.0, 1.5]
    return bad


HPARAM_CASES = [(name, key, v) for name, spec in OBJECTIVES.items() for key in spec.defaults for v in _bad_hparams(key)]


@PROPS
@given(st.sampled_from(HPARAM_CASES))
def test_bad_hparams_are_refused_naming_the_key(case):
    name, key, value = case
    with pytest.raises(ValueError, match=rf"^{name}: .*{key}"):
        get_objective(name, **{key: value})


def test_issue_eps_high_none_and_valid_none():
    with pytest.raises(ValueError, match="ce_gppo: eps_high must be a number in"):
        get_objective("ce_gppo", eps_high=None)
    assert get_objective("ce_gppo", clip_ratio_c=None).hparams["clip_ratio_c"] is None  # None = dual clip off
    with pytest.raises(ValueError, match="unknown objective"):
        get_objective(None)


@pytest.mark.parametrize("kwargs,msg", [
    (dict(rewards=torch.ones(2, 4)), "rewards must be a 1-D tensor"),
    (dict(rewards=[1.0, 0.0]), "rewards must be a 1-D tensor"),
    (dict(rewards=torch.ones(4, dtype=torch.complex64)), "rewards must be bool, integer or floating"),
    (dict(group_size=0), "group_size must be an integer >= 1"),
    (dict(group_size=-2), "group_size must be an integer >= 1"),
    (dict(group_size=2.0), "group_size must be an integer >= 1"),
    (dict(group_size=True), "group_size must be an integer >= 1"),
    (dict(eps=0.0), "eps must be a finite number > 0"),
    (dict(eps=math.nan), "eps must be a finite number > 0"),
    (dict(eps=-1.0, estimator="rloo"), "eps must be a finite number >= 0"),
    (dict(rewards=torch.tensor([1.0, math.nan, 0.0, 1.0])), r"rewards must be finite; 1 of 4 are not \(first: rewards\[1\] = nan\)"),
    (dict(estimator=None), "unknown advantage estimator"),
])
def test_group_advantages_refuses(kwargs, msg):
    args = {"rewards": torch.tensor([1.0, 0.0, 0.0, 1.0]), "group_size": 2, **kwargs}
    with pytest.raises(ValueError, match=msg):
        group_advantages(**args)


@PROPS
@given(st.integers(1, 5), st.integers(1, 4), st.sampled_from(["grpo", "dr_grpo", "rloo"]), st.data())
def test_group_advantages_valid_forms(groups, size, estimator, data):
    """Valid rewards (float, int or bool) give finite advantages that sum to 0 per group."""
    dtype = data.draw(st.sampled_from([torch.float32, F64, torch.int64, torch.bool]))
    rewards = torch.tensor(data.draw(st.lists(st.integers(0, 3), min_size=groups * size, max_size=groups * size)))
    adv = group_advantages(rewards.to(dtype), size, estimator)
    assert adv.shape == (groups * size,) and torch.isfinite(adv).all()
    torch.testing.assert_close(adv.view(groups, size).sum(-1), torch.zeros(groups), atol=1e-5, rtol=0)
