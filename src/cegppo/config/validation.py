"""Validation of a loaded config, section by section: types, finiteness, ranges and cross-field checks, each
failure one line naming the key. Checks that need the loaded data or tokenizer are :mod:`cegppo.config.data_checks`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import types
import typing
from typing import Any

from cegppo.algorithm.advantages import ESTIMATORS
from cegppo.algorithm.entropy_control import validate_adaptive_entropy, validate_entropy_control
from cegppo.algorithm.objectives import AGGREGATIONS, get_objective
from cegppo.config.schema import (AlgorithmConfig, Config, DataConfig, EvalConfig, ModelConfig, OptimConfig,
                                  RewardConfig, RolloutConfig, SFTConfig, TrainConfig)
from cegppo.errors import DEVICES, ConfigError, show

MAX_TIMEOUT_S = 3600.0  # reward.timeout_s upper bound (a finite per-answer limit)
MAX_INT = 2**63 - 1  # every integer setting (seeds, counts) fits a signed 64-bit integer


def check_type(value: Any, tp: Any, where: str) -> Any:
    """``value`` as the annotated type ``tp`` of key ``where`` (ints widen to float, YAML 1.1 float strings are
    read), or a one-line ConfigError."""
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
                return check_type(value, a, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{where}: invalid value {show(value)}")
    if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:
            raise ConfigError(f"{where} must be a finite number, got an integer of {value.bit_length()} "
                              f"bits") from None
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
    raise ConfigError(f"{where}: expected {name}, got {type(value).__name__} {show(value)}")


def _need(ok: bool, key: str, what: str, value: Any) -> None:
    if not ok:
        raise ConfigError(f"{key} must be {what}, got {show(value)}")


def _is_real(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _check_numbers(obj: Any, where: str) -> None:
    """Types of every field (also for a Config built in code), then: every float finite, every int in 64 bits."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        key = f"{where}.{f.name}" if where else f.name
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(hints[f.name]):
            _check_numbers(value, key)
            continue
        value = check_type(value, hints[f.name], key)
        setattr(obj, f.name, value)
        if isinstance(value, str):
            _need("\x00" not in value, key, "text without NUL bytes", value)
        if isinstance(value, float):
            _need(math.isfinite(value), key, "a finite number", value)
        elif isinstance(value, int) and not isinstance(value, bool):
            _need(-MAX_INT - 1 <= value <= MAX_INT, key, "an integer that fits 64 bits", value)


# The longest path a run creates under output_dir, e.g. checkpoints/.tmp-step_000000-<pid>/tokenizer_config.json
# (58 characters) or tensorboard/events.out.tfevents.<time>.<host>.<pid>.<n> (up to ~120 with a 64-byte host name);
# tests/test_outputs.py checks a real run's files against it.
RUN_PATH_HEADROOM = 160
# cegppo sft --out / a checkpoint directory: .tmp-<name>-<pid> beside it, and its files (special_tokens_map.json)
MODEL_DIR_HEADROOM = 64


def _limit(path: str, name: str, default: int) -> int:
    """``os.pathconf`` of the nearest existing ancestor of ``path`` (NAME_MAX / PATH_MAX of its file system)."""
    probe = path
    while probe and not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    try:
        return int(os.pathconf(probe or "/", name))
    except (OSError, ValueError):
        return default


def check_path_fits(path: str, key: str, headroom: int = 0) -> None:
    """ConfigError naming ``key`` when ``path`` cannot be created here: a component longer than NAME_MAX bytes, or
    the absolute path plus ``headroom`` (the longest path that will be created under it) over PATH_MAX."""
    absolute = os.path.abspath(path)
    try:
        raw = os.fsencode(absolute)
    except UnicodeError:
        raise ConfigError(f"{key}: the path {show(path)} cannot be encoded for the file system") from None
    name_max, path_max = _limit(absolute, "PC_NAME_MAX", 255), _limit(absolute, "PC_PATH_MAX", 4096)
    for part in raw.split(b"/"):
        if len(part) > name_max:
            raise ConfigError(f"{key}: the path component {show(os.fsdecode(part), 40)} is {len(part)} bytes; a name "
                              f"may have at most {name_max} here (NAME_MAX)")
    if len(raw) + headroom > path_max - 1:
        raise ConfigError(f"{key} is {len(raw)} bytes long as an absolute path; the files written under it need up to "
                          f"{headroom} more, over the {path_max - 1}-byte limit here (PATH_MAX): use a shorter path")


