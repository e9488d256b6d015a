#!/usr/bin/env bash
# Create (or reuse) .venv and install titanscale's pinned dependencies.
# torch==2.14.1 comes from this machine's local disk through pip (about a minute on a fresh
# machine); nothing else is needed from the network beyond the package registry.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ "${1:-}" = "--vllm" ]; then
  exec bash scripts/setup_vllm.sh
fi
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# A stamp of pyproject.toml's hash skips the install when nothing changed (fast re-runs).
stamp=.venv/.titanscale-deps
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  # pip byte-compiles every file here (~33 CPU-s for ~17,700 files), and that must stay:
  # with PYTHONDONTWRITEBYTECODE=1 (set on this machine and CI's) Python never writes the
  # .pyc of what it imports, and each process would compile torch again (measured: the
  # integration tier's first pass 1,230 -> 1,778 s with pip --no-compile).
  .venv/bin/python -m pip install -q -e '.[dev]'
  # [tool.titanscale] no_deps_dev: pinned dev packages whose own pins cannot be met (why:
  # pyproject.toml); their usable requirements are in the dev group above.
  nodeps=$(.venv/bin/python -c '
try:
    import tomllib
except ImportError:  # Python 3.10: tomli, a runtime dependency there
    import tomli as tomllib
print(" ".join(tomllib.load(open("pyproject.toml", "rb"))["tool"]["titanscale"]["no_deps_dev"]))')
  # shellcheck disable=SC2086
  .venv/bin/python -m pip install -q --no-deps $nodeps
  echo "$want" > "$stamp"
fi
