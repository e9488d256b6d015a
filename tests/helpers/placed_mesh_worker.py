"""torchrun worker (gloo, CPU): torchtitan's meshes built from a permuted world order.

Each rank fakes its host (SLURMD_NODENAME = node<rank % 2>, as if the launcher had
interleaved the hosts) and its switch path, builds PlacedParallelDims for dp_shard 2 x tp 2
with the placement that keeps each tp group on one host, runs collectives on the tp and
dp_shard groups, runs the startup check (must pass), then checks the plain rank order
(must fail, naming the tp group and hosts). Writes rank<r>.json into --out.
"""

import argparse
import importlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--order", default="0,2,1,3")
    args = ap.parse_args()
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    env = {
        "SLURMD_NODENAME": f"node{rank % 2}",
        "SLURM_TOPOLOGY_ADDR": f"spine.leaf{rank % 2}.node{rank % 2}",
    }
    dist.init_process_group("gloo")
    # torchtitan gives size-1 mesh axes the "fake" backend; on CPU it must be registered
    # (the runtime's CPU platform layer does the same).
    importlib.import_module("torch.testing._internal.distributed.fake_pg")
    from torchtitan.config.configs import ParallelismConfig

    from parallel.mesh import make_parallel_dims
    from parallel.placement import PlacementError
    from runtime.startup import check_placement, gather_rank_info, local_rank_info, startup_check

    order = [int(x) for x in args.order.split(",")]
    cfg = ParallelismConfig(data_parallel_shard_degree=2, tensor_parallel_degree=2)
    pd = make_parallel_dims(cfg, world, order, device_type="cpu")
    pd.build_mesh()
    # The invariant PlacedParallelDims enforces: on every mesh, a rank's group rank equals
    # its mesh coordinate (DeviceMesh sorts group ranks).
    coords_ok = all(
        m.get_local_rank() == m.get_coordinate()[0]
        for m in pd.get_all_one_dimensional_meshes().values()
        if m.get_coordinate() is not None
    )
    refused = ""
    try:
        make_parallel_dims(cfg, world, [3, 1, 2, 0], device_type="cpu")
    except ValueError as e:
        refused = str(e)
    tp_mesh = pd.get_mesh("tp")
    tp_ranks = sorted(int(r) for r in tp_mesh.mesh.flatten().tolist())
    x = torch.tensor([float(rank)])
    dist.all_reduce(x, group=tp_mesh.get_group())
    shard_mesh = (
        pd.get_mesh("dp_shard") if pd.spmd_backend != "partial_dtensor" else pd.get_mesh("fsdp")
    )
    shard_ranks = sorted(int(r) for r in shard_mesh.mesh.flatten().tolist())
    y = torch.tensor([float(rank)])
    dist.all_reduce(y, group=shard_mesh.get_group())
    summary = startup_check(pd, env=env)
    infos = gather_rank_info(local_rank_info(rank, env))
    plain_error = ""
    try:
        check_placement(infos, pd.layout, list(range(world)))
    except PlacementError as e:
        plain_error = str(e)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(
            {
                "rank": rank,
                "world_order": pd.world_order(),
                "tp_ranks": tp_ranks,
                "tp_sum": x.item(),
                "shard_ranks": shard_ranks,
                "shard_sum": y.item(),
                "summary": summary,
                "plain_error": plain_error,
                "coords_ok": coords_ok,
                "refused": refused,
            },
            f,
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    from tools.cli import run  # exits past gloo's worker threads (tools.cli.exit_process)

    run(main)
