"""Held-out dry runs: the memory model (parallel/memory.py), frozen at this commit, against
configurations it was not tuned on (issue 38). The in-sample table is benchmarks/dryrun.md's.

    python -m benchmarks.dryrun_heldout [--only LABEL ...] [--jobs 2] [--out FILE.json]

Each case runs `python -m tools.dryrun ... --json` (the real torchtitan step on fake tensors
at the job's full world size) and reads every rank's measured `peak_gib`, the planner's
`planned_gib` of the same commit, and `error_pct`. Prints a markdown table with the commit,
date, machine and command of every row, and the mean and max |error|; with `--out` stores
the raw rows (commit and planner figure included).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

L8 = "--recipe=recipes/llama3_8b.toml"
# label -> tools.dryrun arguments. None of these layouts, schedules, sequence lengths or
# batch sizes is a row of benchmarks/dryrun.md's in-sample table or a probe the memory
# model was corrected on.
CASES: dict[str, list[str]] = {
    "llama3_8b seq 4096": [L8, "--set=training.seq_len=4096"],
    "llama3_8b seq 2048 x 4 rows": [
        L8,
        "--set=training.seq_len=2048",
        "--set=training.local_batch_size=4",
        "--set=training.global_batch_size=32",
    ],
    "llama3_8b TP2 x FSDP4, selective AC": [
        L8,
        "--set=parallel.tp=2",
        "--set=parallel.dp_shard=4",
        "--set=training.activation_checkpoint=selective",
        "--set=training.global_batch_size=8",
    ],
    "llama3_8b CP2 x FSDP4, seq 16384, full AC": [
        L8,
        "--set=parallel.cp=2",
        "--set=parallel.dp_shard=4",
        "--set=training.seq_len=16384",
        "--set=training.activation_checkpoint=full",
        "--set=training.global_batch_size=8",
    ],
    "llama3_8b PP2 x FSDP4, 1F1B, seq 4096": [
        L8,
        "--set=parallel.pp=2",
        "--set=parallel.dp_shard=4",
        "--set=parallel.pp_schedule=1F1B",
        "--set=parallel.pp_microbatches=8",
        "--set=training.seq_len=4096",
        "--set=training.local_batch_size=8",
        "--set=training.global_batch_size=32",
    ],
    "llama3_8b PP4 x FSDP2, Interleaved1F1B, seq 4096": [
        L8,
        "--set=parallel.pp=4",
        "--set=parallel.dp_shard=2",
        "--set=parallel.pp_schedule=Interleaved1F1B",
        "--set=parallel.pp_microbatches=8",
        "--set=training.seq_len=4096",
        "--set=training.local_batch_size=8",
        "--set=training.global_batch_size=16",
    ],
    "llama3_70b_b200 seq 4096": [
        "--recipe=recipes/llama3_70b_b200.toml",
        "--set=training.seq_len=4096",
    ],
    "llama3_70b_h100, 1F1B, 8 microbatches (rank 0)": [
        "--recipe=recipes/llama3_70b_h100.toml",
        "--set=parallel.pp_schedule=1F1B",
        "--microbatches=8",
        "--rank=0",
    ],
    "llama3_70b_h100, GPipe, 8 microbatches (ranks 0, 63)": [
        "--recipe=recipes/llama3_70b_h100.toml",
        "--set=parallel.pp_schedule=GPipe",
        "--microbatches=8",
        "--rank=63",
    ],
    "llama3_405b seq 4096": [
        "--recipe=recipes/llama3_405b.toml",
        "--set=training.seq_len=4096",
    ],
    "moonlight_16b_a3b (shipped, never dry-run before)": [
        "--recipe=recipes/moonlight_16b_a3b.toml"
    ],
    "qwen3_235b_a22b (shipped, never dry-run before)": ["--recipe=recipes/qwen3_235b_a22b.toml"],
    "qwen3_30b_a3b EP 8, seq 2048": [
        "--recipe=recipes/qwen3_30b_a3b.toml",
        "--set=parallel.ep=8",
        "--set=training.seq_len=2048",
    ],
    "gpt_oss_120b seq 2048": [
        "--recipe=recipes/gpt_oss_120b.toml",
        "--set=training.seq_len=2048",
    ],
}


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()


def run_case(label: str, args: list[str], timeout: float) -> dict:
    cmd = [sys.executable, "-m", "tools.dryrun", *args, "--json"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    t0 = time.time()
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"label": label, "args": args, "error": f"timeout {timeout:.0f} s", "ranks": []}
    wall = time.time() - t0
    row: dict = {"label": label, "args": args, "wall_s": round(wall, 1), "ranks": []}
    if p.returncode != 0:
        row["error"] = (p.stderr.strip().splitlines() or [f"rc {p.returncode}"])[-1][:300]
        return row
    rep = json.loads(p.stdout)
    row["world_size"] = rep.get("world_size")
    row["layout"] = rep.get("layout")
    for r in rep["ranks"]:
        row["ranks"].append(
            {
                "rank": r["rank"],
                "stages": r.get("stages"),
                "peak_gib": r["peak_gib"],
                "planned_gib": r["planned_gib"],
                "error_pct": r["error_pct"],
            }
        )
    return row


def render(rows: list[dict], meta: dict) -> str:
    out = [
        f"{meta['machine']}, torch {meta['torch']}; each row's commit is the memory model's",
        "",
        "| case | world | rank (stages) | planner GiB | measured GiB | error | seconds | commit, date "
        "| command |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    errs = []
    for row in rows:
        cmd = "`python -m tools.dryrun " + " ".join(shlex.quote(a) for a in row["args"]) + "`"
        if row.get("error"):
            out.append(
                f"| {row['label']} | | | | | not run: {row['error']} | | {row['commit']} | {cmd} |"
            )
            continue
        for r in row["ranks"]:
            errs.append(abs(r["error_pct"]))
            stages = ",".join(str(s) for s in r["stages"] or [])
            out.append(
                f"| {row['label']} | {row['world_size']:,} | {r['rank']} ({stages}) "
                f"| {r['planned_gib']:.1f} | {r['peak_gib']:.1f} | {r['error_pct']:+.1f}% "
                f"| {row['wall_s']:.0f} | {row['commit']}, {row['date']} | {cmd} |"
            )
    if errs:
        out += [
            "",
            f"{len(errs)} ranks: mean |error| {sum(errs) / len(errs):.1f}%, "
            f"max |error| {max(errs):.1f}%",
        ]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", action="append", default=[], help="run only these labels")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per case")
    ap.add_argument("--out", help="store the raw rows as JSON here")
    a = ap.parse_args()
    cases = {k: v for k, v in CASES.items() if not a.only or k in a.only}
    import torch

    meta = {
        "commit": _git("rev-parse", "--short", "HEAD"),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "torch": torch.__version__,
    }
    with ThreadPoolExecutor(a.jobs) as ex:
        rows = list(ex.map(lambda kv: run_case(kv[0], kv[1], a.timeout), cases.items()))
    for row in rows:
        row["commit"], row["date"] = meta["commit"], meta["date"]
    if a.out and a.only and Path(a.out).exists():
        # Rerun of some cases: keep the stored rows of the others (each row has its commit).
        old = json.loads(Path(a.out).read_text())
        for r in old["rows"]:
            r.setdefault("commit", old["_meta"]["commit"])
            r.setdefault("date", old["_meta"]["date"])
        new = {row["label"]: row for row in rows}
        kept = [new.pop(r["label"], r) for r in old["rows"]]
        rows = [*kept, *new.values()]
        rows.sort(key=lambda r: list(CASES).index(r["label"]) if r["label"] in CASES else 99)
    if a.out:
        Path(a.out).write_text(json.dumps({"_meta": meta, "rows": rows}, indent=1) + "\n")
    print(render(rows, meta))


if __name__ == "__main__":
    main()
