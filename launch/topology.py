"""Node order for a Slurm job: the planner's host order, from Slurm's switch paths.

torchrun's c10d rendezvous numbers nodes in arrival order, and SLURM_NODEID follows the
node names; neither knows the switches. The launcher gives node i of
`parallel.placement.node_order` (hosts sorted by switch path, e.g. Slurm's
``SLURM_TOPOLOGY_ADDR`` = ``spine1.leaf07.gpu-042``, then NVLink domain, then name) node rank
i, so consecutive node ranks, and therefore consecutive global ranks under torchrun's
static rendezvous, share a leaf: the mesh's inner axes (tp, cp, dp_shard) stay under as few
switches as the allocation allows, and plain rank order is the planned placement.

Pure functions (no Slurm calls): the job script gathers ``<node> <address>`` lines with one
``srun`` task per node and runs ``python -m tools.node_order`` on them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from core.axes import Layout
from core.errors import ConfigError
from launch.slurm import parse_scontrol_topology
from parallel.fabric import Fabric, Host
from parallel.placement import node_order

__all__ = [
    "addresses_from_scontrol_topology",
    "host_from_address",
    "leaf_of",
    "leaf_switches_needed",
    "replica_group_nodes",
    "topology_order",
]


def addresses_from_scontrol_topology(text: str, nodes: Iterable[str]) -> dict[str, str]:
    """Rebuild each node's SLURM_TOPOLOGY_ADDR-style path from `scontrol show topology`.

    Each node's leaf is the lowest-level switch (one without child switches) that lists it;
    the path climbs through the switches whose ``Switches=`` name the one below. Nodes no
    leaf lists are left out; text without switch lines gives {}.
    """
    try:
        topo = parse_scontrol_topology(text)
    except ConfigError:
        return {}
    parent = {child: name for name, _, children in topo.switches for child in children}
    leaf_of_node: dict[str, str] = {}
    for name, members, children in topo.switches:
        if not children:
            for node in members:
                leaf_of_node.setdefault(node, name)
    out: dict[str, str] = {}
    for node in nodes:
        sw = leaf_of_node.get(node)
        if sw is None:
            continue
        path, seen = [node], set()
        while sw is not None and sw not in seen:
            seen.add(sw)
            path.append(sw)
            sw = parent.get(sw)
        out[node] = ".".join(reversed(path))
    return out


def host_from_address(node: str, address: str) -> Host:
    """A planner Host from SLURM_TOPOLOGY_ADDR ('spine.leaf1.node1' -> path (spine, leaf1)).

    Without topology/tree Slurm sets the address to the node name alone: no switch path.
    """
    parts = address.split(".") if address else []
    path = tuple(parts[:-1]) if len(parts) > 1 else ()
    return Host(name=node, switch_path=path, nvlink_domain=node)


def topology_order(entries: Sequence[tuple[str, str]]) -> list[str]:
    """Node names in the planner's order, from ``(node, SLURM_TOPOLOGY_ADDR)`` pairs.

    One ordering for the whole project: `parallel.placement.node_order` (hosts by switch
    path, then NVLink domain, then name), here with one NVLink domain per node. Duplicated
    nodes (one line per task) count once, the entry with a switch path winning. The
    result is deterministic, so every node computes the same order.
    """
    best: dict[str, str] = {}
    for node, addr in entries:
        node = node.strip()
        if not node:
            continue
        addr = (addr or "").strip()
        if node not in best or ("." in addr and "." not in best[node]):
            best[node] = addr
    if not best:
        return []
    hosts = tuple(host_from_address(n, a) for n, a in best.items())
    return node_order(Layout(dp_shard=len(hosts)), Fabric(hosts, gpus_per_node=1))


def leaf_of(address: str) -> str:
    """The leaf switch in an address ('spine.leaf2.node3' -> 'leaf2'); '' without one."""
    parts = address.split(".")
    return parts[-2] if len(parts) >= 2 else ""


def leaf_switches_needed(nodes: int, nodes_per_leaf: int) -> int:
    """Fewest leaf switches that can hold `nodes` nodes (what `sbatch --switches` asks for)."""
    if nodes < 1 or nodes_per_leaf < 1:
        raise ValueError(f"nodes ({nodes}) and nodes_per_leaf ({nodes_per_leaf}) must be >= 1")
    return -(-nodes // nodes_per_leaf)


def replica_group_nodes(order: Sequence[str], groups: int) -> list[list[str]]:
    """torchft replica group g's nodes: the g-th run of len(order) / groups consecutive nodes
    of the planner's order (`topology_order`), so a group sits under as few leaf switches as
    the allocation allows (one leaf when a leaf holds whole groups) and its torchrun's node
    ranks follow the same order. ValueError unless the nodes split evenly."""
    if groups < 1 or len(order) % groups:
        raise ValueError(f"{len(order)} nodes do not split into {groups} replica groups")
    k = len(order) // groups
    return [list(order[g * k : (g + 1) * k]) for g in range(groups)]
