"""Post-training dry runs: one RL update and one [[adapters]] round stepped on the step layer
(tools.dryrun -> tools.dryrun.posttrain) against tools.predict's post-training figure.

    python -m benchmarks.dryrun_posttrain [--only LABEL ...] [--out benchmarks/dryrun_posttrain.json]
    python -m benchmarks.dryrun_posttrain --render [--out FILE.json]   # the table from a file

Each case runs `python -m tools.dryrun ... --json` (rank 0 at the recipe's world size) and
`python -m tools.predict --recipe R --cluster C --json` (its `posttrain` section). Both sides
are allocated bytes: the dry run's measured peak and its `planned_gib` (the same
parallel.memory.posttrain_memory figure tools.predict prices, eager, before the allocator's
slack and the runtime); tools.predict's per-GPU figure adds those two. Every row stores the
commit, date, commands and seconds; the table is printed as markdown.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

RL8 = "recipes/rl_llama3_8b.toml"
Q30 = "recipes/rl_qwen3_30b_a3b.toml"
AD8 = "benchmarks/adapters_llama3_8b.toml"
# label -> (recipe, cluster, extra tools.dryrun / tools.predict --set overrides)
CASES: dict[str, tuple[str, str, list[str]]] = {
    "rl_llama3_8b (shipped: async, bf16 generator + probe)": (RL8, "hgx_h100_ib", []),
    "rl_llama3_8b, sync": (RL8, "hgx_h100_ib", ["rl.mode=sync"]),
    "rl_llama3_8b, sync, KL reference": (RL8, "hgx_h100_ib", ["rl.mode=sync", "rl.kl_coef=0.01"]),
    "rl_qwen3_30b_a3b (shipped: sync, EP 2)": (Q30, "hgx_h200_ib", []),
    "rl_qwen3_30b_a3b, EP 1": (Q30, "hgx_h200_ib", ["parallel.ep=1"]),
    "rl_debug (CPU)": ("recipes/rl_debug.toml", "local_cpu", []),
    "adapters_llama3_8b: 4 adapters, batched": (AD8, "hgx_h100_ib", []),
    "adapters_llama3_8b: 4 adapters, turns": (
        AD8,
        "hgx_h100_ib",
        ["finetune.adapter_schedule=turns"],
    ),
    # single-adapter LoRA recipes: torchtitan's Trainer with the LoRA converter (what they
    # train; tools.predict has no post-training section for them: its top-level figure)
    "sft_llama3_8b_lora (Trainer path)": ("recipes/sft_llama3_8b_lora.toml", "hgx_h100_ib", []),
    "sft_qwen3_30b_a3b_lora (Trainer path)": (
        "recipes/sft_qwen3_30b_a3b_lora.toml",
        "hgx_h100_ib",
        [],
    ),
}


def _run(cmd: list[str]) -> tuple[dict | None, str, float]:
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    dt = time.perf_counter() - t0
    try:
        return json.loads(p.stdout), "", dt
    except json.JSONDecodeError:
        tail = [ln for ln in p.stderr.splitlines() if ln.strip()][-1:] or ["no output"]
        return None, tail[0][:300], dt


def run_case(label: str, commit: str) -> dict:
    recipe, cluster, sets = CASES[label]
    over = [f"--set={s}" for s in sets]
    dry = [sys.executable, "-m", "tools.dryrun", f"--recipe={recipe}", f"--cluster={cluster}",
           "--rank=0", "--json", *over]  # fmt: skip
    pred = [sys.executable, "-m", "tools.predict", f"--recipe={recipe}", f"--cluster={cluster}",
            "--json", *over]  # fmt: skip
    out, err, seconds = _run(dry)
    p, perr, _ = _run(pred)
    row: dict = {
        "label": label,
        "commit": commit,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "dryrun": "python -m " + shlex.join(dry[2:]),
        "predict": "python -m " + shlex.join(pred[2:]),
        "seconds": round(seconds, 1),
    }
    post = (p or {}).get("posttrain") or {}
    row["predict_section"] = "posttrain" if post else "top level (no posttrain section)"
    row["predict_gib_per_gpu"] = post.get("memory_gib_per_gpu", (p or {}).get("memory_gib_per_gpu"))
    row["predict_breakdown_gib"] = post.get(
        "memory_breakdown_gib", (p or {}).get("memory_breakdown_gib")
    )
    if perr:
        row["predict_error"] = perr
    r = (out or {}).get("ranks", [{}])[0] if out else {}
    if not out or "error" in r:
        row["error"] = r.get("error", err)
        return row
    row.update(
        notes=out["notes"],
        peak_gib=r["peak_gib"],
        planned_gib=r["planned_gib"],
        error_pct=r["error_pct"],
        measured_peak=r["measured"]["peak"],
        peak_where=r["measured"]["peak_where"],
        planned_terms=r["planned"]["planned"],
        posttrain=r.get("posttrain"),
    )
    return row


def render(rows: list[dict]) -> str:
    out = [
        "| case | measured GiB | planner GiB | error | phases (peak GiB) | "
        "tools.predict GiB per GPU | seconds |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        pred = f"{r['predict_gib_per_gpu']:.1f}" if r.get("predict_gib_per_gpu") else "-"
        if "error" in r:
            out.append(
                f"| {r['label']} | fails: {r['error']} | | | | {pred} | {r['seconds']:.0f} |"
            )
            continue
        steps = (r.get("posttrain") or {}).get("phases_gib", {"Trainer step": r["peak_gib"]})
        phases = ", ".join(f"{k} {v:.1f}" for k, v in steps.items())
        out.append(
            f"| {r['label']} | {r['peak_gib']:.1f} | {r['planned_gib']:.1f} | "
            f"{r['error_pct']:+.1f}% | {phases} | {pred} | {r['seconds']:.0f} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.dryrun_posttrain")
    ap.add_argument("--only", action="append", default=None, choices=sorted(CASES))
    ap.add_argument("--out", default=None, help="write the rows (JSON)")
    ap.add_argument("--render", action="store_true", help="print the table of --out's rows")
    a = ap.parse_args(argv)
    if a.render:
        print(render(json.loads(Path(a.out).read_text())["rows"]))
        return 0
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True, check=False).stdout.strip()  # fmt: skip
    rows = [run_case(label, commit) for label in (a.only or CASES)]
    import torch
    import torchtitan

    meta = {
        "commit": commit,
        "machine": f"{platform.machine()}, {len(__import__('os').sched_getaffinity(0))} cores",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchtitan": getattr(torchtitan, "__version__", "0.3.0"),
    }
    if a.out:
        old = json.loads(Path(a.out).read_text()) if Path(a.out).exists() else {}
        keep = [r for r in old.get("rows", []) if "label" in r and r["label"] not in
                {x["label"] for x in rows}]  # fmt: skip
        Path(a.out).write_text(json.dumps({"_meta": meta, "rows": keep + rows}, indent=1) + "\n")
    print(render(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
