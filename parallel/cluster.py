"""Cluster profiles (`clusters/*.toml`): the schema and the loader.

A profile describes the hardware (GPU kind, GPUs per node, NVLink domain, link speeds), the
switch tree ([topology]: regular `nodes_per_leaf`/`leaves_per_spine`, or an explicit switch
list in Slurm's topology.conf style) and the NCCL environment for the fabric ([nccl]).

`Cluster.fabric()` turns a profile into a `Fabric` (`parallel.fabric`: the hosts in launch
order with switch paths and NVLink domains). At launch the same object can come from Slurm
instead (`launch.slurm.fabric_from_slurm`). Everything here is pure.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from core.errors import ConfigError
from core.hardware import (
    GPUS,
    MAX_GPUS_PER_NODE,
    MAX_NODES,
    MAX_NVLINK_DOMAIN_GPUS,
    MAX_WORLD_SIZE,
    PROFILE_KINDS,
)
from core.safe_text import check_text
from core.typed_toml import apply_override, build_dataclass, doc, read_with_bases, resolve_named
from parallel.fabric import Fabric, fabric_of

CLUSTERS_DIR = Path(__file__).resolve().parent.parent / "clusters"

# Every kind of the hardware table (core.hardware.GPUS), the one home of GPU names.
GpuKind = Literal[PROFILE_KINDS]  # type: ignore[valid-type]  # built from the table
Fabric_ = Literal["infiniband", "roce", "efa", "ethernet", "none"]

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

# Upper bounds on the per-GPU figures, about 10x today's largest, so a unit slip (GB/s for
# Gb/s, MB for GiB) is refused instead of planned: (bound, the largest shipping value).
PHYSICAL_BOUNDS = {
    "nvlink_gbps": (100_000, "NVLink 5: 7,200 Gb/s per direction"),
    "ib_gbps_per_gpu": (100_000, "XDR InfiniBand: 800 Gb/s per port"),
    "hbm_gib": (4096, "GB300: 288 GB"),
    "power_limit_w": (10_000, "GB300: 1,400 W"),
}

# Goodput defaults (parallel.goodput). Meta, "The Llama 3 Herd of Models" (2024), section
# 3.3.4: 419 unexpected interruptions in a 54-day snapshot of pretraining on 16,384 H100s.
FAILURES_PER_GPU_HOUR = 419 / (54 * 24 * 16_384)
# Same paper, section 3.3.1: Tectonic sustains 2 TB/s (peak 7 TB/s) for 16,384 GPUs.
CHECKPOINT_GBPS_PER_GPU = 2e12 * 8 / 1e9 / 16_384
# Failure detection (collective timeout), requeue and init: an assumption (docs/fault_tolerance.md).
RESTART_S = 300.0

# Keys every profile file must set (after its `base` chain): without them an empty or
# truncated file would describe a default 1 x 8 H100 cluster and plan on it silently.
REQUIRED_KEYS = ("gpu", "nodes", "gpus_per_node")


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
            check_size(name, getattr(self, name), MAX_NODES, "(core.hardware.MAX_NODES)")
        if self.oversubscription > 1000:
            raise ConfigError(
                f"expected at most 1000 (a 1000:1 uplink is no network), got "
                f"{self.oversubscription:g}",
                key="oversubscription",
            )
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
        for k, v in self.env.items():
            if not _ENV_NAME.fullmatch(k):
                raise ConfigError(f"not an environment variable name: {k!r}", key=f"env.{k}")
            # Exported (shlex-quoted) by the job script: one line, no NUL.
            check_text(str(v), key=f"env.{k}", what="a value")


@dataclass
class Cluster:
    """A cluster profile. Bandwidths in gigabits per second per GPU per direction."""

    name: str = field(default="", metadata=doc("Profile name (defaults to the file stem)."))
    description: str = field(default="", metadata=doc("Free text."))
    gpu: GpuKind = field(
        default="H100",
        metadata=doc(
            "GPU kind, a key of core.hardware.GPUS: " + ", ".join(PROFILE_KINDS) + " (B300/GB300"
            " = Blackwell Ultra; _PCIE/_NVL = the PCIe cards; cpu = gloo ranks)."
        ),
    )
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
    # Goodput inputs (parallel.goodput; docs/fault_tolerance.md gives the sources).
    failures_per_gpu_hour: float = field(
        default=FAILURES_PER_GPU_HOUR,
        metadata=doc(
            "Job-interrupting failures per GPU-hour (GPU, NIC, host, switch, software). "
            "Default: Meta's Llama 3 405B run, 419 unexpected interruptions in 54 days on "
            "16,384 H100s = 1.97e-5."
        ),
    )
    restart_s: float = field(
        default=RESTART_S,
        metadata=doc(
            "Seconds from a failure to the restarted processes' first step, not counting the "
            "checkpoint read: detection, Slurm requeue/step start, process-group and model "
            "init (an assumption, not a published figure: measure yours)."
        ),
    )
    checkpoint_gbps_per_gpu: float = field(
        default=CHECKPOINT_GBPS_PER_GPU,
        metadata=doc(
            "Checkpoint storage bandwidth per GPU, Gb/s, read or write. Default: Llama 3's "
            "Tectonic, 2 TB/s sustained over 16,384 GPUs = 0.98 Gb/s."
        ),
    )
    topology: TopologySection = field(default_factory=TopologySection)
    nccl: NcclSection = field(default_factory=NcclSection)
    source: str = field(default="<defaults>", init=False, compare=False)

    def __post_init__(self) -> None:
        check_text(self.name, key="name", what="a profile name", limit=128)  # in job scripts
        for name in ("nodes", "gpus_per_node"):
            if getattr(self, name) < 1:
                raise ConfigError(f"expected a positive value, got {getattr(self, name)}", key=name)
        check_size("nodes", self.nodes, MAX_NODES, "hosts (core.hardware.MAX_NODES)")
        check_size(
            "gpus_per_node",
            self.gpus_per_node,
            MAX_GPUS_PER_NODE,
            "GPUs per host (an NVL72 rack as one host; core.hardware.MAX_GPUS_PER_NODE)",
        )
        check_size(
            "nvlink_domain_gpus",
            self.nvlink_domain_gpus,
            MAX_NVLINK_DOMAIN_GPUS,
            "GPUs per NVLink domain (NVLink 5's largest; core.hardware.MAX_NVLINK_DOMAIN_GPUS)",
        )
        if self.nodes * self.gpus_per_node > MAX_WORLD_SIZE:
            raise ConfigError(
                f"{self.nodes} nodes x {self.gpus_per_node} GPUs = "
                f"{self.nodes * self.gpus_per_node:,} GPUs; at most {MAX_WORLD_SIZE:,} "
                "(core.hardware.MAX_WORLD_SIZE)",
                key="nodes",
            )
        for name in ("nvlink_domain_gpus",):
            if getattr(self, name) < 0:
                raise ConfigError(f"expected >= 0, got {getattr(self, name)}", key=name)
        if not 0 <= self.failures_per_gpu_hour < 1:  # nan fails too
            raise ConfigError(
                f"expected a rate in [0, 1) per GPU-hour, got {self.failures_per_gpu_hour}",
                key="failures_per_gpu_hour",
            )
        if not 0 <= self.restart_s <= 86_400:
            raise ConfigError(f"expected 0 to 86400 seconds, got {self.restart_s}", key="restart_s")
        if not 0 < self.checkpoint_gbps_per_gpu <= 100_000:
            raise ConfigError(
                f"expected a positive bandwidth up to 100,000 Gb/s, got "
                f"{self.checkpoint_gbps_per_gpu}",
                key="checkpoint_gbps_per_gpu",
            )
        for name in ("nvlink_gbps", "ib_gbps_per_gpu", "hbm_gib", "power_limit_w"):
            if getattr(self, name) < 0:
                raise ConfigError(f"expected >= 0, got {getattr(self, name)}", key=name)
            bound, why = PHYSICAL_BOUNDS[name]
            if getattr(self, name) > bound:
                raise ConfigError(
                    f"{getattr(self, name):g} is past any GPU: at most {bound:,} ({why})", key=name
                )
        if self.nvlink_domain_gpus == 0:
            self.nvlink_domain_gpus = self.gpus_per_node
        # A domain past one host is NVLink switch hardware this GPU must ship with (NVL72 racks
        # for GB200/GB300; none for HGX B200/B300, H800 or the PCIe cards). Inside one host the
        # profile's link speed says what connects the GPUs (PCIe for the PCIe cards).
        most = GPUS[self.gpu].max_nvlink_domain
        if most and self.nvlink_domain_gpus > max(most, self.gpus_per_node):
            raise ConfigError(
                f"{self.nvlink_domain_gpus} GPUs in one NVLink domain, but {self.gpu} ships in "
                f"domains of at most {most} (core.hardware.GPUS: max_nvlink_domain)",
                key="nvlink_domain_gpus",
            )
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

    def with_nodes(self, nodes: int, *, key: str = "nodes") -> Cluster:
        """This profile sized to a job of `nodes` hosts (`key`: what to blame, e.g. --nodes)."""
        if nodes < 1:
            raise ConfigError(f"expected a positive node count, got {nodes}", key=key)
        check_size(key, nodes, MAX_NODES, "hosts (core.hardware.MAX_NODES)")
        if nodes * self.gpus_per_node > MAX_WORLD_SIZE:
            raise ConfigError(
                f"{nodes} nodes x {self.gpus_per_node} GPUs = {nodes * self.gpus_per_node:,} "
                f"GPUs; at most {MAX_WORLD_SIZE:,} (core.hardware.MAX_WORLD_SIZE)",
                key=key,
            )
        if self.topology.switches:
            have = len(self.fabric().hosts)
            if nodes > have:
                raise ConfigError(
                    f"{nodes} nodes requested but the switch list names only {have} hosts",
                    file=self.source if key == "nodes" else None,
                    key=key,
                )
        c = dataclasses.replace(self, nodes=nodes)
        c.source = self.source
        return c

    def fabric(self) -> Fabric:
        """The hosts of this profile in launch order, with switch paths and NVLink domains."""
        return fabric_of(self)


def check_size(key: str, value: int, bound: int, what: str, file: str | None = None) -> None:
    """A size over its bound (core.hardware.MAX_*) is a typo, not a machine: one line."""
    if value > bound:
        shown = f"{value:,}" if value < 10**30 else f"a {len(str(value))}-digit number"
        raise ConfigError(f"{shown} is too large: at most {bound:,} {what}", file=file, key=key)


def resolve_cluster_path(path_or_name: str | Path) -> Path:
    """A path, or a profile name from clusters/ ("hgx_h100_ib")."""
    return resolve_named(path_or_name, CLUSTERS_DIR, what="cluster profile")


def load_cluster(
    path: str | Path, nodes: int | None = None, overrides: tuple[str, ...] | list[str] = ()
) -> Cluster:
    """Load a profile (path or name in clusters/), optionally for a job of `nodes` hosts."""
    p = resolve_cluster_path(path)
    data = read_with_bases(p)
    for o in overrides:
        data = apply_override(data, o, Cluster, source="--cluster-set")
    missing = [k for k in REQUIRED_KEYS if k not in data]
    data.setdefault("name", p.stem)
    cluster = build_dataclass(Cluster, data, file=str(p), prefix="")
    cluster.source = str(p)
    if missing:  # after the type checks: a wrong value is named before a missing one
        raise ConfigError(
            "missing: a profile must say which GPU, how many per host and how many hosts "
            '(e.g. gpu = "H100", gpus_per_node = 8, nodes = 64)',
            file=str(p),
            key=", ".join(missing),
        )
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
