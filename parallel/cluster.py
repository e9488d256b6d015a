"""Cluster profiles (`clusters/*.toml`) and the concrete host fabric a job runs on.

A profile describes the hardware (GPU kind, GPUs per node, NVLink domain, link speeds), the
switch tree ([topology]: regular `nodes_per_leaf`/`leaves_per_spine`, or an explicit switch
list in Slurm's topology.conf style) and the NCCL environment for the fabric ([nccl]).

`Cluster.fabric()` turns a profile into a `Fabric`: the hosts in launch order (node rank i
is `hosts[i]`), each with its switch path (root ... leaf) and NVLink domain. At launch the
same object can come from Slurm instead (`fabric_from_slurm`: `scontrol show topology`
text, per-node `SLURM_TOPOLOGY_ADDR`, `SLURM_JOB_NODELIST`). Everything here is pure.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Literal

from parallel.hardware import GPUS
from recipe.errors import ConfigError
from recipe.toml_schema import apply_override, build_dataclass, doc, read_with_bases

CLUSTERS_DIR = Path(__file__).resolve().parent.parent / "clusters"

GpuKind = Literal["H100", "H200", "B200", "GB200", "cpu"]
Fabric_ = Literal["infiniband", "roce", "efa", "ethernet", "none"]

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass
class SwitchSpec:
    """One switch, as Slurm's topology.conf writes it (SwitchName= Nodes= / Switches=)."""

    name: str = field(default="", metadata=doc("Switch name."))
    nodes: str = field(
        default="", metadata=doc("Hosts directly under this switch (Slurm hostlist, a leaf).")
    )
    switches: str = field(
        default="", metadata=doc("Child switches (Slurm hostlist of switch names).")
    )

    def __post_init__(self) -> None:
        if not self.name:
            raise ConfigError("every switch needs a name", key="name")
        if self.nodes and self.switches:
            raise ConfigError(
                "a switch lists either nodes (a leaf) or switches, not both", key="nodes"
            )


@dataclass
class BlockSpec:
    """An NVLink domain spanning several hosts (an NVL72 rack; Slurm's BlockName=)."""

    name: str = field(default="", metadata=doc("Domain name."))
    nodes: str = field(default="", metadata=doc("Hosts in this NVLink domain (hostlist)."))


@dataclass
class TopologySection:
    nodes_per_leaf: int = field(
        default=0, metadata=doc("Hosts under each leaf switch; 0 = all under one leaf.")
    )
    leaves_per_spine: int = field(
        default=0, metadata=doc("Leaf switches under each spine; 0 = all under one spine.")
    )
    oversubscription: float = field(
        default=1.0,
        metadata=doc(
            "Leaf downlink:uplink bandwidth ratio (1 = non-blocking fat tree). Traffic "
            "that leaves a leaf gets 1/oversubscription of the per-GPU network bandwidth."
        ),
    )
    switches: list[SwitchSpec] = field(
        default_factory=list,
        metadata=doc("Explicit switch tree instead of the regular one (topology.conf style)."),
    )
    nvlink_blocks: list[BlockSpec] = field(
        default_factory=list,
        metadata=doc("Explicit multi-host NVLink domains (with `switches`; NVL72 racks)."),
    )

    def __post_init__(self) -> None:
        for name in ("nodes_per_leaf", "leaves_per_spine"):
            if getattr(self, name) < 0:
                raise ConfigError(f"expected >= 0, got {getattr(self, name)}", key=name)
        if self.oversubscription < 1.0:
            raise ConfigError(
                f"expected >= 1 (1 = non-blocking), got {self.oversubscription}",
                key="oversubscription",
            )
        if self.switches and (self.nodes_per_leaf or self.leaves_per_spine):
            raise ConfigError(
                "give either nodes_per_leaf/leaves_per_spine or an explicit switch list",
                key="switches",
            )
        names = [s.name for s in self.switches]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ConfigError(f"duplicate switch names: {sorted(dup)}", key="switches")


