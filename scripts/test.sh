#!/usr/bin/env bash
# Set up a fresh machine and run every check: lint, format, types, the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
if [ $# -gt 0 ]; then
    bash scripts/setup.sh
    bash scripts/setup.sh --vllm
    exec .venv/bin/python -m pytest -q -rs --durations=15 "$@"
fi
# The vLLM engine's own environment (.venv-vllm) installs in the background from the start
# (about 80 CPU-seconds on a fresh machine): beside scripts/setup.sh, whose pip leaves a core
# idle most of the time, then beside lint, the unit tier and the integration tier's first
# tests. Its own pip cache (no two pips writing one cache). The `vllm` tests wait for its exit
# code (tests/conftest.py: _vllm_setup_done) and fail if it failed.
setup_dir=$(mktemp -d)
export TITANSCALE_VLLM_SETUP_RC=$setup_dir/vllm-setup.rc
( rc=0; PIP_CACHE_DIR=$setup_dir/pip-cache bash scripts/setup.sh --vllm \
      > "$TITANSCALE_VLLM_SETUP_RC.log" 2>&1 || rc=$?
  echo $rc > "$TITANSCALE_VLLM_SETUP_RC.tmp" && mv "$TITANSCALE_VLLM_SETUP_RC.tmp" "$TITANSCALE_VLLM_SETUP_RC" ) &
setup_pid=$!
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
# The unit tier on both cores. The integration tier in two passes: the tests not marked
# `serial` (nor `beside_serial`), multi-process and vLLM ones included, on two workers
# (`--dist loadfile`: a whole file per worker, so a module's server or training run is built
# once), then the `serial` ones (SERIAL_FILES in tests/conftest.py: deadlines, filled disks,
# signals, concurrency and peak memory, the README's commands) one at a time, beside two
# other pytest processes that use the core the serial tests leave idle: the Slurm lab's
# tests (their jobs mostly wait on Slurm; their deadlines are minutes) and the
# `beside_serial` files (BESIDE_SERIAL_FILES: CPU-bound, no deadline: the dry runs). Each
# pass prints its 30 slowest tests.
.venv/bin/python -m pytest -q -rs --durations=30 -n 2 tests/unit
# mypy (~27 CPU-s without its cache) beside the parallel pass, which leaves about a sixth of
# the two cores idle; its exit code is checked at the end.
mypy_log=$setup_dir/mypy.log
.venv/bin/mypy > "$mypy_log" 2>&1 &
mypy_pid=$!
.venv/bin/python -m pytest -q -rs --durations=30 -n 2 --dist loadfile \
    -m "not serial and not beside_serial" tests/integration
wait "$setup_pid"
[ "$(cat "$TITANSCALE_VLLM_SETUP_RC")" = 0 ] || { tail -20 "$TITANSCALE_VLLM_SETUP_RC.log"; exit 1; }
slurm_log=$setup_dir/slurm-tests.log
beside_log=$setup_dir/beside-serial-tests.log
echo "Slurm lab tests and the beside_serial files running beside the serial pass; their reports follow it"
.venv/bin/python -m pytest -q -rs --durations=30 -m "serial and slurm" tests/integration \
    > "$slurm_log" 2>&1 &
slurm_pid=$!
.venv/bin/python -m pytest -q -rs --durations=30 -m "beside_serial" tests/integration \
    > "$beside_log" 2>&1 &
beside_pid=$!
serial_rc=0
.venv/bin/python -m pytest -q -rs --durations=30 -m "serial and not slurm" tests/integration \
    || serial_rc=$?
slurm_rc=0
wait "$slurm_pid" || slurm_rc=$?
beside_rc=0
wait "$beside_pid" || beside_rc=$?
cat "$slurm_log" "$beside_log"
mypy_rc=0
wait "$mypy_pid" || mypy_rc=$?
cat "$mypy_log"
[ "$serial_rc" = 0 ] && [ "$slurm_rc" = 0 ] && [ "$beside_rc" = 0 ] && [ "$mypy_rc" = 0 ]
