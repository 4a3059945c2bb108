"""Run configuration: plain dataclasses, loaded from YAML plus dotted ``key=value`` overrides, validated
before any model is loaded (unknown keys, wrong types and out-of-range values name the key and the file).
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from cegppo.io import atomic_write_text


class ConfigError(ValueError):
    """A configuration problem, with the key (and file) it concerns."""


@dataclass
class ModelConfig:
    name: str = "smollm2-135m-instruct"  # preset (smollm2-135m-instruct, tiny), local directory or hub name
    precision: str = "bf16-autocast"  # fp32 | bf16-autocast (fp32 master weights, bf16 matmuls)
    rollout_dtype: str = "bfloat16"  # dtype of the generation copy of the policy: bfloat16 | float32
    gradient_checkpointing: bool = False
    fused_lm_head: bool = False  # LM head applied in row chunks inside the log-prob/entropy: no [B, T, V] logits held


@dataclass
class DataConfig:
    task: str | None = "arithmetic"  # a built-in task; or None and give train_path
    difficulty: int = 1
    num_train: int = 4096
    num_test: int = 64
    train_path: str | None = None  # .jsonl / .json / .parquet (verl or plain schema)
    test_path: str | None = None
    prompt_key: str | None = None
    answer_key: str | None = None
    seed: int = 0


@dataclass
class RolloutConfig:
    n: int = 8  # responses per prompt (group size)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_prompt_tokens: int = 256
    max_new_tokens: int = 128
    backend: str = "hf"


@dataclass
class RewardConfig:
    fn: str = "math-strict"  # math-strict | math-lenient | module:function
    correct_score: float = 1.0
    incorrect_score: float = -1.0
    timeout_s: float = 5.0
    overlong_buffer: int = 0  # DAPO overlong shaping: 0 = off; else the buffer length L_buf in tokens
    overlong_penalty: float = 1.0


@dataclass
class AlgorithmConfig:
    objective: str = "ce_gppo"
    hparams: dict = field(default_factory=dict)  # objective hyperparameters, e.g. {beta1: 0.75, beta2: 1.0}
    agg: str = "token-mean"
    advantage: str = "grpo"  # grpo | dr_grpo | rloo
    adv_eps: float = 1e-6
    dynamic_sampling: bool = False  # DAPO: keep only groups whose rewards are not all equal
    max_num_gen_batches: int = 1  # extra generation rounds to fill the batch under dynamic sampling
    # NLL on fully-correct rollouts (0.1 in the authors' scripts). Off by default: it is an SFT term the paper
    # never mentions, it lowers entropy by itself, and it confounds any comparison of objectives.
    positive_loss_coeff: float = 0.0
    kl_coeff: float = 0.0  # k3 KL to the frozen initial policy (off in every CE-GPPO script)
    entropy_coeff: float = 0.0  # entropy bonus (off in every CE-GPPO script)
    prob_threshold: float = 0.5  # quadrant split: pi_old(token) >= threshold is "high probability"


@dataclass
class OptimConfig:
    lr: float = 1e-6
    warmup_steps: int = 10  # linear warm-up multiplier min(1, step / warmup_steps), as the authors' LambdaLR
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    betas: list = field(default_factory=lambda: [0.9, 0.999])


@dataclass
class SFTConfig:
    steps: int = 0  # supervised warm-start on the task's reference solutions before RL (0 = none)
    batch_size: int = 16
    lr: float = 5e-5
    warmup_steps: int = 5


@dataclass
class EvalConfig:
    every: int = 0  # validate every N steps (0 = only before and after training)
    num_problems: int = 64
    k: int = 1
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    max_new_tokens: int = 128


@dataclass
class TrainConfig:
    steps: int = 20
    prompts_per_step: int = 8  # train batch, in prompts
    gen_prompts_per_step: int = 0  # prompts generated per round under dynamic sampling (0 = prompts_per_step)
    mini_batches: int = 4  # optimizer steps per RL step (later ones are off-policy: clipping matters)
    ppo_epochs: int = 1
    micro_batch_size: int = 16  # sequences per forward/backward (the global token-mean stays exact)
    save_every: int = 10
    keep_checkpoints: int = 2
    max_bad_steps: int = 3  # stop after this many consecutive steps with a non-finite loss or gradient
    seed: int = 0
    deterministic: bool = False  # torch.use_deterministic_algorithms; for bit-exact resume tests
    threads: int = 0  # torch intra-op threads (0 = torch default)


@dataclass
class LoggingConfig:
    tensorboard: bool = False
    wandb: bool = False
    progress: bool = True


@dataclass
class Config:
    output_dir: str = "runs/quickstart"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------------------------------------------------


def _check_type(value: Any, tp: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _check_type(value, a, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{where}: invalid value {value!r}")
    if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):  # YAML 1.1 reads "1e-6" (no dot) as a string
        try:
            return float(value)
        except ValueError:
            pass
    if tp is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if tp in (str, bool, dict, list) and isinstance(value, tp):
        return value
    name = getattr(tp, "__name__", str(tp))
    raise ConfigError(f"{where}: expected {name}, got {type(value).__name__} {value!r}")


def _build(cls: type, data: dict, where: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'config'}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        key = f"{where}.{unknown[0]}" if where else unknown[0]
        raise ConfigError(f"unknown config key {key!r}; valid keys{' in ' + where if where else ''}: {sorted(fields)}")
    kwargs = {}
    for name, value in data.items():
        key = f"{where}.{name}" if where else name
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            kwargs[name] = _build(tp, value, key)
        else:
            kwargs[name] = _check_type(value, tp, key)
    return cls(**kwargs)


class _Replace(dict):
    """An override whose value is a whole mapping: it replaces the section instead of merging into it."""


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {dotted!r}: {p!r} is not a section")
    node[parts[-1]] = _Replace(value) if isinstance(value, dict) else value


def parse_overrides(overrides: list[str]) -> dict:
    """``["algorithm.hparams.beta1=0.5", "train.steps=3"]`` -> nested dict (values parsed as YAML scalars).

    ``algorithm.hparams={}`` replaces the whole mapping; ``algorithm.hparams.beta1=0.5`` changes one entry.
    """
    tree: dict = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected key=value, e.g. train.steps=10")
        key, raw = item.split("=", 1)
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError as e:
            raise ConfigError(f"override {item!r}: value is not valid YAML ({e})") from None
        _set_dotted(tree, key.strip(), value)
    return tree


def _plain(v: Any) -> Any:
    return {k: _plain(x) for k, x in v.items()} if isinstance(v, dict) else v


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        if isinstance(v, dict) and not isinstance(v, _Replace) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = _plain(v)
    return out


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Load a YAML config (or the defaults), apply overrides, validate. Raises :class:`ConfigError`."""
    tree: dict = {}
    source = "defaults"
    if path is not None:
        source = str(path)
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {source} does not exist")
        try:
            tree = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{source}: not valid YAML: {e}") from None
        base = tree.pop("base", None)  # a config may extend another, relative to its own directory
        if base is not None:
            parent = load_config(p.parent / base).to_dict()
            tree = _merge(parent, tree)
    tree = _merge(tree, parse_overrides(overrides or []))
    try:
        cfg = _build(Config, tree, "")
        validate(cfg)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None
    return cfg


