"""Slurm's views of a job, parsed: `scontrol show topology` text, SLURM_TOPOLOGY_ADDR, and the
job's fabric from them (`fabric_from_slurm`). Pure functions; no Slurm calls. The hostlist
syntax itself is `core.hostlist` (cluster profiles use it too).
"""

from __future__ import annotations

from dataclasses import dataclass

from core.errors import ConfigError
from core.hostlist import expand_hostlist
from core.launch_env import parse_topology_addr
from parallel.cluster import Cluster
from parallel.fabric import Fabric, Host, assign_nvlink_domains, hosts_from_switches


@dataclass(frozen=True)
class SlurmTopology:
    """`scontrol show topology`: switches (name, nodes, child switches) and NVLink blocks."""

    switches: tuple[tuple[str, tuple[str, ...], tuple[str, ...]], ...]
    blocks: tuple[tuple[str, tuple[str, ...]], ...] = ()


def parse_scontrol_topology(text: str) -> SlurmTopology:
    """Parse `scontrol show topology` (tree plugin SwitchName=..., block plugin BlockName=)."""
    switches = []
    blocks = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        fields = dict(_kv(tok) for tok in line.split())
        try:
            if "SwitchName" in fields:
                switches.append(
                    (
                        fields["SwitchName"],
                        tuple(expand_hostlist(fields.get("Nodes", ""))),
                        tuple(expand_hostlist(fields.get("Switches", ""))),
                    )
                )
            elif "BlockName" in fields:
                blocks.append(
                    (fields["BlockName"], tuple(expand_hostlist(fields.get("Nodes", ""))))
                )
        except ValueError as e:
            raise ConfigError(f"line {lineno}: {e}", file="scontrol show topology") from None
    if not switches and not blocks:
        raise ConfigError(
            "no SwitchName= or BlockName= lines (is a topology plugin configured?)",
            file="scontrol show topology",
        )
    return SlurmTopology(tuple(switches), tuple(blocks))


def _kv(tok: str) -> tuple[str, str]:
    k, _, v = tok.partition("=")
    return k, v


def fabric_from_slurm(
    cluster: Cluster,
    *,
    nodelist: str | None = None,
    topology_text: str | None = None,
    topology_addrs: dict[str, str] | None = None,
) -> Fabric:
    """The job's fabric from Slurm: hosts in `SLURM_JOB_NODELIST` order (node rank order).

    Switch paths come from `topology_addrs` (host -> SLURM_TOPOLOGY_ADDR, gathered from
    each node) or else from `scontrol show topology` text; hosts that neither source knows
    get the profile's regular topology by position. NVLink domains follow the one rule of
    `parallel.fabric.assign_nvlink_domains`: a host that the topology text places keeps
    the domain it has in the whole tree (as the profile's own switch list would give it);
    the others are grouped per leaf in node-list order.
    """
    hosts_from_topo: dict[str, Host] = {}
    blocks: dict[str, list[str]] = {}
    if topology_text:
        topo = parse_scontrol_topology(topology_text)
        blocks = {n: list(m) for n, m in topo.blocks}
        if topo.switches:
            for h in hosts_from_switches(
                [(n, list(m), list(c)) for n, m, c in topo.switches],
                blocks=blocks,
                nodes_per_domain=cluster.nodes_per_domain,
                file="scontrol show topology",
            ):
                hosts_from_topo[h.name] = h
    try:
        names = expand_hostlist(nodelist) if nodelist else None
    except ValueError as e:
        raise ConfigError(str(e), file="slurm", key="SLURM_JOB_NODELIST") from None
    if names is None:
        if topology_addrs:
            names = list(topology_addrs)
        elif hosts_from_topo:
            names = list(hosts_from_topo)
        else:
            raise ConfigError("no node list and no topology to take hosts from", file="slurm")
    if len(set(names)) != len(names):
        raise ConfigError(
            "a host appears twice in the node list", file="slurm", key="SLURM_JOB_NODELIST"
        )
    regular = cluster.with_nodes(len(names)).fabric() if not cluster.topology.switches else None
    placed: list[tuple[str, tuple[str, ...]]] = []
    for i, name in enumerate(names):
        path: tuple[str, ...]
        if topology_addrs and name in topology_addrs:
            path, node = parse_topology_addr(topology_addrs[name])
            if node != name:
                raise ConfigError(
                    f"SLURM_TOPOLOGY_ADDR of {name} names node {node!r}",
                    file="environment",
                    key="SLURM_TOPOLOGY_ADDR",
                )
        elif name in hosts_from_topo:
            path = hosts_from_topo[name].switch_path
        elif regular is not None:
            path = regular.hosts[i].switch_path
        else:
            path = ()
        placed.append((name, path))
    in_tree = {
        name
        for name, path in placed
        if name in hosts_from_topo and hosts_from_topo[name].switch_path == path
    }
    others = assign_nvlink_domains(
        [p for p in placed if p[0] not in in_tree],
        nodes_per_domain=cluster.nodes_per_domain,
        blocks={h: b for b, members in blocks.items() for h in members},
    )
    by_name = {h.name: h for h in others} | {n: hosts_from_topo[n] for n in in_tree}
    return Fabric(tuple(by_name[n] for n in names), cluster.gpus_per_node)
