#!/usr/bin/env bash
# One-GPU check (an H200 lent through the device tool, or any single CUDA GPU):
#   bash tools/gpu_check.sh [OUT]            # ~5-7 min on an H200
#   bash tools/gpu_check.sh --cpu-smoke      # the same pipeline on CPU, debug model
# On the lent machine torch is the image's own (older than our pin); torchtitan, torchao and
# their small pure-Python dependencies travel as wheels in .whl/ (see docs/gpu_check.md).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
if [ "${1:-}" = "--cpu-smoke" ]; then
  exec "$PY" -m tools.gpu_check --cpu-smoke --steps 4 --warmup 1 --out "${OUT:-outputs/gpu_check_cpu}"
fi
exec "$PY" -m tools.gpu_check --out "${1:-${OUT:-outputs/gpu_check}}"
