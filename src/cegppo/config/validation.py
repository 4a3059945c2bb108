"""Validation of a loaded config: every field's type (coerced), finiteness and declared rule, then the
cross-field checks, each failure one line naming the key. The rules live in the schema (each field's
``metadata["range"]``, :func:`cegppo.config.schema.key`) and one interpreter reads them,
:func:`cegppo.errors.check_rule`; what is stated here is only what one key's rule cannot say: the checks across keys
(each stated once), path expansion and the file-system limits. Checks that need the loaded data or tokenizer are
:mod:`cegppo.config.data_checks`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import types
import typing
from typing import Any

from cegppo.algorithm.entropy_control import validate_adaptive_entropy, validate_entropy_control
from cegppo.algorithm.objectives import get_objective
from cegppo.config.schema import MAX_TIMEOUT_S  # noqa: F401 - re-exported by cegppo.config
from cegppo.config.schema import MAX_BATCH_TOKENS
from cegppo.config.schema import (AlgorithmConfig, Config, DataConfig, EvalConfig, RewardConfig, RolloutConfig,
                                  TrainConfig)
from cegppo.errors import MAX_INT, ConfigError, check_rule, show


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


def _leaves(obj: Any, where: str = ""):
    """``(section, field, annotated type, dotted key)`` of every non-section field, nested sections included."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        key = f"{where}.{f.name}" if where else f.name
        if dataclasses.is_dataclass(hints[f.name]):
            yield from _leaves(getattr(obj, f.name), key)
        else:
            yield obj, f, hints[f.name], key


def _check_types(obj: Any) -> None:
    """Types of every field (also for a Config built in code), then: every float finite, every int in 64 bits, no
    text with a NUL byte."""
    for section, f, tp, key in _leaves(obj):
        value = check_type(getattr(section, f.name), tp, key)
        setattr(section, f.name, value)
        if isinstance(value, str):
            _need("\x00" not in value, key, "text without NUL bytes", value)
        if isinstance(value, float):
            _need(math.isfinite(value), key, "a finite number", value)
        elif isinstance(value, int) and not isinstance(value, bool):
            _need(-MAX_INT - 1 <= value <= MAX_INT, key, "an integer that fits 64 bits", value)


def _check_rules(obj: Any) -> None:
    """Every field's declared rule (``metadata["range"]``), nested sections included; null where the type admits
    it needs no rule."""
    for section, f, tp, key in _leaves(obj):
        value = getattr(section, f.name)
        if not (value is None and type(None) in typing.get_args(tp)):
            check_rule(value, f.metadata["range"], key)


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


def _expand(path: str | None) -> str | None:
    return None if path is None else os.path.expanduser(path)


GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo")  # advantages relative to the other samples of the same prompt

EVAL_KEYS = {"num_problems": "eval.num_problems", "k": "eval.k", "temperature": "eval.temperature",
             "top_p": "eval.top_p", "max_new_tokens": "eval.max_new_tokens"}
CLI_EVAL_KEYS = {"num_problems": "--num-problems", "k": "--k", "temperature": "--temperature", "top_p": "--top-p",
                 "max_new_tokens": "--max-new-tokens"}
# the declared rules and types of eval.*, which `cegppo eval`'s flags share (values no type check has seen)
_EVAL_RULES = {f.name: f.metadata["range"] for f in dataclasses.fields(EvalConfig)}
_EVAL_KINDS = typing.get_type_hints(EvalConfig)


def eval_limit(num_problems: Any, key: str = "eval.num_problems") -> int | None:
    """Validate a held-out problem count and return the slice end: 0 means all (None), a negative count or a
    non-integer is a ConfigError. Use as ``problems[: eval_limit(n, key)]``."""
    check_rule(num_problems, _EVAL_RULES["num_problems"], key, kind=int)
    return num_problems or None


def check_eval_settings(*, num_problems: Any, k: Any, temperature: Any, top_p: Any, max_new_tokens: Any,
                        keys: dict[str, str] | None = None) -> None:
    """The held-out evaluation settings, shared by ``eval.*`` in a config and ``cegppo eval`` (pass
    ``keys=CLI_EVAL_KEYS`` so messages name the flags): each its declared rule, then greedy decoding with k > 1.
    Raises a one-line ConfigError."""
    keys = {**EVAL_KEYS, **(keys or {})}
    values = {"num_problems": num_problems, "k": k, "temperature": temperature, "top_p": top_p,
              "max_new_tokens": max_new_tokens}
    for name, value in values.items():
        check_rule(value, _EVAL_RULES[name], keys[name], kind=_EVAL_KINDS[name])
    if k > 1 and temperature == 0:
        raise ConfigError(f"{keys['k']}={k} with {keys['temperature']}=0: greedy decoding gives {k} identical samples; "
                          f"expected {keys['k']}=1 or {keys['temperature']} > 0")


