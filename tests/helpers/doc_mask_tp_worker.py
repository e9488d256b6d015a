"""torchrun worker for test_doc_mask_tp: TP=2 (gloo) debug model, dense and flex attention.

Each rank builds the same model (same seed), computes reference logits without parallelism,
applies torchtitan's tensor parallelism (model.parallelize, partial_dtensor), and checks
that TP logits match the reference and that no document sees another. Rank 0 prints both
ranks' results as one JSON line prefixed with RESULT.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist


def main() -> None:
    from runtime.platform import Platform

    Platform.detect().apply()  # CPU: torchtitan's CUDA assumptions answered (runtime.platform)
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    from torchtitan.distributed import ParallelDims

    from tests.helpers.doc_mask import build_model, contamination, logits, packed_batch

    pd = ParallelDims(
        dp_replicate=1, dp_shard=1, cp=1, tp=2, pp=1, ep=1, world_size=2,
        spmd_backend="partial_dtensor",
    )  # fmt: skip
    pd.build_mesh()
    x, pos, _ = packed_batch()
    out = {}
    for backend in sys.argv[1:]:
        model = build_model(backend, tp=True)
        ref = logits(model, x, pos)
        model.parallelize(pd)
        wqkv = model.layers["0"].attention.qkv_linear.wqkv.weight
        assert type(wqkv).__name__ == "DTensor", "tensor parallelism was not applied"
        tp = logits(model, x, pos)
        res = contamination(model, x, pos)
        res["tp_vs_single"] = (tp - ref).abs().max().item()
        out[backend] = res
    every = [None, None]
    dist.all_gather_object(every, out)  # both ranks' views (each computes full logits)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(every), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    # The results are out. Skip interpreter teardown: once in a CI run, the exit of a process
    # that had compiled flex attention aborted in C++ ("terminate called without an active
    # exception", SIGABRT) after everything had finished.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    from tools.cli import run  # exits past gloo's worker threads (tools.cli.exit_process)

    run(main)