def _path(value: Any, key: str, optional: bool = False) -> str | None:
    if value is None and optional:
        return None
    _need(isinstance(value, str) and value.strip() != "", key, "a non-empty path" + (" or null" if optional else ""),
          value)
    _need("\x00" not in value, key, "a path without NUL bytes", value)
    return os.path.expanduser(value)


GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo")  # advantages relative to the other samples of the same prompt

EVAL_KEYS = {"num_problems": "eval.num_problems", "k": "eval.k", "temperature": "eval.temperature",
             "top_p": "eval.top_p", "max_new_tokens": "eval.max_new_tokens"}
CLI_EVAL_KEYS = {"num_problems": "--num-problems", "k": "--k", "temperature": "--temperature", "top_p": "--top-p",
                 "max_new_tokens": "--max-new-tokens"}


def eval_limit(num_problems: Any, key: str = "eval.num_problems") -> int | None:
    """Validate a held-out problem count and return the slice end: 0 means all (None), a negative count or a
    non-integer is a ConfigError. Use as ``problems[: eval_limit(n, key)]``."""
    _need(isinstance(num_problems, int) and not isinstance(num_problems, bool) and 0 <= num_problems <= MAX_INT,
          key, "an integer >= 0 (0 = all problems)", num_problems)
    return num_problems or None