def validate(cfg: Config) -> None:
    """Every key of every section: its type (coerced in place), finiteness of every float, its declared rule; then
    the checks across keys, degenerate settings (with the reason). Paths are normalised in place (``~`` expanded).
    Objective hyperparameters are checked by the objective registry; the task name by the task registry
    (:func:`cegppo.data.tasks.check_task`, before any data or model loads). Raises a one-line ConfigError naming
    the key."""
    _check_types(cfg)
    e = cfg.eval  # first, so that eval.* is worded as `cegppo eval`'s flags are (an integer >= 1)
    check_eval_settings(num_problems=e.num_problems, k=e.k, temperature=e.temperature, top_p=e.top_p,
                        max_new_tokens=e.max_new_tokens)
    _check_rules(cfg)

    cfg.output_dir = _expand(cfg.output_dir)
    check_path_fits(cfg.output_dir, "output_dir", RUN_PATH_HEADROOM)  # not at the first checkpoint
    if cfg.model.name.startswith("~"):
        cfg.model.name = _expand(cfg.model.name)
    _data(cfg.data)
    _algorithm(cfg.algorithm)
    _rollout(cfg.rollout, cfg.algorithm)
    _reward(cfg.reward, cfg.rollout)
    _train(cfg.train)
    _batch_tokens(cfg)
    cfg.optim.betas = [float(b) for b in cfg.optim.betas]


def _data(d: DataConfig) -> None:
    d.train_path, d.test_path = _expand(d.train_path), _expand(d.test_path)
    _need(d.task is not None or d.train_path is not None, "data.task", "set, or data.train_path given", d.task)


def _algorithm(a: AlgorithmConfig) -> None:
    hp = {}
    for k, v in a.hparams.items():  # free: their names and ranges are the objective's (get_objective)
        _need(isinstance(k, str) and k.strip() != "", "algorithm.hparams", "a mapping of hyperparameter names to "
              "numbers", k)
        if isinstance(v, str):  # YAML 1.1 reads "1e-6" (no dot) as a string
            try:
                v = float(v)
            except ValueError:
                pass
        _need(v is None or (_is_real(v) and math.isfinite(v)), f"algorithm.hparams.{k}", "a finite number (or null)",
              v)
        hp[k] = v
    a.hparams = hp
    try:
        get_objective(a.objective, **a.hparams)
    except ValueError as e:
        raise ConfigError(f"algorithm.objective / algorithm.hparams: {e}") from None
    # across keys: the controllers' betas against the objective's, and not both on (these functions also repeat the
    # controllers' ranges, for the TRL / verl adapters, whose configs no schema walk sees)
    validate_entropy_control(a.entropy_control, a.objective, a.hparams)
    validate_adaptive_entropy(a.adaptive_entropy, a.entropy_control)


def _rollout(r: RolloutConfig, a: AlgorithmConfig) -> None:
    if a.advantage in GROUP_ESTIMATORS:
        _need(r.n >= 2, "rollout.n", f">= 2 with algorithm.advantage={a.advantage} (the advantage of a group of one "
              f"sample is 0: training would be a no-op)", r.n)
    _need(r.tis_cap == 0 or r.backend == "vllm", "rollout.tis_cap", "0 unless rollout.backend=vllm (only vLLM "
          "reports its sampling log-probs; the hf engine samples from the trained policy itself)", r.tis_cap)


def _reward(w: RewardConfig, r: RolloutConfig) -> None:
    _need(w.correct_score > w.incorrect_score, "reward.correct_score", "> reward.incorrect_score", w.correct_score)
    _need(w.overlong_buffer < r.max_new_tokens, "reward.overlong_buffer",
          f"< rollout.max_new_tokens ({r.max_new_tokens})", w.overlong_buffer)


def _train(t: TrainConfig) -> None:
    _need(t.gen_prompts_per_step == 0 or t.gen_prompts_per_step >= t.prompts_per_step, "train.gen_prompts_per_step",
          "0 or >= train.prompts_per_step", t.gen_prompts_per_step)


EVAL_BATCH_PROMPTS = 16  # prompts the held-out evaluation inside a run generates together (engine.evaluation)


def check_batch_tokens(factors: list[tuple[str, int]], tokens: list[tuple[str, int]], what: str) -> None:
    """Refuse a generation batch of more than MAX_BATCH_TOKENS tokens: the product of ``factors`` (sequences) times
    the sum of ``tokens`` (each sequence's budget), every ``(key, value)`` named in the one-line ConfigError."""
    sequences = math.prod(v for _, v in factors)
    total = sequences * sum(v for _, v in tokens)
    if total > MAX_BATCH_TOKENS:
        product = " x ".join(f"{k}={v}" for k, v in factors)
        budget = " + ".join(f"{k}={v}" for k, v in tokens)
        raise ConfigError(f"{product} sequences x ({budget}) tokens = {total} tokens in {what}; expected at most "
                          f"{MAX_BATCH_TOKENS} (2^31: past 32-bit tensor indexing, and their ids, masks and log-probs "
                          f"alone would take over 64 GiB): lower one of them")


def _batch_tokens(cfg: Config) -> None:
    t, r, e = cfg.train, cfg.rollout, cfg.eval
    prompts = (("train.gen_prompts_per_step", t.gen_prompts_per_step) if t.gen_prompts_per_step
               else ("train.prompts_per_step", t.prompts_per_step))
    check_batch_tokens([prompts, ("rollout.n", r.n)], [("rollout.max_prompt_tokens", r.max_prompt_tokens),
                                                        ("rollout.max_new_tokens", r.max_new_tokens)],
                       "one step's generation")
    check_batch_tokens([("prompts per held-out batch", EVAL_BATCH_PROMPTS), ("eval.k", e.k)],
                       [("rollout.max_prompt_tokens", r.max_prompt_tokens), ("eval.max_new_tokens", e.max_new_tokens)],
                       "one held-out generation batch")
