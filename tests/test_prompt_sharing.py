"""The responses to one prompt computed with the prompt once (cegppo.engine.prompt_sharing): the same per-token
log-probs, entropies, collision terms and parameter gradients as the padded rows, on real rollouts of the tiny
model, whole packs per micro-batch within the row and token budgets, and the padded rows where a model's mask cannot
be written. On CEGPPO_TEST_DEVICE (cpu unless benchmarks/gpu_check.sh asks for cuda)."""

from __future__ import annotations

import pytest
import torch

from cegppo.engine.batching import column_token_stats
from cegppo.engine.prompt_sharing import (packs, prompt_sharing_supported, shared_prompt_micro_batches,
                                          shared_prompt_token_stats)
from cegppo.engine.rollout import RolloutBatch
from cegppo.engine.trainer import Trainer

from conftest import TEST_DEVICE


@pytest.fixture(scope="module")
def rollouts(tmp_path_factory):
    """A trainer on the tiny model and one step's rollouts: 4 prompts x 4 responses of different lengths."""
    from cegppo.cli import example_config
    from cegppo.config import load_config

    out = tmp_path_factory.mktemp("sharing") / "run"
    cfg = load_config(example_config("tiny"), [f"output_dir={out}", "reward.fn=fixtures.rewards:digit_overlap",
                                               "sft.steps=0", "data.num_test=4", "eval.num_problems=4",
                                               "logging.progress=false", "train.prompts_per_step=4",
                                               "rollout.max_new_tokens=24", f"model.device={TEST_DEVICE}"])
    with Trainer(cfg) as tr:
        exp, _ = tr.collect(step=1)
        yield tr, exp.to(tr.device).rollouts


def _loss(stats, rb, rows):
    """A loss that weighs every statistic differently per token, so that any misplaced gradient shows."""
    lp, ent, _ = stats
    g = torch.Generator().manual_seed(0)
    m = rb.response_mask[rows]
    w = torch.randn(lp.shape, generator=g).to(lp.device)
    return (w * m * lp).sum() + (w.flip(-1) * m * ent).sum()


def _assert_packs_give_the_padded_rows(tr, rb, rows, temperature, fused_head, pack_tokens, collision=False):
    """Statistics (zero past each response) and every parameter's gradient of ``rows`` in packs equal the padded
    rows' (:func:`column_token_stats`)."""
    params = [p for p in tr.model.parameters() if p.requires_grad]
    want = column_token_stats(tr.model, rb, rows, temperature, "fp32", fused_head, collision=collision)
    want_grad = torch.autograd.grad(_loss(want, rb, rows), params)
    got = shared_prompt_token_stats(tr.model, rb, rows, temperature, "fp32", fused_head, pack_tokens,
                                    collision=collision)
    got_grad = torch.autograd.grad(_loss(got, rb, rows), params)
    m = rb.response_mask[rows].bool()
    assert (got[2] is None) == (not collision)
    for w, g in zip(want, got):
        if w is None:
            continue
        torch.testing.assert_close(g[m], w[m], rtol=1e-5, atol=1e-5)
        assert not g[~m].any()  # zero past each response
    for w, g in zip(want_grad, got_grad):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5 * float(w.abs().max()))


# one pack per prompt; packs of two responses (prompts of ~96 tokens, responses of <= 24); one response per pack
@pytest.mark.parametrize("pack_tokens", [1024, 150, 1])
def test_packs_give_the_padded_rows_statistics_and_gradients(rollouts, pack_tokens):
    tr, rb = rollouts
    prompt_len, response_len = rb.lengths
    assert len(set(rb.prompt_group)) == 4 and len(set(response_len)) > 1
    rows = torch.tensor([5, 0, 1, 2, 3, 9, 4, 15, 12, 13])  # groups split and out of order
    plan = packs(rb, rows.tolist(), pack_tokens)
    if pack_tokens == 1024:
        assert len(plan) == 4
    elif pack_tokens == 1:
        assert all(len(p.rows) == 1 for p in plan)
    else:
        assert len(plan) > 4 and any(len(p.rows) > 1 for p in plan)
    _assert_packs_give_the_padded_rows(tr, rb, rows, 0.8, tr.fused_head, pack_tokens, collision=True)


def test_packs_with_gradient_checkpointing_and_the_unfused_head(rollouts):
    tr, rb = rollouts
    tr.model.gradient_checkpointing_enable()
    try:
        _assert_packs_give_the_padded_rows(tr, rb, torch.arange(8), 1.0, False, 1024)
    finally:
        tr.model.gradient_checkpointing_disable()


