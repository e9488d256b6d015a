"""Run train.py's main in a torch made to look like the lent H200's older one (torch < 2.14).

    python tests/integration/_old_torch_worker.py [--no-pipeline-kwargs] -- <train.py args>

Removes, before anything imports torchtitan: `torch.distributed.fsdp.DataParallelMeshDims`,
`torch.distributed.set_timeout`, and `fully_shard`'s `dp_mesh_dims` keyword (a wrapper that
refuses it, as torch 2.11's has none). With --no-pipeline-kwargs the pipeline schedules'
step() also loses its pre-split keywords (torch 2.13's signature).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def make_old() -> None:
    import torch
    import torch.distributed
    import torch.distributed.fsdp as fsdp

    del fsdp.DataParallelMeshDims
    del torch.distributed.set_timeout
    native = fsdp.fully_shard

    def fully_shard(module, *, mesh=None, reshard_after_forward=None, shard_placement_fn=None,
                    mp_policy=None, offload_policy=None, ignored_params=None):  # fmt: skip
        kw = {"mesh": mesh, "reshard_after_forward": reshard_after_forward,
              "shard_placement_fn": shard_placement_fn, "ignored_params": ignored_params}  # fmt: skip
        if mp_policy is not None:
            kw["mp_policy"] = mp_policy
        if offload_policy is not None:
            kw["offload_policy"] = offload_policy
        return native(module, **kw)

    fsdp.fully_shard = fully_shard


def drop_pipeline_kwargs() -> None:
    from torch.distributed.pipelining import schedules

    def step(self, *args, target=None, losses=None, **kwargs):  # torch 2.13's shape
        raise AssertionError("must not be reached: the pre-flight check stops first")

    schedules.PipelineScheduleSingle.step = step
    schedules.PipelineScheduleMulti.step = step


if __name__ == "__main__":
    argv = sys.argv[1:]
    make_old()
    if argv and argv[0] == "--no-pipeline-kwargs":
        drop_pipeline_kwargs()
        argv = argv[1:]
    if argv and argv[0] == "--":
        argv = argv[1:]
    import train

    train.main(argv)
