"""The worker registry: `peers.py --worker NAME ARGS_JSON` runs one side of a pair in its own
process and prints one `RESULT <json>` line. Modules are imported by name only when their
worker runs (the skyrl-tx venv has no torch, TRL or titanscale)."""

from __future__ import annotations

import importlib
import json
import sys

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


def run_worker(name: str, raw: str) -> None:
    a = json.loads(raw)
    sys.path.insert(0, str(ROOT))
    if "threads" in a:
        try:
            import torch

            torch.set_num_threads(a["threads"])
        except ImportError:
            pass
    module, fn = WORKERS[name]
    out = getattr(importlib.import_module(f"benchmarks.peerbench.{module}"), fn)(a)
    print("RESULT " + json.dumps(out), flush=True)
