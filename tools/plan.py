"""Rank the parallel plans for a recipe on a cluster (no process group, no GPU).

    python -m tools.plan --recipe R --cluster C [--nodes N] [--top K] [--json] [--placement]
                         [--set k=v ...] [--shuffle-hosts SEED]
                         [--slurm-topology FILE --nodelist HOSTLIST]

The table: degrees, schedule, microbatches, activation checkpointing, memory GiB/GPU,
predicted tokens/s/GPU, MFU, and GB per step crossing leaf switches (leaving a host) and
the spine (between leaves) under the planned placement. `--placement` prints the best
plan's rank -> host -> switch table and groups, and its cross-switch traffic against
plain rank order on the same (launch-ordered) hosts. `--shuffle-hosts` emulates an
arbitrary rendezvous order; `--slurm-topology`/`--nodelist` take the hosts from Slurm.
"""

from __future__ import annotations

import argparse
import json
import sys

from core.errors import ConfigError, exit_on_config_error
from tools.cli import (
    ArgumentParser,
    add_recipe_cluster_args,
    add_stack_arg,
    load,
    load_stack_arg,
    run,
)

# --placement builds rank orders, groups and traffic rank by rank: 2.5 s of CPU at 32,768
# GPUs (8B, 4,096 nodes; 9 s wall on a loaded 2-core machine), minutes at a million.
MAX_PLACEMENT_GPUS = 32768


def _fmt_plan_row(i: int, p) -> str:
    lay = p.layout
    sched = p.pp_schedule or "-"
    mfu = "n/a" if p.prediction.mfu_pct is None else f"{p.prediction.mfu_pct:.1f}"
    cs = p.cross_switch or {}
    return (
        f"{i:>3} {lay.pp:>3} {lay.dp_replicate:>4} {lay.dp_shard:>5} {lay.cp:>3} {lay.tp:>3}  "
        f"{sched:<21} {p.microbatches:>4} {p.activation_checkpoint:<9} {p.local_batch_size:>5} "
        f"{p.memory_gib:>7.1f} {p.tokens_per_sec_per_gpu:>9.1f} {mfu:>6} "
        f"{cs.get('leaf', 0):>10.1f} {cs.get('spine', 0):>9.1f}"
    )


HEADER = (
    f"{'#':>3} {'pp':>3} {'rep':>4} {'shard':>5} {'cp':>3} {'tp':>3}  {'schedule':<21} {'mb':>4} "
    f"{'AC':<9} {'lbs':>5} {'mem GiB':>7} {'tok/s/GPU':>9} {'MFU%':>6} {'leaf GB/s':>10} "
    f"{'spine GB':>9}"
).replace("leaf GB/s", "leaf GB")


def fabric_for(args, cluster):
    from launch.slurm import fabric_from_slurm
    from tools.cli import read_text_arg

    if args.slurm_topology or args.nodelist:
        if args.nodelist:
            from core.hostlist import expand_hostlist

            try:
                expand_hostlist(args.nodelist)
            except ValueError as e:
                raise ConfigError(str(e), key="--nodelist") from None
        text = None
        if args.slurm_topology:
            text = read_text_arg(args.slurm_topology, "--slurm-topology")
        fab = fabric_from_slurm(cluster, nodelist=args.nodelist, topology_text=text)
        if len(fab.hosts) != cluster.nodes:
            cluster = cluster.with_nodes(len(fab.hosts))
    else:
        fab = cluster.fabric()
    if args.shuffle_hosts is not None:
        fab = fab.shuffled(args.shuffle_hosts)
    return cluster, fab


def placement_report(best, cluster, fabric, limit: int) -> tuple[str, dict]:
    """Text and JSON for the best plan's placement vs plain rank order."""
    from parallel.perf import predict
    from parallel.placement import (
        cross_switch_traffic,
        group_spans,
        monotone_violation,
        node_order,
        placement_table,
        plain_rank_order,
        planned_rank_order,
    )

    lay = best.layout
    w = best.prediction.workload
    colls = best.prediction.collectives
    planned = planned_rank_order(lay, fabric)
    plain = plain_rank_order(lay.world_size)
    t_plan = cross_switch_traffic(colls, lay, planned, fabric)
    t_plain = cross_switch_traffic(colls, lay, plain, fabric)
    out = ["", f"placement of plan 1 ({best.describe()}) on {len(fabric.hosts)} hosts:"]
    out.append(placement_table(lay, planned, fabric, limit=limit))
    rows = {}
    for name, order, tr in (("planned", planned, t_plan), ("plain rank order", plain, t_plain)):
        spans = group_spans(lay, order, fabric)
        tp_ok = spans["tp"].domains <= 1 and spans["cp"].domains <= 1
        pred = predict(w, cluster, spans)
        rows[name] = {
            "leaf_gb_per_step": round(tr.leaf_gb, 2),
            "spine_gb_per_step": round(tr.spine_gb, 2),
            "tp_cp_inside_nvlink": tp_ok,
            "tokens_per_sec_per_gpu": round(pred.tokens_per_sec_per_gpu, 1),
        }
    out.append("")
    out.append(f"{'order':<18} {'leaf GB/step':>13} {'spine GB/step':>14} {'tp/cp in NVLink':>16} "
               f"{'tok/s/GPU':>10}")  # fmt: skip
    for name, r in rows.items():
        out.append(
            f"{name:<18} {r['leaf_gb_per_step']:>13.1f} {r['spine_gb_per_step']:>14.1f} "
            f"{'yes' if r['tp_cp_inside_nvlink'] else 'NO':>16} {r['tokens_per_sec_per_gpu']:>10.1f}"
        )
    by_axis = {
        axis: {
            "planned_spine_gb": round(t_plan.spine_bytes.get(axis, 0) / 1e9, 2),
            "plain_spine_gb": round(t_plain.spine_bytes.get(axis, 0) / 1e9, 2),
        }
        for axis in sorted(set(t_plan.spine_bytes) | set(t_plain.spine_bytes))
    }
    out.append("spine GB/step by axis (planned vs plain): " + ", ".join(
        f"{a} {v['planned_spine_gb']:.1f} vs {v['plain_spine_gb']:.1f}" for a, v in by_axis.items()
    ))  # fmt: skip
    hosts = node_order(lay, fabric)
    bad = monotone_violation(lay, planned)
    out.append(
        "launch: node ranks in this host order (torchrun --node_rank=i on host i): "
        + " ".join(hosts[:16])
        + (f" ... ({len(hosts)} hosts)" if len(hosts) > 16 else "")
    )
    out.append(
        "as a permuted world mesh on the current launch order: "
        + (
            "safe (every group increasing)"
            if bad is None
            else f"not safe ({bad} decreases); use the node order"
        )
    )
    info = {"rank_order": planned, "node_order": hosts, "mesh_permutation_safe": bad is None}
    return "\n".join(out), {**info, **rows, "spine_gb_by_axis": by_axis}


