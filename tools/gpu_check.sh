#!/usr/bin/env bash
# One-GPU check (an H200 lent through the device tool, or any single CUDA GPU); docs/gpu.md.
#   bash tools/gpu_carry.sh                 # HERE, once: wheels -> .whl/, tokenizer -> .gpu_carry/
#   bash tools/gpu_check.sh [--budget-s S]  # THERE (device run, carry .whl and .gpu_carry):
#                                           # ~5-7 min; report in $OUT (3 files)
#   bash tools/gpu_check.sh --cpu-smoke     # the same stages on CPU, debug model
# On the lent machine torch is the image's own (older than our pin); torchtitan, torchao and
# their small pure-Python dependencies travel as wheels in .whl/ and are installed to /tmp.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
if ls .whl/*.whl >/dev/null 2>&1 && ! "$PY" -c "import torchtitan" 2>/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/titanscale_site .whl/*.whl
  export PYTHONPATH=/tmp/titanscale_site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
if [ "${1:-}" = "--cpu-smoke" ]; then
  shift
  exec "$PY" -m tools.gpu_check --cpu-smoke --steps 4 --warmup 1 \
    --out "${OUT:-outputs/gpu_check_cpu}" --work "${TMPDIR:-/tmp}/titanscale_gpu_check_cpu" "$@"
fi
exec "$PY" -m tools.gpu_check --out "${OUT:-outputs/gpu_check}" "$@"
