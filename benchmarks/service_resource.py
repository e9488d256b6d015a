"""A model resource on CPU: forward_backward and sample latency, per-rank memory against the
planner's figure, with 1, 2 and 4 gloo processes (`tools.serve` under tools.torchrun).

    OMP_NUM_THREADS=1 python benchmarks/service_resource.py [--procs 1 2 4] [--n 8]
        [--out benchmarks/service_resource.json]

For each process count: starts the service on the full debug model (6 layers, dim 256,
vocab 2048, float32, dense attention on CPU), one LoRA client (rank 8) through the unmodified
tinker SDK; times N forward_backward calls (8 datums x 128 tokens, cross_entropy) and N
sample calls (8 samples x 32 tokens after a 16-token prompt), one at a time after 2 warm-ups:
client-observed and the server's own operation time (its `service.op` log lines). Then each
rank's peak RSS (/proc/<pid>/status VmHWM) and base-shard size (its start-up line) against
parallel/serve.py's figure for the same workload (the memory tools.serve plans: resident
base shard, adapters, the larger of the microbatch and the generator, fragmentation, the CPU
runtime's 0.8 GiB). Records the load average before and after each run (other sessions
share the 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
BATCH, TOKENS = 8, 128
SAMPLES, PROMPT, NEW = 8, 16, 32


def _stats(ms: list[float]) -> dict[str, float]:
    a = np.asarray(ms)
    return {"p50": round(float(np.percentile(a, 50)), 1), "mean": round(float(a.mean()), 1)}


def _op_ms(log: str, kind: str, n: int) -> list[float]:
    walls = re.findall(rf"kind={kind} seq=\S+ wall_s=([\d.]+)", log)
    return [1e3 * float(w) for w in walls[-n:]]


def _peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def planned(procs: int) -> dict[str, float]:
    """parallel/serve.py's per-rank figure for this benchmark's workload (GiB)."""
    from parallel.serve import Resource, resource_memory, served_model
    from recipe.loader import load_recipe

    m = served_model(load_recipe("recipes/debug.toml"), cpu=True)
    per_rank_rows = -(-BATCH // procs)
    mem = resource_memory(
        m, Resource(devices=procs, adapters=1), per_rank_rows * TOKENS, SAMPLES * (PROMPT + NEW)
    )
    return {
        "required_gib": round(mem.required_gib_on("cpu"), 3),
        "base_shard_mib": round(mem.base_shard / 2**20, 2),
    }


def run(procs: int, n: int) -> dict:
    import tinker
    from tinker import types

    from tests.helpers.service_server import KEY, start_server

    load0 = os.getloadavg()
    tmp = Path(tempfile.mkdtemp())
    server = start_server(tmp, sets=[], procs=procs)  # the full debug model
    try:
        sc = tinker.ServiceClient(base_url=server.url, api_key=KEY)
        tc = sc.create_lora_training_client(base_model="titanscale/debug", rank=8, seed=0).result()
        rng = np.random.default_rng(0)
        data = []
        for _ in range(BATCH):
            toks = rng.integers(0, 2048, TOKENS + 1).tolist()
            data.append(
                types.Datum(
                    model_input=types.ModelInput.from_ints(toks[:-1]),
                    loss_fn_inputs={"target_tokens": toks[1:], "weights": [1.0] * TOKENS},
                )
            )
        fb_ms, smp_ms = [], []
        for i in range(n + 2):
            t0 = time.perf_counter()
            tc.forward_backward(data, "cross_entropy").result()
            if i >= 2:
                fb_ms.append((time.perf_counter() - t0) * 1e3)
        smp = tc.save_weights_and_get_sampling_client().result()
        prompt = types.ModelInput.from_ints(rng.integers(0, 2048, PROMPT).tolist())
        params = types.SamplingParams(max_tokens=NEW, temperature=1.0, stop=[])
        for i in range(n + 2):
            t0 = time.perf_counter()
            smp.sample(prompt, SAMPLES, params).result()
            if i >= 2:
                smp_ms.append((time.perf_counter() - t0) * 1e3)
        sc.close("success").result()
        log = server.log_text()
        lines = re.findall(
            r"resource: rank (\d+) of \d+ \(pid (\d+) on [^)]*\) holds ([\d,]+) of ([\d,]+) base "
            r"parameters \([\d.]+%, ([\d.]+) MiB\)",
            log,
        )
        ranks = [(int(r), int(p), float(mib)) for r, p, _, _, mib in lines] or [
            (0, server.proc.pid, float("nan"))
        ]
        rss = {r: _peak_rss(pid) for r, pid, _ in ranks}
        plan_line = re.search(r"planned ([\d.]+) GiB per device of ([\d.]+)", log)
    finally:
        server.stop()
    return {
        "procs": procs,
        "forward_backward_ms": {
            "client": _stats(fb_ms),
            "server_op": _stats(_op_ms(log, "forward_backward", n)),
        },
        "sample_ms": {"client": _stats(smp_ms), "server_op": _stats(_op_ms(log, "sample", n))},
        "peak_rss_gib_per_rank": {r: round(v / 2**30, 3) for r, v in rss.items()},
        "base_shard_mib_per_rank": {r: mib for r, _, mib in ranks},
        "planned_for_this_workload": planned(procs),
        "planned_at_chosen_budgets_gib": float(plan_line.group(1)) if plan_line else None,
        "load_average_before_after": [round(load0[0], 2), round(os.getloadavg()[0], 2)],
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--procs", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "service_resource.json"))
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    import torch

    rows = [run(n, args.n) for n in args.procs]
    out = {
        "command": "OMP_NUM_THREADS=1 python benchmarks/service_resource.py "
        + " ".join(sys.argv[1:]),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "workload": {
            "model": "recipes/debug.toml (6 layers, dim 256, vocab 2048, float32)",
            "forward_backward": f"{BATCH} datums x {TOKENS} tokens, cross_entropy",
            "sample": f"{SAMPLES} samples x {NEW} tokens after a {PROMPT}-token prompt",
        },
        "runs": rows,
    }
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
