"""Tenant B's wait while tenant A floods the service (fair sharing, service/scheduler.py).

    OMP_NUM_THREADS=1 python benchmarks/fair_share.py [--rows 64] [--tokens 256] [--n 20]
        [--pieces 0 2048] [--out benchmarks/fair_share.json]

For each `--piece-tokens` value: starts `tools.serve` (the debug model, two layers, context
`--tokens`; tenants A and B), times B's 1 x 32-token forward_backward alone (`--n` calls),
then sends A's `--rows` x `--tokens` forward_backward and times B's calls (one at a time)
while A's request runs. Reports B's p50 / p99 / max in seconds, alone and under A, and A's
wall time. `--piece-tokens 0` is the whole-request scheduler (B waits behind all of A).
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def stats(s: list[float]) -> dict[str, float]:
    a = np.asarray(s)
    return {
        "n": len(s),
        "p50_s": round(float(np.percentile(a, 50)), 3),
        "p99_s": round(float(np.percentile(a, 99)), 3),
        "max_s": round(float(a.max()), 3),
    }


def one(pieces: int, rows: int, tokens: int, n: int) -> dict:
    import tinker
    from tinker import types

    from tests.helpers.service_server import KEY, KEY_B, TWO_TENANTS, start_server

    def datum(k: int) -> types.Datum:
        seq = [(7 * i + 3) % 2000 for i in range(k + 1)]
        return types.Datum(
            model_input=types.ModelInput.from_ints(seq[:-1]),
            loss_fn_inputs={"target_tokens": seq[1:], "weights": [1.0] * k},
        )

    server = start_server(
        Path(tempfile.mkdtemp()),
        "--piece-tokens",
        str(pieces),
        keys=TWO_TENANTS,
        sets=["model.layers=2", f"training.seq_len={tokens}"],
    )
    try:
        a = tinker.ServiceClient(base_url=server.url, api_key=KEY)
        b = tinker.ServiceClient(base_url=server.url, api_key=KEY_B)
        ta = a.create_lora_training_client(base_model="titanscale/debug", rank=8).result()
        tb = b.create_lora_training_client(base_model="titanscale/debug", rank=8).result()
        small = [datum(32)]

        def b_call() -> float:
            t0 = time.perf_counter()
            tb.forward_backward(small, "cross_entropy").result()
            return time.perf_counter() - t0

        b_call()  # warm-up
        alone = [b_call() for _ in range(n)]
        big = [datum(tokens - 1) for _ in range(rows)]
        t0 = time.perf_counter()
        done = threading.Event()
        fut = ta.forward_backward(big, "cross_entropy")
        waiter = threading.Thread(target=lambda: (fut.result(), done.set()), daemon=True)
        waiter.start()
        time.sleep(1.0)  # A's request is queued and running
        under = []
        while not done.is_set() and len(under) < n:
            under.append(b_call())
        waiter.join()
        a_wall = time.perf_counter() - t0
        a.close("success").result()
        b.close("success").result()
    finally:
        server.stop()
    return {
        "piece_tokens": pieces,
        "a_request": f"{rows} x {tokens} tokens",
        "a_wall_s": round(a_wall, 2),
        "b_alone": stats(alone),
        "b_under_a": stats(under),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--n", type=int, default=20)
    p.add_argument("--pieces", type=int, nargs="+", default=[0, 2048])
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "fair_share.json"))
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    import tinker
    import torch

    runs = [one(k, args.rows, args.tokens, args.n) for k in args.pieces]
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    out = {
        "command": "OMP_NUM_THREADS=1 python benchmarks/fair_share.py " + " ".join(sys.argv[1:]),
        "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}, 2 cores, no GPU",
        "versions": {"torch": torch.__version__, "tinker": tinker.__version__},
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "commit": commit,
        "runs": runs,
    }
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
