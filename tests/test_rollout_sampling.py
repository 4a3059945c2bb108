"""HFGenerator's fast paths draw what Hugging Face ``generate`` draws: the inverse-CDF sampler samples the softmax of
the processed scores, the warpers are HF's own in ``generate``'s order, and the shared prefill with its static
cache produces the tokens that ``generate`` on each prompt repeated n times produces, greedy and sampled."""

from __future__ import annotations

import pytest
import torch

from cegppo.engine.decode import InverseCDFSampler, sampling_warpers
from cegppo.engine.rollout import HFGenerator, Sampling, encode_prompts

PROMPTS = [[{"role": "user", "content": "1+1?"}],
           [{"role": "system", "content": "Answer in one line, and check the sum twice."},
            {"role": "user", "content": "What is 12 + 30 - 4?"}],
           [{"role": "user", "content": "7 * 6?"}]]


class SamplerProcessor:
    """:class:`InverseCDFSampler` as the last of ``generate``'s logits processors, run greedy: scores whose only
    finite entry is the drawn token (one uniform per row), which greedy decoding then picks. The reference
    ``generate`` the decode loop is held to."""

    def __init__(self, block: int = 256):
        self.sampler = InverseCDFSampler(block)

    def __call__(self, input_ids, scores: torch.Tensor) -> torch.Tensor:
        u = torch.rand(scores.shape[0], 1, dtype=torch.float64, device=scores.device)
        token = self.sampler.draw(scores, u)
        return scores.fill_(float("-inf")).scatter_(-1, token[:, None], 0.0)  # generate's own copy of the scores


def sampling_processors(sampling: Sampling) -> list:
    """``generate``'s processors for the decode loop's draw: HF's warpers, then the sampler."""
    return [*sampling_warpers(sampling), SamplerProcessor()]


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
    scores = SamplerProcessor(block)(None, logits.repeat(draws, 1))
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
    warpers = LogitsProcessorList(sampling_warpers(sampling))
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


@pytest.mark.parametrize("sampling", [Sampling(0.0, 1.0, 0, 24), Sampling(1.0, 1.0, 0, 24), Sampling(0.8, 0.9, 5, 24)],
                         ids=["greedy", "sampled", "warped"])
def test_rows_that_ended_leave_the_batch_and_the_tokens_stay_generates(tiny, sampling):
    """Dropping ended rows (at once: drop_share=0) changes the work, not the draw: the same tokens as generate on
    every row, which keeps feeding ended rows pads and draws a uniform for each of them at every step."""
    from transformers import LogitsProcessorList

    from cegppo.engine.decode import decode, shared_prefill

    model, tok = tiny
    n = 4
    unique_ids, unique_mask = encode_prompts(tok, PROMPTS, 512)
    ids, mask = unique_ids.repeat_interleave(n, 0), unique_mask.repeat_interleave(n, 0)
    kwargs = dict(logits_processor=LogitsProcessorList(sampling_processors(sampling))) if sampling.temperature else {}

    def generate(eos: list[int]) -> torch.Tensor:
        torch.manual_seed(3)
        return model.generate(input_ids=ids, attention_mask=mask, do_sample=False, temperature=None, top_p=None,
                              top_k=None, max_new_tokens=sampling.max_new_tokens, pad_token_id=tok.pad_token_id,
                              eos_token_id=eos, **kwargs)[:, ids.shape[1]:]

    # the tiny model rarely ends a row (never greedy): a token the first row draws early ends rows as well
    eos = HFGenerator(model, tok, 512, torch.float32).eos
    eos = eos + [int(generate(eos)[0, 3])]
    want = generate(eos)
    is_eos = torch.isin(want, torch.tensor(eos))
    ended_at = torch.where(is_eos.any(-1), is_eos.int().argmax(-1), want.shape[1])
    assert ended_at.min() < want.shape[1] - 1 and ended_at.unique().numel() > 1  # rows end early, and not together
    for drop_share in (0.0, 1.0):
        cache = shared_prefill(model, unique_ids, unique_mask, n, sampling.max_new_tokens)
        torch.manual_seed(3)
        got = decode(model, ids, mask, cache, sampling, eos, tok.pad_token_id, drop_share=drop_share)
        assert torch.equal(got, want), drop_share
        left = cache.layers[0].keys.shape[0]  # rows still in the batch at the end
        assert left < ids.shape[0] if drop_share == 0 else left == ids.shape[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_decode_attention_is_sdpas(dtype):
    """One query per row, 9 query heads on 3 key/value heads, a padding mask: what sdpa computes on the repeated
    heads (to float32 rounding; in bf16, to the rounding of scores held in bf16, as HF's eager attention holds them)."""
    from types import SimpleNamespace

    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    from cegppo.engine.decode import grouped_decode_attention

    torch.manual_seed(0)
    q, k, v = (torch.randn(5, h, t, 16, dtype=dtype) for h, t in ((9, 1), (3, 11), (3, 11)))
    mask = torch.rand(5, 1, 1, 11) > 0.3
    mask[:, :, :, -1] = True  # every row sees at least its own key
    got, _ = grouped_decode_attention(SimpleNamespace(), q, k, v, mask, scaling=0.25)
    want = torch.nn.functional.scaled_dot_product_attention(q, repeat_kv(k, 3), repeat_kv(v, 3), attn_mask=mask,
                                                            scale=0.25).transpose(1, 2)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got.float(), want.float(), **tol)
    # what the grouped path does not compute (a position bias) goes to sdpa's own function, unchanged
    module, bias = SimpleNamespace(num_key_value_groups=3, is_causal=True), torch.randn(5, 9, 1, 11, dtype=dtype)
    got, _ = grouped_decode_attention(module, q, k, v, mask, scaling=0.25, position_bias=bias)
    want, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.25, position_bias=bias)
    assert torch.equal(got, want)


def test_decoding_puts_the_model_back_on_sdpa(tiny):
    from cegppo.engine.decode import decode, shared_prefill

    model, tok = tiny
    assert model.config._attn_implementation == "sdpa"
    ids, mask = encode_prompts(tok, PROMPTS, 512)
    seen = []
    decode(model, ids, mask, shared_prefill(model, ids, mask, 1, 3), Sampling(0.0, 1.0, 0, 3), [2],
           tok.pad_token_id, on_token=lambda *_: seen.append(model.config._attn_implementation))
    assert seen == ["cegppo_grouped_decode"] * 3 and model.config._attn_implementation == "sdpa"
