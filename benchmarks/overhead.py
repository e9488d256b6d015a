"""titanscale's overhead against torchtitan's stock Trainer, in one run.

Runs the debug recipe alternately through `train.py` and `benchmarks/stock_trainer.py`
(same Trainer.Config, same CPU layer), `--rounds` times each, one process each, and compares
the median step time over steady-state steps. Step times come from the same source for both:
the timestamps of consecutive per-step log lines.

    python benchmarks/overhead.py [--steps 30] [--rounds 3] [--out benchmarks/overhead]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STAMP = re.compile(r"\[titan\] (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*\bstep:?\s+(\d+)\s+loss")


def step_times(log: str, skip: int) -> list[float]:
    stamps: dict[int, float] = {}
    for m in STAMP.finditer(log):
        t = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
        stamps[int(m.group(2))] = t
    steps = sorted(stamps)
    return [stamps[s] - stamps[s - 1] for s in steps if s - 1 in stamps and s > skip + 1]


def run(kind: str, steps: int, out: str) -> list[float]:
    script = ROOT / ("train.py" if kind == "titanscale" else "benchmarks/stock_trainer.py")
    sets = [f"training.steps={steps}", f"job.output_dir={out}", "metrics.tensorboard=false"]
    cmd = [sys.executable, str(script), "--recipe", "recipes/debug.toml"]
    for s in sets:
        cmd += ["--set", s]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    return step_times(proc.stdout + proc.stderr, skip=3)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "overhead"))
    a = p.parse_args()
    times: dict[str, list[float]] = {"titanscale": [], "stock": []}
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            for kind in ("titanscale", "stock") if r % 2 == 0 else ("stock", "titanscale"):
                times[kind] += run(kind, a.steps, f"{tmp}/{kind}{r}")
    import torch
    import torchao
    import torchtitan

    med = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "benchmark": "train.py vs torchtitan stock Trainer, debug recipe, 1 process, CPU",
        "command": f"python benchmarks/overhead.py --steps {a.steps} --rounds {a.rounds}",
        "date": datetime.now().isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}",
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "torchtitan": torchtitan.__version__,
            "torchao": torchao.__version__,
        },
        "steps_per_run": a.steps,
        "rounds": a.rounds,
        "median_step_s": med,
        "steps_measured": {k: len(v) for k, v in times.items()},
        "overhead_pct": 100 * (med["titanscale"] / med["stock"] - 1),
        "wall_s": time.time() - t0,
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out + ".json").write_text(json.dumps(result, indent=2) + "\n")
    md = f"""# Overhead of train.py against torchtitan's stock Trainer

- command: `{result["command"]}`
- date: {result["date"]}; machine: {result["machine"]}
- versions: {result["versions"]}
- what: the debug recipe (debugmodel, seq 256, local batch 2, dense CPU attention, stdlib
  corpus), same `Trainer.Config` for both; titanscale adds its Trainer subclass (useful-token
  counting, start events) and its metrics processor (JSONL, per-node, MFU, summary).
  Runs alternate ({a.rounds} rounds x {a.steps} steps each, first 3 steps of each run dropped);
  step time = gap between consecutive per-step log lines.

| trainer | median step (s) | steps measured |
|---|---|---|
| titanscale train.py | {med["titanscale"]:.4f} | {result["steps_measured"]["titanscale"]} |
| torchtitan stock Trainer | {med["stock"]:.4f} | {result["steps_measured"]["stock"]} |

**Overhead: {result["overhead_pct"]:+.2f}%** (target: at most +3%).
"""
    Path(a.out + ".md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
