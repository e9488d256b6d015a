"""Mesh axes, named once, and the resolved parallel layout.

Rank order (outermost to innermost): pp, dp_replicate, dp_shard, cp, tp.
tp is innermost so that consecutive ranks (one node's GPUs, one NVLink domain) form a tp
group; pp and dp_replicate are outermost so that the traffic that tolerates the most latency
(pipeline point-to-point, replica all-reduce) is the traffic that crosses the spine. This is
torchtitan's own order (ParallelDims), which Megatron writes as tp-cp-dp-pp from inner to
outer.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class MeshAxis(str, Enum):
    PP = "pp"
    DP_REPLICATE = "dp_replicate"
    DP_SHARD = "dp_shard"
    CP = "cp"
    TP = "tp"


# Outermost first; the product of the degrees in this order is the world size.
MESH_ORDER: tuple[MeshAxis, ...] = (
    MeshAxis.PP,
    MeshAxis.DP_REPLICATE,
    MeshAxis.DP_SHARD,
    MeshAxis.CP,
    MeshAxis.TP,
)


@dataclass(frozen=True)
class Layout:
    """Concrete degrees for one world size (dp_shard resolved, no -1)."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        """Data-parallel size: how many different batches are processed per microstep."""
        return self.dp_replicate * self.dp_shard

    @property
    def non_data_parallel_size(self) -> int:
        return self.pp * self.cp * self.tp

    def degree(self, axis: MeshAxis) -> int:
        return int(getattr(self, axis.value))

    def shape(self) -> tuple[int, ...]:
        return tuple(self.degree(a) for a in MESH_ORDER)

    @classmethod
    def of(cls, dims: object) -> Layout:
        """The layout of anything with pp/dp_replicate/dp_shard/cp/tp degrees (torchtitan's
        ParallelDims)."""
        return cls(**{a.value: int(getattr(dims, a.value)) for a in MESH_ORDER})

    def describe(self) -> str:
        return " x ".join(
            f"{a.value}{self.degree(a)}" for a in MESH_ORDER if self.degree(a) > 1
        ) or ("single process")


def resolve_layout(
    *, world_size: int, dp_replicate: int, dp_shard: int, cp: int, tp: int, pp: int
) -> Layout | str:
    """The layout for `world_size`, or a sentence saying why the degrees don't fit."""
    fixed = dp_replicate * cp * tp * pp
    if dp_shard == -1:
        if world_size % fixed:
            return (
                f"dp_replicate x cp x tp x pp = {fixed} does not divide the world size {world_size}"
            )
        dp_shard = world_size // fixed
    elif fixed * dp_shard != world_size:
        return (
            f"dp_replicate x dp_shard x cp x tp x pp = {fixed * dp_shard}, but the world "
            f"size is {world_size}"
        )
    return Layout(pp=pp, dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp)
