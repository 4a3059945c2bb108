#!/usr/bin/env bash
# CE-GPPO on DeepSeek-R1-Distill-Qwen-7B as the authors ran it (beta1 = 0.75, beta2 = 1): see ce_gppo_math.sh.
# Their 7B validation used 32K-token responses; verl 0.9.1's val_kwargs has no length cap (16K here, as training).
#   TRAIN_FILE=mathsub30k.parquet VAL_FILE=aime24.parquet bash run_7b.sh [hydra overrides]
set -euo pipefail
export MODEL_PATH=${MODEL_PATH:-deepseek-ai/DeepSeek-R1-Distill-Qwen-7B}
export BETA1=0.75
export EXPERIMENT=${EXPERIMENT:-ce_gppo_7b_math}
exec bash "$(dirname "${BASH_SOURCE[0]}")/ce_gppo_math.sh" "$@"
