#!/usr/bin/env bash
# Set up a fresh machine and run every check: lint, format, types, the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The vLLM engine's own environment (.venv-vllm): the `vllm` tests need it, and fail without.
bash scripts/setup.sh --vllm
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
if [ $# -gt 0 ]; then
    exec .venv/bin/python -m pytest -q -rs --durations=15 "$@"
fi
# The unit tier on both cores (pure tests: two xdist workers halve its wall time). The
# integration tier in two passes: the tests not marked `serial` on two workers, a whole file
# per worker (`--dist loadfile`: a module's server or training run is built once), then the
# `serial` ones alone (multiproc / slurm, deadlines, filled disks, signals, benchmarks: see
# SERIAL_FILES in tests/conftest.py). Each pass prints its 20 slowest tests.
.venv/bin/python -m pytest -q -rs --durations=20 -n 2 tests/unit
.venv/bin/python -m pytest -q -rs --durations=20 -n 2 --dist loadfile -m "not serial" tests/integration
.venv/bin/python -m pytest -q -rs --durations=20 -m serial tests/integration
