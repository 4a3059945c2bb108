"""A step's experience: rollout -> reward -> advantages -> dynamic sampling (the first half of
:meth:`cegppo.engine.trainer.Trainer.step`)."""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from cegppo.algorithm.advantages import group_advantages, mixed_groups, overlong_penalty
from cegppo.config import Config
from cegppo.engine.batching import Experience
from cegppo.engine.components import DataOrder, step_seed
from cegppo.engine.reporter import Reporter
from cegppo.engine.rollout import Sampling
from cegppo.faults import failpoint

log = logging.getLogger(__name__)

MEANS = ("reward/mean", "reward/accuracy", "response_length/mean", "response_length/clip_ratio")  # over rounds


def collect(cfg: Config, step: int, data: DataOrder, cursor: int, generator: Any, reward_fn: Callable,
            pad_token_id: int, progress: Reporter) -> tuple[Experience | None, dict[str, float], int]:
    """Generate, grade and compute advantages; with dynamic sampling keep only mixed-reward groups, generating up to
    ``max_num_gen_batches`` rounds to fill ``prompts_per_step`` groups. Returns the experience (None if no group
    was kept), the rollout metrics and the data cursor after the prompts taken."""
    r, a, n = cfg.rollout, cfg.algorithm, cfg.rollout.n
    kept: list[Experience] = []
    kept_groups = 0
    stats: dict[str, float] = {k: 0.0 for k in (*MEANS, "reward/failures", "response_length/max")}
    for gen_batch in range(a.max_num_gen_batches if a.dynamic_sampling else 1):
        problems = data.take(cursor, cfg.train.gen_prompts_per_step or cfg.train.prompts_per_step)
        cursor += len(problems)
        torch.manual_seed(step_seed(cfg.train.seed, step, f"rollout{gen_batch}"))
        progress.phase(f"generate {len(problems)} x {n}" + (f" (round {gen_batch + 1})" if gen_batch else ""))
        rollouts = generator.generate([p.messages for p in problems], n,
                                      Sampling(r.temperature, r.top_p, r.top_k, r.max_new_tokens),
                                      on_token=progress.on_token)
        failpoint("generation", step)
        graded = reward_fn(rollouts.texts, [p.answer for p in problems for _ in range(n)])
        for msg in graded.failure_messages:
            log.warning("reward failure at step %d: %s", step, msg)
        lengths = rollouts.response_mask.sum(-1).float()
        rewards = torch.tensor(graded.scores, dtype=torch.float32) + overlong_penalty(
            lengths, r.max_new_tokens, cfg.reward.overlong_buffer, cfg.reward.overlong_penalty)
        correct = torch.tensor(graded.correct)
        stats["reward/mean"] += rewards.mean().item()
        stats["reward/accuracy"] += correct.float().mean().item()
        stats["reward/failures"] += graded.failures
        stats["response_length/mean"] += lengths.mean().item()
        stats["response_length/max"] = max(stats["response_length/max"], lengths.max().item())
        stats["response_length/clip_ratio"] += rollouts.truncated.float().mean().item()
        stats["train/num_gen_batches"] = gen_batch + 1
        adv = group_advantages(rewards, n, a.advantage, a.adv_eps)
        rows = torch.arange(len(rewards))
        if a.dynamic_sampling:  # DAPO: only groups whose rewards differ carry a learning signal
            groups = torch.nonzero(mixed_groups(correct, n)).flatten()[: cfg.train.prompts_per_step - kept_groups]
            rows = (groups[:, None] * n + torch.arange(n)).flatten()
        kept_groups += len(rows) // n
        if len(rows):
            in_loss = ~rollouts.truncated[rows] if a.overlong_filter else None  # cut responses: no loss (DAPO)
            kept.append(Experience(rollouts.select(rows), rewards[rows], correct[rows], adv[rows], in_loss))
        if kept_groups >= cfg.train.prompts_per_step:
            break
    for k in MEANS:
        stats[k] /= stats["train/num_gen_batches"]
    stats["train/kept_groups"] = kept_groups
    exp = Experience.concat(kept, pad_token_id) if kept else None
    if exp is not None and exp.in_loss is not None:  # the guard names a run whose loss the filter emptied
        stats["overlong/in_loss_frac"] = exp.in_loss.float().mean().item()
    return exp, stats, cursor
