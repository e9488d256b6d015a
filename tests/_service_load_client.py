"""One training client for the service load test: `python tests/_service_load_client.py URL KEY
SEED STEPS OUT` trains a rank-4 adapter on SEED's data for STEPS steps through the tinker SDK
and writes {"session_id", "model_id", "losses"} to OUT."""

from __future__ import annotations

import json
import sys

import numpy as np
import tinker
from tinker import types


def main(url: str, key: str, seed: int, steps: int, out: str) -> None:
    rng = np.random.default_rng(seed)
    data = []
    for _ in range(2):
        toks = rng.integers(0, 2048, 33).tolist()
        data.append(types.Datum(
            model_input=types.ModelInput.from_ints(toks[:-1]),
            loss_fn_inputs={"target_tokens": toks[1:], "weights": [1.0] * 32}))
    sc = tinker.ServiceClient(base_url=url, api_key=key)
    tc = sc.create_lora_training_client(base_model="titanscale/debug", rank=4, seed=seed).result()
    losses = []
    for _ in range(steps):
        fb = tc.forward_backward(data, "cross_entropy")
        opt = tc.optim_step(types.AdamParams(learning_rate=1e-3))
        losses.append(fb.result().metrics["loss:sum"])
        opt.result()
    with open(out, "w") as f:
        json.dump({"session_id": sc.holder.get_session_id(), "model_id": tc.model_id,
                   "losses": losses}, f)
    sc.close("success").result()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
