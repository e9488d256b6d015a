"""Rank placement: which global rank takes which position of the [pp, dp_replicate,
dp_shard, cp, tp] mesh, and what that costs in switch traffic.

Global rank r runs on host r // gpus_per_node in launch order (`Fabric.hosts`), which
c10d rendezvous makes arbitrary. The planned order sorts hosts by switch path, then NVLink
domain, then name, and fills the mesh row-major with tp innermost:
- a tp x cp block is gpus-contiguous, so it lies inside one NVLink domain whenever
  tp x cp divides the domain's GPU count (checked; `PlacementError` otherwise);
- a dp_shard group is a contiguous stretch of hosts in switch order, so it touches as
  few leaf switches as its size allows (with full leaves);
- dp_replicate and pp, outermost, are the groups that cross the spine.

`rank_order[i]` is the global rank at mesh position i (row-major over the mesh shape).

How a placement takes effect. torch's DeviceMesh builds each group with `new_group`,
which sorts the ranks: a rank's group rank (what collectives and FSDP2's shard index use)
is its position among the *sorted* ranks, while DTensor, DCP and the data loader use its
mesh coordinate. They agree only when every group's ranks increase along the mesh
(`monotone_violation` finds a group where they do not). So the placement is applied at
launch: node ranks follow `node_order` (torchrun `--node_rank`), which makes plain rank
order the planned order. A permuted world mesh (`parallel.mesh.PlacedParallelDims`) is
for orders that are monotone in every group, e.g. hosts regrouped without reordering.

Traffic: NCCL rings visit the hosts of a group in the order their first rank appears in
the communicator (ranks in mesh order) and walk each host's GPUs over NVLink. So an
all-gather of S bytes on N ranks sends S(N-1)/N over every inter-host ring edge; edges
between hosts on different leaves cross the spine. `cross_switch_traffic` sums that over
every collective of a step (volumes from `parallel.perf`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from core.axes import MESH_ORDER, Layout
from core.hostlist import natural_key
from parallel.fabric import Fabric
from parallel.perf import Collective
from parallel.workload import GroupSpan


class PlacementError(ValueError):
    """The layout cannot be placed on this fabric (a tp/cp group would leave NVLink)."""


def plain_rank_order(world_size: int) -> list[int]:
    return list(range(world_size))


def planned_rank_order(layout: Layout, fabric: Fabric) -> list[int]:
    """Mesh position -> global rank: hosts in switch/domain order, tp innermost."""
    if layout.world_size != fabric.world_size:
        raise PlacementError(
            f"layout {layout.describe()} has {layout.world_size} ranks but the fabric has "
            f"{fabric.world_size} ({len(fabric.hosts)} hosts x {fabric.gpus_per_node})"
        )
    g = fabric.gpus_per_node
    # NVLink domains stay contiguous even when one spans several leaves (tp and cp groups
    # must not leave a domain): domains in order of their first switch path, then hosts.
    domain_path: dict[str, tuple[str, ...]] = {}
    for h in fabric.hosts:
        cur = domain_path.get(h.nvlink_domain)
        domain_path[h.nvlink_domain] = h.switch_path if cur is None else min(cur, h.switch_path)
    order_hosts = sorted(
        range(len(fabric.hosts)),
        key=lambda i: (
            domain_path[fabric.hosts[i].nvlink_domain],
            fabric.hosts[i].nvlink_domain,
            fabric.hosts[i].switch_path,
            natural_key(fabric.hosts[i].name),
        ),
    )
    order = [h * g + k for h in order_hosts for k in range(g)]
    check_nvlink(layout, order, fabric)
    return order


def node_order(layout: Layout, fabric: Fabric) -> list[str]:
    """Hosts in planned order: give host i node rank i at launch (torchrun --node_rank)."""
    order = planned_rank_order(layout, fabric)
    g = fabric.gpus_per_node
    return [fabric.hosts[order[i] // g].name for i in range(0, len(order), g)]


def monotone_violation(layout: Layout, rank_order: list[int]) -> str | None:
    """The first group whose ranks do not increase along the mesh, or None.

    DeviceMesh sorts each group's ranks (group rank = position among the sorted ranks),
    while DTensor/FSDP/DCP place shards by mesh coordinate: a decreasing pair makes them
    disagree, and sharded weights land in the wrong places.
    """
    for axis, grps in groups(layout, rank_order).items():
        for grp in grps:
            if any(a > b for a, b in zip(grp, grp[1:], strict=False)):
                return f"{axis} group {grp}"
    return None


def mesh_array(layout: Layout, rank_order: list[int]) -> np.ndarray:
    return np.asarray(rank_order, dtype=np.int64).reshape(layout.shape())


def groups(layout: Layout, rank_order: list[int]) -> dict[str, list[list[int]]]:
    """Every group of every axis (and 'fsdp' = dp_shard x cp), ranks in communicator order."""
    arr = mesh_array(layout, rank_order)
    out: dict[str, list[list[int]]] = {}
    for k, axis in enumerate(MESH_ORDER):
        d = layout.degree(axis)
        out[axis.value] = np.moveaxis(arr, k, -1).reshape(-1, d).tolist()
    # dp_shard (axis 2) and cp (axis 3), flattened in that order like torchtitan's fsdp.
    fs = np.moveaxis(arr, (2, 3), (3, 4)).reshape(-1, layout.dp_shard * layout.cp)
    out["fsdp"] = fs.tolist()
    return out


@dataclass(frozen=True)
class RankPlace:
    """Where one rank runs: the one placement record of planning, startup and preflight."""

    rank: int
    host: str
    nvlink_domain: str
    switch_path: tuple[str, ...]  # root first, leaf last; () = unknown

    @property
    def leaf(self) -> str:
        return self.switch_path[-1] if self.switch_path else ""


def fabric_places(fabric: Fabric) -> dict[int, RankPlace]:
    """rank -> RankPlace for every rank of `fabric` in launch order."""
    out = {}
    for r in range(fabric.world_size):
        h = fabric.host_of(r)
        out[r] = RankPlace(r, h.name, h.nvlink_domain, h.switch_path)
    return out


@dataclass(frozen=True)
class GroupPlace:
    """The hosts, leaf switches and NVLink domains one mesh group touches."""

    axis: str
    ranks: tuple[int, ...]
    hosts: tuple[str, ...]  # natural order
    leaves: tuple[str, ...]  # natural order; unknown leaves left out
    domains: tuple[str, ...]


def group_places(
    layout: Layout, rank_order: list[int], places: Mapping[int, RankPlace]
) -> dict[str, list[GroupPlace]]:
    """Every group of every mesh axis (MESH_ORDER) with where its ranks run.

    A rank missing from `places` counts as host "?" (a partial gather)."""
    out: dict[str, list[GroupPlace]] = {}
    gs = groups(layout, rank_order)
    for axis in MESH_ORDER:
        rows = []
        for grp in gs[axis.value]:
            ps = [places.get(r) for r in grp]
            rows.append(
                GroupPlace(
                    axis=axis.value,
                    ranks=tuple(grp),
                    hosts=tuple(sorted({p.host if p else "?" for p in ps}, key=natural_key)),
                    leaves=tuple(sorted({p.leaf for p in ps if p and p.leaf}, key=natural_key)),
                    domains=tuple(sorted({p.nvlink_domain for p in ps if p}, key=natural_key)),
                )
            )
        out[axis.value] = rows
    return out


def nvlink_violation(
    layout: Layout, rank_order: list[int], places: Mapping[int, RankPlace]
) -> GroupPlace | None:
    """The first tp or cp group whose ranks span NVLink domains, or None: the one NVLink
    check behind the planner (`check_nvlink`) and the startup check (runtime.startup)."""
    gp = group_places(layout, rank_order, places)
    for axis in ("tp", "cp"):
        for g in gp[axis]:
            if len(g.domains) > 1:
                return g
    return None


def check_nvlink(layout: Layout, rank_order: list[int], fabric: Fabric) -> None:
    """Raise PlacementError naming the group and hosts if a tp or cp group leaves NVLink."""
    bad = nvlink_violation(layout, rank_order, fabric_places(fabric))
    if bad is not None:
        names = sorted(bad.hosts)
        raise PlacementError(
            f"{bad.axis} group {list(bad.ranks)} spans {len(bad.domains)} NVLink domains (hosts "
            f"{', '.join(names[:8])}{' ...' if len(names) > 8 else ''}); "
            f"tp x cp = {layout.tp * layout.cp} must fit one domain "
            f"(domains of {sorted(set(fabric.domain_gpus.values()))} GPUs)"
        )


def _ring_hosts(grp: list[int], fabric: Fabric) -> list[int]:
    """Host indices in the order a ring visits them (first appearance in the group)."""
    seen: dict[int, None] = {}
    g = fabric.gpus_per_node
    for r in grp:
        seen.setdefault(r // g, None)
    return list(seen)


def span_of(grp: list[int], fabric: Fabric) -> GroupSpan:
    hosts = _ring_hosts(grp, fabric)
    doms: dict[str, int] = {}
    for r in grp:
        d = fabric.host_of(r).nvlink_domain
        doms[d] = doms.get(d, 0) + 1
    leaves = {fabric.hosts[h].leaf for h in hosts}
    n = len(hosts)
    node_hops = n if n > 1 else 0
    leaf_hops = 0
    if n > 1:
        for i in range(n):
            a, b = fabric.hosts[hosts[i]], fabric.hosts[hosts[(i + 1) % n]]
            leaf_hops += a.leaf != b.leaf
    return GroupSpan(
        size=len(grp),
        domains=len(doms),
        per_domain=min(doms.values()) if len(doms) > 1 else len(grp),
        nodes=n,
        leaves=len(leaves),
        ring_node_hops=node_hops,
        ring_leaf_hops=leaf_hops,
    )


def group_spans(layout: Layout, rank_order: list[int], fabric: Fabric) -> dict[str, GroupSpan]:
    """The worst span of each axis's groups (most leaf hops, then most domains)."""
    out = {}
    for axis, grps in groups(layout, rank_order).items():
        spans = [span_of(g, fabric) for g in grps]
        out[axis] = max(
            spans, key=lambda s: (s.ring_leaf_hops, s.leaves, s.domains, s.ring_node_hops)
        )
    return out


