"""Supervised warm-start on reference solutions: teaches the answer format (``\\boxed{}``) before RL.

A from-scratch ``tiny`` model has zero reward without it, and the base SmolLM2-135M never boxes its
answers unprompted; the same path serves users who want SFT before RL.
"""

from __future__ import annotations

import contextlib
import logging

import torch

from cegppo.data import Problem

log = logging.getLogger(__name__)


def sft_batch(tokenizer, problems: list[Problem], max_tokens: int = 512) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """input_ids, attention_mask and labels (-100 on prompt and padding) for prompt + solution + EOS."""
    ids, labels = [], []
    for p in problems:
        if not p.solution:
            raise ValueError(f"problem {p.id} has no reference solution to warm-start on")
        prompt = tokenizer.apply_chat_template(p.messages, add_generation_prompt=True, tokenize=False)
        p_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        r_ids = tokenizer(p.solution, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        seq = (p_ids + r_ids)[-max_tokens:]
        lab = ([-100] * len(p_ids) + r_ids)[-max_tokens:]
        ids.append(seq)
        labels.append(lab)
    width = max(len(x) for x in ids)
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([x + [pad] * (width - len(x)) for x in ids])
    attention = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in ids])
    label_t = torch.tensor([x + [-100] * (width - len(x)) for x in labels])
    return input_ids, attention, label_t


def supervised_warmup(
    model: torch.nn.Module,
    tokenizer,
    problems: list[Problem],
    steps: int,
    batch_size: int = 16,
    lr: float = 5e-5,
    warmup_steps: int = 5,
    seed: int = 0,
    autocast: bool = True,
    progress: bool = True,
) -> list[float]:
    """AdamW on the NLL of reference solutions for ``steps`` steps; returns the loss per step."""
    if steps <= 0:
        return []
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, warmup_steps)))
    ctx = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if autocast else contextlib.nullcontext
    model.train()
    losses = []
    it = range(steps)
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(it, desc="cegppo sft", dynamic_ncols=True)
    for _ in it:
        idx = torch.randint(len(problems), (batch_size,), generator=g).tolist()
        input_ids, attention, labels = sft_batch(tokenizer, [problems[i] for i in idx])
        with ctx():
            out = model(input_ids=input_ids, attention_mask=attention, labels=labels, use_cache=False)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(out.loss.item())
        if progress:
            it.set_postfix(loss=f"{losses[-1]:.3f}")
    model.eval()
    return losses
