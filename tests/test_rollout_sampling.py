"""HFGenerator's fast paths draw what Hugging Face ``generate`` draws: the inverse-CDF sampler samples the softmax of
the processed scores, the warpers are HF's own in ``generate``'s order, and the shared prefill with its static
cache produces the tokens that ``generate`` on each prompt repeated n times produces, greedy and sampled."""

from __future__ import annotations

import pytest
import torch

from cegppo.engine.rollout import HFGenerator, Sampling, _InverseCDFSampler, encode_prompts, sampling_processors

PROMPTS = [[{"role": "user", "content": "1+1?"}],
           [{"role": "system", "content": "Answer in one line, and check the sum twice."},
            {"role": "user", "content": "What is 12 + 30 - 4?"}],
           [{"role": "user", "content": "7 * 6?"}]]


@pytest.fixture(scope="module")
def tiny():
    from cegppo.engine.models import load_model

    return load_model("tiny")


@pytest.mark.parametrize("block", [4, 256])
def test_inverse_cdf_sampler_draws_the_softmax(block):
    # 11 tokens: not a multiple of the block, several likely tokens in each block of 4, impossible tokens inside
    # blocks and at a block's edge, one of mass ~1e-14
    inf = float("-inf")
    logits = torch.tensor([0.0, 0.5, inf, 1.0, 0.2, inf, 0.7, -0.3, inf, -30.0, 0.5])
    draws = 400_000
    torch.manual_seed(0)
    scores = _InverseCDFSampler(block)(None, logits.repeat(draws, 1))
    assert torch.isfinite(scores).sum(-1).eq(1).all()  # exactly one finite entry per row: the drawn token
    freq = torch.bincount(scores.argmax(-1), minlength=11).double() / draws
    p = torch.softmax(logits.double(), -1)
    assert freq[p == 0].sum() == 0  # an impossible token is never drawn
    sd = (p * (1 - p) / draws).sqrt()
    assert ((freq - p).abs() <= 5 * sd + 1e-12).all(), (freq, p)


def test_the_warpers_are_generates_own_in_its_order(tiny):
    """generate(do_sample=True) reports the scores it sampled from; our processors turn its raw logits into them."""
    from transformers import LogitsProcessorList

    model, tok = tiny
    ids, mask = encode_prompts(tok, PROMPTS, 512)
    sampling = Sampling(temperature=0.7, top_p=0.8, top_k=7, max_new_tokens=5)
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=0.7, top_p=0.8, top_k=7,
                         max_new_tokens=5, min_new_tokens=5, pad_token_id=tok.pad_token_id, output_scores=True,
                         output_logits=True, return_dict_in_generate=True)
    warpers = LogitsProcessorList(sampling_processors(sampling)[:-1])  # all but the sampler
    assert len(warpers) == 3
    for step, (logits, scores) in enumerate(zip(out.logits, out.scores)):
        seen = out.sequences[:, : ids.shape[1] + step]
        ours = warpers(seen, logits.clone())
        assert torch.equal(torch.isinf(ours), torch.isinf(scores)), step  # the same tokens kept
        torch.testing.assert_close(torch.softmax(ours, -1), torch.softmax(scores, -1))


@pytest.mark.parametrize("sampling", [Sampling(0.0, 1.0, 0, 12), Sampling(1.0, 1.0, 0, 12), Sampling(0.8, 0.9, 5, 12)],
                         ids=["greedy", "sampled", "warped"])
def test_shared_prefill_generates_what_generate_on_the_copies_does(tiny, sampling):
    """The same seed, the same sampler: every token equal, so the shared prefill and its static cache (positions
    under left padding included) feed the decode exactly what generate's own prefill does."""
    from transformers import LogitsProcessorList

    model, tok = tiny
    n = 3
    ids, mask = (x.repeat_interleave(n, 0) for x in encode_prompts(tok, PROMPTS, 512))
    assert (mask == 0).any()  # left padding is exercised
    generator = HFGenerator(model, tok, 512, torch.float32)
    torch.manual_seed(1)
    got = generator.generate(PROMPTS, n, sampling)
    kwargs = dict(logits_processor=LogitsProcessorList(sampling_processors(sampling))) if sampling.temperature else {}
    torch.manual_seed(1)
    want = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, temperature=None, top_p=None,
                          top_k=None, max_new_tokens=sampling.max_new_tokens, pad_token_id=tok.pad_token_id,
                          eos_token_id=generator.eos, **kwargs)[:, ids.shape[1]:]
    got_tokens = got.input_ids[:, ids.shape[1]:]
    width = got_tokens.shape[1]
    assert width > 1
    want = torch.where(got.response_mask.bool(), want[:, :width], tok.pad_token_id)
    assert torch.equal(got_tokens, want)
    if sampling.temperature:
        assert len({tuple(r.tolist()) for r in got_tokens}) > 1  # really sampled: the copies differ
