"""Placed meshes under torchrun (gloo, CPU): torchtitan's groups follow the permutation,
collectives run on them, the startup check passes for the placement and names the group
and hosts for plain order; and a permuted mesh trains to the same losses."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.helpers.runs import FAST, ROOT, child_env, free_port, python, read_losses

pytestmark = pytest.mark.multiproc


def _torchrun(nproc: int, script: str, args: list[str], env: dict | None = None, timeout=600):
    cmd = [
        python(), "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
        "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{free_port()}",
        str(ROOT / script), *args,
    ]  # fmt: skip
    e = child_env()
    e.update(env or {})
    proc = subprocess.run(cmd, cwd=ROOT, env=e, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def test_placed_mesh_groups_collectives_and_startup_check(tmp_path):
    _torchrun(
        4, "tests/helpers/placed_mesh_worker.py", ["--out", str(tmp_path), "--order", "0,2,1,3"]
    )
    res = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    # Mesh (dp_shard 2 x tp 2) positions 0..3 hold ranks 0,2,1,3: tp groups {0,2}, {1,3}
    # (plain order would give {0,1}, {2,3}); dp_shard groups {0,1}, {2,3}.
    want_tp = {0: [0, 2], 2: [0, 2], 1: [1, 3], 3: [1, 3]}
    want_shard = {0: [0, 1], 1: [0, 1], 2: [2, 3], 3: [2, 3]}
    for r in res:
        rank = r["rank"]
        assert r["world_order"] == [0, 2, 1, 3]
        assert r["coords_ok"]  # group rank == mesh coordinate on every mesh
        assert "out of increasing rank order" in r["refused"]  # [3,1,2,0] is refused
        assert r["tp_ranks"] == want_tp[rank]
        assert r["tp_sum"] == sum(want_tp[rank])  # an all-reduce ran on that group
        assert r["shard_ranks"] == want_shard[rank]
        assert r["shard_sum"] == sum(want_shard[rank])
        # Faked hosts: rank r on node<r % 2>. Placement keeps each tp group on one host.
        assert "NVLink domains 1-1" in r["summary"].splitlines()[1]
        assert (
            "tp group [0, 1]" in r["plain_error"]
            and "rank 0 on node0, rank 1 on node1" in r["plain_error"]
        )


def test_permuted_mesh_trains_to_the_unpermuted_losses(tmp_path, seed_checkpoint, fast_reference):
    """FSDP2 x TP2 on the permuted mesh [0, 2, 1, 3] (tp groups {0,2}, {1,3}) against the
    unpermuted single-process run from the same seed checkpoint and the same global batch
    (`fast_reference`, tests/conftest.py: the run every layout test holds to 2e-4)."""
    out = tmp_path / "permuted"
    args = ["--set", f"job.output_dir={out}"]
    for o in [*FAST, f"checkpoint.load_from={seed_checkpoint}", "training.local_batch_size=2",
              "parallel.dp_shard=2", "parallel.tp=2"]:  # fmt: skip
        args += ["--set", o]
    proc = _torchrun(4, "tests/helpers/train_placed.py", args,
                     env={"TITANSCALE_TEST_RANK_ORDER": "0,2,1,3"})  # fmt: skip
    losses = read_losses(out)
    assert sorted(losses) == sorted(fast_reference), proc.stdout[-2000:]
    for step, ref in fast_reference.items():
        assert abs(losses[step] - ref) <= 2e-4, (step, losses[step], ref)
    assert losses[5] < losses[1]
