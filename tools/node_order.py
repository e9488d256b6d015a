"""`python -m tools.node_order GATHERED [--scontrol-topology FILE] [--cluster C --recipe R
[--set k=v ...]]`: print the job's nodes in the planner's order, one per line (line 1 =
node rank 0 = the rendezvous host).

GATHERED holds ``<SLURMD_NODENAME> <SLURM_TOPOLOGY_ADDR>`` lines, one per node, written by
the job script's gathering ``srun``. Switch paths come from those addresses, else from
`scontrol show topology` saved in FILE (a topology plugin that leaves the variable unset),
else from the profile's regular topology. With a profile and a recipe the order is
`parallel.placement.node_order(layout, fabric)` for the job's layout, which also refuses a
layout whose tp x cp groups cannot stay inside an NVLink domain (exit 1, before training).

`--replica-groups G --group-files PREFIX` (torchft replica groups, one job step each): also
write replica group g's nodes, one per line in the same order, to PREFIX-g.txt
(`launch.topology.replica_group_nodes`: consecutive runs of the order, so a group stays
under its own leaf switches when a leaf holds whole groups).
"""

from __future__ import annotations

import sys
from pathlib import Path

from core.errors import ConfigError, exit_on_config_error
from launch.node_order import order_nodes, read_gathered
from tools.cli import ArgumentParser, add_cluster_arg, add_override_arg, add_recipe_arg, run


def _read(path: str, key: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError, ValueError) as e:
        why = getattr(e, "strerror", None) or str(e).splitlines()[0]
        raise ConfigError(f"cannot read {path!r}: {why}", key=key) from None


@exit_on_config_error
def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="python -m tools.node_order", description=__doc__)
    ap.add_argument("gathered", help="file of '<node> <SLURM_TOPOLOGY_ADDR>' lines")
    ap.add_argument("--scontrol-topology", default="", help="saved `scontrol show topology`")
    add_cluster_arg(ap)
    add_recipe_arg(ap, help="recipe TOML or a name in recipes/ (the layout to place)")
    add_override_arg(ap)
    ap.add_argument("--replica-groups", type=int, default=0, help="torchft replica groups")
    ap.add_argument("--group-files", default="", help="with --replica-groups: PREFIX-g.txt")
    args = ap.parse_args(argv)
    if bool(args.replica_groups) != bool(args.group_files) or args.replica_groups < 0:
        raise ConfigError("--replica-groups G and --group-files PREFIX go together (G >= 1)",
                          key="--replica-groups")  # fmt: skip
    gathered = _read(args.gathered, "GATHERED")
    topo = ""
    if args.scontrol_topology and Path(args.scontrol_topology).exists():
        topo = _read(args.scontrol_topology, "--scontrol-topology")
    cluster = layout = None
    if args.cluster:
        from parallel.cluster import load_cluster

        cluster = load_cluster(args.cluster)
        if args.recipe:
            from launch.preflight import recipe_layout
            from recipe.loader import load_recipe

            recipe = load_recipe(args.recipe, args.overrides)
            nodes = len({n for n, _ in read_gathered(gathered, args.gathered)})
            layout = recipe_layout(recipe, nodes * cluster.gpus_per_node)
    from parallel.placement import PlacementError

    try:
        order, paths = order_nodes(gathered, topo, cluster, layout, file=args.gathered)
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
    if args.replica_groups:
        from launch.topology import leaf_of, replica_group_nodes

        try:
            groups = replica_group_nodes(order, args.replica_groups)
        except ValueError as e:
            raise ConfigError(str(e), key="--replica-groups") from None
        for g, members in enumerate(groups):
            Path(f"{args.group_files}-{g}.txt").write_text("".join(f"{n}\n" for n in members))
            leaves = sorted({leaf_of(paths.get(n, "")) or "?" for n in members})
            print(f"node_order: replica group {g}: {' '.join(members)} (leaf switches "
                  f"{' '.join(leaves)})", file=sys.stderr)  # fmt: skip
    for n in order:
        print(n)
    return 0


if __name__ == "__main__":
    run(main)
