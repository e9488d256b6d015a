#!/usr/bin/env bash
# CPU post-training demo: pretrain the debug model (200 steps, checkpointed), then LoRA-SFT it
# on the generated letter-sorting task; held-out exact match is logged before and after.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
if [ ! -d outputs/debug/checkpoint/step-200 ]; then
  .venv/bin/python train.py --recipe recipes/debug.toml \
    --set training.steps=200 --set checkpoint.interval=200 --set metrics.log_every=20
fi
.venv/bin/python -m posttrain.tasks --out data/tasks/letter_sort
.venv/bin/python train.py --recipe recipes/sft_debug.toml "$@"