def test_a_micro_batch_replans_to_its_own_packs():
    """shared_prompt_token_stats cuts a micro-batch's rows into packs again: that must give back the packs the
    micro-batch was made of (and so the token budget it was checked against), also when a prompt's responses span
    two packs and the longer pack is listed first."""
    P, lengths, cap = 10, [2, 2, 2, 2, 9], 19  # one prompt: packs (0-3) of 14 tokens and (4) of 18
    B, T = len(lengths), max(lengths)
    response_mask = torch.stack([(torch.arange(T) < r).long() for r in lengths])
    rb = RolloutBatch(torch.cat([torch.arange(1, P + 1).repeat(B, 1), torch.ones(B, T, dtype=torch.long)], 1),
                      torch.cat([torch.ones(B, P, dtype=torch.long), response_mask], 1), response_mask, [""] * B,
                      torch.zeros(B, dtype=torch.bool))
    plan = packs(rb, list(range(B)), cap, 16)
    assert [p.rows for p in plan] == [(0, 1, 2, 3), (4,)]
    replanned = [p for mb in shared_prompt_micro_batches(rb, torch.arange(B), 16, 0, cap)
                 for p in packs(rb, mb.tolist(), cap)]
    assert sorted(replanned, key=lambda p: p.rows) == sorted(plan, key=lambda p: p.rows)


@pytest.mark.parametrize("max_rows,max_tokens,pack_tokens", [(16, 0, 1024), (3, 0, 1024), (16, 60, 1024),
                                                             (16, 0, 25), (5, 80, 30)])
def test_micro_batches_hold_whole_packs_within_their_budgets(rollouts, max_rows, max_tokens, pack_tokens):
    _, rb = rollouts
    prompt_len, response_len = rb.lengths
    rows = torch.arange(len(response_len))
    batches = shared_prompt_micro_batches(rb, rows, max_rows, max_tokens, pack_tokens)
    assert sorted(torch.cat(batches).tolist()) == rows.tolist()  # every row once
    lengths = []
    for mb in batches:
        plan = packs(rb, mb.tolist(), pack_tokens, max_rows)
        assert len(mb) <= max_rows
        longest = max(p.length for p in plan)
        assert len(plan) == 1 or not max_tokens or len(plan) * longest <= max_tokens
        for p in plan:
            assert len({rb.prompt_group[i] for i in p.rows}) == 1  # one prompt per pack
            assert p.length == prompt_len[p.rows[0]] + sum(max(response_len[i], 1) - 1 for i in p.rows)
            assert len(p.rows) == 1 or p.length <= pack_tokens
        lengths.append(longest)
    assert lengths == sorted(lengths, reverse=True)  # longest first
    if max_rows == 16 and not max_tokens and pack_tokens == 1024:
        assert len(batches) == 1  # 16 rows, 4 prompts: one forward pass of 4 packs


def test_models_whose_mask_cannot_be_written_run_the_padded_rows(rollouts, monkeypatch):
    tr, _ = rollouts
    assert prompt_sharing_supported(tr.model) and tr.shared_prompt
    monkeypatch.setattr(tr.model.config, "_attn_implementation", "flex_attention")
    assert not prompt_sharing_supported(tr.model)
    monkeypatch.undo()
    monkeypatch.setattr(tr.model.config, "layer_types", ["full_attention", "sliding_attention"])
    assert not prompt_sharing_supported(tr.model)
    monkeypatch.undo()
    monkeypatch.setattr(tr.model.config, "model_type", "gpt2")
    assert not prompt_sharing_supported(tr.model)


def test_the_trainer_keeps_packs_within_its_token_budget(rollouts, monkeypatch):
    """With train.micro_batch_tokens below train.shared_prompt_tokens, no pack passes the budget (but a single response
    may), so the budget still bounds a micro-batch's activations."""
    tr, rb = rollouts
    prompt_len, response_len = rb.lengths
    budget = max(prompt_len) + 2 * max(response_len)  # two responses fit in a pack, not a whole group of four
    monkeypatch.setattr(tr.cfg.train, "micro_batch_tokens", budget)
    assert tr.pack_tokens == budget < tr.cfg.train.shared_prompt_tokens
    batches = tr.micro_batches(rb, torch.arange(len(response_len)))
    assert sorted(torch.cat(batches).tolist()) == list(range(len(response_len)))
    for mb in batches:
        plan = packs(rb, mb.tolist(), tr.pack_tokens, tr.cfg.train.micro_batch_size)
        assert all(p.length <= budget or len(p.rows) == 1 for p in plan)
        assert len(plan) * max(p.length for p in plan) <= budget or len(plan) == 1
    assert any(len(p.rows) > 1 for mb in batches for p in packs(rb, mb.tolist(), tr.pack_tokens))  # still shared