@dataclass(frozen=True)
class Traffic:
    """Bytes per optimizer step over the whole job that cross leaf switches (leave a host
    onto the network) and that cross the spine (between leaves), by axis."""

    leaf_bytes: dict[str, float]
    spine_bytes: dict[str, float]

    @property
    def leaf_gb(self) -> float:
        return sum(self.leaf_bytes.values()) / 1e9

    @property
    def spine_gb(self) -> float:
        return sum(self.spine_bytes.values()) / 1e9

    def to_json(self) -> dict:
        return {"leaf": round(self.leaf_gb, 2), "spine": round(self.spine_gb, 2)}


def _edge_bytes(c: Collective, n: int) -> float:
    if c.kind == "all_reduce":
        return 2 * c.nbytes * (n - 1) / n * c.count
    if c.kind == "p2p":
        return c.nbytes * c.count
    return c.nbytes * (n - 1) / n * c.count


def _edge_traffic(c: Collective, sp: GroupSpan) -> tuple[float, int, int]:
    """(bytes per edge, edges leaving a node, edges leaving a leaf) of one group's collective."""
    if c.kind == "p2p":
        # Stage boundaries, not a ring: a chain over n ranks (n - 1 edges).
        return (
            c.nbytes * c.count / 2,
            max(0, sp.ring_node_hops - 1),
            max(0, sp.ring_leaf_hops - 1),
        )
    return _edge_bytes(c, sp.size), sp.ring_node_hops, sp.ring_leaf_hops


