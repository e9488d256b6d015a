"""The worker registry: `peers.py --worker NAME ARGS_JSON` runs one side of a pair in its own
process and prints one `RESULT <json>` line. Modules are imported by name only when their
worker runs (the skyrl-tx venv has no torch, TRL or titanscale)."""

from __future__ import annotations

import importlib
import json
import sys
import traceback

from benchmarks.peerbench.config import ROOT

# name -> (module under benchmarks.peerbench, function)
WORKERS = {
    "trl_sft": ("hf_workers", "w_trl_sft"),
    "hf_full": ("hf_workers", "w_hf_full"),
    "gen": ("gen_worker", "w_gen"),
    "trl_grpo": ("hf_workers", "w_trl_grpo"),
    "trl_dpo": ("hf_workers", "w_trl_dpo"),
    "tinker_dpo": ("tinker_workers", "w_tinker_dpo"),
    "tinker_script": ("tinker_workers", "w_tinker_script"),
}


def call(name: str, a: dict) -> dict:
    """Run worker `name` on its arguments in this process; its result."""
    sys.path.insert(0, str(ROOT))
    if "threads" in a:
        try:
            import torch

            torch.set_num_threads(a["threads"])
        except ImportError:
            pass
    module, fn = WORKERS[name]
    return getattr(importlib.import_module(f"benchmarks.peerbench.{module}"), fn)(a)


def run_worker(name: str, raw: str) -> None:
    """`peers.py --worker NAME ARGS_JSON`: one worker, one process, one RESULT line."""
    print("RESULT " + json.dumps(call(name, json.loads(raw))), flush=True)


def worker_loop() -> None:
    """`peers.py --worker-loop` (--one-worker-process): every request, one `[NAME, ARGS]`
    JSON line on stdin, runs in this one process and answers one `RESULT <json>` or
    `FAILED <json traceback>` line, until stdin closes. The imports (torch, transformers,
    TRL, the SDK) are paid once instead of once per run: for loss checks, not timings."""
    for line in sys.stdin:
        name, a = json.loads(line)
        try:
            out = "RESULT " + json.dumps(call(name, a))
        except Exception:
            out = "FAILED " + json.dumps(traceback.format_exc())
        print(out, flush=True)
