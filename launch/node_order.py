"""`python -m launch.node_order GATHERED [--scontrol-topology FILE] [--cluster C --recipe R
[--set k=v ...]]`: print the job's nodes in the planner's order, one per line (line 1 =
node rank 0 = the rendezvous host).

GATHERED holds ``<SLURMD_NODENAME> <SLURM_TOPOLOGY_ADDR>`` lines, one per node, written by
the job script's gathering ``srun``. Switch paths come from those addresses, else from
`scontrol show topology` saved in FILE (a topology plugin that leaves the variable unset),
else from the profile's regular topology. With a profile and a recipe the order is
`parallel.placement.node_order(layout, fabric)` for the job's layout, which also refuses a
layout whose tp x cp groups cannot stay inside an NVLink domain (exit 1, before training).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from core.errors import ConfigError, exit_on_config_error
from launch.topology import topology_order
from recipe.cli import add_override_arg


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


@exit_on_config_error
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m launch.node_order", description=__doc__)
    ap.add_argument("gathered", help="file of '<node> <SLURM_TOPOLOGY_ADDR>' lines")
    ap.add_argument("--scontrol-topology", default="", help="saved `scontrol show topology`")
    ap.add_argument("--cluster", default=None, help="cluster profile")
    ap.add_argument("--recipe", default=None, help="recipe (the layout to place)")
    add_override_arg(ap)
    args = ap.parse_args(argv)
    gathered = Path(args.gathered).read_text()
    topo = ""
    if args.scontrol_topology and Path(args.scontrol_topology).exists():
        topo = Path(args.scontrol_topology).read_text()
    cluster = layout = None
    if args.cluster:
        from parallel.cluster import load_cluster

        cluster = load_cluster(args.cluster)
        if args.recipe:
            from launch.preflight import recipe_layout
            from recipe.loader import load_recipe

            recipe = load_recipe(args.recipe, args.overrides)
            nodes = len({n for n, _ in read_gathered(gathered)})
            layout = recipe_layout(recipe, nodes * cluster.gpus_per_node)
    from parallel.placement import PlacementError

    try:
        order, paths = order_nodes(gathered, topo, cluster, layout)
    except PlacementError as e:
        print(f"node_order: error: {e}", file=sys.stderr)
        return 1
    if not order:
        print("node_order: no nodes in " + args.gathered, file=sys.stderr)
        return 1
    if not any("." in paths.get(n, "") for n in order):
        print(
            "node_order: warning: no switch paths (SLURM_TOPOLOGY_ADDR empty, no `scontrol "
            "show topology`, no profile topology); nodes keep name order",
            file=sys.stderr,
        )
    for i, n in enumerate(order):
        print(f"node_order: node_rank {i}: {n} {paths.get(n, '')}", file=sys.stderr)
        print(n)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