def validate(cfg: Config) -> None:
    """Range checks and cross-field checks; objective hyperparameters are checked by the objective registry."""
    from cegppo.algorithm.advantages import ESTIMATORS
    from cegppo.algorithm.objectives import AGGREGATIONS, get_objective

    def need(ok: bool, key: str, what: str, value: Any) -> None:
        if not ok:
            raise ConfigError(f"{key} must be {what}, got {value!r}")

    try:
        get_objective(cfg.algorithm.objective, **cfg.algorithm.hparams)
    except ValueError as e:
        raise ConfigError(f"algorithm.objective / algorithm.hparams: {e}") from None
    need(cfg.algorithm.agg in AGGREGATIONS, "algorithm.agg", f"one of {AGGREGATIONS}", cfg.algorithm.agg)
    need(cfg.algorithm.advantage in ESTIMATORS, "algorithm.advantage", f"one of {ESTIMATORS}", cfg.algorithm.advantage)
    for key in ("positive_loss_coeff", "kl_coeff", "entropy_coeff"):
        v = getattr(cfg.algorithm, key)
        need(math.isfinite(v) and v >= 0, f"algorithm.{key}", "a finite number >= 0", v)
    need(0 < cfg.algorithm.prob_threshold < 1, "algorithm.prob_threshold", "in (0, 1)", cfg.algorithm.prob_threshold)
    need(cfg.algorithm.max_num_gen_batches >= 1, "algorithm.max_num_gen_batches", ">= 1", cfg.algorithm.max_num_gen_batches)
    need(cfg.model.precision in ("fp32", "bf16-autocast"), "model.precision", "fp32 or bf16-autocast", cfg.model.precision)
    need(cfg.model.rollout_dtype in ("bfloat16", "float32"), "model.rollout_dtype", "bfloat16 or float32", cfg.model.rollout_dtype)
    need(cfg.rollout.n >= 1, "rollout.n", ">= 1", cfg.rollout.n)
    need(cfg.rollout.temperature > 0, "rollout.temperature", "> 0 for RL sampling", cfg.rollout.temperature)
    need(0 < cfg.rollout.top_p <= 1, "rollout.top_p", "in (0, 1]", cfg.rollout.top_p)
    need(cfg.rollout.top_k >= 0, "rollout.top_k", ">= 0", cfg.rollout.top_k)
    need(cfg.rollout.max_new_tokens >= 1, "rollout.max_new_tokens", ">= 1", cfg.rollout.max_new_tokens)
    need(cfg.rollout.max_prompt_tokens >= 1, "rollout.max_prompt_tokens", ">= 1", cfg.rollout.max_prompt_tokens)
    need(cfg.rollout.backend == "hf", "rollout.backend", "'hf' (the only backend built in)", cfg.rollout.backend)
    need(cfg.reward.correct_score > cfg.reward.incorrect_score, "reward.correct_score", "> reward.incorrect_score",
         cfg.reward.correct_score)
    need(cfg.reward.timeout_s > 0, "reward.timeout_s", "> 0", cfg.reward.timeout_s)
    need(0 <= cfg.reward.overlong_buffer < cfg.rollout.max_new_tokens, "reward.overlong_buffer",
         "in [0, rollout.max_new_tokens)", cfg.reward.overlong_buffer)
    o = cfg.optim
    need(math.isfinite(o.lr) and o.lr >= 0, "optim.lr", "a finite number >= 0", o.lr)
    need(o.warmup_steps >= 0, "optim.warmup_steps", ">= 0", o.warmup_steps)
    need(o.weight_decay >= 0, "optim.weight_decay", ">= 0", o.weight_decay)
    need(o.grad_clip > 0, "optim.grad_clip", "> 0", o.grad_clip)
    need(len(o.betas) == 2 and all(isinstance(b, (int, float)) and 0 <= b < 1 for b in o.betas), "optim.betas",
         "two numbers in [0, 1)", o.betas)
    t = cfg.train
    need(t.steps >= 0, "train.steps", ">= 0", t.steps)
    need(t.prompts_per_step >= 1, "train.prompts_per_step", ">= 1", t.prompts_per_step)
    need(t.gen_prompts_per_step == 0 or t.gen_prompts_per_step >= t.prompts_per_step, "train.gen_prompts_per_step",
         "0 or >= train.prompts_per_step", t.gen_prompts_per_step)
    need(t.mini_batches >= 1, "train.mini_batches", ">= 1", t.mini_batches)
    need(t.ppo_epochs >= 1, "train.ppo_epochs", ">= 1", t.ppo_epochs)
    need(t.micro_batch_size >= 1, "train.micro_batch_size", ">= 1", t.micro_batch_size)
    need(t.save_every >= 0, "train.save_every", ">= 0", t.save_every)
    need(t.keep_checkpoints >= 1, "train.keep_checkpoints", ">= 1", t.keep_checkpoints)
    need(t.max_bad_steps >= 1, "train.max_bad_steps", ">= 1", t.max_bad_steps)
    d = cfg.data
    need(d.task is not None or d.train_path is not None, "data.task", "set, or data.train_path given", d.task)
    need(1 <= d.difficulty <= 5, "data.difficulty", "in 1..5", d.difficulty)
    need(d.num_train >= 1 and d.num_test >= 0, "data.num_train / data.num_test", ">= 1 / >= 0", (d.num_train, d.num_test))
    s = cfg.sft
    need(s.steps >= 0 and s.batch_size >= 1 and s.lr >= 0, "sft", "steps >= 0, batch_size >= 1, lr >= 0",
         (s.steps, s.batch_size, s.lr))
    e = cfg.eval
    need(e.every >= 0 and e.num_problems >= 0 and e.k >= 1, "eval", "every >= 0, num_problems >= 0, k >= 1",
         (e.every, e.num_problems, e.k))
    need(e.temperature >= 0, "eval.temperature", ">= 0", e.temperature)


def save_config(cfg: Config, path: Path) -> None:
    atomic_write_text(path, yaml.safe_dump(cfg.to_dict(), sort_keys=False))
