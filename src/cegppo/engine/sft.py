"""Supervised warm-start on reference solutions: teaches the answer format (``\\boxed{}``) before RL.

A from-scratch ``tiny`` model has zero reward without it, and the base SmolLM2-135M never boxes its
answers unprompted; the same path serves users who want SFT before RL.
"""

from __future__ import annotations

import torch

from cegppo.engine.model_forward import sequence_token_stats
from cegppo.algorithm.objectives import aggregate
from cegppo.config import SFTConfig
from cegppo.data.problems import Problem
from cegppo.engine.precision import autocast
from cegppo.engine.reporter import Reporter, Silent
from cegppo.engine.rollout import encode_prompts



def sft_batch(tokenizer, problems: list[Problem], max_prompt_tokens: int = 512, max_response_tokens: int = 512):
    """The rollout layout (left-padded prompt | right-padded reference solution + EOS): input_ids, attention
    mask and the response mask, so the loss needs logits for the response positions only."""
    for p in problems:
        if not p.solution:
            raise ValueError(f"problem {p.id} has no reference solution to warm-start on")
    prompt_ids, prompt_mask = encode_prompts(tokenizer, [p.messages for p in problems], max_prompt_tokens)
    resp = [(tokenizer(p.solution, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id])[:max_response_tokens]
            for p in problems]
    width = max(len(r) for r in resp)
    pad = tokenizer.pad_token_id
    resp_ids = torch.tensor([r + [pad] * (width - len(r)) for r in resp])
    resp_mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in resp])
    return torch.cat([prompt_ids, resp_ids], 1), torch.cat([prompt_mask, resp_mask], 1), resp_mask


def supervised_warmup(
    model: torch.nn.Module,
    tokenizer,
    problems: list[Problem],
    cfg: SFTConfig,
    steps: int | None = None,
    seed: int = 0,
    precision: str = "bf16-autocast",
    progress: Reporter | None = None,
) -> list[float]:
    """AdamW on the NLL of reference solutions for ``steps`` (default ``cfg.steps``) steps; the loss per step.
    ``progress`` (a :class:`~cegppo.engine.reporter.Reporter` over ``steps``) is advanced once per step."""
    steps = cfg.steps if steps is None else steps
    if steps <= 0:
        return []
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, cfg.warmup_steps)))
    model.train()
    device = next(model.parameters()).device
    losses = []
    bar = progress or Silent()
    for _ in range(steps):
        idx = torch.randint(len(problems), (cfg.batch_size,), generator=g).tolist()
        input_ids, attention, resp_mask = (x.to(device) for x in sft_batch(tokenizer, [problems[i] for i in idx]))
        with autocast(precision, model):
            log_prob, _, _ = sequence_token_stats(model, input_ids, attention, resp_mask.shape[1])
        loss = aggregate(-log_prob, resp_mask, "token-mean")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        bar.advance(1, loss=losses[-1], tokens=int(resp_mask.sum()))
    model.eval()
    return losses