@exit_on_config_error
def main(argv: list[str] | None = None) -> None:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_recipe_cluster_args(p)
    p.add_argument("--top", type=int, default=10, help="plans to show (default 10)")
    add_stack_arg(p)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--placement", action="store_true", help="show the best plan's placement")
    p.add_argument("--shuffle-hosts", type=int, default=None, metavar="SEED",
                   help="launch hosts in a shuffled order (emulates c10d rendezvous)")  # fmt: skip
    p.add_argument("--slurm-topology", default=None, metavar="FILE",
                   help="`scontrol show topology` output to take switch paths from")  # fmt: skip
    p.add_argument("--nodelist", default=None, help="SLURM_JOB_NODELIST (launch order)")
    p.add_argument("--placement-rows", type=int, default=64, help="ranks listed by --placement")
    p.add_argument("--time", type=int, default=0, metavar="N",
                   help="also time the search N times (wall and CPU seconds, to stderr)")  # fmt: skip
    args = p.parse_args(argv)
    if args.top < 1:
        raise ConfigError(f"expected a positive count, got {args.top}", key="--top")
    if not 0 <= args.time <= 100:  # each repetition is a whole search
        raise ConfigError(f"expected 0 to 100 repetitions, got {args.time}", key="--time")
    if args.placement_rows < 0:
        raise ConfigError(f"expected >= 0, got {args.placement_rows}", key="--placement-rows")

    from parallel.planner import add_traffic, search

    stack = load_stack_arg(args)
    recipe, cluster = load(args)
    fabric = None
    if args.placement and cluster.world_size > MAX_PLACEMENT_GPUS:
        raise ConfigError(
            f"the placement report walks every rank: at most {MAX_PLACEMENT_GPUS:,} GPUs, this "
            f"job has {cluster.world_size:,} (plan without --placement)",
            key="--placement",
        )
    if args.placement or args.slurm_topology or args.nodelist:
        cluster, fabric = fabric_for(args, cluster)
    res = search(recipe, cluster, nodes=cluster.nodes, stack=stack)
    for w in res.warnings:
        print(f"warning: {w}", file=sys.stderr)
    if args.time > 0:
        import statistics
        import time

        walls, cpus = [], []
        for _ in range(args.time):
            w0, c0 = time.perf_counter(), time.process_time()
            search(recipe, cluster, nodes=cluster.nodes, stack=stack)
            walls.append(time.perf_counter() - w0)
            cpus.append(time.process_time() - c0)
        print(
            f"search time over {args.time} runs: wall min {min(walls):.3f} s, median "
            f"{statistics.median(walls):.3f} s; CPU min {min(cpus):.3f} s, median "
            f"{statistics.median(cpus):.3f} s ({res.candidates} candidates, {len(res.plans)} fit)",
            file=sys.stderr,
        )
    top = res.plans[: args.top]
    add_traffic(top, cluster)
    extra: dict = {}
    text_extra = ""
    if args.placement and top:
        text_extra, extra = placement_report(top[0], cluster, fabric, args.placement_rows)

    if args.json:
        out: dict = {"plans": [pl.to_json() for pl in top]}
        if args.placement and top:
            out["placement"] = extra
        json.dump(out, sys.stdout, indent=2)
        print()
        return
    print(
        f"{recipe.model.flavor} seq {recipe.training.seq_len} on {cluster.nodes} x "
        f"{cluster.gpus_per_node} {cluster.gpu} ({cluster.name}), world {res.world_size}: "
        f"{res.candidates} candidates, {len(res.plans)} fit, rejected {res.reasons()}"
    )
    if not top:
        # Why, with the numbers, and the nearest batch / node counts that fit (each searched).
        from parallel.planner import explain_infeasible

        for line in explain_infeasible(recipe, cluster, cluster.nodes, stack, res).lines():
            print(line)
        return
    print(HEADER)
    for i, pl in enumerate(top, 1):
        print(_fmt_plan_row(i, pl))
    print(
        "(GB per optimizer step over the whole job; leaf = leaving a host, spine = between leaves)"
    )
    if text_extra:
        print(text_extra)


if __name__ == "__main__":
    run(main)
