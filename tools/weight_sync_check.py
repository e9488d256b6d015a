"""GPU check of the collective weight push (rl/weight_sync.py): bitwise, timed, one call.

    python -m tools.weight_sync_check [--gib 2] [--out DIR] [--budget-s 500]
    python -m tools.weight_sync_check --cpu-smoke          # the same stages on CPU (gloo)

Needs only torch (the lent H200's own; nothing carried, no vLLM, no torchtitan). Each stage is
two processes (rank 0 sends, rank 1 receives, as the trainer and the engine's worker do),
started here under a timeout, that run the protocol functions unchanged on synthetic
Llama-8B-shaped tensors (bf16 matrices, fp32 norms), regenerated from one seed on the
receiver, which compares what arrived bitwise:

1. gloo-cuda: gloo over CUDA tensors on GPU 0 (both ranks): the CUDA side of packing and
   unpacking (uint8 views of bf16, aligned offsets, stream sync) without NCCL.
2. nccl-same-gpu: NCCL with both ranks on GPU 0, as an engine sharing the trainer's GPU
   would be. Expected: refused ("Duplicate GPU detected"), the reason rl.weight_sync =
   "nccl" needs rl.engine_gpus; if it is accepted the transfer is checked and timed too.
3. nccl (2+ GPUs only): rank 0 on GPU 0, rank 1 on GPU 1, --gib GiB at 64 MiB and 1 GiB
   buckets: seconds and GB/s per push (after one warm-up push).

The report goes to --out: weight_sync_check.json and weight_sync_check.md (docs/vllm.md
"NCCL" says what to expect). Exit 0 when every stage that ran did what was expected.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tools.cli import run

ROOT = Path(__file__).resolve().parent.parent
LAYER = [  # Llama 3 8B's per-layer tensors (out, in); bf16; the norms fp32
    ((4096, 4096), "bfloat16"),
    ((1024, 4096), "bfloat16"),
    ((1024, 4096), "bfloat16"),
    ((4096, 4096), "bfloat16"),
    ((14336, 4096), "bfloat16"),
    ((14336, 4096), "bfloat16"),
    ((4096, 14336), "bfloat16"),
    ((4096,), "float32"),
    ((4096,), "float32"),
]


def shapes(total_bytes: int, scale: int) -> list[tuple[tuple[int, ...], str]]:
    """Whole layers (dimensions divided by `scale`) until `total_bytes` is reached."""
    out: list[tuple[tuple[int, ...], str]] = []
    size = 0
    while size < total_bytes:
        for shape, dtype in LAYER:
            s = tuple(d // scale for d in shape)
            out.append((s, dtype))
            n = 1
            for d in s:
                n *= d
            size += n * (2 if dtype == "bfloat16" else 4)
    return out


def _tensors(spec: list[Any], device: Any, seed: int) -> dict[str, Any]:
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    return {
        f"layers.{i // len(LAYER)}.t{i % len(LAYER)}": torch.randn(
            tuple(s), generator=g, device=device
        ).to(getattr(torch, d))
        for i, (s, d) in enumerate(spec)
    }


def rank_main(a: argparse.Namespace) -> int:
    """One rank of a stage: prints PORT (rank 0) and one JSON line of results."""
    import torch

    from rl import weight_sync as ws

    device = torch.device("cpu")
    if a.gpu >= 0:
        torch.cuda.set_device(a.gpu)
        device = torch.device("cuda", a.gpu)
    world = 2
    store = ws.rendezvous(a.rank, world, port=a.port, timeout_s=a.timeout_s)
    if a.rank == 0:
        print(f"PORT {store.port}", flush=True)
    group = ws.join(store, a.backend, a.rank, world, a.timeout_s)
    spec = json.loads(a.spec)
    src = _tensors(spec, device, seed=1234)
    results = []
    for bucket in a.buckets:
        for rep in range(a.reps + 1):  # the first push warms up
            man = ws.manifest(src, version=rep, bucket_bytes=bucket)
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            if a.rank == 0:
                ws.send(group, src, man)
                ok = True
            else:
                ok = True
                for name, t in ws.receive(group, man, device):
                    ok = ok and torch.equal(t, src[name])
                if device.type == "cuda":
                    torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            if rep:
                results.append({"bucket_bytes": bucket, "seconds": dt, "bitwise": ok,
                                "bytes": man["bytes"], "buckets": len(man["buckets"])})  # fmt: skip
    print(json.dumps({"rank": a.rank, "results": results}), flush=True)
    del group
    return 0


def stage(name: str, backend: str, gpus: tuple[int, int], spec: list[Any], buckets: list[int],
          reps: int, timeout_s: float) -> dict[str, Any]:  # fmt: skip
    """Run the two ranks; the stage's outcome (ok, refused, error) and rank 1's timings."""
    base = [sys.executable, "-m", "tools.weight_sync_check", "--backend", backend,
            "--spec", json.dumps(spec), "--reps", str(reps), "--timeout-s", str(timeout_s),
            "--buckets", *map(str, buckets)]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(ROOT), NCCL_DEBUG=os.environ.get("NCCL_DEBUG", "WARN"))
    out: dict[str, Any] = {"stage": name, "backend": backend, "gpus": list(gpus)}
    t0 = time.monotonic()
    r0 = subprocess.Popen([*base, "--rank", "0", "--gpu", str(gpus[0])], cwd=ROOT, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    assert r0.stdout is not None
    seen, first = "", [""]
    while first[:1] != ["PORT"]:  # (a warning may come first)
        line = r0.stdout.readline()
        if not line:
            r0.wait()
            return {**out, "outcome": "error", "detail": _error_line(seen)}
        seen, first = seen + line, line.split() or [""]
    r1 = subprocess.Popen([*base, "--rank", "1", "--gpu", str(gpus[1]), "--port", first[1]],
                          cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)  # fmt: skip
    # A rank that failed leaves its peer waiting for it: the peer gets 10 s more, then goes.
    failed_at = None
    while r0.poll() is None or r1.poll() is None:
        now = time.monotonic()
        if failed_at is None and (r0.poll() or r1.poll()):
            failed_at = now
        if now - t0 > timeout_s or (failed_at is not None and now - failed_at > 10):
            break
        time.sleep(0.2)
    timed_out = r0.poll() is None or r1.poll() is None
    for r in (r0, r1):
        if r.poll() is None:
            r.kill()
    o0, o1 = r0.communicate()[0], r1.communicate()[0]
    if timed_out and failed_at is None:
        return {**out, "outcome": "timeout", "detail": _error_line(o0 + "\n" + o1)}
    out["wall_s"] = round(time.monotonic() - t0, 1)
    lines = [x for x in o1.splitlines() if x.startswith("{")]
    if r0.returncode or r1.returncode or not lines:
        text = o0 + "\n" + o1
        refused = "Duplicate GPU" in text or "invalid usage" in text
        return {**out, "outcome": "refused" if refused else "error",
                "detail": _error_line(text)}  # fmt: skip
    res = json.loads(lines[-1])["results"]
    for r in res:
        r["gb_per_s"] = round(r["bytes"] / r["seconds"] / 1e9, 2)
        r["seconds"] = round(r["seconds"], 4)
    ok = all(r["bitwise"] for r in res)
    return {**out, "outcome": "ok" if ok else "mismatch", "results": res}


def _error_line(text: str) -> str:
    keep = [x for x in text.splitlines() if "Duplicate GPU" in x or "Error" in x or "error" in x]
    return (keep or text.strip().splitlines() or [""])[-1][:400]


def report(stages: list[dict[str, Any]], facts: dict[str, Any], out: Path, show: bool) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "weight_sync_check.json").write_text(json.dumps({**facts, "stages": stages}, indent=1))
    lines = ["# weight-sync check", "", " ".join(f"{k}={v}" for k, v in facts.items()), ""]
    lines += ["| stage | gpus | outcome | bucket MiB | tensors MiB | s/push | GB/s | bitwise |",
              "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for s in stages:
        g = ",".join(map(str, s["gpus"]))
        if not s.get("results"):
            lines.append(f"| {s['stage']} | {g} | {s['outcome']}: {s.get('detail', '')} |||||")
        for r in s.get("results", []):
            lines.append(f"| {s['stage']} | {g} | {s['outcome']} | {r['bucket_bytes'] >> 20} | "
                         f"{r['bytes'] >> 20} | {r['seconds']} | {r['gb_per_s']} | "
                         f"{r['bitwise']} |")  # fmt: skip
    (out / "weight_sync_check.md").write_text("\n".join(lines) + "\n")
    if show:
        print("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=2.0, help="NCCL stage's push size (GiB)")
    p.add_argument("--out", default="", help="report folder (default: $OUT, else "
                   "outputs/weight_sync_check)")  # fmt: skip
    p.add_argument("--budget-s", type=float, default=500.0,
                   help="a stage whose timeout no longer fits is skipped")  # fmt: skip
    p.add_argument("--cpu-smoke", action="store_true", help="gloo on CPU only (no GPU)")
    # one rank of a stage (run by `stage`)
    p.add_argument("--rank", type=int, default=-1, help="(internal) run one rank of a stage")
    p.add_argument("--gpu", type=int, default=-1, help="(internal) the rank's GPU; -1: CPU")
    p.add_argument("--port", type=int, default=0, help="(internal) rank 0's store port")
    p.add_argument("--backend", default="gloo", help="(internal) nccl or gloo")
    p.add_argument("--spec", default="[]", help="(internal) JSON [[shape, dtype], ...]")
    p.add_argument("--reps", type=int, default=2, help="(internal) timed pushes per bucket")
    p.add_argument("--timeout-s", type=float, default=120.0, help="(internal) group timeout")
    p.add_argument("--buckets", type=int, nargs="+", default=[1 << 26],
                   help="(internal) bucket sizes in bytes")  # fmt: skip
    a = p.parse_args(argv)
    if a.rank >= 0:
        return rank_main(a)
    import torch

    start = time.monotonic()
    out = Path(a.out or os.environ.get("OUT") or "outputs/weight_sync_check")
    n = 0 if a.cpu_smoke else torch.cuda.device_count()
    facts: dict[str, Any] = {"torch": torch.__version__, "gpus": n,
                             "nccl": ".".join(map(str, torch.cuda.nccl.version())) if n else "",
                             "gpu_name": torch.cuda.get_device_name(0) if n else "cpu"}  # fmt: skip
    if not a.cpu_smoke and n == 0:
        print("no CUDA device: run with --cpu-smoke for the CPU stages")
        return 2
    small = shapes(256 << 20, scale=4 if n else 16)  # gloo's stage: TCP, keep it small
    big = shapes(int(a.gib * (1 << 30)), scale=1)
    cpu = -1 if a.cpu_smoke else 0
    plan = [("gloo-cuda" if n else "gloo-cpu", "gloo", (cpu, cpu), small, [1 << 24], 1, 180.0)]
    if n:
        plan.append(("nccl-same-gpu", "nccl", (0, 0), small, [1 << 26], 1, 120.0))
    if n >= 2:
        plan.append(("nccl", "nccl", (0, 1), big, [1 << 26, 1 << 30], 2, 240.0))
    stages: list[dict[str, Any]] = []
    for name, backend, gpus, spec, buckets, reps, timeout in plan:
        if time.monotonic() - start + timeout > a.budget_s:
            stages.append({"stage": name, "gpus": list(gpus), "outcome": "skipped (budget)"})
            continue
        stages.append(stage(name, backend, gpus, spec, buckets, reps, timeout))
        report(stages, facts, out, show=False)  # what ran, should the call be killed
    report(stages, facts, out, show=True)
    expected = {"gloo-cuda": "ok", "gloo-cpu": "ok", "nccl": "ok", "nccl-same-gpu": "refused"}
    bad = [s for s in stages if s["outcome"] not in (expected[s["stage"]], "skipped (budget)")]
    for s in bad:
        print(f"unexpected: {s['stage']}: {s['outcome']} (expected {expected[s['stage']]})")
    return 1 if bad else 0


if __name__ == "__main__":
    run(main)
