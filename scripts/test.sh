#!/usr/bin/env bash
# Set up a fresh machine and run every check: lint, format, types, the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
if [ $# -gt 0 ]; then
    bash scripts/setup.sh --vllm
    exec .venv/bin/python -m pytest -q -rs --durations=15 "$@"
fi
# The vLLM engine's own environment (.venv-vllm) installs in the background (about 4 minutes
# on a fresh machine, mostly downloading and unpacking) while lint, the unit tier and the
# integration tier's first tests run; the `vllm` tests wait for its exit code
# (tests/conftest.py: _vllm_setup_done) and fail if it failed.
setup_dir=$(mktemp -d)
export TITANSCALE_VLLM_SETUP_RC=$setup_dir/vllm-setup.rc
( rc=0; bash scripts/setup.sh --vllm > "$TITANSCALE_VLLM_SETUP_RC.log" 2>&1 || rc=$?
  echo $rc > "$TITANSCALE_VLLM_SETUP_RC.tmp" && mv "$TITANSCALE_VLLM_SETUP_RC.tmp" "$TITANSCALE_VLLM_SETUP_RC" ) &
setup_pid=$!
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
# The unit tier on both cores. The integration tier in two passes: the tests not marked
# `serial`, multi-process and vLLM ones included, on two workers (`--dist loadfile`: a whole
# file per worker, so a module's server or training run is built once), then the `serial`
# ones alone (deadlines, filled disks, signals,
# benchmarks, the Slurm lab: SERIAL_FILES in tests/conftest.py). Each pass prints its 30
# slowest tests.
.venv/bin/python -m pytest -q -rs --durations=30 -n 2 tests/unit
.venv/bin/python -m pytest -q -rs --durations=30 -n 2 --dist loadfile -m "not serial" tests/integration
wait "$setup_pid"
[ "$(cat "$TITANSCALE_VLLM_SETUP_RC")" = 0 ] || { tail -20 "$TITANSCALE_VLLM_SETUP_RC.log"; exit 1; }
.venv/bin/python -m pytest -q -rs --durations=30 -m serial tests/integration
