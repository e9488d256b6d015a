"""titanscale side by side with the tools a post-training user would pick instead.

    python benchmarks/peers.py [--quick] [--repeats R] [--pairs a,b] [--threads T]
                               [--out benchmarks/peers] [--work outputs/peers]

One invocation runs every pair on the same base, data and hyperparameters, the two sides of
a pair interleaved (ours, peer, peer, ours, ...) so that both see the same machine load, and
writes `<out>.md` and `<out>.json` (command, machine, versions, date, load averages, median
and spread over the repeats, ratios ours/peer with > 1 = titanscale faster).

The base: the debug Llama (6 layers, dim 256, vocabulary 2048) trained from scratch by
`train.py` on the arithmetic task's train split for --base-steps steps, saved as a DCP
checkpoint (what titanscale loads) and exported to a Hugging Face folder (what the peers
load; float32, so both hold the same numbers). Built once and cached under --work.

Pairs (titanscale is driven only through its public entry points: `train.py` recipes with
`--set`, `tools.serve` through the tinker SDK, the generator's API):
- sft_lora_packed / sft_lora_unpacked: LoRA SFT, recipes/sft_debug.toml vs TRL SFTTrainer +
  PEFT LoraConfig (same rank, alpha, target modules), packing on (bfd) and off.
- full_ft: full fine-tune, recipes/sft_debug.toml with finetune.mode=full vs transformers
  Trainer.
- generate: rl.generator.Generator vs transformers `generate` (KV cache), greedy and sampled
  (group of 8 per prompt).
- grpo: recipes/rl_debug.toml (arithmetic) vs TRL GRPOTrainer, same group size, steps and
  reward; held-out reward is greedy decoding on every held-out prompt.
- dpo: DPO through tools.serve (tinker SDK forward_backward_custom) vs TRL DPOTrainer + PEFT.
- service: one tinker SDK script (forward_backward + optim_step + sample) against tools.serve
  and against skyrl-tx's Tinker server (its own virtual environment, see --skyrl-python).

Each side runs in its own process (`peers.py --worker NAME ARGS_JSON` for the peers), one
process at a time. Step times are wall time between consecutive optimizer steps, the median
over the steps after the first few (warm-up); a pair's figure is the median over repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from benchmarks.peerbench.config import PAIRS, ROOT, SKYRL_INSTALL
from benchmarks.peerbench.harness import Ctx, RunFailed, Server, prepare, start_serve
from benchmarks.peerbench.pairs import dpo_pair, gen_pair, grpo_pair, service_pair, sft_pair
from benchmarks.peerbench.report import before_of, versions, write_report
from benchmarks.peerbench.workers import run_worker, worker_loop


def merge(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Several runs' results as one: their pairs (later runs replace a pair), commands joined,
    load readings pooled, the first run's machine, versions and --before columns; the date and
    wall minutes of the run that ended last (runs may have overlapped: say so in the report)."""
    first, last = runs[0]["meta"], max((r["meta"] for r in runs), key=lambda m: m["date"])
    loads = [x for r in runs for x in r["meta"]["loads"]]
    pairs: dict[str, Any] = {}
    for r in runs:
        pairs.update(
            {k: v for k, v in r["pairs"].items() if k not in r["meta"].get("pairs_pending", [])}
        )
    meta = {
        **first,
        "command": " + ".join(f"`{r['meta']['command']}` ({', '.join(r['pairs'])})" for r in runs),
        "date": last["date"],
        "wall_minutes": max(r["meta"]["wall_minutes"] for r in runs),
        "load_min": min(loads),
        "load_max": max(loads),
        "load_median": statistics.median(loads),
        "loads": loads,
        "pairs_pending": [],
        "merged_from": [r["meta"] for r in runs],
    }
    out = {"pairs": pairs, "meta": meta}
    if "before" in runs[0]:
        out["before"] = runs[0]["before"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--worker", nargs=2, metavar=("NAME", "ARGS_JSON"), help=argparse.SUPPRESS)
    ap.add_argument("--worker-loop", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument(
        "--one-worker-process",
        action="store_true",
        help="run every worker of this venv (the TRL / transformers sides, the tinker clients) "
        "in one shared process: imports paid once, for loss checks (the test); its timings "
        "are not the benchmark's (train.py, the servers and skyrl-tx keep their processes)",
    )
    ap.add_argument("--quick", action="store_true", help="smoke test: few steps, 1 repeat")
    ap.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="repeats per side of each pair (default 5; quick 1)",
    )
    ap.add_argument("--pairs", default=",".join(PAIRS), help=f"subset of {','.join(PAIRS)}")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument(
        "--base-steps", type=int, default=None, help="base training steps (150; quick 30)"
    )
    ap.add_argument("--out", default="benchmarks/peers", help="writes OUT.md and OUT.json")
    ap.add_argument(
        "--before",
        action="append",
        default=[],
        help="an earlier run's .json: its ratios as a column (repeatable)",
    )
    ap.add_argument("--work", default="outputs/peers", help="base cache and run folders")
    ap.add_argument(
        "--merge",
        nargs="+",
        metavar="JSON",
        help="no run: one report (--out) from the pairs of several runs' .json (a pair in a "
        "later file replaces an earlier one's; the first file's --before columns are kept)",
    )
    ap.add_argument(
        "--skyrl-python",
        default=str(ROOT / ".venv-skyrl" / "bin" / "python"),
        help="interpreter of the skyrl-tx venv ('' = skip skyrl-tx)",
    )
    args = ap.parse_args()
    if args.worker:
        run_worker(*args.worker)
        return
    if args.worker_loop:
        worker_loop()
        return
    sys.path.insert(0, str(ROOT))
    from benchmarks.bench_data_scale import cpu_name

    pairs = [p.strip() for p in args.pairs.split(",") if p.strip()]
    unknown = [p for p in pairs if p not in PAIRS]
    if unknown:
        ap.error(f"--pairs: unknown {unknown}; expected a subset of {','.join(PAIRS)}")
    if args.repeats is None:
        args.repeats = 1 if args.quick else 5
    if args.base_steps is None:
        args.base_steps = 30 if args.quick else 150
    out = Path(args.out)
    if not out.is_absolute():
        out = ROOT / out
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.merge:
        write_report(merge([json.loads(Path(f).read_text()) for f in args.merge]), out)
        print(out.with_suffix(".md").read_text())
        return
    befores = [before_of(json.loads(Path(b).read_text())) for b in args.before]
    t_start = time.perf_counter()
    ctx = Ctx(args)
    try:
        prepare(ctx)
    except RunFailed as e:
        raise SystemExit(f"peers: the base could not be prepared: {e}") from None
    vers = versions(args.skyrl_python)

    def write(pending: list[str]) -> None:
        """The report of the pairs run so far (after each pair: a long run interrupted
        keeps what it measured; `pairs_pending` names what it had not run yet)."""
        loads = ctx.loads or [os.getloadavg()[0]]
        cmd = "python benchmarks/peers.py " + " ".join(sys.argv[1:])
        results["meta"] = {
            "command": cmd.strip(),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "wall_minutes": (time.perf_counter() - t_start) / 60,
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs ({cpu_name()}), "
            f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB, no GPU",
            "threads": args.threads,
            "repeats": args.repeats,
            "quick": args.quick,
            "one_worker_process": args.one_worker_process,
            "base_steps": args.base_steps,
            "load_min": min(loads),
            "load_max": max(loads),
            "load_median": statistics.median(loads),
            "loads": loads,
            "versions": vers,
            "skyrl_install": SKYRL_INSTALL,
            "pairs_pending": pending,
        }
        if befores:
            results["before"] = befores
        write_report(results, out)

    results: dict[str, Any] = {"pairs": {}}
    serve: Server | None = None
    serve_start = 0.0
    try:
        for name in pairs:
            print(f"[peers] {name}", flush=True)
            try:
                if name == "sft_lora_packed":
                    r = sft_pair(ctx, lora=True, packed=True)
                elif name == "sft_lora_unpacked":
                    r = sft_pair(ctx, lora=True, packed=False)
                elif name == "full_ft":
                    r = sft_pair(ctx, lora=False, packed=False)
                elif name == "generate":
                    r = gen_pair(ctx)
                elif name == "grpo":
                    r = grpo_pair(ctx)
                else:
                    if serve is None:
                        serve, serve_start = start_serve(ctx)
                    r = (
                        dpo_pair(ctx, serve)
                        if name == "dpo"
                        else service_pair(ctx, serve, serve_start)
                    )
            except RunFailed as e:
                r = {"error": str(e)[-3000:]}
                print(f"[peers] {name} failed: {r['error']}", flush=True)
            results["pairs"][name] = r
            write(pairs[pairs.index(name) + 1 :])
            print(json.dumps({name: {k: v for k, v in r.items() if k != "config"}}, default=str)[:1500],
                  flush=True)  # fmt: skip
    finally:
        if serve is not None:
            serve.stop()
        ctx.close()
    write([])
    print(out.with_suffix(".md").read_text())
