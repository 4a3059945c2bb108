"""Direct tests of the building blocks: advantages and reward shaping, every term of the policy loss, the
generator's padding and masks, the SFT batch, the data order, and the package's layering."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from cegppo.algorithm.advantages import group_advantages, mixed_groups, overlong_penalty
from cegppo.algorithm.objectives import aggregate, get_objective
from cegppo.algorithm.policy_loss import (aggregator, correct_nll, entropy_bonus, k3_kl, kl_metric, kl_penalty,
                                         policy_loss)


# ------------------------------------------------------------------------------------------ advantages, shaping

def test_group_advantages_by_hand():
    r = torch.tensor([1.0, -1.0, -1.0, -1.0, 2.0, 2.0, 2.0, 2.0])
    grpo = group_advantages(r, 4, "grpo")  # eps 1e-6 keeps the all-equal group at 0, not NaN
    # group 1: mean -0.5, unbiased std = 1 -> (1.5, -0.5, -0.5, -0.5); group 2: all equal -> 0
    torch.testing.assert_close(grpo, torch.tensor([1.5, -0.5, -0.5, -0.5, 0, 0, 0, 0]))
    torch.testing.assert_close(group_advantages(r, 4, "dr_grpo"), torch.tensor([1.5, -0.5, -0.5, -0.5, 0, 0, 0, 0]))
    torch.testing.assert_close(group_advantages(r, 4, "rloo"), torch.tensor([2.0, -2 / 3, -2 / 3, -2 / 3, 0, 0, 0, 0]))
    assert torch.equal(group_advantages(torch.tensor([3.0, -1.0]), 1), torch.zeros(2))
    with pytest.raises(ValueError, match="do not split into groups of 3"):
        group_advantages(r, 3)
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        group_advantages(r, 4, "ppo")


def test_mixed_groups_filter():
    correct = torch.tensor([True, False, True, True, False, False])
    assert mixed_groups(correct, 2).tolist() == [True, False, False]


def test_overlong_penalty():
    lengths = torch.tensor([10.0, 96.0, 100.0, 112.0, 128.0])
    # L_max 128, buffer 32: no penalty up to 96 tokens, then linear down to -factor at 128
    torch.testing.assert_close(overlong_penalty(lengths, 128, 32, 1.0), torch.tensor([0.0, 0.0, -0.125, -0.5, -1.0]))
    torch.testing.assert_close(overlong_penalty(lengths, 128, 32, 0.5), torch.tensor([0.0, 0.0, -0.0625, -0.25, -0.5]))
    assert torch.equal(overlong_penalty(lengths, 128, 0), torch.zeros(5))


# ------------------------------------------------------------------------------------------ policy-loss terms

def batch(seed=0, B=6, T=7):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    lp = (old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3).requires_grad_(True)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    mask = (torch.arange(T)[None] < torch.randint(1, T + 1, (B,), generator=g)[:, None]).double()
    ent = (torch.rand(B, T, generator=g, dtype=torch.float64) * 2).requires_grad_(True)
    ref = old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.1
    correct = torch.tensor([True, False] * (B // 2))
    return lp, old, adv, mask, ent, ref, correct


def loss_and_grads(kl_coeff=0.0, entropy_coeff=0.0, positive_loss_coeff=0.0, num_correct_tokens=None):
    """The full loss as Trainer.update writes it, with these coefficients."""
    lp, old, adv, mask, ent, ref, correct = batch()
    reduce = aggregator("token-mean")
    loss, m = policy_loss(get_objective("ce_gppo"), lp, old, adv, mask, reduce=reduce)
    nll = correct_nll(lp, mask, correct, num_tokens=num_correct_tokens) if positive_loss_coeff else 0.0
    kl = kl_penalty(lp, ref, mask, reduce=reduce) if kl_coeff else 0.0
    bonus = entropy_bonus(ent, mask, reduce=reduce) if entropy_coeff else 0.0
    loss = loss + positive_loss_coeff * nll + kl_coeff * kl - entropy_coeff * bonus
    m |= {"kl": kl_metric(lp, ref, mask)} if kl_coeff else {}
    loss.backward()
    return loss.detach(), lp.grad, ent.grad, m, (lp.detach(), old, adv, mask, ent.detach(), ref, correct)


def test_policy_loss_terms_add_exactly():
    base, g_base, _, m_base, (lp, old, adv, mask, ent, ref, correct) = loss_and_grads()
    n = 40.0
    for kw, term in [
        (dict(kl_coeff=0.3), lambda: 0.3 * aggregate(k3_kl(lp, ref), mask, "token-mean")),
        (dict(entropy_coeff=0.1), lambda: -0.1 * aggregate(ent, mask, "token-mean")),
        (dict(positive_loss_coeff=0.2, num_correct_tokens=n),
         lambda: 0.2 * (-lp * mask * correct[:, None]).sum() / n),
    ]:
        loss, *_ = loss_and_grads(**kw)
        torch.testing.assert_close(loss - base, term(), rtol=0, atol=1e-12)


def test_policy_loss_gradients_of_each_term():
    _, g_base, ge_base, m, (lp, old, adv, mask, ent, ref, correct) = loss_and_grads()
    assert ge_base is None  # no entropy bonus: no gradient into the entropy
    _, g_kl, _, m_kl, _ = loss_and_grads(kl_coeff=0.3)
    d = ref - lp  # d k3 / d log pi = 1 - exp(ref - lp)
    torch.testing.assert_close(g_kl - g_base, 0.3 * (1 - d.exp()) * mask / mask.sum(), rtol=0, atol=1e-12)
    torch.testing.assert_close(m_kl["kl"], (k3_kl(lp, ref) * mask).sum() / mask.sum(), rtol=0, atol=1e-12)
    _, _, g_ent, _, _ = loss_and_grads(entropy_coeff=0.1)
    torch.testing.assert_close(g_ent, -0.1 * mask / mask.sum(), rtol=0, atol=1e-12)
    _, g_pos, _, m_pos, _ = loss_and_grads(positive_loss_coeff=0.2, num_correct_tokens=10.0)
    torch.testing.assert_close(g_pos - g_base, -0.2 * mask * correct[:, None] / 10.0, rtol=0, atol=1e-12)
    torch.testing.assert_close(m_pos["pg_loss"], m["pg_loss"], rtol=0, atol=0)  # the NLL leaves the objective's term


def test_policy_loss_token_weights_and_engine_reduce():
    lp, old, adv, mask, ent, ref, correct = batch()
    obj = get_objective("ce_gppo")
    w = torch.rand_like(old)
    loss, _ = policy_loss(obj, lp, old, adv, mask, token_weights=w)
    torch.testing.assert_close(loss, aggregate(obj.token_loss(lp, old, adv, mask) * w, mask), rtol=0, atol=1e-12)
    seen = []

    def reduce(values, m):
        seen.append(values.shape)
        return (values * m).sum() * 7.0

    loss = policy_loss(obj, lp, old, adv, mask, reduce=reduce)[0] - 0.1 * entropy_bonus(ent, mask, reduce=reduce)
    assert len(seen) == 2  # the objective and the entropy bonus both go through the engine's reduction
    expected = 7.0 * ((obj.token_loss(lp, old, adv, mask) * mask).sum() - 0.1 * (ent * mask).sum())
    torch.testing.assert_close(loss, expected, rtol=0, atol=1e-12)


def test_kl_is_clamped_like_the_ratio():
    lp = torch.tensor([[-200.0, 0.0]])
    ref = torch.tensor([[0.0, -200.0]])
    assert torch.isfinite(k3_kl(lp, ref)).all()


# ------------------------------------------------------------------------------------------ rollout, SFT, data

@pytest.fixture(scope="module")
def tiny():
    from cegppo.engine.models import load_model

    return load_model("tiny")


def test_prompts_are_left_padded_and_responses_masked_through_first_eos(tiny):
    from cegppo.engine.rollout import HFGenerator, Sampling, encode_prompts, response_mask_from

    model, tok = tiny
    prompts = [[{"role": "user", "content": "1+1?"}], [{"role": "user", "content": "What is 12 + 30 - 4?"}]]
    ids, att = encode_prompts(tok, prompts, 512)
    assert att[0, 0] == 0 and att[1, 0] == 1 and att[:, -1].all()  # the short prompt is padded on the left
    assert (ids[0][att[0] == 0] == tok.pad_token_id).all()
    eos = 5
    responses = torch.tensor([[1, 2, eos, 3, eos], [1, 2, 3, 4, 6]])
    mask, truncated = response_mask_from(responses, [eos])
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]] and truncated.tolist() == [False, True]

    generator = HFGenerator(model, tok, 512, torch.float32)
    torch.manual_seed(0)
    rb = generator.generate(prompts, 3, Sampling(1.0, 1.0, 0, 12))
    assert rb.input_ids.shape[0] == 6 and rb.response_len <= 12
    resp = rb.input_ids[:, -rb.response_len:]
    assert (resp[rb.response_mask == 0] == tok.pad_token_id).all()  # nothing after the first EOS survives
    assert torch.equal(rb.attention_mask[:, -rb.response_len:], rb.response_mask)
    for row, m, trunc in zip(resp, rb.response_mask, rb.truncated):
        n = int(m.sum())
        assert trunc or row[n - 1].item() in generator.eos


def test_rollout_batches_concatenate(tiny):
    from cegppo.engine.rollout import HFGenerator, RolloutBatch, Sampling

    model, tok = tiny
    generator = HFGenerator(model, tok, 512, torch.float32)
    a = generator.generate([[{"role": "user", "content": "1+1?"}]], 2, Sampling(1.0, 1.0, 0, 4))
    b = generator.generate([[{"role": "user", "content": "What is 123 * 456 + 7?"}]], 2, Sampling(1.0, 1.0, 0, 9))
    c = RolloutBatch.concat([a, b], tok.pad_token_id)
    assert c.input_ids.shape == c.attention_mask.shape and c.texts == a.texts + b.texts
    assert c.response_len == max(a.response_len, b.response_len)
    # each part's prompt keeps its right edge and each response its left edge
    for part, rows in ((a, slice(0, 2)), (b, slice(2, 4))):
        P = part.input_ids.shape[1] - part.response_len
        CP = c.input_ids.shape[1] - c.response_len
        assert torch.equal(c.input_ids[rows, CP - P:CP], part.input_ids[:, :P])
        assert torch.equal(c.response_mask[rows, :part.response_len], part.response_mask)


def test_sft_batch_masks_the_solution_and_eos_only(tiny):
    from cegppo.data.tasks import make_task
    from cegppo.engine.sft import sft_batch

    _, tok = tiny
    problems = make_task("arithmetic", "train", 3, seed=0)
    ids, att, resp_mask = sft_batch(tok, problems)
    T = resp_mask.shape[1]
    for i, p in enumerate(problems):
        want = tok(p.solution, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        n = int(resp_mask[i].sum())
        assert ids[i, -T:][:n].tolist() == want and resp_mask[i, :n].all() and not resp_mask[i, n:].any()
    assert torch.equal(att[:, -T:], resp_mask)


def test_data_order_is_a_seeded_permutation_per_epoch():
    from cegppo.data.tasks import make_task
    from cegppo.engine.components import DataOrder

    problems = make_task("arithmetic", "train", 10, seed=0)
    order = DataOrder(problems, seed=3)
    first, second = order.take(0, 10), order.take(10, 10)
    assert sorted(p.id for p in first) == sorted(p.id for p in problems) == sorted(p.id for p in second)
    assert [p.id for p in first] != [p.id for p in second]
    assert [p.id for p in DataOrder(problems, seed=3).take(7, 6)] == [p.id for p in first[7:] + second[:3]]


# ------------------------------------------------------------------------------------------ layering

def test_algorithm_blocks_import_nothing_but_torch():
    """The pure building blocks never pull in transformers, the engine, or the integrations."""
    code = ("import sys, cegppo.algorithm.policy_loss, cegppo.algorithm.advantages, cegppo.algorithm.logprobs; "
            "bad = [m for m in sys.modules if m.startswith(('transformers', 'cegppo.engine', 'cegppo.integrations', "
            "'cegppo.data', 'cegppo.reporting', 'cegppo.config'))]; print(bad); sys.exit(bool(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_default_aggregation_is_the_objectives_own(tiny_config):
    """algorithm.agg unset: GSPO aggregates seq-mean-token-mean (its published form), the rest token-mean."""
    lp, old, adv, mask, *_ = batch()
    gspo = get_objective("gspo")
    loss, _ = policy_loss(gspo, lp, old, adv, mask)  # reduce unset: the objective's own aggregation
    assert tiny_config().algorithm.agg is None
    want = aggregate(gspo.token_loss(lp, old, adv, mask), mask, "seq-mean-token-mean")
    torch.testing.assert_close(loss, want, rtol=0, atol=1e-12)
    assert tiny_config("algorithm.objective=gspo", "algorithm.hparams={}").algorithm.agg is None


def test_run_json_records_command_and_commit(tiny_config):
    import json

    from cegppo.engine.trainer import Trainer

    with Trainer(tiny_config("train.steps=1", "train.save_every=0")) as tr:
        record = json.loads((tr.run.path / "run.json").read_text())
    assert {"run_id", "started", "command", "cegppo_version", "commit", "uncommitted_changes"} <= set(record)
    assert record["command"] and record["cegppo_version"]


def test_hf_generator_shares_the_policy_only_in_its_dtype(tiny):
    from cegppo.engine.rollout import HFGenerator, Sampling

    model, tok = tiny
    model.train()
    same = HFGenerator(model, tok, 512, torch.float32)
    assert same.model is model  # no second copy of the weights to hold or to sync
    same.generate([[{"role": "user", "content": "1+1?"}]], 2, Sampling(1.0, 1.0, 0, 4))
    assert model.training  # generation ran in eval mode and left the policy as it found it
    kept = HFGenerator(model, tok, 512, torch.bfloat16, release=False)
    assert kept.model is not model and next(kept.model.parameters()).dtype == torch.bfloat16
    assert next(model.parameters()).dtype == torch.float32  # the policy was not cast
    released = HFGenerator(model, tok, 512, torch.bfloat16)  # the default: weights held only while generating
    assert sum(p.numel() for p in released.model.parameters()) == 0
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)
    kept.sync(model)
    released.sync(model)  # a no-op: the next rollout casts the current weights
    assert torch.equal(next(kept.model.parameters()), next(model.parameters()).to(torch.bfloat16))
    greedy = Sampling(0.0, 1.0, 0, 8)
    prompts = [[{"role": "user", "content": "2+3?"}], [{"role": "user", "content": "7*6?"}]]
    a, b = kept.generate(prompts, 1, greedy), released.generate(prompts, 1, greedy)
    assert torch.equal(a.input_ids, b.input_ids)  # the same (updated) weights generated both
    assert sum(p.numel() for p in released.model.parameters()) == 0  # and were freed again


def test_token_stats_compute_only_the_columns_their_rows_use(tiny_config):
    """The trainer's micro-batch forward is cut to its rows' longest prompt and response: the same log-probs and
    entropies as on the whole padded batch, zeros past the cut; micro-batches group rows of similar length."""
    from cegppo.engine.model_forward import sequence_token_stats
    from cegppo.engine.trainer import Trainer

    with Trainer(tiny_config("train.steps=1", "rollout.max_new_tokens=24", "train.micro_batch_size=3",
                             "train.shared_prompt_tokens=0")) as tr:  # the padded rows (packs: test_prompt_sharing)
        exp, _ = tr.collect(step=1)
        rb = exp.rollouts
        prompt_len, response_len = rb.lengths
        assert len(set(response_len)) > 1  # responses of different lengths: there is padding to cut
        full = sequence_token_stats(tr.model, rb.input_ids, rb.attention_mask, rb.response_len,
                                    tr.cfg.rollout.temperature)
        batches = tr.micro_batches(rb, torch.arange(len(response_len)))
        assert sorted(torch.cat(batches).tolist()) == list(range(len(response_len)))
        totals = [prompt_len[i] + response_len[i] for i in torch.cat(batches).tolist()]
        assert totals == sorted(totals, reverse=True)  # longest first
        for rows in batches:
            lp, ent, _ = tr.token_stats(tr.model, rb, rows)
            m = rb.response_mask[rows].bool()
            torch.testing.assert_close(lp[m], full[0][rows][m], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(ent[m], full[1][rows][m], rtol=1e-5, atol=1e-5)
            keep = max(response_len[i] for i in rows.tolist())
            assert not lp[:, keep:].any() and not ent[:, keep:].any()


def test_micro_batch_tokens_bound_each_forward_pass(tiny_config):
    """With train.micro_batch_tokens, a micro-batch holds rows x (longest prompt + longest response) <= the budget
    (a single row may exceed it), every row once, longest first; the row limit still applies."""
    from cegppo.engine.trainer import Trainer

    with Trainer(tiny_config("train.steps=1", "rollout.max_new_tokens=24", "train.micro_batch_size=5",
                             "train.shared_prompt_tokens=0")) as tr:  # the padded rows (packs: test_prompt_sharing)
        exp, _ = tr.collect(step=1)
        rb = exp.rollouts
        prompt_len, response_len = rb.lengths
        budget = int(2.5 * max(p + max(1, r) for p, r in zip(prompt_len, response_len)))  # two long rows fit, not three
        tr.cfg.train.micro_batch_tokens = budget
        batches = tr.micro_batches(rb, torch.arange(len(response_len)))
    assert sorted(torch.cat(batches).tolist()) == list(range(len(response_len)))
    sizes = []
    for rows in batches:
        idx = rows.tolist()
        width = max(prompt_len[i] for i in idx) + max(max(1, response_len[i]) for i in idx)
        assert len(idx) <= 5 and (len(idx) == 1 or len(idx) * width <= budget)
        sizes.append(len(idx))
    assert 1 < max(sizes) < 5  # the budget, not the row limit, shaped them
