"""Pre-flight check of the collectives a recipe's layout uses, before a long run.

    torchrun --nproc-per-node=8 -m tools.preflight --recipe R [--cluster C] [--out DIR]
    python -m tools.preflight --recipe R            # one process: checks the wiring only

One collective per mesh group (all-gather and reduce-scatter over dp_shard, all-reduce over
dp_replicate and tp, all-gather over cp, send/recv around pp), each result checked, its
algorithm and bus bandwidth set against the cluster profile's prediction; with NCCL the
NCCL_DEBUG=INFO log is read to confirm InfiniBand (NET/IB) and not TCP sockets carries the
traffic. Writes placement.json and preflight.json to --out. Exit 0 when every result is
right (warnings included), 1 when a collective gives a wrong result (or, with --strict, on
any warning), 2 on bad input.
"""

from __future__ import annotations

import argparse
import sys

from core.errors import exit_on_config_error
from core.launch_env import launch_env
from tools.cli import ArgumentParser, add_cluster_arg, add_override_arg, add_recipe_arg, run


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(
        prog="python -m tools.preflight",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_recipe_arg(p)
    add_override_arg(p)
    add_cluster_arg(p)
    p.add_argument("--out", default=None, help="folder for placement.json and preflight.json")
    p.add_argument(
        "--size-mb", type=float, default=None, help="message size (default 256 GPU, 1 CPU)"
    )
    p.add_argument("--iters", type=int, default=None, help="timed iterations (default 20 / 3)")
    p.add_argument("--strict", action="store_true", help="exit 1 on warnings too")
    return p.parse_args(argv)


@exit_on_config_error
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from tools.cli import out_dir_arg, positive_arg

    if args.size_mb is not None:
        positive_arg(args.size_mb, "--size-mb", 16384)  # MiB: 16 GiB per message at most
    if args.iters is not None:
        positive_arg(args.iters, "--iters", 10000)
    if args.out is not None:
        out_dir_arg(args.out, "--out")
    from recipe.loader import load_recipe

    recipe = load_recipe(args.recipe, args.overrides)
    env = launch_env()  # checked before torch and any process group (one line, exit 2)
    from launch.preflight import recipe_layout

    layout = recipe_layout(recipe, env.world_size)
    cluster = None
    if args.cluster:
        from parallel.cluster import load_cluster

        cluster = load_cluster(args.cluster)
    from launch.preflight import format_report, run_preflight

    size = int(args.size_mb * 2**20) if args.size_mb else None
    rep = run_preflight(layout, cluster, out_dir=args.out, size_bytes=size, iters=args.iters)
    if env.rank != 0:
        return 0 if rep.ok else 1
    print(format_report(rep), flush=True)
    if not rep.ok:
        bad = [r for r in rep.results if not r.ok]
        for r in bad:
            print(
                f"error: pre-flight: {r.op} over {r.axis} (groups of {r.group_size}) gave a wrong "
                f"result on ranks {r.bad_ranks} (max error {r.max_error:g})",
                file=sys.stderr,
            )
        return 1
    if args.strict and rep.warnings:
        print(f"error: pre-flight: {len(rep.warnings)} warning(s) with --strict", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    run(main)
