#!/usr/bin/env bash
# The authors' CE-GPPO math recipe (docs/algorithm.md §8; their scripts 1_5B_/7B_perf_run_gppo_v1_*_ours_math.sh)
# for verl 0.9.x: `python -m verl.trainer.main_ppo` with cegppo's `ce_gppo` policy loss. Needs GPUs (vLLM rollouts,
# FSDP with Ulysses sequence parallelism); run_1p5b.sh and run_7b.sh set the model and beta1 and call this script.
#
#   MODEL_PATH   model directory or Hugging Face id (required)
#   BETA1        CE-GPPO beta1 (required: authors 0.5 at 1.5B, 0.75 at 7B); beta2 = 1
#   TRAIN_FILE   training parquet in verl's schema (KlearReasoner-MathSub-30K), required
#   VAL_FILE     validation parquet (an AIME set; the authors repeat each problem 32 times), required
#   NNODES, GPUS_PER_NODE   default 16 x 8 (the authors' 128 GPUs); ray must already span NNODES nodes
#   EXPERIMENT   trainer.experiment_name (default ce_gppo_math)
#   PYTHON       the interpreter with verl and cegppo (default python3)
# Extra arguments are appended as Hydra overrides (they win), e.g. trainer.total_epochs=1.
# CEGPPO_PRINT_OVERRIDES=1 prints the overrides, one per line, instead of starting verl (used by the tests).
set -euo pipefail
: "${MODEL_PATH:?set MODEL_PATH}" "${BETA1:?set BETA1}" "${TRAIN_FILE:?set TRAIN_FILE}" "${VAL_FILE:?set VAL_FILE}"
NNODES=${NNODES:-16}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
max_prompt=4096
max_response=16384
sp=4  # Ulysses sequence parallelism, as the authors: a 20480-token sequence spans 4 GPUs of 5120 tokens
max_tokens_per_gpu=$(((max_prompt + max_response) / sp))
# verl loads a custom reward from a file path: cegppo's, wherever it is installed
PYTHON=${PYTHON:-python3}
reward_py=$("$PYTHON" -c 'import importlib.util as u; print(u.find_spec("cegppo.integrations.verl_reward").origin)')
a=actor_rollout_ref.actor
r=actor_rollout_ref.rollout
overrides=(
    # CE-GPPO (cegppo's verl plugin registers ce_gppo at `import verl`)
    "$a.policy_loss._target_=cegppo.integrations.verl.CEGPPOPolicyLossConfig"
    "$a.policy_loss.loss_mode=ce_gppo"
    "+$a.policy_loss.beta1=$BETA1"
    "+$a.policy_loss.beta2=1.0"
    "$a.clip_ratio_low=0.2" "$a.clip_ratio_high=0.2" "$a.clip_ratio_c=10.0"
    "$a.loss_agg_mode=token-mean"
    # GRPO advantages, no KL, dynamic sampling on the `acc` metric of the dapo reward manager
    "algorithm.adv_estimator=grpo" "algorithm.norm_adv_by_std_in_grpo=True" "algorithm.use_kl_in_reward=False"
    "algorithm.filter_groups.enable=True" "algorithm.filter_groups.metric=acc"
    "$a.use_kl_loss=False" "$a.entropy_coeff=0"
    # data: 256 prompts generated, 128 trained per step, 8 rollouts each, mini-batches of 16 prompts (8 updates)
    "data.train_files=$TRAIN_FILE" "data.val_files=$VAL_FILE"
    "data.train_batch_size=128" "data.gen_batch_size=256"
    "data.max_prompt_length=$max_prompt" "data.max_response_length=$max_response" "data.truncation=left"
    "$a.ppo_mini_batch_size=16" "$a.ppo_epochs=1"
    # optimizer: AdamW lr 1e-6, 10 warm-up steps, weight decay 0.1, grad clip 1
    "$a.optim.lr=1e-6" "$a.optim.lr_warmup_steps=10" "$a.optim.weight_decay=0.1" "$a.optim.clip_grad=1.0"
    # model and parallelism (the authors' settings: SP 4, rollout TP 2, param/optimizer offload, dynamic batches)
    "actor_rollout_ref.model.path=$MODEL_PATH" "actor_rollout_ref.model.use_remove_padding=True"
    "$a.strategy=fsdp2" "$a.ulysses_sequence_parallel_size=$sp"
    "$a.fsdp_config.param_offload=True" "$a.fsdp_config.optimizer_offload=True"
    "$a.use_dynamic_bsz=True" "$a.ppo_max_token_len_per_gpu=$max_tokens_per_gpu"
    "$r.log_prob_use_dynamic_bsz=True" "$r.log_prob_max_token_len_per_gpu=$max_tokens_per_gpu"
    # rollouts: vLLM, T = 1, top-p 1; validation T = 0.6, top-p 0.95, one sample per (repeated) problem
    "$r.name=vllm" "$r.tensor_model_parallel_size=2" "$r.gpu_memory_utilization=0.8"
    "$r.n=8" "$r.temperature=1.0" "$r.top_p=1.0" "$r.top_k=-1"
    "$r.val_kwargs.temperature=0.6" "$r.val_kwargs.top_p=0.95" "$r.val_kwargs.do_sample=True" "$r.val_kwargs.n=1"
    # reward: +1 / -1 from math-verify on the full response (cegppo.integrations.verl_reward), `acc` for filter_groups
    "reward.reward_manager.name=dapo"
    "reward.custom_reward_function.path=$reward_py" "reward.custom_reward_function.name=compute_score"
    "trainer.nnodes=$NNODES" "trainer.n_gpus_per_node=$GPUS_PER_NODE"
    "trainer.total_epochs=10" "trainer.test_freq=5" "trainer.save_freq=5" "trainer.val_before_train=True"
    "trainer.project_name=cegppo" "trainer.experiment_name=${EXPERIMENT:-ce_gppo_math}"
)
if [ "${CEGPPO_PRINT_OVERRIDES:-0}" = 1 ]; then
    printf '%s\n' "${overrides[@]}" "$@"
    exit 0
fi
exec "$PYTHON" -m verl.trainer.main_ppo "${overrides[@]}" "$@"
