"""Training clients for the service load test: `python tests/helpers/service_load_client.py URL KEY
SEEDS STEPS OUT [BARRIER N]` trains, for each comma-separated seed in turn, a rank-4 adapter on
that seed's data for STEPS steps through the tinker SDK (one ServiceClient = one session per
seed) and writes {seed: {"session_id", "model_id", "losses"}} to OUT. With BARRIER (a folder)
and N, each client waits after creating its model until N clients have, so their steps
overlap however slowly the processes start."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import tinker
from tinker import types


def wait_for_others(barrier: str | None, n: int, seed: int) -> None:
    if barrier is None:
        return
    Path(barrier, f"ready-{seed}").touch()
    end = time.monotonic() + 300
    while len(list(Path(barrier).glob("ready-*"))) < n:
        if time.monotonic() > end:
            raise TimeoutError(f"only {len(list(Path(barrier).glob('ready-*')))} of {n} clients")
        time.sleep(0.02)


def run(url: str, key: str, seed: int, steps: int, barrier: str | None = None, n: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    data = []
    for _ in range(2):
        toks = rng.integers(0, 2048, 33).tolist()
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(toks[:-1]),
                loss_fn_inputs={"target_tokens": toks[1:], "weights": [1.0] * 32},
            )
        )
    sc = tinker.ServiceClient(base_url=url, api_key=key)
    tc = sc.create_lora_training_client(base_model="titanscale/debug", rank=4, seed=seed).result()
    wait_for_others(barrier, n, seed)
    losses = []
    for _ in range(steps):
        fb = tc.forward_backward(data, "cross_entropy")
        opt = tc.optim_step(types.AdamParams(learning_rate=1e-3))
        losses.append(fb.result().metrics["loss:sum"])
        opt.result()
    result = {"session_id": sc.holder.get_session_id(), "model_id": tc.model_id, "losses": losses}
    sc.close("success").result()
    return result


if __name__ == "__main__":
    url, key, seeds, steps, out = sys.argv[1:6]
    barrier, n = (sys.argv[6], int(sys.argv[7])) if len(sys.argv) > 7 else (None, 0)
    res = {int(s): run(url, key, int(s), int(steps), barrier, n) for s in seeds.split(",")}
    with open(out, "w") as f:
        json.dump(res, f)
