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
# The unit tier on both cores (pure tests: two xdist workers halve its wall time), then the
# integration tier one test at a time (its tests start process groups, servers and clusters
# of their own and carry deadlines that a second worker's load would eat into).
.venv/bin/python -m pytest -q -rs --durations=5 -n 2 tests/unit
.venv/bin/python -m pytest -q -rs --durations=15 tests/integration
