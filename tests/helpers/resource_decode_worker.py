"""Two gloo ranks holding the tiny debug base FSDP2-sharded (service.titan_backend): one
adapter, sampled with the base gathered once per request and with it gathered layer by layer;
rank 0 also samples from an unsharded one-process backend and prints one JSON line of the
differences. Run under tools.torchrun."""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
os.environ["TORCHDYNAMO_DISABLE"] = "1"

import numpy as np  # noqa: E402
import torch.distributed as dist  # noqa: E402

from recipe.loader import load_recipe  # noqa: E402
from service.distributed import Group  # noqa: E402
from service.titan_backend import TitanLoraBackend  # noqa: E402
from service.types import Datum, LoraSpec, SamplingParams  # noqa: E402

RECIPE = load_recipe("recipes/debug.toml", ["model.layers=2", "training.seq_len=64"])
PROMPT = [5, 17, 33, 2, 9]


def run(b: TitanLoraBackend) -> dict:
    b.create_adapter("a", LoraSpec(rank=4, seed=0))
    t = np.array([5, 17, 33, 2, 9, 100, 7], dtype=np.int64)
    d = Datum(t, {"target_tokens": np.roll(t, -1)})
    b.forward_backward("a", [d], "cross_entropy", {}, forward_only=False)
    from service.types import AdamParams

    b.optim_step("a", AdamParams(learning_rate=1e-2))  # a non-zero adapter to sample with
    h = b.snapshot("a")
    out = {}
    for whole in (True, False):
        b.whole_base_decode = whole and b.group is not None
        r = b.sample(h, PROMPT, 4, SamplingParams(max_tokens=5, temperature=1.0, seed=7),
                     prompt_logprobs=True)  # fmt: skip
        out[whole] = (
            [s.tokens.tolist() for s in r.sequences],
            np.concatenate([s.logprobs for s in r.sequences]),
            r.prompt_logprobs[1:],
        )
    return out


def main() -> int:
    group = Group.start(backend="gloo", device_type="cpu", timeout_s=120)
    sharded = run(TitanLoraBackend.from_recipe(RECIPE, mesh=group.mesh))
    if group.rank == 0:
        ref = run(TitanLoraBackend.from_recipe(RECIPE))[True]  # one process, not sharded
        res = {}
        for whole, (toks, lps, plp) in sharded.items():
            res["whole" if whole else "per_layer"] = {
                "same_tokens": toks == ref[0],
                "max_logprob_diff": float(np.abs(lps - ref[1]).max()),
                "max_prompt_logprob_diff": float(np.abs(plp - ref[2]).max()),
            }
        print(json.dumps(res), flush=True)
    dist.barrier(group=group.control)
    group.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
