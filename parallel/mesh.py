"""torchtitan's device meshes built from a placed (permuted) world order.

torchtitan's `ParallelDims.build_mesh` makes its world mesh with
`init_device_mesh(device_type, (world_size,))` (plain rank order) and unflattens it into
every named mesh (pp, batch, dp_replicate, dp_shard/fsdp, cp, tp, ...).
`PlacedParallelDims` runs the very same method with one difference: the world mesh is
`DeviceMesh(device_type, tensor(rank_order), mesh_dim_names=("world",))`, so position i
of the [pp, dp_replicate, dp_shard, cp, tp] mesh is global rank `rank_order[i]` (from
`parallel.placement.planned_rank_order`). Every unflattened mesh, and so every process
group torchtitan's parallelize functions use, follows the placement.

Only orders whose groups all increase along the mesh are accepted: DeviceMesh sorts each
group's ranks, so in a decreasing group a rank's group rank (used by collectives and
FSDP2's shard index) differs from its mesh coordinate (used by DTensor, DCP and the data
loader) and sharded weights would be silently misplaced (seen with torch 2.14: a [1, 0]
FSDP order loaded the seed checkpoint's shards swapped). Orders that need reordering are
applied at launch instead: node ranks in `parallel.placement.node_order`.

The Trainer picks it up by overriding `init_distributed`:

    def init_distributed(self):
        world_size = dist_utils.init_distributed(...)   # as torchtitan does
        return make_parallel_dims(self.config.parallelism, world_size, rank_order)
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torchtitan.distributed.parallel_dims as _tt_parallel_dims
from torch.distributed.device_mesh import DeviceMesh
from torchtitan.distributed.parallel_dims import ParallelDims

from core.axes import Layout
from parallel.placement import monotone_violation

# build_mesh looks `init_device_mesh` up in its module at call time; we swap it for the
# duration of one build_mesh call. The lock keeps two concurrent builds from interleaving.
_BUILD_LOCK = threading.Lock()


@dataclass
class PlacedParallelDims(ParallelDims):
    """ParallelDims whose world mesh follows `rank_order` (None = plain rank order)."""

    rank_order: tuple[int, ...] | None = None
    mesh_device_type: str | None = None  # None = torchtitan's device type

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.rank_order is not None:
            self.rank_order = tuple(int(r) for r in self.rank_order)
            if sorted(self.rank_order) != list(range(self.world_size)):
                raise ValueError(
                    f"rank_order must be a permutation of 0..{self.world_size - 1}, got "
                    f"{list(self.rank_order)[:16]}{' ...' if len(self.rank_order) > 16 else ''}"
                )
            bad = monotone_violation(self.layout, list(self.rank_order))
            if bad:
                raise ValueError(
                    f"rank_order puts {bad} out of increasing rank order: torch's DeviceMesh "
                    "would give those ranks group ranks that differ from their mesh "
                    "coordinates (FSDP shards and checkpoints would be misplaced). Apply this "
                    "placement at launch instead: node ranks in "
                    "parallel.placement.node_order(layout, fabric) order"
                )

    @property
    def layout(self) -> Layout:
        return Layout.of(self)

    def world_order(self) -> list[int]:
        """Mesh position -> global rank, as the world mesh was built."""
        if self._world_mesh is not None:
            return [int(r) for r in self._world_mesh.mesh.flatten().tolist()]
        return list(self.rank_order) if self.rank_order else list(range(self.world_size))

    def build_mesh(self) -> DeviceMesh:
        order = self.rank_order
        dev = self.mesh_device_type
        if order is None and dev is None:
            return super().build_mesh()

        world = self.world_size
        mesh_ranks = torch.tensor(order if order is not None else range(world), dtype=torch.int)

        def placed_init_device_mesh(device_type, mesh_shape, *, mesh_dim_names=None, **kw):
            if tuple(mesh_shape) != (world,):
                raise AssertionError(f"expected the 1-D world mesh, got shape {mesh_shape}")
            return DeviceMesh(dev or device_type, mesh_ranks, mesh_dim_names=mesh_dim_names)

        with _BUILD_LOCK:
            original = _tt_parallel_dims.init_device_mesh
            _tt_parallel_dims.init_device_mesh = placed_init_device_mesh
            try:
                return super().build_mesh()
            finally:
                _tt_parallel_dims.init_device_mesh = original


def make_parallel_dims(
    parallelism_config,
    world_size: int,
    rank_order: Sequence[int] | None = None,
    *,
    device_type: str | None = None,
) -> PlacedParallelDims:
    """`ParallelDims.from_config` with a placement (and optionally the mesh device type,
    e.g. "cpu" where torchtitan would assume cuda)."""
    pd = PlacedParallelDims.from_config(parallelism_config, world_size)
    pd.rank_order = tuple(rank_order) if rank_order is not None else None
    pd.mesh_device_type = device_type
    pd.__post_init__()
    return pd
