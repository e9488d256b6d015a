#!/usr/bin/env bash
# Set up a fresh machine and train the embedded default (tiny Llama on this Python's standard
# library) on CPU with 2 processes (FSDP2 over gloo). Extra arguments go to train.py.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
exec .venv/bin/python -m tools.torchrun --nproc_per_node=2 --local-ranks-filter=0 train.py --recipe recipes/debug.toml "$@"
