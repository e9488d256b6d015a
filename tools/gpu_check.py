"""One-GPU check: probe, GPU tests, a Llama 3 70B slice in BF16 and FP8, ours against stock.

    python -m tools.gpu_check [--out DIR] [--work DIR] [--budget-s S] [--cpu-smoke]
    python -m tools.gpu_check --prepare-tokenizer DIR      # (here) build the 128k tokenizer

Stages, each a subprocess in its own process group under its own timeout, in this order:
1. probe: versions, GPU name and capability, a bf16 8192^3 matmul (the measured ceiling),
   and `import runtime` (the torch-version bridges of runtime.platform; a torch they cannot
   bridge stops here with their one line). A failed probe ends the check.
2. the `gpu`-marked tests (kernels, document masks), pass/skip/fail counts.
3. the slice (recipes/gpu_slice_70b.toml: 4 layers of 70B, seq 8192, compiled) per linear
   backend: bf16, fp8_rowwise, and mxfp8 on SM100; each through train.py (titanscale) and
   then through torchtitan's stock Trainer (benchmarks/stock_trainer.py) on the same
   Trainer.Config, back to back (the second reuses inductor's cache).
After every stage the report is rewritten: `gpu_check.json` and `gpu_check.md` in --out,
plus `gpu_check.log` (the tail of every stage's output); nothing else goes to --out (the
device tool returns at most 8 files). Run folders go under --work (default /tmp). A stage is
not started when the time left in --budget-s is below its timeout, so the check ends inside
one device call; a killed call still leaves the report of the stages before it.
MFU: `mfu_pct` against the dense BF16 peak (every precision), `mfu_at_precision_peak_pct`
against the linears' precision, and `mfu_vs_measured_matmul_pct` against the probe's matmul.
`--cpu-smoke` runs the same stages on CPU with the debug model (FP8 emulated).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from core.atomic import write_text_atomic
from tools.cli import add_override_arg, run

ROOT = Path(__file__).resolve().parent.parent
OURS = re.compile(r"step\s+(\d+)\s+loss\s+([\d.]+)\s+tok/s/gpu ([\d,]+)")
STOCK = re.compile(r"step:\s*(\d+)\s+loss:\s*([\d.]+).*?tps: ([\d,]+)")
CARRIED_TOKENIZER = ROOT / ".gpu_carry" / "tokenizer"
LOG_TAIL_CHARS = 6000  # per stage, in gpu_check.log

PROBE = r"""
import json, os, platform, sys, time
out = {"python": platform.python_version()}
import torch
out["torch"] = torch.__version__
out["cuda_available"] = torch.cuda.is_available()
if torch.cuda.is_available():
    out["gpu_name"] = torch.cuda.get_device_name(0)
    out["capability"] = list(torch.cuda.get_device_capability(0))
    out["cuda"] = torch.version.cuda
    out["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        a @ b
    torch.cuda.synchronize()
    out["bf16_matmul_tflops"] = round(10 * 2 * 8192**3 / (time.perf_counter() - t) / 1e12, 1)
for name in ("triton", "torchtitan", "torchao", "tokenizers", "datasets"):
    try:
        out[name] = __import__(name).__version__
    except Exception as e:
        out[name] = f"missing: {type(e).__name__}: {e}"[:200]
import runtime  # noqa: F401  (torch-version bridges; exits 2 with one line if impossible)
from runtime.platform import BRIDGED, spmd_backend
out["bridged"] = list(BRIDGED)
out["spmd_backend"] = spmd_backend()
from kernels.caps import detect_features
out["kernel_packages"] = sorted(detect_features())
print("PROBE " + json.dumps(out))
"""


def parse(log: str, pattern: re.Pattern[str], warmup: int) -> tuple[list[float], float | None]:
    """Per-step tokens/s/GPU after `warmup` steps, and the last loss, from a trainer's log."""
    tps: dict[int, float] = {}
    loss = None
    for m in pattern.finditer(log):
        tps[int(m.group(1))] = float(m.group(3).replace(",", ""))
        loss = float(m.group(2))
    return [v for s, v in sorted(tps.items()) if s > warmup], loss


def run_stage(cmd: list[str], timeout_s: float, env: dict[str, str]) -> dict[str, Any]:
    """Run `cmd` in its own process group; on timeout kill the whole group (compile workers
    included). Never raises for the child's failure."""
    t = time.time()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip
    timed_out = False
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
    return {"exit_code": proc.returncode, "timed_out": timed_out,
            "wall_s": round(time.time() - t, 1), "log": out or ""}  # fmt: skip


def _fmt(v: Any, spec: str) -> str:
    return format(v, spec) if isinstance(v, (int, float)) else "n/a"


class Report:
    """The JSON + markdown report, rewritten whole after every stage."""

    def __init__(self, out: Path, command: str, recipe: str):
        self.out = out
        self.data: dict[str, Any] = {"command": command, "recipe": recipe, "stages": [],
                                     "runs": [], "status": "running"}  # fmt: skip
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu_check.log").write_text("")

    def log(self, name: str, text: str) -> None:
        with open(self.out / "gpu_check.log", "a") as f:
            f.write(f"===== {name} (last {LOG_TAIL_CHARS} chars) =====\n{text[-LOG_TAIL_CHARS:]}\n")

    def write(self) -> None:
        d = self.data
        d["derived"] = derived(d["runs"])
        write_text_atomic(self.out / "gpu_check.json", json.dumps(d, indent=2) + "\n")
        (self.out / "gpu_check.md").write_text(markdown(d))


def derived(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """FP8/BF16 speedup of ours, ours/stock per backend."""
    med = {(r["trainer"], r["linear"]): r.get("median_tokens_per_sec_per_gpu") for r in runs}
    out: dict[str, Any] = {}
    base = med.get(("titanscale", "bf16"))
    for lin in ("fp8_rowwise", "mxfp8"):
        v = med.get(("titanscale", lin))
        if base and v:
            out[f"{lin}_over_bf16"] = round(v / base, 3)
    for lin in ("bf16", "fp8_rowwise", "mxfp8"):
        a, b = med.get(("titanscale", lin)), med.get(("torchtitan-stock", lin))
        if a and b:
            out[f"ours_over_stock_{lin}"] = round(a / b, 4)
    return out


def markdown(d: dict[str, Any]) -> str:
    env = d.get("probe", {})
    lines = [
        f"# GPU check: {d['recipe']} on {env.get('gpu_name', 'cpu')} ({d['status']})",
        "",
        f"- command: `{d['command']}`; date {d.get('date', '?')}",
        f"- python {env.get('python')}, torch {env.get('torch')}, torchtitan "
        f"{env.get('torchtitan')}, torchao {env.get('torchao')}, triton {env.get('triton')}, "
        f"CUDA {env.get('cuda')}; bridged: {', '.join(env.get('bridged', [])) or 'none'}; "
        f"spmd backend {env.get('spmd_backend')}",
        f"- measured bf16 matmul (8192^3): {_fmt(env.get('bf16_matmul_tflops'), '.0f')} "
        f"TFLOP/s; dense BF16 peak {_fmt(d.get('bf16_peak_tflops'), '.0f')} TFLOP/s",
        f"- FLOPs/token (torchtitan's count): {_fmt(d.get('flops_per_token', 0) / 1e9, '.3f')} G;"
        f" steps {d.get('steps')}, warmup excluded {d.get('warmup')}",
        "",
        "| stage | exit | timed out | wall s | note |",
        "|---|---|---|---|---|",
    ]
    for s in d["stages"]:
        lines.append(f"| {s['name']} | {s.get('exit_code')} | {s.get('timed_out')} | "
                     f"{s.get('wall_s')} | {s.get('note', '')} |")  # fmt: skip
    lines += [
        "",
        "| trainer | linear | tok/s/GPU (median) | TFLOP/s/GPU | MFU % (BF16 peak) "
        "| MFU % (precision peak) | MFU % (measured matmul) | final loss | exit | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in d["runs"]:
        if "skipped" in r:
            lines.append(f"| {r['trainer']} | {r['linear']} | skipped: {r['skipped']} "
                         "| | | | | | | |")  # fmt: skip
            continue
        lines.append(
            f"| {r['trainer']} | {r['linear']} | "
            f"{_fmt(r.get('median_tokens_per_sec_per_gpu'), ',.0f')} | "
            f"{_fmt(r.get('tflops_per_gpu'), '.1f')} | {_fmt(r.get('mfu_pct'), '.1f')} | "
            f"{_fmt(r.get('mfu_at_precision_peak_pct'), '.1f')} | "
            f"{_fmt(r.get('mfu_vs_measured_matmul_pct'), '.1f')} | "
            f"{_fmt(r.get('final_loss'), '.4f')} | {r.get('exit_code')}"
            f"{' (timeout)' if r.get('timed_out') else ''} | {r.get('wall_s')} |"
        )
    if d.get("derived"):
        lines += ["", "Derived: " + ", ".join(f"{k} = {v}" for k, v in d["derived"].items())]
    return "\n".join(lines) + "\n"


def prepare_tokenizer(dest: Path, vocab_size: int) -> Path:
    """Build the embedded tokenizer for `vocab_size` here and copy it to `dest` (carried to the
    GPU machine, whose different library versions would otherwise key a fresh training)."""
    from data.tokenizer import resolve_tokenizer

    src = Path(resolve_tokenizer("embedded", vocab_size=vocab_size))
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(src, dest)
    return dest


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT") or "outputs/gpu_check")
    p.add_argument("--work", default="/tmp/titanscale_gpu_check", help="run folders, logs")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--budget-s", type=float, default=540.0, help="whole check, seconds")
    p.add_argument("--run-timeout-s", type=float, default=180.0, help="per training run")
    p.add_argument("--tests-timeout-s", type=float, default=60.0)
    p.add_argument("--tests", nargs="+", default=["tests"], help="where the gpu-marked tests are")
    p.add_argument("--linears", nargs="+", default=None,
                   help="linear backends to run (default: bf16 fp8_rowwise, + mxfp8 on SM100)")  # fmt: skip
    p.add_argument("--cpu-smoke", action="store_true")
    p.add_argument("--prepare-tokenizer", default=None, metavar="DIR")
    add_override_arg(p, "recipe override for every run, e.g. training.cuda_graphs=off")
    a = p.parse_args(argv)
    recipe = "recipes/debug.toml" if a.cpu_smoke else "recipes/gpu_slice_70b.toml"
    from recipe.loader import effective_shape, load_recipe

    if a.prepare_tokenizer:
        shape = effective_shape(load_recipe(recipe))
        dest = prepare_tokenizer(Path(a.prepare_tokenizer), shape.vocab_size)
        print(f"tokenizer for vocab {shape.vocab_size} -> {dest}")
        return 0

    t0 = time.time()
    out, work = Path(a.out), Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    base = [f"training.steps={a.steps}", "metrics.tensorboard=false", "checkpoint.interval=0",
            f"metrics.summary_skip_steps={a.warmup}"]  # fmt: skip
    if a.cpu_smoke:
        base += ["training.seq_len=128", "training.compile=false"]
    elif (CARRIED_TOKENIZER / "tokenizer.json").exists():
        base += [f"model.tokenizer={CARRIED_TOKENIZER}"]
    base += a.overrides
    r = load_recipe(recipe, base)
    fpt = effective_shape(r).flops_per_token(r.training.seq_len)
    report = Report(out, "python -m tools.gpu_check " + " ".join(argv or sys.argv[1:]), recipe)
    d = report.data
    d.update(date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), flops_per_token=fpt,
             steps=a.steps, warmup=a.warmup)  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1"}  # fmt: skip
    if a.cpu_smoke:
        env["OMP_NUM_THREADS"] = "1"
    env.setdefault("TITANSCALE_CACHE", str(work / "cache"))
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(work / "inductor"))

    def left() -> float:
        return a.budget_s - (time.time() - t0)

    def stage(name: str, cmd: list[str], timeout: float) -> dict[str, Any] | None:
        if left() < timeout * 0.5:
            d["stages"].append({"name": name, "note": f"skipped: {left():.0f} s left in budget"})
            report.write()
            return None
        res = run_stage(cmd, min(timeout, left()), env)
        report.log(name, res["log"])
        return res

    # 1. probe
    res = stage("probe", [sys.executable, "-c", PROBE], 120)
    probe: dict[str, Any] = {}
    if res is not None:
        m = re.search(r"^PROBE (\{.*\})$", res["log"], re.M)
        probe = json.loads(m.group(1)) if m else {}
        err = [ln for ln in res["log"].splitlines() if ln.startswith("error:")]
        note = err[-1][:300] if err else ("" if m else res["log"].strip()[-300:])
        d["stages"].append({"name": "probe", "exit_code": res["exit_code"],
                            "timed_out": res["timed_out"], "wall_s": res["wall_s"], "note": note})  # fmt: skip
    d["probe"] = probe
    from core.hardware import peak_flops

    device = probe.get("gpu_name", "cpu")
    bf16_peak = peak_flops(device, "bf16")
    d["bf16_peak_tflops"] = bf16_peak / 1e12 if bf16_peak else None
    if res is None or res["exit_code"] != 0 or not probe:
        d["status"] = "probe failed"
        report.write()
        print(markdown(d))
        return 1
    report.write()

    # 2. gpu-marked tests
    res = stage("gpu tests", [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p",
                              "no:cacheprovider", "-o", "addopts=", *a.tests], a.tests_timeout_s)  # fmt: skip
    if res is not None:
        summary = [ln for ln in res["log"].splitlines() if re.search(r"\d+ (passed|skipped|failed|deselected|error)", ln)]  # fmt: skip
        d["stages"].append({"name": "gpu tests", "exit_code": res["exit_code"],
                            "timed_out": res["timed_out"], "wall_s": res["wall_s"],
                            "note": summary[-1].strip("= ") if summary else ""})  # fmt: skip
    report.write()

    # 3. slice runs
    linears = a.linears or ["bf16", "fp8_rowwise"]
    if a.linears is None and (probe.get("capability") or [0])[0] >= 10:
        linears.append("mxfp8")  # SM100: block-scaled FP8 tensor cores
    measured = probe.get("bf16_matmul_tflops")
    for linear in linears:
        precision = "bf16" if linear == "bf16" else linear
        for trainer, script, pattern in (
            ("titanscale", "train.py", OURS),
            ("torchtitan-stock", "benchmarks/stock_trainer.py", STOCK),
        ):
            name = f"{trainer} {linear}"
            run_dir = work / f"{trainer}-{linear}"
            shutil.rmtree(run_dir, ignore_errors=True)
            cmd = [sys.executable, str(ROOT / script), "--recipe", recipe]
            for s in [*base, f"kernels.linear={linear}", f"job.output_dir={run_dir}"]:
                cmd += ["--set", s]
            res = stage(name, cmd, a.run_timeout_s)
            if res is None:
                d["runs"].append({"trainer": trainer, "linear": linear, "skipped": "time budget"})
                report.write()
                continue
            tps, loss = parse(res["log"], pattern, a.warmup)
            med = statistics.median(tps) if tps else None
            flops = med * fpt if med else None
            prec_peak = peak_flops(device, precision)
            err = [ln for ln in res["log"].splitlines() if ln.startswith("error:")]
            d["runs"].append({
                "trainer": trainer, "linear": linear, "exit_code": res["exit_code"],
                "timed_out": res["timed_out"], "wall_s": res["wall_s"],
                "steps_measured": len(tps), "median_tokens_per_sec_per_gpu": med,
                "p10_tokens_per_sec_per_gpu": min(tps) if tps else None,
                "final_loss": loss, "tflops_per_gpu": flops / 1e12 if flops else None,
                "mfu_pct": 100 * flops / bf16_peak if flops and bf16_peak else None,
                "mfu_at_precision_peak_pct": 100 * flops / prec_peak if flops and prec_peak else None,
                "mfu_vs_measured_matmul_pct": 100 * flops / (measured * 1e12) if flops and measured else None,
                "error": (err[-1] if err else res["log"].strip()[-400:]) if res["exit_code"] else None,
            })  # fmt: skip
            report.write()
    failed = [s for s in d["stages"] + d["runs"] if s.get("exit_code") not in (None, 0)]
    d["status"] = "failures" if failed else "complete"
    d["total_wall_s"] = round(time.time() - t0, 1)
    report.write()
    print(markdown(d))
    return 1 if failed else 0


if __name__ == "__main__":
    run(main)
