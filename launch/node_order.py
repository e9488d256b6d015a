"""The job's nodes in the planner's order, from what the job script gathered.

GATHERED holds ``<SLURMD_NODENAME> <SLURM_TOPOLOGY_ADDR>`` lines, one per node, written by
the job script's gathering ``srun``. Switch paths come from those addresses, else from
`scontrol show topology` (a topology plugin that leaves the variable unset), else from the
profile's regular topology. With a profile and a layout the order is
`parallel.placement.node_order(layout, fabric)`, which also refuses a layout whose tp x cp
groups cannot stay inside an NVLink domain. The command line is `tools.node_order`.
"""

from __future__ import annotations

from core.errors import ConfigError
from launch.topology import topology_order


def read_gathered(text: str) -> list[tuple[str, str]]:
    entries = []
    for line in text.splitlines():
        parts = line.split()
        if parts:
            entries.append((parts[0], parts[1] if len(parts) > 1 else ""))
    return entries


def order_nodes(
    gathered: str, scontrol_topology: str = "", cluster=None, layout=None
) -> tuple[list[str], dict[str, str]]:
    """(nodes in the planner's order, node -> switch path used, dot-joined)."""
    from core.axes import Layout
    from launch.slurm import fabric_from_slurm
    from parallel.placement import node_order

    entries = read_gathered(gathered)
    names = list(dict.fromkeys(n for n, _ in entries))
    addrs = {n: a for n, a in entries if "." in a}
    topo = scontrol_topology if scontrol_topology.strip() else None
    if topo is not None:
        try:
            from launch.slurm import parse_scontrol_topology

            parse_scontrol_topology(topo)
        except ConfigError:
            topo = None  # no switch lines: nothing to learn from it
    if cluster is None:
        if not addrs and topo:
            from launch.topology import addresses_from_scontrol_topology

            addrs = addresses_from_scontrol_topology(topo, names)
        order = topology_order([(n, addrs.get(n, "")) for n in names])
        return order, {n: addrs.get(n, "") for n in order}
    fabric = fabric_from_slurm(
        cluster,
        nodelist=",".join(names),
        topology_text=None if addrs else topo,
        topology_addrs={n: addrs[n] for n in names if n in addrs} or None,
    )
    if layout is None:
        layout = Layout(dp_shard=fabric.world_size)
    order = node_order(layout, fabric)
    path = {h.name: ".".join((*h.switch_path, h.name)) for h in fabric.hosts}
    return order, path
