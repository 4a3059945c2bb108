import pytest
import torch

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
