"""Measured (tools.dryrun) against planned (parallel.memory) memory per rank, for the shipped
recipes and the calibration rows torchtitan 0.3.0 can run eagerly.

    python -m benchmarks.dryrun_table [--only LABEL ...] [--jobs 2]   # run, then render
    python -m benchmarks.dryrun_table --render                        # re-render only

Runs are stored in benchmarks/dryrun.json (what each rank measured, the command, seconds);
`--render` recomputes the planner's side with the current memory model from each case's
own recipe and layout (pure, seconds), so the table always shows today's model against the
stored measurements. Writes benchmarks/dryrun.md between its markers.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT_JSON = ROOT / "benchmarks" / "dryrun.json"
OUT_MD = ROOT / "benchmarks" / "dryrun.md"
BEGIN, END = "<!-- table:begin -->", "<!-- table:end -->"


def _row(flavor: str, world: int, lbs: int, ac: str, *, tp: int = 1, linear: str = "bf16",
         cluster: str = "grand_teton_h100") -> list[str]:  # fmt: skip
    """A calibration row (parallel/calibration.py) as recipe overrides on llama3_8b.toml."""
    return [
        "--recipe=recipes/llama3_8b.toml",
        f"--set=model.flavor={flavor}",
        f"--set=training.local_batch_size={lbs}",
        f"--set=training.global_batch_size={lbs * world // tp}",
        f"--set=training.activation_checkpoint={ac}",
        f"--set=parallel.world_size={world}",
        f"--set=parallel.dp_shard={world // tp}",
        f"--set=parallel.tp={tp}",
        f"--set=parallel.cluster={cluster}",
        f"--set=kernels.linear={linear}",
    ]


# label -> (kind, arguments to tools.dryrun, published GiB (max reserved) or None)
CASES: dict[str, tuple[str, list[str], float | None]] = {
    "llama3_8b": ("recipe", ["--recipe=recipes/llama3_8b.toml"], None),
    "llama3_8b_continue": ("recipe", ["--recipe=recipes/llama3_8b_continue.toml"], None),
    "sft_llama3_8b_lora": ("recipe", ["--recipe=recipes/sft_llama3_8b_lora.toml"], None),
    "sft_qwen3_8b_lora": ("recipe", ["--recipe=recipes/sft_qwen3_8b_lora.toml"], None),
    "rl_llama3_8b": ("recipe", ["--recipe=recipes/rl_llama3_8b.toml"], None),
    "llama3_70b_b200": ("recipe", ["--recipe=recipes/llama3_70b_b200.toml"], None),
    # Pipeline recipes with 16 of their 64 microbatches (--microbatches): the schedules hold
    # at most 2p stage-microbatches, so the peak is the same past that but for the receive
    # buffers (one per microbatch, modelled: parallel.memory.recv_buffer_bytes); both sides
    # of the comparison use 16. Cost: about a quarter of the full step.
    "llama3_70b_h100": (
        "recipe",
        ["--recipe=recipes/llama3_70b_h100.toml", "--microbatches=16"],
        None,
    ),  # fmt: skip
    "llama3_70b": ("recipe", ["--recipe=recipes/llama3_70b.toml", "--microbatches=16"], None),
    "llama3_70b, ZBVZeroBubble (shipped before)": (
        "recipe",
        [
            "--recipe=recipes/llama3_70b.toml",
            "--microbatches=16",
            "--set=parallel.pp_schedule=ZBVZeroBubble",
        ],
        None,
    ),  # fmt: skip
    "llama3_405b": ("recipe", ["--recipe=recipes/llama3_405b.toml"], None),
    "llama3_70b_h100 @4096": (
        "recipe",
        [
            "--recipe=recipes/llama3_70b_h100.toml",
            "--nodes=512",
            "--set=training.global_batch_size=2048",
            "--microbatches=16",
        ],
        None,
    ),  # fmt: skip
    "gpu_slice_70b": (
        "recipe",
        ["--recipe=recipes/gpu_slice_70b.toml", "--cluster=hgx_h200_ib"],
        None,
    ),  # fmt: skip
    "debug": ("recipe", ["--recipe=recipes/debug.toml"], None),
    "sft_debug": ("recipe", ["--recipe=recipes/sft_debug.toml"], None),
    "rl_debug": ("recipe", ["--recipe=recipes/rl_debug.toml"], None),
    "8B FSDP8 BF16 eager": ("calibration", _row("8B", 8, 2, "selective"), 82.4),
    "8B FSDP128 BF16 eager": ("calibration", _row("8B", 128, 2, "selective"), 67.0),
    "70B FSDP32xTP8 BF16 (2025), eager": (
        "calibration",
        _row("70B", 256, 16, "full", tp=8),
        None,
    ),  # fmt: skip
    "70B FSDP32xTP8 FP8 rowwise (2025), eager": (
        "calibration",
        _row("70B", 256, 16, "full", tp=8, linear="fp8_rowwise"),
        None,
    ),  # fmt: skip
}


def run_case(label: str) -> dict:
    kind, args, published = CASES[label]
    cmd = [sys.executable, "-m", "tools.dryrun", *args, "--json"]
    t0 = time.perf_counter()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, check=False)
    wall = time.perf_counter() - t0
    try:
        result = json.loads(proc.stdout)
    except json.JSONDecodeError:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        result = {"error": f"exit {proc.returncode}: {tail}"}
    print(f"{label}: {wall:.0f} s, exit {proc.returncode}", file=sys.stderr, flush=True)
    return {"kind": kind, "args": args, "published_gib": published, "wall_s": round(wall, 1),
            "result": result}  # fmt: skip


def store(label: str, out: dict) -> None:
    """Merge one case into dryrun.json under a lock (several drivers may run at once)."""
    with open(os.path.join(tempfile.gettempdir(), "dryrun_table.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        data = json.loads(OUT_JSON.read_text()) if OUT_JSON.exists() else {}
        data[label] = out
        data["_meta"] = {
            "machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d"),
        }
        OUT_JSON.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


def _spec(args: list[str]) -> dict:
    """tools.dryrun.prepare's arguments from a case's command line."""
    kw: dict = {"overrides": [], "cluster_name": None, "nodes": None, "microbatches": None}
    for a in args:
        k, _, v = a.partition("=")
        if k == "--recipe":
            kw["recipe_path"] = v
        elif k == "--set":
            kw["overrides"].append(v)
        elif k == "--cluster":
            kw["cluster_name"] = v
        elif k == "--nodes":
            kw["nodes"] = int(v)
        elif k == "--microbatches":
            kw["microbatches"] = int(v)
    return kw


def render(data: dict) -> str:
    from tools.dryrun.job import prepare
    from tools.dryrun.planned import planned

    rows = [
        "| case | kind | world | rank (stages) | planner GiB | measured GiB | error | "
        "peak during | published GiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for label in CASES:
        if label not in data:
            continue
        case = data[label]
        res = case["result"]
        if "error" in res:
            rows.append(f"| {label} | {case['kind']} | | | | | | FAILED: {res['error']} | |")
            continue
        kw = _spec(case["args"])
        job = prepare(kw.pop("recipe_path"), kw.pop("overrides"), **kw)
        pub = case["published_gib"]
        for r in res["ranks"]:
            if "error" in r:
                rows.append(f"| {label} | {case['kind']} | {res['world_size']:,} | "
                            f"{r['rank']} | | | | FAILED: {r['error']} | |")  # fmt: skip
                continue
            want = planned(job, r["rank"])["planned_gib"]
            err = 100 * (want - r["peak_gib"]) / r["peak_gib"]
            stages = ",".join(str(s) for s in r["stages"])
            rows.append(
                f"| {label} | {case['kind']} | {res['world_size']:,} | {r['rank']} ({stages}) "
                f"| {want:.1f} | {r['peak_gib']:.1f} | {err:+.1f}% | "
                f"{r['measured']['peak_where']} | {'' if pub is None else f'{pub:.1f}'} |"
            )
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--only", action="append", default=None, help="case label (repeatable)")
    p.add_argument("--jobs", type=int, default=2, help="cases at once (2 on this machine)")
    p.add_argument("--render", action="store_true", help="re-render from dryrun.json only")
    args = p.parse_args()
    if not args.render:
        labels = args.only or list(CASES)
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            for label, out in zip(labels, pool.map(run_case, labels), strict=True):
                store(label, out)
    data = json.loads(OUT_JSON.read_text()) if OUT_JSON.exists() else {}
    table = render(data)
    text = OUT_MD.read_text() if OUT_MD.exists() else f"{BEGIN}\n{END}\n"
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    OUT_MD.write_text(f"{head}{BEGIN}\n{table}\n{END}{tail}")
    print(table)


if __name__ == "__main__":
    main()
