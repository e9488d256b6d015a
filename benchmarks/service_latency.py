"""forward_backward latency through the Tinker SDK against `tools.serve` (debug model, CPU).

    python benchmarks/service_latency.py [--n 100] [--tokens 128] [--batch 1] [--out benchmarks/service_latency.json]

Starts `python -m tools.serve --recipe recipes/debug.toml` (the full debug model: 6 layers,
dim 256, vocab 2048) on a free port, creates one LoRA client (rank 8), and times N
forward_backward calls one at a time (call -> result): client-observed latency, including the
SDK's submit and retrieve_future round trips, and the server's own time for the operation
(from its `service.op` log lines). Reports p50 / p90 / p99 / mean in milliseconds.
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


def _stats(ms: list[float]) -> dict[str, float]:
    a = np.asarray(ms)
    return {
        k: round(float(v), 2)
        for k, v in {
            "p50": np.percentile(a, 50),
            "p90": np.percentile(a, 90),
            "p99": np.percentile(a, 99),
            "mean": a.mean(),
        }.items()
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=100)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "service_latency.json"))
    args = p.parse_args()
    import tinker
    from tinker import types

    sys.path.insert(0, str(ROOT))
    from tests.helpers.service_server import KEY, start_server

    tmp = Path(tempfile.mkdtemp())
    server = start_server(tmp, sets=[])  # the full debug model
    url, log = server.url, server.log
    try:
        sc = tinker.ServiceClient(base_url=url, api_key=KEY)
        tc = sc.create_lora_training_client(base_model="titanscale/debug", rank=8, seed=0).result()
        rng = np.random.default_rng(0)
        data = []
        for _ in range(args.batch):
            toks = rng.integers(0, 2048, args.tokens + 1).tolist()
            data.append(
                types.Datum(
                    model_input=types.ModelInput.from_ints(toks[:-1]),
                    loss_fn_inputs={"target_tokens": toks[1:], "weights": [1.0] * args.tokens},
                )
            )
        for _ in range(5):  # warm-up, excluded
            tc.forward_backward(data, "cross_entropy").result()
        client_ms = []
        for _ in range(args.n):
            t0 = time.perf_counter()
            tc.forward_backward(data, "cross_entropy").result()
            client_ms.append((time.perf_counter() - t0) * 1e3)
        sc.close("success").result()
    finally:
        server.stop()
    walls = [
        float(m) * 1e3
        for m in re.findall(
            r"kind=forward_backward .*?wall_s=([0-9.]+)", log.read_text(errors="replace")
        )
    ][5:]
    import tinker as _t
    import torch

    result = {
        "command": " ".join(["python", "benchmarks/service_latency.py", *sys.argv[1:]]),
        "model": "recipes/debug.toml (debugmodel: 6 layers, dim 256, vocab 2048), LoRA rank 8",
        "batch": f"{args.batch} x {args.tokens} tokens, cross_entropy",
        "n": args.n,
        "client_ms": _stats(client_ms),
        "server_op_ms": _stats(walls),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, OMP_NUM_THREADS=1",
        "load_average_at_end": os.getloadavg(),
        "versions": {
            "torch": torch.__version__,
            "tinker": _t.__version__,
            "python": platform.python_version(),
        },
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
