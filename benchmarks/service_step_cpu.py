"""The service's CPU time and page faults per training step, for A/B runs across commits.

    python benchmarks/service_step_cpu.py [--root CHECKOUT] [--n 10] [--dpo]

Starts `python -m tools.serve` of the checkout at --root (default: this one; e.g. a
`git archive` of an older commit) on the full debug model, creates one LoRA client (rank 16)
with the tinker SDK and runs 3 warm-up and then --n steps of forward_backward (cross_entropy,
or with --dpo forward_backward_custom, the DPO pair's path) + optim_step, 8 x 96 tokens.
Prints one JSON line: the server process's CPU seconds (utime + stime from /proc, so other
processes on the machine do not count) and minor page faults per step, wall per step, RSS.
Used for benchmarks/peers.md finding 7 (glibc's mmap threshold).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def cpu_and_faults(pid: int) -> tuple[float, int]:
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK"), int(f[7])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", default=str(Path(__file__).resolve().parent.parent))
    p.add_argument("--n", type=int, default=10)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--dpo", action="store_true")
    a = p.parse_args()
    sys.path.insert(0, a.root)
    import tinker
    from tinker import types

    from tests.helpers.service_server import KEY, start_server

    srv = start_server(Path(tempfile.mkdtemp()), sets=[])  # the full debug model
    try:
        sc = tinker.ServiceClient(base_url=srv.url, api_key=KEY)
        tc = sc.create_lora_training_client(base_model="titanscale/debug", rank=16, seed=0)
        rng = np.random.default_rng(0)
        half = a.tokens // 2
        data = []
        for _ in range(a.batch):
            t = rng.integers(0, 2048, a.tokens + 1).tolist()
            w = [0.0] * half + [1.0] * (a.tokens - half)  # a prompt, then a completion
            data.append(
                types.Datum(
                    model_input=types.ModelInput.from_ints(t[:-1]),
                    loss_fn_inputs={"target_tokens": t[1:], "weights": w},
                )
            )

        def custom(_data, logprobs):
            return sum(-lp.sum() for lp in logprobs) / len(logprobs), {}

        def step() -> None:
            if a.dpo:
                tc.forward_backward_custom(data, custom).result()
            else:
                tc.forward_backward(data, "cross_entropy").result()
            tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()

        for _ in range(3):
            step()
        (c0, f0), w0 = cpu_and_faults(srv.proc.pid), time.perf_counter()
        for _ in range(a.n):
            step()
        (c1, f1), w1 = cpu_and_faults(srv.proc.pid), time.perf_counter()
        status = Path(f"/proc/{srv.proc.pid}/status").read_text().splitlines()
        rss = [ln.split()[1] + " kB" for ln in status if ln.startswith(("VmHWM", "VmRSS"))]
        result = {
            "root": a.root,
            "loss": "forward_backward_custom" if a.dpo else "cross_entropy",
            "server_cpu_s_per_step": round((c1 - c0) / a.n, 4),
            "server_minor_faults_per_step": (f1 - f0) // a.n,
            "wall_s_per_step": round((w1 - w0) / a.n, 4),
            "server_vmhwm_vmrss": rss,
            "load_average": os.getloadavg(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        }
        print(json.dumps(result))
    finally:
        srv.stop()


if __name__ == "__main__":
    main()
