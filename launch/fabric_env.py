"""The environment a job exports for its fabric, from the cluster profile's [nccl] table.

InfiniBand (and RoCE) jobs get the profile's NCCL_* settings plus two guards, and every
AWS EFA / libfabric variable is unset so that an inherited module environment cannot slow
the run down (EFA settings on an InfiniBand cluster make NCCL load the libfabric plugin or
force the Simple protocol). EFA jobs get libfabric's EFA provider settings. A profile that
mixes them is a ConfigError naming the key.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from core.errors import ConfigError

# Variables that belong to AWS EFA (libfabric + aws-ofi-nccl). On any other fabric they are
# at best ignored and at worst select the wrong network plugin.
EFA_PREFIXES = ("FI_", "OFI_NCCL_")
# NCCL_PROTO=simple was the aws-ofi-nccl workaround on EFA; elsewhere it turns off the LL and
# LL128 protocols, which carry NCCL's small and medium messages.
EFA_ONLY_VALUES = {"NCCL_PROTO": "simple"}

# Guards added on RDMA fabrics unless the profile sets them: IB on (an inherited
# NCCL_IB_DISABLE=1 silently falls back to TCP sockets), and GPUDirect RDMA whenever the GPU
# and its NIC share a PCIe switch, which is how HGX boards pair each GPU with its rail NIC.
RDMA_DEFAULTS = {
    "NCCL_IB_DISABLE": "0",
    "NCCL_NET_GDR_LEVEL": "PXB",
}
# EFA: the libfabric provider and GPUDirect RDMA over EFA (p4d/p5 instances).
EFA_DEFAULTS = {
    "FI_PROVIDER": "efa",
    "FI_EFA_USE_DEVICE_RDMA": "1",
    "FI_EFA_FORK_SAFE": "1",
}


@dataclass
class FabricEnv:
    fabric: str
    exports: list[tuple[str, str, str]] = field(default_factory=list)  # (name, value, origin)
    unset_prefixes: tuple[str, ...] = ()  # inherited variables to drop (prefix match)
    unset_names: tuple[str, ...] = ()
    warnings: list[str] = field(default_factory=list)


def is_efa_setting(name: str, value: str) -> bool:
    if name.startswith(EFA_PREFIXES):
        return True
    want = EFA_ONLY_VALUES.get(name)
    return want is not None and value.strip().lower() == want


def fabric_env(fabric: str, env: dict[str, str], *, file: str | None = None) -> FabricEnv:
    """What the job script exports and unsets for `fabric` given the profile's [nccl.env]."""
    out = FabricEnv(fabric=fabric)
    env = {k: str(v) for k, v in env.items()}
    if fabric in ("infiniband", "roce"):
        for k, v in env.items():
            if is_efa_setting(k, v):
                raise ConfigError(
                    f"{k}={v} is an AWS EFA (libfabric) setting, but this profile's fabric is "
                    f'{fabric}; remove it, or set nccl.fabric = "efa" if the nodes use EFA',
                    file=file,
                    key=f"nccl.env.{k}",
                )
        for k, v in env.items():
            out.exports.append((k, v, "profile"))
        for k, v in RDMA_DEFAULTS.items():
            if k not in env:
                out.exports.append((k, v, "default"))
        out.unset_prefixes = EFA_PREFIXES
        out.unset_names = tuple(k for k in EFA_ONLY_VALUES if k not in env)
        if "NCCL_SOCKET_IFNAME" not in env:
            out.warnings.append(
                "the profile sets no NCCL_SOCKET_IFNAME: NCCL's bootstrap picks an interface "
                "itself (may be a slow or unrouted one)"
            )
    elif fabric == "efa":
        for k, v in env.items():
            out.exports.append((k, v, "profile"))
        for k, v in EFA_DEFAULTS.items():
            if k not in env:
                out.exports.append((k, v, "default"))
        ib = [k for k in env if k.startswith("NCCL_IB_")]
        if ib:
            out.warnings.append(
                f"{', '.join(ib)} set on an EFA fabric: NCCL's IB transport is not used there"
            )
    elif fabric == "ethernet":
        for k, v in env.items():
            if is_efa_setting(k, v):
                raise ConfigError(
                    f"{k}={v} is an AWS EFA setting, but this profile's fabric is ethernet",
                    file=file,
                    key=f"nccl.env.{k}",
                )
            out.exports.append((k, v, "profile"))
        out.unset_prefixes = EFA_PREFIXES
    else:  # "none": CPU processes over gloo; NCCL settings would be meaningless
        for k, v in env.items():
            out.exports.append((k, v, "profile"))
    return out
