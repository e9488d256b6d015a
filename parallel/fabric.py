"""The concrete fabric a job runs on: hosts in launch order (node rank i is `hosts[i]`), each
with its switch path (root ... leaf) and NVLink domain. Built from a cluster profile
(`fabric_of`) or from Slurm (`launch.slurm.fabric_from_slurm`); NVLink domains of a switch
tree come from one rule, `assign_nvlink_domains`. Everything here is pure.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

from core.errors import ConfigError
from core.hostlist import expand_hostlist

if TYPE_CHECKING:
    from parallel.cluster import Cluster


@dataclass(frozen=True)
class Host:
    name: str
    switch_path: tuple[str, ...]  # root first, leaf last; () = no switch (one host)
    nvlink_domain: str

    @property
    def leaf(self) -> str:
        return self.switch_path[-1] if self.switch_path else ""

    @property
    def spine(self) -> str:
        return self.switch_path[-2] if len(self.switch_path) >= 2 else self.leaf


@dataclass(frozen=True)
class Fabric:
    """Hosts in launch order: global rank r runs on hosts[r // gpus_per_node]."""

    hosts: tuple[Host, ...]
    gpus_per_node: int

    @property
    def world_size(self) -> int:
        return len(self.hosts) * self.gpus_per_node

    def host_of(self, rank: int) -> Host:
        return self.hosts[rank // self.gpus_per_node]

    @cached_property
    def domain_gpus(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for h in self.hosts:
            out[h.nvlink_domain] = out.get(h.nvlink_domain, 0) + self.gpus_per_node
        return out

    def shuffled(self, seed: int) -> Fabric:
        """The same hosts in another launch order (what c10d rendezvous may give)."""
        import random

        hosts = list(self.hosts)
        random.Random(seed).shuffle(hosts)
        return Fabric(tuple(hosts), self.gpus_per_node)


def fabric_of(c: Cluster) -> Fabric:
    """The hosts of profile `c` in launch order (its explicit switch list, else the regular
    tree: host i under leaf i // nodes_per_leaf, NVLink domain i // nodes_per_domain, which
    may span leaves when the profile says so, as an NVL72 rack over two leaves does)."""
    t = c.topology
    if t.switches:

        def hl(expr: str, key: str) -> list[str]:
            try:
                return expand_hostlist(expr)
            except ValueError as e:
                raise ConfigError(str(e), file=c.source, key=key) from None

        hosts = hosts_from_switches(
            [
                (
                    s.name,
                    hl(s.nodes, f"topology.switches[{i}].nodes"),
                    hl(s.switches, f"topology.switches[{i}].switches"),
                )
                for i, s in enumerate(t.switches)
            ],
            blocks={
                b.name: hl(b.nodes, f"topology.nvlink_blocks[{i}].nodes")
                for i, b in enumerate(t.nvlink_blocks)
            },
            nodes_per_domain=c.nodes_per_domain,
            file=c.source,
        )
        return Fabric(tuple(hosts[: c.nodes]), c.gpus_per_node)
    npl = t.nodes_per_leaf or c.nodes
    lps = t.leaves_per_spine or max(1, -(-c.nodes // npl))
    npd = c.nodes_per_domain
    width = max(4, len(str(c.nodes - 1)))
    hosts = []
    for i in range(c.nodes):
        leaf = i // npl
        spine = leaf // lps
        hosts.append(
            Host(
                name=f"{c.host_prefix}{i:0{width}d}",
                switch_path=(f"spine{spine}", f"leaf{leaf}"),
                nvlink_domain=(f"{c.host_prefix}{i:0{width}d}" if npd == 1 else f"nvl{i // npd}"),
            )
        )
    return Fabric(tuple(hosts), c.gpus_per_node)


def hosts_from_switches(
    switches: list[tuple[str, list[str], list[str]]],
    *,
    blocks: dict[str, list[str]] | None = None,
    nodes_per_domain: int = 1,
    file: str | None = None,
    key: str = "topology.switches",
) -> list[Host]:
    """Hosts (in the order the leaves list them) with root..leaf paths from a switch tree."""
    parent: dict[str, str] = {}
    names = {s[0] for s in switches}
    listed = [s[0] for s in switches]
    if "" in names:
        raise ConfigError("a switch without a name", file=file, key=key)
    dup = sorted({n for n in listed if listed.count(n) > 1}) if len(names) < len(listed) else []
    if dup:  # two switches of one name: which children and hosts are whose is unknown
        raise ConfigError(f"duplicate switch names: {dup}", file=file, key=key)
    for name, _, children in switches:
        for ch in children:
            if ch not in names:
                raise ConfigError(
                    f"switch {name} lists unknown child switch {ch!r}", file=file, key=key
                )
            if ch in parent and parent[ch] != name:
                raise ConfigError(
                    f"switch {ch} has two parents ({parent[ch]}, {name})", file=file, key=key
                )
            parent[ch] = name
    cycle = _cycle(parent)
    if cycle:
        # A tree has none; every switch is checked, not only those above a leaf, so a loop
        # off to the side is refused too (it would otherwise be ignored silently).
        raise ConfigError(f"switch cycle: {' -> '.join(cycle)}", file=file, key=key)

    def path(sw: str) -> tuple[str, ...]:
        out = [sw]
        seen = {sw}
        while out[-1] in parent:
            nxt = parent[out[-1]]
            if nxt in seen:
                raise ConfigError(f"switch cycle through {nxt}", file=file, key=key)
            seen.add(nxt)
            out.append(nxt)
        return tuple(reversed(out))

    host_domain: dict[str, str] = {}
    for bname, members in (blocks or {}).items():
        for h in members:
            if h in host_domain:
                raise ConfigError(f"host {h} is in two NVLink blocks", file=file, key=key)
            host_domain[h] = bname
    placed: list[tuple[str, tuple[str, ...]]] = []
    seen_hosts: set[str] = set()
    for name, nodes, children in switches:
        # Upper-level switches in `scontrol show topology` repeat their subtree's nodes;
        # only a leaf (no child switches) places a host.
        if children:
            continue
        for h in nodes:
            if h in seen_hosts:
                raise ConfigError(f"host {h} is under two leaf switches", file=file, key=key)
            seen_hosts.add(h)
            placed.append((h, path(name)))
    return assign_nvlink_domains(placed, nodes_per_domain=nodes_per_domain, blocks=host_domain)


def _cycle(parent: Mapping[str, str]) -> list[str]:
    """A cycle of the child -> parent map (its switches, the first repeated at the end), or
    []. Linear time: each switch is walked once."""
    done: set[str] = set()
    for start in parent:
        walk: list[str] = []
        on_walk: set[str] = set()
        sw: str | None = start
        while sw is not None and sw not in done:
            if sw in on_walk:
                return [*walk[walk.index(sw) :], sw]
            walk.append(sw)
            on_walk.add(sw)
            sw = parent.get(sw)
        done.update(walk)
    return []


def assign_nvlink_domains(
    hosts: Sequence[tuple[str, tuple[str, ...]]],
    *,
    nodes_per_domain: int,
    blocks: Mapping[str, str] | None = None,
) -> list[Host]:
    """NVLink domains for hosts of a switch tree, given as (name, switch path) in listing order.

    The one rule for every tree that does not number its hosts itself (a profile's switch
    list, `scontrol show topology`, SLURM_TOPOLOGY_ADDR): a host named in a block takes the
    block's name; with one host per domain a host is its own domain; otherwise the hosts
    under each leaf, counted per leaf in listing order, form domains of `nodes_per_domain`
    hosts named "<leaf>/nvl<k>". A domain therefore never spans a leaf, and a host's domain
    does not depend on how many hosts earlier leaves hold.
    """
    blocks = blocks or {}
    per_leaf: dict[str, int] = {}
    out = []
    for name, path in hosts:
        leaf = path[-1] if path else ""
        if name in blocks:
            dom = blocks[name]
        elif nodes_per_domain == 1:
            dom = name
        else:
            k = per_leaf.get(leaf, 0)
            per_leaf[leaf] = k + 1
            dom = f"{leaf}/nvl{k // nodes_per_domain}"
        out.append(Host(name, path, dom))
    return out
