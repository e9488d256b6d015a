"""One-GPU check: a Llama 3 70B slice in BF16 and FP8 rowwise, ours against torchtitan's stock.

    python -m tools.gpu_check [--out DIR] [--steps N] [--warmup W] [--cpu-smoke]

For each precision it runs the same Trainer.Config twice, one process each: through
train.py (titanscale) and through torchtitan's stock Trainer (benchmarks/stock_trainer.py),
and reports the median tokens/s/GPU after the warmup steps and MFU against this GPU's dense
peak for that precision (core.hardware). Stops starting new runs once --budget-s is
spent, so the whole check fits a short device lease. `--cpu-smoke` runs the same pipeline
on the debug model on CPU (FP8 emulated) to prove the script before a GPU is available.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
OURS = re.compile(r"step\s+(\d+)\s+loss\s+([\d.]+)\s+tok/s/gpu ([\d,]+)")
STOCK = re.compile(r"step:\s*(\d+)\s+loss:\s*([\d.]+).*?tps: ([\d,]+)")


def parse(log: str, pattern: re.Pattern[str], warmup: int) -> tuple[list[float], float | None]:
    tps = {}
    loss = None
    for m in pattern.finditer(log):
        step = int(m.group(1))
        tps[step] = float(m.group(3).replace(",", ""))
        loss = float(m.group(2))
    return [v for s, v in sorted(tps.items()) if s > warmup], loss


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default="outputs/gpu_check")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--budget-s", type=float, default=420.0)
    p.add_argument("--cpu-smoke", action="store_true")
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    recipe = "recipes/debug.toml" if a.cpu_smoke else "recipes/gpu_slice_70b.toml"
    base = [f"training.steps={a.steps}", "metrics.tensorboard=false", "checkpoint.interval=0"]
    if a.cpu_smoke:
        base += ["training.seq_len=128"]
    from core.hardware import peak_flops
    from recipe.loader import effective_shape, load_recipe
    from tools.bench import fingerprint

    r = load_recipe(recipe, base)
    fpt = effective_shape(r).flops_per_token(r.training.seq_len)
    env = fingerprint()
    device = env.get("gpu_name") or "cpu"
    t0 = time.time()
    results: list[dict[str, Any]] = []
    for precision, linear in (("bf16", "bf16"), ("fp8", "fp8_rowwise")):
        for trainer, script, pattern in (
            ("titanscale", "train.py", OURS),
            ("torchtitan-stock", "benchmarks/stock_trainer.py", STOCK),
        ):
            if time.time() - t0 > a.budget_s:
                results.append({"trainer": trainer, "linear": linear, "skipped": "time budget"})
                continue
            cmd = [sys.executable, str(ROOT / script), "--recipe", recipe]
            for s in [
                *base,
                f"kernels.linear={linear}",
                f"job.output_dir={out}/{trainer}-{linear}",
            ]:
                cmd += ["--set", s]
            t = time.time()
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                                  env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
            log = proc.stdout + proc.stderr
            (out / f"{trainer}-{linear}.log").write_text(log)
            tps, loss = parse(log, pattern, a.warmup)
            med = statistics.median(tps) if tps else None
            peak = peak_flops(device, precision)
            results.append({
                "trainer": trainer, "linear": linear, "exit_code": proc.returncode,
                "wall_s": round(time.time() - t, 1), "steps_measured": len(tps),
                "median_tokens_per_sec_per_gpu": med, "final_loss": loss,
                "tflops_per_gpu": med * fpt / 1e12 if med else None,
                "mfu_pct": 100 * med * fpt / peak if med and peak else None,
                "error_tail": log[-1500:] if proc.returncode else None,
            })  # fmt: skip
    report = {
        "command": "python -m tools.gpu_check " + " ".join(argv or sys.argv[1:]),
        "recipe": recipe,
        "flops_per_token": fpt,
        "environment": env,
        "results": results,
        "total_wall_s": round(time.time() - t0, 1),
    }
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [
        f"# GPU check: {recipe} on {device}",
        "",
        f"- command: `{report['command']}`; date {env['date']}; torch {env['torch']}, "
        f"torchtitan {env['torchtitan']}, torchao {env['torchao']}",
        f"- FLOPs/token (torchtitan's count): {fpt / 1e9:.3f} G; warmup steps excluded: {a.warmup}",
        "",
        "| trainer | linear | tok/s/GPU (median) | TFLOP/s/GPU | MFU % | exit | wall s |",
        "|---|---|---|---|---|---|---|",
    ]
    for x in results:
        if "skipped" in x:
            lines.append(f"| {x['trainer']} | {x['linear']} | skipped ({x['skipped']}) | | | | |")
            continue

        def f(v, fmt):
            return format(v, fmt) if v is not None else "n/a"

        lines.append(
            f"| {x['trainer']} | {x['linear']} | {f(x['median_tokens_per_sec_per_gpu'], ',.0f')} | "
            f"{f(x['tflops_per_gpu'], '.1f')} | {f(x['mfu_pct'], '.1f')} | {x['exit_code']} | "
            f"{x['wall_s']} |"
        )
    (out / "gpu_check.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if any(x.get("exit_code") for x in results):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
