"""Startup placement check: after the process group starts, every rank says where it runs
(host, NVLink domain, switch path); a tp or cp group that spans NVLink domains stops the
run with a message naming the group and its hosts, and rank 0 logs a one-screen summary.

Where each rank's facts come from (first that is set):
- host: SLURMD_NODENAME (Slurm; `hostname` can be shared by emulated nodes), else the
  machine's hostname;
- NVLink domain: TITANSCALE_NVLINK_DOMAIN (a launcher can set it from the GPU fabric's
  clique id on NVL72), else the cluster profile's fabric for that host, else the host;
- switch path: SLURM_TOPOLOGY_ADDR ("spine.leaf1.node1"), else the profile's fabric.

`check_placement` and `placement_summary` are pure (tested without processes);
`startup_check` adds the all-gather.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping

from core.axes import Layout
from launch.slurm import parse_topology_addr
from parallel.fabric import Fabric
from parallel.placement import PlacementError, RankPlace, group_places, nvlink_violation

DOMAIN_ENV = "TITANSCALE_NVLINK_DOMAIN"


def local_rank_info(
    rank: int, env: Mapping[str, str] | None = None, fabric: Fabric | None = None
) -> RankPlace:
    env = os.environ if env is None else env
    host = env.get("SLURMD_NODENAME") or socket.gethostname()
    known = {h.name: h for h in fabric.hosts} if fabric else {}
    path: tuple[str, ...] = ()
    if env.get("SLURM_TOPOLOGY_ADDR"):
        path, _ = parse_topology_addr(
            env["SLURM_TOPOLOGY_ADDR"], env.get("SLURM_TOPOLOGY_ADDR_PATTERN", "")
        )
    elif host in known:
        path = known[host].switch_path
    domain = env.get(DOMAIN_ENV) or (known[host].nvlink_domain if host in known else host)
    return RankPlace(rank=rank, host=host, nvlink_domain=domain, switch_path=path)


def check_placement(infos: list[RankPlace], layout: Layout, rank_order: list[int]) -> None:
    """Raise PlacementError if any tp or cp group spans NVLink domains."""
    by_rank = {i.rank: i for i in infos}
    bad = nvlink_violation(layout, rank_order, by_rank)
    if bad is not None:
        grp = list(bad.ranks)
        where = ", ".join(f"rank {r} on {by_rank[r].host}" for r in grp[:16])
        raise PlacementError(
            f"{bad.axis} group {grp} spans {len(bad.domains)} NVLink domains "
            f"({', '.join(sorted(bad.domains))}): {where}. {bad.axis} collectives would cross "
            "the network every layer; launch with the planned rank order "
            "(parallel.placement.planned_rank_order) or lower tp/cp"
        )


def placement_summary(
    infos: list[RankPlace], layout: Layout, rank_order: list[int], max_hosts: int = 8
) -> str:
    """A one-screen summary: hosts and switches, and how each axis's groups lie."""
    by_rank = {i.rank: i for i in infos}
    hosts: dict[str, list[int]] = {}
    for i in sorted(infos, key=lambda i: i.rank):
        hosts.setdefault(i.host, []).append(i.rank)
    leaves = {i.switch_path[-1] if i.switch_path else "-" for i in infos}
    doms = {i.nvlink_domain for i in infos}
    lines = [
        f"placement: {layout.describe()} on {len(infos)} ranks, {len(hosts)} hosts, "
        f"{len(doms)} NVLink domains, {len(leaves)} leaf switches",
    ]
    gp = group_places(layout, rank_order, by_rank)
    for axis in ("tp", "cp", "dp_shard", "dp_replicate", "pp"):
        grps = gp[axis]
        if len(grps[0].ranks) <= 1:
            continue
        n_hosts = [len(g.hosts) for g in grps]
        n_leaves = [len(g.leaves) or 1 for g in grps]  # an unknown leaf counts as one ("-")
        n_doms = [len(g.domains) for g in grps]
        ok = "" if axis not in ("tp", "cp") or max(n_doms) == 1 else "  <-- spans NVLink domains"
        lines.append(
            f"  {axis:<12} {len(grps):>5} groups of {len(grps[0].ranks):>4}: hosts {min(n_hosts)}-"
            f"{max(n_hosts)}, leaves {min(n_leaves)}-{max(n_leaves)}, NVLink domains "
            f"{min(n_doms)}-{max(n_doms)}{ok}"
        )
    pos = {r: i for i, r in enumerate(rank_order)}
    for k, (h, ranks) in enumerate(hosts.items()):
        if k == max_hosts:
            lines.append(f"  ... {len(hosts) - max_hosts} more hosts")
            break
        info = by_rank[ranks[0]]
        lines.append(
            f"  {h:<16} {'/'.join(info.switch_path) or '-':<20} ranks {_ranges(ranks)} "
            f"-> mesh positions {_ranges(sorted(pos[r] for r in ranks))}"
        )
    return "\n".join(lines)


def _ranges(xs: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    out: list[str] = []
    i = 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        out.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ",".join(out)


def gather_rank_info(info: RankPlace, group=None) -> list[RankPlace]:
    import torch.distributed as dist

    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, info, group=group)
    return out  # type: ignore[return-value]


def startup_check(
    parallel_dims, fabric: Fabric | None = None, env: Mapping[str, str] | None = None
) -> str:
    """Gather every rank's placement, raise PlacementError on a bad tp/cp group, return
    the summary (log it on rank 0). Call after `parallel_dims.build_mesh()`."""
    import torch.distributed as dist

    rank = dist.get_rank()
    infos = gather_rank_info(local_rank_info(rank, env, fabric))
    layout = Layout.of(parallel_dims)
    world_mesh = getattr(parallel_dims, "_world_mesh", None)
    if world_mesh is not None:
        order = [int(r) for r in world_mesh.mesh.flatten().tolist()]
    else:
        order = list(range(layout.world_size))
    check_placement(infos, layout, order)
    return placement_summary(infos, layout, order)
