"""`python -m launch.node_order GATHERED [--scontrol-topology FILE]`: print the job's nodes
in topology order, one per line (line 1 = node rank 0 = the rendezvous host).

GATHERED holds ``<SLURMD_NODENAME> <SLURM_TOPOLOGY_ADDR>`` lines, one per node, written by
the job script's gathering ``srun``. When no node has a switch path (topology plugin off,
or a Slurm that leaves the variable unset), the path is rebuilt from `scontrol show
topology` saved in FILE; with neither, nodes keep name order and a warning says so.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from launch.topology import addresses_from_scontrol_topology, topology_order


def read_gathered(text: str) -> list[tuple[str, str]]:
    entries = []
    for line in text.splitlines():
        parts = line.split()
        if not parts:
            continue
        entries.append((parts[0], parts[1] if len(parts) > 1 else ""))
    return entries


def order_nodes(gathered: str, scontrol_topology: str = "") -> tuple[list[str], dict[str, str]]:
    """(nodes in topology order, node -> address used)."""
    entries = read_gathered(gathered)
    addrs = {n: a for n, a in entries}
    if not any("." in a for a in addrs.values()) and scontrol_topology.strip():
        rebuilt = addresses_from_scontrol_topology(scontrol_topology, addrs)
        addrs = {n: rebuilt.get(n, a) for n, a in addrs.items()}
    return topology_order(list(addrs.items())), addrs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m launch.node_order", description=__doc__)
    ap.add_argument("gathered", help="file of '<node> <SLURM_TOPOLOGY_ADDR>' lines")
    ap.add_argument("--scontrol-topology", default="", help="saved `scontrol show topology`")
    args = ap.parse_args(argv)
    gathered = Path(args.gathered).read_text()
    topo = ""
    if args.scontrol_topology and Path(args.scontrol_topology).exists():
        topo = Path(args.scontrol_topology).read_text()
    order, addrs = order_nodes(gathered, topo)
    if not order:
        print("node_order: no nodes in " + args.gathered, file=sys.stderr)
        return 1
    if not any("." in addrs.get(n, "") for n in order):
        print(
            "node_order: warning: no switch paths (SLURM_TOPOLOGY_ADDR empty and no "
            "`scontrol show topology`); nodes keep name order",
            file=sys.stderr,
        )
    for i, n in enumerate(order):
        print(f"node_order: node_rank {i}: {n} {addrs.get(n, '')}", file=sys.stderr)
        print(n)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