def check_eval_settings(*, num_problems: Any, k: Any, temperature: Any, top_p: Any, max_new_tokens: Any,
                        keys: dict[str, str] | None = None) -> None:
    """The held-out evaluation settings, shared by ``eval.*`` in a config and ``cegppo eval`` (pass
    ``keys=CLI_EVAL_KEYS`` so messages name the flags). Raises a one-line ConfigError."""
    keys = {**EVAL_KEYS, **(keys or {})}

    def is_int(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and -MAX_INT - 1 <= v <= MAX_INT

    eval_limit(num_problems, keys["num_problems"])
    _need(is_int(k) and k >= 1, keys["k"], "an integer >= 1", k)
    _need(_is_real(temperature) and math.isfinite(temperature) and temperature >= 0, keys["temperature"],
          "a finite number >= 0 (0 = greedy)", temperature)
    _need(_is_real(top_p) and 0 < top_p <= 1, keys["top_p"], "in (0, 1]", top_p)
    _need(is_int(max_new_tokens) and max_new_tokens >= 1, keys["max_new_tokens"], "an integer >= 1", max_new_tokens)
    if k > 1 and temperature == 0:
        raise ConfigError(f"{keys['k']}={k} with {keys['temperature']}=0: greedy decoding gives {k} identical samples; "
                          f"expected {keys['k']}=1 or {keys['temperature']} > 0")


def validate(cfg: Config) -> None:
    """Every key of every section: types, finiteness of every float, integer ranges, range and cross-field
    checks, degenerate settings (with the reason). Paths are normalised in place (``~`` expanded). Objective
    hyperparameters are checked by the objective registry; the task name by the task registry
    (:func:`cegppo.data.tasks.check_task`, before any data or model loads). Raises a one-line ConfigError naming the key."""
    _check_numbers(cfg, "")

    cfg.output_dir = _path(cfg.output_dir, "output_dir")
    check_path_fits(cfg.output_dir, "output_dir", RUN_PATH_HEADROOM)  # not at the first checkpoint
    _model(cfg.model)
    _data(cfg.data)
    _algorithm(cfg.algorithm)
    _rollout(cfg.rollout, cfg.algorithm)
    _reward(cfg.reward, cfg.rollout)
    _optim(cfg.optim)
    _sft(cfg.sft)
    _eval(cfg.eval)
    _train(cfg.train)


def _model(m: ModelConfig) -> None:
    need = _need
    need(m.name.strip() != "" and "\x00" not in m.name, "model.name", "a preset, a local directory or a hub name",
         m.name)
    if m.name.startswith("~"):
        m.name = os.path.expanduser(m.name)
    need(m.precision in ("auto", "fp32", "bf16-autocast"), "model.precision", "auto, fp32 or bf16-autocast", m.precision)
    need(m.rollout_dtype in ("auto", "bfloat16", "float32"), "model.rollout_dtype", "auto, bfloat16 or float32",
         m.rollout_dtype)
    need(m.fused_lm_head in (True, False, "auto"), "model.fused_lm_head", "true, false or auto", m.fused_lm_head)
    need(isinstance(m.device, str) and DEVICES.fullmatch(m.device) is not None, "model.device",
         "auto, cpu, cuda or cuda:N", m.device)


def _data(d: DataConfig) -> None:
    need = _need
    d.train_path = _path(d.train_path, "data.train_path", optional=True)
    d.test_path = _path(d.test_path, "data.test_path", optional=True)
    need(d.task is not None or d.train_path is not None, "data.task", "set, or data.train_path given", d.task)
    for key in ("prompt_key", "answer_key"):
        v = getattr(d, key)
        need(v is None or v.strip() != "", f"data.{key}", "null or a non-empty (dotted) column name", v)
    need(1 <= d.difficulty <= 5, "data.difficulty", "in 1..5", d.difficulty)
    need(d.num_train >= 1, "data.num_train", ">= 1", d.num_train)
    need(d.num_test >= 0, "data.num_test", ">= 0", d.num_test)
    need(d.seed >= 0, "data.seed", ">= 0", d.seed)


def _algorithm(a: AlgorithmConfig) -> None:
    need = _need
    hp = {}
    for k, v in a.hparams.items():
        need(isinstance(k, str) and k.strip() != "", "algorithm.hparams", "a mapping of hyperparameter names to "
             "numbers", k)
        if isinstance(v, str):  # YAML 1.1 reads "1e-6" (no dot) as a string
            try:
                v = float(v)
            except ValueError:
                pass
        need(v is None or (_is_real(v) and math.isfinite(v)), f"algorithm.hparams.{k}", "a finite number (or null)",
             v)
        hp[k] = v
    a.hparams = hp
    try:
        get_objective(a.objective, **a.hparams)
    except ValueError as e:
        raise ConfigError(f"algorithm.objective / algorithm.hparams: {e}") from None
    need(a.agg is None or a.agg in AGGREGATIONS, "algorithm.agg", f"one of {AGGREGATIONS} or null", a.agg)
    need(a.advantage in ESTIMATORS, "algorithm.advantage", f"one of {ESTIMATORS}", a.advantage)
    need(a.adv_eps > 0, "algorithm.adv_eps", "a finite number > 0 (it keeps (R - mean) / (std + eps) finite)",
         a.adv_eps)
    for key in ("positive_loss_coeff", "kl_coeff", "entropy_coeff"):
        need(getattr(a, key) >= 0, f"algorithm.{key}", "a finite number >= 0", getattr(a, key))
    need(0 < a.prob_threshold < 1, "algorithm.prob_threshold", "in (0, 1)", a.prob_threshold)
    validate_entropy_control(a.entropy_control, a.objective, a.hparams)
    validate_adaptive_entropy(a.adaptive_entropy, a.entropy_control)
    need(a.max_num_gen_batches >= 1, "algorithm.max_num_gen_batches", ">= 1", a.max_num_gen_batches)


def _rollout(r: RolloutConfig, a: AlgorithmConfig) -> None:
    need = _need
    need(r.n >= 1, "rollout.n", ">= 1", r.n)
    if a.advantage in GROUP_ESTIMATORS:
        need(r.n >= 2, "rollout.n", f">= 2 with algorithm.advantage={a.advantage} (the advantage of a group of one "
             f"sample is 0: training would be a no-op)", r.n)
    need(r.temperature > 0, "rollout.temperature", "> 0 for RL sampling", r.temperature)
    need(0 < r.top_p <= 1, "rollout.top_p", "in (0, 1]", r.top_p)
    need(r.top_k >= 0, "rollout.top_k", ">= 0 (0 = off)", r.top_k)
    need(r.max_new_tokens >= 1, "rollout.max_new_tokens", ">= 1", r.max_new_tokens)
    need(r.max_prompt_tokens >= 1, "rollout.max_prompt_tokens", ">= 1", r.max_prompt_tokens)
    need(r.backend in ("hf", "vllm"), "rollout.backend", "'hf' or 'vllm'", r.backend)
    need(r.tis_cap == 0 or r.tis_cap >= 1, "rollout.tis_cap", "0 (off) or a cap >= 1 on the importance weight",
         r.tis_cap)
    need(r.tis_cap == 0 or r.backend == "vllm", "rollout.tis_cap", "0 unless rollout.backend=vllm (only vLLM reports "
         "its sampling log-probs; the hf engine samples from the trained policy itself)", r.tis_cap)
    need(0 < r.vllm_gpu_memory_utilization <= 1, "rollout.vllm_gpu_memory_utilization", "in (0, 1]",
         r.vllm_gpu_memory_utilization)


def _reward(w: RewardConfig, r: RolloutConfig) -> None:
    need = _need
    need(w.fn.strip() != "", "reward.fn", "math-strict, math-lenient, math or module:function", w.fn)
    need(w.correct_score > w.incorrect_score, "reward.correct_score", "> reward.incorrect_score", w.correct_score)
    need(0 < w.timeout_s <= MAX_TIMEOUT_S, "reward.timeout_s", f"in (0, {MAX_TIMEOUT_S:g}] seconds", w.timeout_s)
    need(0 <= w.overlong_buffer < r.max_new_tokens, "reward.overlong_buffer", "in [0, rollout.max_new_tokens)",
         w.overlong_buffer)
    need(w.overlong_penalty >= 0, "reward.overlong_penalty", "a finite number >= 0", w.overlong_penalty)


def _optim(o: OptimConfig) -> None:
    need = _need
    need(0 <= o.lr <= 1, "optim.lr", "a finite number >= 0 and <= 1 (AdamW moves every weight by about lr per step: "
         "a larger lr makes the weights overflow)", o.lr)
    need(o.warmup_steps >= 0, "optim.warmup_steps", ">= 0", o.warmup_steps)
    need(o.weight_decay >= 0, "optim.weight_decay", "a finite number >= 0", o.weight_decay)
    need(o.grad_clip > 0, "optim.grad_clip", "a finite number > 0", o.grad_clip)
    need(len(o.betas) == 2 and all(_is_real(b) and 0 <= b < 1 for b in o.betas), "optim.betas",
         "two numbers in [0, 1)", o.betas)
    o.betas = [float(b) for b in o.betas]


def _sft(s: SFTConfig) -> None:
    need = _need
    need(s.steps >= 0, "sft.steps", ">= 0 (0 = no warm-start)", s.steps)
    need(s.batch_size >= 1, "sft.batch_size", ">= 1", s.batch_size)
    need(0 <= s.lr <= 1, "sft.lr", "a finite number >= 0 and <= 1 (AdamW moves every weight by about lr per step)",
         s.lr)
    need(s.warmup_steps >= 0, "sft.warmup_steps", ">= 0", s.warmup_steps)


def _eval(e: EvalConfig) -> None:
    need = _need
    need(e.every >= 0, "eval.every", ">= 0 (0 = only before and after training)", e.every)
    check_eval_settings(num_problems=e.num_problems, k=e.k, temperature=e.temperature, top_p=e.top_p,
                        max_new_tokens=e.max_new_tokens)


def _train(t: TrainConfig) -> None:
    need = _need
    need(t.steps >= 0, "train.steps", ">= 0", t.steps)
    need(t.prompts_per_step >= 1, "train.prompts_per_step", ">= 1", t.prompts_per_step)
    need(t.gen_prompts_per_step == 0 or t.gen_prompts_per_step >= t.prompts_per_step, "train.gen_prompts_per_step",
         "0 or >= train.prompts_per_step", t.gen_prompts_per_step)
    need(t.mini_batches >= 1, "train.mini_batches", ">= 1", t.mini_batches)
    need(t.ppo_epochs >= 1, "train.ppo_epochs", ">= 1", t.ppo_epochs)
    need(t.micro_batch_size >= 1, "train.micro_batch_size", ">= 1", t.micro_batch_size)
    need(t.micro_batch_tokens >= 0, "train.micro_batch_tokens", ">= 0 (0 = rows only)", t.micro_batch_tokens)
    need(t.save_every >= 0, "train.save_every", ">= 0 (0 = no checkpoints)", t.save_every)
    need(t.keep_checkpoints >= 1, "train.keep_checkpoints", ">= 1", t.keep_checkpoints)
    need(t.max_bad_steps >= 1, "train.max_bad_steps", ">= 1", t.max_bad_steps)
    need(t.seed >= 0, "train.seed", ">= 0", t.seed)
    need(0 <= t.threads <= 1024, "train.threads", "in 0..1024 (0 = torch default)", t.threads)
