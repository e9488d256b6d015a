#!/usr/bin/env bash
# Prepare, on this machine, what tools/gpu_check.sh needs on the lent GPU machine (docs/gpu.md):
#   .whl/        wheels for Python 3.12 of the packages its image lacks (pure Python, plus
#                torchao's abi3 wheel), installed there to /tmp by gpu_check.sh
#   .gpu_carry/  the embedded 128k-vocabulary tokenizer, built here (the machine's other
#                library versions would key a fresh training on every fresh machine)
# Both folders are git-ignored; name them in the device run's `carry`. Together ~15 MiB of
# the 64 MiB a call may carry. Needs network access to PyPI (here, not there).
set -euo pipefail
cd "$(dirname "$0")/.."
# Pinned to the versions in this repository's environment (pip list), not the latest.
WHEELS=(
  torchtitan==0.3.0 torchao==0.18.0 spmd_types==0.2.3 torch_checkpointing==0.1.1
  tyro==1.0.17 docstring_parser==0.18.0 typeguard==4.6.1 torchdata==0.11.0
  datasets==4.7.0 dill==0.4.0 multiprocess==0.70.18
)
rm -rf .whl && mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux1_x86_64 --platform any -d .whl "${WHEELS[@]}"
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
"$PY" -m tools.gpu_check --prepare-tokenizer .gpu_carry/tokenizer
du -sh .whl .gpu_carry
