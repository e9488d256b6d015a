"""Benchmark harness: a real training run, measured the way the throughput report defines.

    python -m tools.bench --recipe R [--steps N] [--warmup W] [--nproc P] [--out DIR]
                          [--cluster C] [--set k=v ...]

Runs `train.py` (torchrun when --nproc > 1) on whatever device is there, then reads the
run's metrics.jsonl and writes `<out>/bench.json` (median, p10, p90 tokens/s per device after
the warmup steps, MFU, peak memory, an environment fingerprint) and `<out>/bench.png`
(throughput and loss per step). With --cluster, the performance model's prediction for the
same recipe is put next to the measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

from core.errors import ConfigError, exit_on_config_error
from recipe.loader import load_recipe
from runtime.metrics import summarize
from tools.cli import ArgumentParser, add_cluster_arg, add_override_arg, add_recipe_arg, run

ROOT = Path(__file__).resolve().parent.parent


def fingerprint() -> dict[str, Any]:
    """Versions and hardware that a throughput figure depends on."""
    import torch
    import torchao
    import torchtitan

    fp: dict[str, Any] = {
        "date": datetime.now().isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchtitan": torchtitan.__version__,
        "torchao": torchao.__version__,
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
    }
    if torch.cuda.is_available():
        fp["gpu_name"] = torch.cuda.get_device_name(0)
        fp["gpu_count"] = torch.cuda.device_count()
        fp["cuda"] = torch.version.cuda
        try:
            fp["nccl"] = ".".join(str(x) for x in torch.cuda.nccl.version())
        except Exception:  # NCCL missing from this build: report, don't fail
            fp["nccl"] = None
        smi = shutil.which("nvidia-smi")
        if smi:
            q = subprocess.run(
                [smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
            )
            fp["driver"] = q.stdout.strip().splitlines()[0] if q.returncode == 0 else None
    else:
        fp["gpu_name"] = None
        fp["gpu_count"] = 0
    return fp


def read_records(path: Path) -> list[dict[str, Any]]:
    return [
        r
        for r in (json.loads(x) for x in path.read_text().splitlines() if x.strip())
        if "event" not in r
    ]


def plot(records: list[dict[str, Any]], warmup: int, out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    ax1.plot(steps, [r["tokens_per_sec_per_gpu"] for r in records], "o-", label="all tokens")
    ax1.plot(
        steps,
        [r["useful_tokens_per_sec_per_gpu"] for r in records],
        "x--",
        label="useful tokens",
    )
    ax1.axvspan(0.5, warmup + 0.5, color="grey", alpha=0.2, label="warmup (excluded)")
    ax1.set_ylabel("tokens/s per device")
    ax1.legend()
    ax1.set_title(title)
    ax2.plot(steps, [r["loss"] for r in records], "o-", color="C3")
    ax2.set_ylabel("loss")
    ax2.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def run_training(recipe: str, overrides: list[str], nproc: int, out: Path) -> None:
    args = ["--recipe", recipe, "--set", f"job.output_dir={out}"]
    for o in overrides:
        args += ["--set", o]
    if nproc == 1:
        cmd = [sys.executable, str(ROOT / "train.py"), *args]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={nproc}",
            "--local-ranks-filter=0",
            str(ROOT / "train.py"),
            *args,
        ]
    env = {**os.environ}
    env.setdefault("OMP_NUM_THREADS", "1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"training failed with exit code {proc.returncode}")


@exit_on_config_error
def main(argv: list[str] | None = None) -> None:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_recipe_arg(p, default=str(ROOT / "recipes" / "debug.toml"))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3, help="steps excluded from the statistics")
    p.add_argument("--nproc", type=int, default=1, help="processes (torchrun when > 1)")
    p.add_argument("--out", default=None, help="output folder (default outputs/bench-<name>)")
    add_cluster_arg(p, help="cluster profile (TOML or a name in clusters/): add the prediction")
    add_override_arg(p)
    a = p.parse_args(argv)
    from core.hardware import MAX_GPUS_PER_NODE
    from tools.cli import positive_arg

    positive_arg(a.steps, "--steps")
    positive_arg(a.nproc, "--nproc", MAX_GPUS_PER_NODE)  # one host's processes
    if a.warmup < 0:
        raise ConfigError(f"expected >= 0, got {a.warmup}", key="--warmup")
    if a.warmup >= a.steps:
        raise ConfigError(f"--warmup {a.warmup} must be below --steps {a.steps}", key="--warmup")
    overrides = [
        *a.overrides,
        f"training.steps={a.steps}",
        f"metrics.summary_skip_steps={a.warmup}",
        "metrics.log_every=1",
        "checkpoint.interval=0",
    ]
    recipe = load_recipe(a.recipe, overrides)  # fail fast, before any process starts
    from tools.cli import out_dir_arg

    out = out_dir_arg(a.out or f"outputs/bench-{recipe.job.name}", "--out")
    run_dir = out / "run"
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_training(a.recipe, overrides, a.nproc, run_dir)

    records = read_records(run_dir / "metrics.jsonl")
    summary = summarize(records, a.warmup)
    run_summary = json.loads((run_dir / "summary.json").read_text())
    result: dict[str, Any] = {
        "recipe": a.recipe,
        "overrides": a.overrides,
        "command": "python -m tools.bench " + " ".join(sys.argv[1:] if argv is None else argv),
        "processes": a.nproc,
        "steps": a.steps,
        "warmup_steps_excluded": a.warmup,
        "measured": summary,
        "device": run_summary.get("device"),
        "precision": run_summary.get("precision"),
        "peak_tflops": run_summary.get("peak_tflops"),
        "environment": fingerprint(),
    }
    if a.cluster:
        result["predicted"] = predict_for(a.recipe, overrides, a.cluster, a.nproc)
        med = summary.get("median_tokens_per_sec_per_gpu")
        pred = result["predicted"].get("tokens_per_sec_per_gpu")
        if med and pred:
            result["measured_over_predicted"] = med / pred
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(records, a.warmup, out / "bench.png", f"{recipe.job.name}: {a.nproc} process(es)")
    med = summary.get("median_tokens_per_sec_per_gpu")
    print(
        f"median tokens/s/device {med:,.1f} [p10 {summary['p10_tokens_per_sec_per_gpu']:,.1f}, "
        f"p90 {summary['p90_tokens_per_sec_per_gpu']:,.1f}] over {summary['steps_in_summary']} "
        f"steps; mfu {summary.get('median_mfu_pct') or 'n/a'}; "
        f"peak memory {summary['peak_memory_gib']:.2f} GiB -> {out}/bench.json, bench.png"
        if med
        else f"no steady-state steps: {summary}"
    )


def predict_for(
    recipe_path: str, overrides: list[str], cluster_path: str, world_size: int
) -> dict[str, Any]:
    """The performance model's figures for the same recipe on `cluster_path`."""
    from parallel.cluster import load_cluster
    from tools.predict import predict_recipe

    cluster = load_cluster(cluster_path)
    nodes = max(1, world_size // cluster.gpus_per_node)
    if nodes != cluster.nodes:
        cluster = load_cluster(cluster_path, nodes=nodes)
    out, _ = predict_recipe(load_recipe(recipe_path, overrides), cluster)
    return out


if __name__ == "__main__":
    run(main)
