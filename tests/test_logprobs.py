import pytest
import torch

from cegppo.recipes import train_loop
from cegppo.algorithm.logprobs import token_stats


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk", [1, 7, 1024])
def test_chunked_stats_match_direct_and_gradients(temperature, chunk):
    torch.manual_seed(0)
    logits = (torch.randn(3, 5, 33, dtype=torch.float64) * 3).requires_grad_(True)
    tokens = torch.randint(0, 33, (3, 5))
    w1, w2 = torch.randn(3, 5, dtype=torch.float64), torch.randn(3, 5, dtype=torch.float64)
    lp, H, C = token_stats(logits, tokens, temperature, chunk_rows=chunk, collision=True)
    (lp.double() * w1 + H.double() * w2).sum().backward()
    g_fast = logits.grad.clone()

    x = logits.detach().clone().requires_grad_(True)
    logp = torch.log_softmax(x / temperature, -1)
    p = logp.exp()
    lp_ref = logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    H_ref = -(p * logp).sum(-1)
    C_ref = (p * p * (logp + H_ref.unsqueeze(-1))).sum(-1)
    (lp_ref * w1 + H_ref * w2).sum().backward()
    torch.testing.assert_close(lp.double(), lp_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(H.double(), H_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(C.double(), C_ref.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(g_fast, x.grad, rtol=1e-5, atol=1e-5)


def test_bf16_logits_give_fp32_stats():
    logits = torch.randn(2, 4, 17).bfloat16().requires_grad_(True)
    lp, H, _ = token_stats(logits, torch.zeros(2, 4, dtype=torch.long))
    assert lp.dtype == torch.float32 and H.dtype == torch.float32
    lp.sum().backward()
    assert logits.grad.dtype == torch.bfloat16


# ----------------------------------------------------------------------------------------------------
# linear_token_stats: the LM head fused into the chunked log-prob / entropy

from cegppo.algorithm.logprobs import fused_chunk_rows, linear_token_stats  # noqa: E402
from cegppo.engine.model_forward import sequence_token_stats  # noqa: E402


def _plain_stats(hidden, weight, bias, tokens, temperature):
    """Reference: full logits, then a plain float log_softmax."""
    logits = hidden @ weight.T + (0 if bias is None else bias)
    logp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature, -1)
    p = logp.exp()
    H = -(p * logp).sum(-1)
    C = (p * p * (logp + H.unsqueeze(-1))).sum(-1)
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1), H, C


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("temperature,chunk", [(1.0, 4), (0.7, 3), (1.3, None)])
def test_linear_token_stats_match_plain_path(dtype, tol, with_bias, temperature, chunk):
    torch.manual_seed(0)
    N, D, V = 11, 8, 37
    hidden = torch.randn(N, D, dtype=dtype)
    weight = torch.randn(V, D, dtype=dtype) * 0.7
    bias = torch.randn(V, dtype=dtype) if with_bias else None
    tokens = torch.randint(0, V, (N,))
    w1, w2 = torch.randn(N, dtype=dtype), torch.randn(N, dtype=dtype)
    params = [hidden, weight] + ([bias] if with_bias else [])

    def run(fn):
        xs = [x.detach().clone().requires_grad_(True) for x in params]
        lp, H, C = fn(*xs)
        (lp.to(dtype) * w1 + H.to(dtype) * w2).sum().backward()
        return lp, H, C, [x.grad for x in xs]

    bias_of = (lambda xs: xs[2]) if with_bias else (lambda xs: None)
    fused = run(lambda *xs: linear_token_stats(xs[0], xs[1], bias_of(xs), tokens, temperature, chunk, collision=True))
    plain = run(lambda *xs: _plain_stats(xs[0], xs[1], bias_of(xs), tokens, temperature))
    # the existing chunked path on materialised logits, as the trainer uses it today
    chunked = run(lambda *xs: token_stats(xs[0] @ xs[1].T + (0 if bias_of(xs) is None else bias_of(xs)), tokens,
                                          temperature, collision=True))
    # token_stats' softmax is float32 even for float64 logits: it matches to float32 precision only
    for ref, rtol in ((plain, tol), (chunked, max(tol, 1e-5))):
        for a, b in zip(fused[:3], ref[:3]):
            torch.testing.assert_close(a.double(), b.double().detach(), rtol=rtol, atol=rtol)
        for a, b in zip(fused[3], ref[3]):
            assert a.dtype == dtype
            torch.testing.assert_close(a, b, rtol=rtol, atol=rtol)
    assert fused[0].dtype == fused[1].dtype == dtype and not fused[2].requires_grad


def test_linear_token_stats_only_log_prob_or_only_entropy_in_graph():
    torch.manual_seed(1)
    hidden, weight = torch.randn(6, 5, dtype=torch.float64), torch.randn(13, 5, dtype=torch.float64)
    tokens = torch.randint(0, 13, (6,))
    for pick in (0, 1):
        h1, w1 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        linear_token_stats(h1, w1, None, tokens, 0.9, 4)[pick].sum().backward()
        h2, w2 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        _plain_stats(h2, w2, None, tokens, 0.9)[pick].sum().backward()
        torch.testing.assert_close(h1.grad, h2.grad, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(w1.grad, w2.grad, rtol=1e-10, atol=1e-10)


def test_linear_token_stats_tied_weight_gets_both_gradients():
    """A weight used as the input embedding and as the output layer gets the sum of both paths' gradients."""
    torch.manual_seed(2)
    V, D = 19, 6
    emb = torch.randn(V, D, dtype=torch.float64)
    ids = torch.randint(0, V, (2, 5))
    tokens = torch.randint(0, V, (2, 5))

    def loss(fn):
        w = emb.clone().requires_grad_(True)
        hidden = torch.tanh(torch.nn.functional.embedding(ids, w))
        lp, H, _ = fn(hidden, w)
        (lp * 0.3 - H).sum().backward()
        return w.grad

    g_fused = loss(lambda h, w: linear_token_stats(h, w, None, tokens, 0.8, 3))
    g_plain = loss(lambda h, w: _plain_stats(h, w, None, tokens, 0.8))
    torch.testing.assert_close(g_fused, g_plain, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("grad_w_block", [None, 7 * 16])
def test_linear_token_stats_under_bf16_autocast_follows_nn_linear(grad_w_block, monkeypatch):
    """Under autocast the projection runs in bf16 like the model's nn.Linear head: same values as the current
    path (bf16 logits, then token_stats) up to bf16 rounding; gradients come back in the inputs' dtypes."""
    if grad_w_block:  # the weight gradient formed 7 vocabulary rows at a time
        monkeypatch.setattr("cegppo.algorithm.logprobs._GRAD_W_BLOCK_ELEMENTS", grad_w_block)
    torch.manual_seed(3)
    hidden, head = torch.randn(40, 16), torch.nn.Linear(16, 300, bias=False)
    tokens = torch.randint(0, 300, (40,))
    h1 = hidden.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp1, H1, _ = linear_token_stats(h1, head.weight, None, tokens, 0.7, 16)
    (lp1 + H1).sum().backward()
    g_w1, head.weight.grad = head.weight.grad.clone(), None
    h2 = hidden.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = head(h2)
        assert logits.dtype == torch.bfloat16
        lp2, H2, _ = token_stats(logits, tokens, 0.7)
    (lp2 + H2).sum().backward()
    assert lp1.dtype == torch.float32 and h1.grad.dtype == torch.float32 and g_w1.dtype == torch.float32
    torch.testing.assert_close(lp1, lp2, rtol=0, atol=1e-5)  # same bf16 logits, same float32 softmax
    torch.testing.assert_close(H1, H2, rtol=0, atol=1e-5)
    torch.testing.assert_close(h1.grad, h2.grad, rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(g_w1, head.weight.grad, rtol=2e-2, atol=2e-3)


def test_fused_chunk_rows_bounds_the_chunk():
    # on a GPU 2^25 logits a chunk; on a CPU 2^22 (16 MiB of float32: under glibc's 32 MiB, the heap reuses them)
    assert fused_chunk_rows(49152, "cuda") == 512 and fused_chunk_rows(151936, "cuda") == 128
    assert fused_chunk_rows(49152) == 64 and fused_chunk_rows(151936) == 16 and fused_chunk_rows(1 << 30) == 1
    assert all(fused_chunk_rows(v) * v * 4 < 32 * 2 ** 20 for v in (1000, 32000, 49152, 151936, 262144))


# ----------------------------------------------------------------------------------------------------
# model level: fused_head=True against today's path on the tiny model


@pytest.fixture(scope="module")
def tiny_model():
    from cegppo.engine.models import load_model

    return load_model("tiny")[0]


def _tiny_batch(vocab):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (3, 14), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left-padded prompts
    mask[1, :2] = 0
    mask[2, -3:] = 0  # right-padded response
    return ids, mask, 8


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_sequence_token_stats_fused_head_matches_logits_path(tiny_model, temperature):
    model = tiny_model
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # tied
    ids, mask, R = _tiny_batch(model.config.vocab_size)
    w1, w2 = torch.randn(3, R, generator=torch.Generator().manual_seed(1)), torch.rand(3, R)

    def run(fused):
        model.zero_grad(set_to_none=True)
        lp, H, C = sequence_token_stats(model, ids, mask, R, temperature, collision=True, fused_head=fused)
        ((lp * w1 + H * w2) * mask[:, -R:]).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return lp.detach(), H.detach(), C, grads

    fused, plain = run(True), run(False)
    assert fused[0].shape == (3, R)
    for a, b in zip(fused[:3], plain[:3]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert fused[3].keys() == plain[3].keys() and "model.embed_tokens.weight" in fused[3]
    for name in plain[3]:
        scale = plain[3][name].abs().max()  # float32 sums of different order: tolerance relative to the tensor's scale
        torch.testing.assert_close(fused[3][name], plain[3][name], rtol=1e-5, atol=1e-5 * float(scale), msg=name)
    model.zero_grad(set_to_none=True)


def test_sequence_token_stats_fused_head_under_autocast(tiny_model):
    ids, mask, R = _tiny_batch(tiny_model.config.vocab_size)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        fused = sequence_token_stats(tiny_model, ids, mask, R, 0.8, fused_head=True)
        plain = sequence_token_stats(tiny_model, ids, mask, R, 0.8)
    torch.testing.assert_close(fused[0], plain[0], rtol=0, atol=1e-4)
    torch.testing.assert_close(fused[1], plain[1], rtol=0, atol=1e-4)


def test_fused_head_refuses_models_with_post_processed_logits(tiny_model, monkeypatch):
    monkeypatch.setattr(tiny_model.config, "model_type", "gemma2")
    ids, mask, R = _tiny_batch(tiny_model.config.vocab_size)
    with pytest.raises(NotImplementedError, match="fused_lm_head=false"):
        sequence_token_stats(tiny_model, ids, mask, R, fused_head=True)


def test_trainer_step_with_fused_lm_head_matches(tiny_config, tmp_path):
    from cegppo.engine.trainer import Trainer

    rows = {}
    for fused in (False, True):
        cfg = tiny_config("train.steps=1", "train.save_every=0", "model.precision=fp32", "eval.num_problems=1",
                          "eval.max_new_tokens=2", "rollout.max_new_tokens=12",
                          f"model.fused_lm_head={str(fused).lower()}", out=tmp_path / str(fused))
        with Trainer(cfg) as tr:
            rows[fused] = train_loop(tr)[0]
    for k in ("reward/mean", "entropy", "pg_loss", "grad_norm", "ppo_kl"):
        assert rows[True][k] == pytest.approx(rows[False][k], rel=1e-4, abs=1e-6), k


def test_fused_head_auto_is_on_only_for_plain_lm_heads(tiny_model, monkeypatch):
    from cegppo.engine.model_forward import fused_head_supported

    assert fused_head_supported(tiny_model)  # qwen2: logits = lm_head(hidden)
    monkeypatch.setattr(tiny_model.config, "model_type", "gemma2")  # soft-capped logits: the plain path
    assert not fused_head_supported(tiny_model)
