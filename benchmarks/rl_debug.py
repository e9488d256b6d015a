"""GRPO on recipes/rl_debug.toml: held-out reward before and after, and trainer wait time,
synchronous against asynchronous rollouts (lag bound 1 and 2).

Each variant is one `train.py` run (one process, CPU) from the same supervised warmup (same
seed: the warmup and the step-0 evaluation are identical across variants). Figures come from
the run's metrics.jsonl: the `rl_eval` events (greedy decoding on every held-out prompt), the
per-update records and the `rl_summary` event.

    python benchmarks/rl_debug.py [--steps 100] [--out benchmarks/rl_debug]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

VARIANTS = {
    "sync": ["rl.mode=sync"],
    "async_lag1": ["rl.mode=async", "rl.max_policy_lag=1"],
    "async_lag2": ["rl.mode=async", "rl.max_policy_lag=2"],
}


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_variant(name: str, extra: list[str], steps: int, out: Path) -> dict:
    cmd = [
        sys.executable,
        str(ROOT / "train.py"),
        "--recipe",
        "recipes/rl_debug.toml",
        "--set",
        f"job.output_dir={out}",
        "--set",
        f"training.steps={steps}",
        "--set",
        "checkpoint.interval=0",
        "--set",
        "rl.tis_cap=2.0",
    ]
    for o in extra:
        cmd += ["--set", o]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    t0 = time.time()
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"{name} failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    recs = read(out / "metrics.jsonl")
    evals = [r for r in recs if r.get("event") == "rl_eval"]
    (summary,) = [r for r in recs if r.get("event") == "rl_summary"]
    steps_recs = [r for r in recs if "reward_mean" in r and "event" not in r]
    k = min(10, len(steps_recs) // 2)
    return {
        "variant": name,
        "overrides": extra,
        "updates": len(steps_recs),
        "heldout_reward_before": evals[0]["eval_reward_mean"],
        "heldout_reward_after": evals[-1]["eval_reward_mean"],
        "heldout_exact_pct_before": evals[0]["eval_exact_pct"],
        "heldout_exact_pct_after": evals[-1]["eval_exact_pct"],
        "heldout_reward_by_update": {e["step"]: e["eval_reward_mean"] for e in evals},
        "train_reward_first10": sum(r["reward_mean"] for r in steps_recs[:k]) / k,
        "train_reward_last10": sum(r["reward_mean"] for r in steps_recs[-k:]) / k,
        "rl_minutes": (summary["time"] - evals[0]["time"]) / 60,
        "total_minutes": (time.time() - t0) / 60,
        "trainer_wait_pct": summary["trainer_wait_pct"],
        "policy_lag_mean": sum(r["policy_lag"] for r in steps_recs) / len(steps_recs),
        "policy_lag_max": max(r["policy_lag_max"] for r in steps_recs),
        "train_infer_max_abs_diff_max": max(
            r.get("train_infer_max_abs_diff", 0.0) for r in steps_recs
        ),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", default="benchmarks/rl_debug")
    args = ap.parse_args()
    import torch

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.variants.split(","):
            print(f"running {name} ...", flush=True)
            rows.append(run_variant(name, VARIANTS[name], args.steps, Path(tmp) / name))
            print(json.dumps(rows[-1]), flush=True)
    meta = {
        "command": f"python benchmarks/rl_debug.py --steps {args.steps}",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, load average at end "
        f"{os.getloadavg()[0]:.1f}",
        "versions": {"python": platform.python_version(), "torch": torch.__version__},
    }
    Path(args.out + ".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [
        "# GRPO on recipes/rl_debug.toml (CPU)",
        "",
        f"`{meta['command']}` on {meta['date']}; {meta['machine']}; torch "
        f"{meta['versions']['torch']}. Same supervised warmup (100 steps) for every variant; "
        "held-out = greedy decoding on all 55 held-out a+b prompts (never trained on).",
        "",
        "| variant | held-out reward before -> after | held-out exact % | train reward first"
        " 10 -> last 10 | RL minutes | trainer wait % | policy lag mean / max |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['variant']} | {r['heldout_reward_before']:.3f} -> "
            f"{r['heldout_reward_after']:.3f} | {r['heldout_exact_pct_before']:.1f} -> "
            f"{r['heldout_exact_pct_after']:.1f} | {r['train_reward_first10']:.3f} -> "
            f"{r['train_reward_last10']:.3f} | {r['rl_minutes']:.1f} | "
            f"{r['trainer_wait_pct']:.0f} | {r['policy_lag_mean']:.2f} / "
            f"{r['policy_lag_max']:.0f} |"
        )
    Path(args.out + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
