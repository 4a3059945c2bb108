#!/usr/bin/env bash
# CE-GPPO on DeepSeek-R1-Distill-Qwen-1.5B as the authors ran it (beta1 = 0.5, beta2 = 1): see ce_gppo_math.sh.
#   TRAIN_FILE=mathsub30k.parquet VAL_FILE=aime24.parquet bash run_1p5b.sh [hydra overrides]
set -euo pipefail
export MODEL_PATH=${MODEL_PATH:-deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B}
export BETA1=0.5
export EXPERIMENT=${EXPERIMENT:-ce_gppo_1p5b_math}
exec bash "$(dirname "${BASH_SOURCE[0]}")/ce_gppo_math.sh" "$@"