def cross_switch_traffic(
    collectives: list[Collective],
    layout: Layout,
    rank_order: list[int],
    fabric: Fabric,
) -> Traffic:
    """Bytes per step crossing leaf switches and the spine for this rank order."""
    gs = groups(layout, rank_order)
    leaf: dict[str, float] = {}
    spine: dict[str, float] = {}
    span_cache: dict[str, list[GroupSpan]] = {}
    for c in collectives:
        grps = gs[c.axis]
        if c.axis not in span_cache:
            span_cache[c.axis] = [span_of(g, fabric) for g in grps]
        for sp in span_cache[c.axis]:
            n = sp.size
            if n <= 1:
                continue
            per_edge, node_edges, leaf_edges = _edge_traffic(c, sp)
            leaf[c.axis] = leaf.get(c.axis, 0.0) + per_edge * node_edges
            spine[c.axis] = spine.get(c.axis, 0.0) + per_edge * leaf_edges
    return Traffic(leaf, spine)


def planned_traffic(
    collectives: list[Collective], layout: Layout, spans: dict[str, GroupSpan]
) -> Traffic:
    """Cross-switch bytes per step from analytic spans (all groups alike): for the planner
    table, without building the rank order."""
    leaf: dict[str, float] = {}
    spine: dict[str, float] = {}
    world = layout.world_size
    for c in collectives:
        sp = spans[c.axis]
        n = sp.size
        if n <= 1:
            continue
        n_groups = world // n
        per_edge, node_edges, leaf_edges = _edge_traffic(c, sp)
        leaf[c.axis] = leaf.get(c.axis, 0.0) + per_edge * node_edges * n_groups
        spine[c.axis] = spine.get(c.axis, 0.0) + per_edge * leaf_edges * n_groups
    return Traffic(leaf, spine)


def placement_table(layout: Layout, rank_order: list[int], fabric: Fabric, limit: int = 64) -> str:
    """rank -> host -> switch path, per mesh position, and each axis's groups."""
    lines = [
        f"{'pos':>5} {'rank':>5}  {'host':<14} {'switch path':<24} {'nvlink':<10} mesh (pp,rep,shard,cp,tp)"
    ]
    shape = layout.shape()
    for pos, r in enumerate(rank_order):
        if pos >= limit:
            lines.append(f"... ({len(rank_order) - limit} more ranks)")
            break
        h = fabric.host_of(r)
        coord = np.unravel_index(pos, shape)
        lines.append(
            f"{pos:>5} {r:>5}  {h.name:<14} {'/'.join(h.switch_path):<24} {h.nvlink_domain:<10} "
            f"{tuple(int(x) for x in coord)}"
        )
    gs = groups(layout, rank_order)
    for axis in [a.value for a in MESH_ORDER] + ["fsdp"]:
        grps = gs[axis]
        if len(grps[0]) <= 1:
            continue
        lines.append(f"{axis} groups ({len(grps)} of {len(grps[0])} ranks):")
        for grp in grps[: min(len(grps), 8)]:
            sp = span_of(grp, fabric)
            hosts = sorted({fabric.host_of(r).name for r in grp}, key=natural_key)
            lines.append(
                f"  {grp if len(grp) <= 16 else str(grp[:16])[:-1] + ', ...]'}  hosts={len(hosts)} "
                f"leaves={sp.leaves} domains={sp.domains} ring leaf hops={sp.ring_leaf_hops}"
            )
        if len(grps) > 8:
            lines.append(f"  ... ({len(grps) - 8} more)")
    return "\n".join(lines)
