"""Read NCCL's `NCCL_DEBUG=INFO` log: which network carries inter-node traffic.

NCCL falls back to TCP sockets without failing when InfiniBand is unusable (no verbs
library, NCCL_IB_DISABLE inherited, wrong NCCL_IB_HCA): the job runs, at a fraction of the
bandwidth. The lines that tell (formats of NCCL 2.18-2.27):

    NCCL INFO NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/IB ; OOB ib0:10.0.0.1<0>
    NCCL INFO NET/Socket : Using [0]eth0:10.0.0.1<0>
    NCCL INFO Using network IB            (or Socket, AWS Libfabric, ...)
    NCCL INFO Channel 00/0 : 0[0] -> 8[0] [send] via NET/IB/0/GDRDMA
    NCCL INFO Channel 00/0 : 8[0] -> 0[0] [receive] via NET/Socket/0
    NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read
    NCCL INFO GPU Direct RDMA Enabled for HCA 0 'mlx5_0'
    NCCL INFO NET/IB : No device found.

Pure text processing: unit-tested on sample lines.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

_USING_NETWORK = re.compile(r"NCCL INFO Using network (.+?)\s*$")
_NET_USING = re.compile(r"NCCL INFO NET/([A-Za-z][\w ]*?)\s*: Using (.*)$")
# A network transport's name may hold a space ("NET/AWS Libfabric/0/GDRDMA").
_CHANNEL = re.compile(r"NCCL INFO Channel [\d/]+ ?: .*? via (NET/[^/\n]+(?:/\S*)?|\S+)")
_IB_DEV = re.compile(r"\[\d+\]([\w.\-]+):\d+/(IB|RoCE)")
_NO_DEVICE = re.compile(r"NCCL INFO NET/IB : No device found")
_GDR_ENABLED = re.compile(r"GPU Direct RDMA Enabled for HCA")
_WARN = re.compile(r"NCCL WARN (.*)$")


@dataclass
class NcclNetReport:
    networks: list[str] = field(default_factory=list)  # "Using network X", in order seen
    net_plugins: dict[str, str] = field(default_factory=dict)  # NET/<name> -> its "Using" text
    ib_devices: list[str] = field(default_factory=list)
    ib_no_device: bool = False
    gdr_enabled_hcas: int = 0
    # Transport of each channel connection: "NET/IB", "NET/Socket", "P2P", "SHM", ...
    transports: Counter = field(default_factory=Counter)
    gdrdma_channels: int = 0  # network channels with /GDRDMA
    warnings: list[str] = field(default_factory=list)

    @property
    def network_channels(self) -> Counter:
        return Counter({k: v for k, v in self.transports.items() if k.startswith("NET/")})

    def merge(self, other: NcclNetReport) -> NcclNetReport:
        out = NcclNetReport()
        out.networks = list(dict.fromkeys(self.networks + other.networks))
        out.net_plugins = {**self.net_plugins, **other.net_plugins}
        out.ib_devices = list(dict.fromkeys(self.ib_devices + other.ib_devices))
        out.ib_no_device = self.ib_no_device or other.ib_no_device
        out.gdr_enabled_hcas = self.gdr_enabled_hcas + other.gdr_enabled_hcas
        out.transports = self.transports + other.transports
        out.gdrdma_channels = self.gdrdma_channels + other.gdrdma_channels
        out.warnings = self.warnings + other.warnings
        return out


def _transport(via: str) -> str:
    """'NET/IB/0/GDRDMA' -> 'NET/IB'; 'NET/AWS Libfabric/0' -> 'NET/AWS Libfabric';
    'P2P/CUMEM/read' -> 'P2P'."""
    parts = via.split("/")
    if parts[0] == "NET" and len(parts) > 1:
        return f"NET/{parts[1]}"
    return parts[0]


def parse_nccl_log(text: str) -> NcclNetReport:
    r = NcclNetReport()
    for line in text.splitlines():
        if "NCCL" not in line:
            continue
        m = _USING_NETWORK.search(line)
        if m:
            if m.group(1) not in r.networks:
                r.networks.append(m.group(1))
            continue
        if _NO_DEVICE.search(line):
            r.ib_no_device = True
            continue
        m = _NET_USING.search(line)
        if m:
            name, rest = m.group(1).strip(), m.group(2).strip()
            r.net_plugins[name] = rest
            for dev, _ in _IB_DEV.findall(rest):
                if dev not in r.ib_devices:
                    r.ib_devices.append(dev)
            continue
        m = _CHANNEL.search(line)
        if m:
            via = m.group(1)
            t = _transport(via)
            r.transports[t] += 1
            if t.startswith("NET/") and "GDRDMA" in via:
                r.gdrdma_channels += 1
            continue
        if _GDR_ENABLED.search(line):
            r.gdr_enabled_hcas += 1
            continue
        m = _WARN.search(line)
        if m:
            r.warnings.append(m.group(1).strip())
    return r


_EXPECTED = {
    "infiniband": ("IB",),
    "roce": ("IB",),  # RoCE runs over NCCL's IB verbs transport
    "efa": ("AWS Libfabric", "Libfabric", "OFI"),
}


@dataclass(frozen=True)
class NetVerdict:
    ok: bool
    level: str  # "ok", "warn", "info"
    message: str


def check_network(report: NcclNetReport, fabric: str, *, multi_node: bool = True) -> NetVerdict:
    """Does the network NCCL chose match the profile's fabric? Warn when it doesn't."""
    expected = _EXPECTED.get(fabric)
    if expected is None:
        return NetVerdict(True, "info", f"fabric {fabric}: no network expectation")
    net_channels = report.network_channels
    used = [t.split("/", 1)[1] for t in net_channels]
    chosen = report.networks or used
    want = " or ".join(f"NET/{e}" for e in expected)
    if not chosen and not net_channels:
        if not multi_node:
            return NetVerdict(True, "info", "single node: no network transport in use")
        return NetVerdict(
            False,
            "warn",
            "the NCCL log names no network (was NCCL_DEBUG=INFO set, and did NCCL initialise?)",
        )
    bad = [n for n in chosen if not n.startswith(expected)]
    bad_channels = {t: c for t, c in net_channels.items() if not t[4:].startswith(expected)}
    if bad or bad_channels:
        detail = ", ".join(f"{t} x{c}" for t, c in bad_channels.items())
        hint = ""
        if "Socket" in " ".join(bad + list(bad_channels)):
            hint = (
                " (TCP sockets: check NCCL_IB_HCA / NCCL_IB_DISABLE, the verbs library "
                "libibverbs, and that the IB ports are up)"
            )
            if report.ib_no_device:
                hint += "; NCCL reported 'NET/IB : No device found'"
        return NetVerdict(
            False,
            "warn",
            f"inter-node traffic does not use {want}: network {', '.join(chosen) or '-'}"
            + (f", channels {detail}" if detail else "")
            + hint,
        )
    msg = f"inter-node traffic on {want} ({', '.join(report.ib_devices) or 'devices not listed'})"
    if fabric in ("infiniband", "roce") and net_channels and report.gdrdma_channels == 0:
        return NetVerdict(
            True,
            "warn",
            msg + "; but no channel uses GPUDirect RDMA (GDRDMA): traffic is staged through "
            "host memory (is nvidia-peermem / dma-buf available? NCCL_NET_GDR_LEVEL?)",
        )
    return NetVerdict(True, "ok", msg)