@dataclass
class NcclSection:
    fabric: Fabric_ = field(
        default="infiniband", metadata=doc("Inter-node fabric the NCCL settings are for.")
    )
    env: dict[str, str] = field(
        default_factory=dict,
        metadata=doc("Environment set for every rank at launch (NCCL_*, FI_*, UCX_* ...)."),
    )

    def __post_init__(self) -> None:
        for k in self.env:
            if not _ENV_NAME.match(k):
                raise ConfigError(f"not an environment variable name: {k!r}", key=f"env.{k}")


@dataclass
class Cluster:
    """A cluster profile. Bandwidths in gigabits per second per GPU per direction."""

    name: str = field(default="", metadata=doc("Profile name (defaults to the file stem)."))
    description: str = field(default="", metadata=doc("Free text."))
    gpu: GpuKind = field(default="H100", metadata=doc("GPU kind: H100, H200, B200, GB200, cpu."))
    nodes: int = field(default=1, metadata=doc("Hosts in the cluster (or in the job)."))
    gpus_per_node: int = field(default=8, metadata=doc("GPUs (ranks) per host."))
    nvlink_domain_gpus: int = field(
        default=0,
        metadata=doc(
            "GPUs sharing one NVLink domain: 8 for HGX, 72 for NVL72; 0 = one host. A "
            "multiple of gpus_per_node."
        ),
    )
    nvlink_gbps: float = field(
        default=0.0,
        metadata=doc("NVLink Gb/s per GPU per direction (0 = the GPU's datasheet value)."),
    )
    ib_gbps_per_gpu: float = field(
        default=400.0, metadata=doc("Inter-node network Gb/s per GPU (one rail NIC per GPU).")
    )
    hbm_gib: float = field(
        default=0.0, metadata=doc("Usable GPU memory, GiB (0 = the GPU's datasheet value).")
    )
    power_limit_w: float = field(
        default=0.0,
        metadata=doc("GPU power cap, W (0 = the GPU's TDP); a lower cap lowers clocks."),
    )
    host_prefix: str = field(
        default="node", metadata=doc("Host names for a regular topology: <prefix>0000 ...")
    )
    topology: TopologySection = field(default_factory=TopologySection)
    nccl: NcclSection = field(default_factory=NcclSection)
    source: str = field(default="<defaults>", init=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("nodes", "gpus_per_node"):
            if getattr(self, name) < 1:
                raise ConfigError(f"expected a positive value, got {getattr(self, name)}", key=name)
        for name in ("nvlink_domain_gpus",):
            if getattr(self, name) < 0:
                raise ConfigError(f"expected >= 0, got {getattr(self, name)}", key=name)
        for name in ("nvlink_gbps", "ib_gbps_per_gpu", "hbm_gib", "power_limit_w"):
            if getattr(self, name) < 0:
                raise ConfigError(f"expected >= 0, got {getattr(self, name)}", key=name)
        if self.nvlink_domain_gpus == 0:
            self.nvlink_domain_gpus = self.gpus_per_node
        if self.nvlink_domain_gpus % self.gpus_per_node:
            raise ConfigError(
                f"an NVLink domain of {self.nvlink_domain_gpus} GPUs must hold whole hosts of "
                f"{self.gpus_per_node} GPUs",
                key="nvlink_domain_gpus",
            )
        if self.gpu != "cpu" and self.ib_gbps_per_gpu == 0 and self.nodes > 1:
            raise ConfigError(
                "a multi-node GPU cluster needs a network bandwidth", key="ib_gbps_per_gpu"
            )

    # --- derived numbers -------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def nodes_per_domain(self) -> int:
        return self.nvlink_domain_gpus // self.gpus_per_node

    @property
    def hbm_bytes(self) -> float:
        gib = self.hbm_gib or GPUS[self.gpu].hbm_gib
        return gib * 2**30

    @property
    def nvlink_bytes_per_s(self) -> float:
        """NVLink bandwidth per GPU per direction, bytes/s (0 for CPU hosts)."""
        return (self.nvlink_gbps or GPUS[self.gpu].nvlink_gbps) * 1e9 / 8

    @property
    def net_bytes_per_s(self) -> float:
        """Inter-node bandwidth per GPU per direction, bytes/s."""
        return self.ib_gbps_per_gpu * 1e9 / 8

    @property
    def power_fraction(self) -> float:
        tdp = GPUS[self.gpu].tdp_w
        if not self.power_limit_w or not tdp:
            return 1.0
        return min(1.0, self.power_limit_w / tdp)

    def with_nodes(self, nodes: int) -> Cluster:
        if nodes < 1:
            raise ConfigError(f"expected a positive node count, got {nodes}", key="nodes")
        if self.topology.switches:
            have = len(self.fabric().hosts)
            if nodes > have:
                raise ConfigError(
                    f"{nodes} nodes requested but the switch list names only {have} hosts",
                    file=self.source,
                    key="nodes",
                )
        c = dataclasses.replace(self, nodes=nodes)
        c.source = self.source
        return c

    def fabric(self) -> Fabric:
        """The hosts of this profile in launch order, with switch paths and NVLink domains."""
        return _fabric_of(self)


# ----------------------------------------------------------------------------------------
# The concrete fabric


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


def _fabric_of(c: Cluster) -> Fabric:
    t = c.topology
    if t.switches:

        def hl(expr: str, key: str) -> list[str]:
            try:
                return expand_hostlist(expr)
            except ValueError as e:
                raise ConfigError(str(e), file=c.source, key=key) from None

        hosts = _hosts_from_switches(
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


def _hosts_from_switches(
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
    hosts: list[Host] = []
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
            hosts.append(Host(h, path(name), ""))
    out = []
    for i, host in enumerate(hosts):
        dom = host_domain.get(host.name) or (
            host.name if nodes_per_domain == 1 else f"{host.leaf}/nvl{i // nodes_per_domain}"
        )
        out.append(Host(host.name, host.switch_path, dom))
    return out


# ----------------------------------------------------------------------------------------
# Loading profiles


def resolve_cluster_path(path_or_name: str | Path) -> Path:
    """A path, or a profile name from clusters/ ("hgx_h100_ib")."""
    p = Path(path_or_name)
    if p.exists() or p.suffix == ".toml" or "/" in str(path_or_name):
        return p
    cand = CLUSTERS_DIR / f"{path_or_name}.toml"
    if cand.exists():
        return cand
    from recipe.errors import did_you_mean

    known = sorted(f.stem for f in CLUSTERS_DIR.glob("*.toml"))
    hint = did_you_mean(str(path_or_name), known)
    raise ConfigError(
        f"no cluster profile named {str(path_or_name)!r}{hint}; known: {', '.join(known)}",
        file=str(path_or_name),
    )


def load_cluster(
    path: str | Path, nodes: int | None = None, overrides: tuple[str, ...] | list[str] = ()
) -> Cluster:
    """Load a profile (path or name in clusters/), optionally for a job of `nodes` hosts."""
    p = resolve_cluster_path(path)
    data = read_with_bases(p)
    for o in overrides:
        data = apply_override(data, o, Cluster, source="--cluster-set")
    data.setdefault("name", p.stem)
    cluster = build_dataclass(Cluster, data, file=str(p), prefix="")
    cluster.source = str(p)
    if cluster.topology.switches:
        fab = cluster.fabric()
        if len(fab.hosts) < cluster.nodes:
            raise ConfigError(
                f"nodes = {cluster.nodes} but the switch list names {len(fab.hosts)} hosts",
                file=str(p),
                key="nodes",
            )
    if nodes is not None:
        cluster = cluster.with_nodes(nodes)
    return cluster


# ----------------------------------------------------------------------------------------
# Slurm


def expand_hostlist(expr: str) -> list[str]:
    """Expand a Slurm hostlist ("gpu[001-003,7],cpu1") in order; ValueError on bad syntax."""
    expr = expr.strip()
    if not expr:
        return []
    parts: list[str] = []
    depth = 0
    cur = ""
    for ch in expr:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in hostlist {expr!r}")
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if depth:
        raise ValueError(f"unbalanced '[' in hostlist {expr!r}")
    parts.append(cur)
    out: list[str] = []
    for part in parts:
        part = part.strip()
        if part:
            out.extend(_expand_one(part, expr))
    return out


def _expand_one(part: str, whole: str) -> list[str]:
    m = re.search(r"\[([^\[\]]*)\]", part)
    if not m:
        return [part]
    head, tail = part[: m.start()], part[m.end() :]
    values: list[str] = []
    for rng in m.group(1).split(","):
        rng = rng.strip()
        if "-" in rng:
            lo, hi = rng.split("-", 1)
            if not (lo.isdigit() and hi.isdigit()) or int(hi) < int(lo):
                raise ValueError(f"bad range {rng!r} in hostlist {whole!r}")
            width = len(lo) if lo.startswith("0") else 0
            values.extend(f"{i:0{width}d}" for i in range(int(lo), int(hi) + 1))
        elif rng.isdigit():
            values.append(rng)
        else:
            raise ValueError(f"bad entry {rng!r} in hostlist {whole!r}")
    out = []
    for v in values:
        out.extend(_expand_one(head + v + tail, whole))
    return out


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


def parse_topology_addr(addr: str, pattern: str = "") -> tuple[tuple[str, ...], str]:
    """`SLURM_TOPOLOGY_ADDR` ("spine.leaf1.node1") -> (("spine", "leaf1"), "node1").

    With `SLURM_TOPOLOGY_ADDR_PATTERN` ("switch.switch.node") the fields are checked.
    """
    parts = addr.split(".")
    if pattern:
        kinds = pattern.split(".")
        if len(kinds) != len(parts) or kinds[-1] != "node":
            raise ConfigError(
                f"SLURM_TOPOLOGY_ADDR {addr!r} does not match pattern {pattern!r}",
                file="environment",
                key="SLURM_TOPOLOGY_ADDR",
            )
    if not parts[-1]:
        raise ConfigError(
            f"empty node name in {addr!r}", file="environment", key="SLURM_TOPOLOGY_ADDR"
        )
    return tuple(parts[:-1]), parts[-1]


def fabric_from_slurm(
    cluster: Cluster,
    *,
    nodelist: str | None = None,
    topology_text: str | None = None,
    topology_addrs: dict[str, str] | None = None,
) -> Fabric:
    """The job's fabric from Slurm: hosts in `SLURM_JOB_NODELIST` order (node rank order).

    Switch paths come from `topology_addrs` (host -> SLURM_TOPOLOGY_ADDR, gathered from
    each node) or else from `scontrol show topology` text; NVLink domains from block
    lines, else hosts grouped by leaf in blocks of the profile's nodes-per-domain. Hosts
    that neither source knows get the profile's regular topology by position.
    """
    hosts_from_topo: dict[str, Host] = {}
    blocks: dict[str, list[str]] = {}
    if topology_text:
        topo = parse_scontrol_topology(topology_text)
        blocks = {n: list(m) for n, m in topo.blocks}
        if topo.switches:
            for h in _hosts_from_switches(
                [(n, list(m), list(c)) for n, m, c in topo.switches],
                blocks=blocks,
                nodes_per_domain=cluster.nodes_per_domain,
                file="scontrol show topology",
            ):
                hosts_from_topo[h.name] = h
    names = expand_hostlist(nodelist) if nodelist else None
    if names is None:
        if topology_addrs:
            names = list(topology_addrs)
        elif hosts_from_topo:
            names = list(hosts_from_topo)
        else:
            raise ConfigError("no node list and no topology to take hosts from", file="slurm")
    regular = cluster.with_nodes(len(names)).fabric() if not cluster.topology.switches else None
    block_of = {h: b for b, members in blocks.items() for h in members}
    out: list[Host] = []
    leaf_count: dict[str, int] = {}
    npd = cluster.nodes_per_domain
    for i, name in enumerate(names):
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
        leaf = path[-1] if path else ""
        if name in block_of:
            dom = block_of[name]
        elif npd == 1:
            dom = name
        else:
            k = leaf_count.get(leaf, 0)
            leaf_count[leaf] = k + 1
            dom = f"{leaf}/nvl{k // npd}"
        out.append(Host(name, path, dom))
    if len({h.name for h in out}) != len(out):
        raise ConfigError(
            "a host appears twice in the node list", file="slurm", key="SLURM_JOB_NODELIST"
        )
    return Fabric(tuple(out), cluster.gpus_per_node)
