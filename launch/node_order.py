"""The job's nodes in the planner's order, from what the job script gathered.

GATHERED holds ``<SLURMD_NODENAME> <SLURM_TOPOLOGY_ADDR>`` lines, one per node, written by
the job script's gathering ``srun``. Switch paths come from those addresses, else from
`scontrol show topology` (a topology plugin that leaves the variable unset), else from the
profile's regular topology. With a profile and a layout the order is
`parallel.placement.node_order(layout, fabric)`, which also refuses a layout whose tp x cp
groups cannot stay inside an NVLink domain. The command line is `tools.node_order`.
"""

from __future__ import annotations

import re

from core.errors import ConfigError, shown
from launch.topology import topology_order


def read_gathered(text: str, file: str = "gathered node list") -> list[tuple[str, str]]:
    """(node, switch path) per line. Node names are written back into the order file that the
    job script reads (`head -n 1` = MASTER_ADDR, `grep -x` = node rank), so each is checked
    as a host name, and a path as dot-separated switch names (ConfigError naming the line)."""
    entries = []
    # str.splitlines also breaks at U+2028/U+0085, which `grep -x` would not: split on \n only.
    for lineno, line in enumerate(text.split("\n"), 1):
        # Split on ASCII blanks only: str.split also splits at U+2028 / U+0085.
        parts = [t for t in re.split(r"[ \t]+", line.strip(" \t\r")) if t]
        if not parts:
            continue
        node, addr = parts[0], parts[1] if len(parts) > 1 else ""
        if len(parts) > 2 or not _HOST.fullmatch(node) or (addr and not _ADDR.fullmatch(addr)):
            raise ConfigError(
                f"expected '<host name> [<spine.leaf.node>]' (letters, digits, '_', '.', '-'), "
                f"got {shown(line)}",
                file=file,
                key=f"line {lineno}",
            )
        entries.append((node, addr))
    return entries


_HOST = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,252}")
_ADDR = re.compile(r"[A-Za-z0-9_.-]{1,1024}")


def order_nodes(
    gathered: str,
    scontrol_topology: str = "",
    cluster=None,
    layout=None,
    file: str = "gathered node list",
) -> tuple[list[str], dict[str, str]]:
    """(nodes in the planner's order, node -> switch path used, dot-joined)."""
    from core.axes import Layout
    from launch.slurm import fabric_from_slurm
    from parallel.placement import node_order

    entries = read_gathered(gathered, file)
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
