"""Rank the parallel plans for a recipe on a cluster (no process group, no GPU).

    python -m tools.plan --recipe R --cluster C [--nodes N] [--top K] [--json] [--placement]
                         [--set k=v ...] [--shuffle-hosts SEED]
                         [--slurm-topology FILE --nodelist HOSTLIST]
    python -m tools.plan --serve --recipe R --cluster C [--nodes N] [--context T]
                         [--generators 0|1] [--generator-tokens T] [--adapters N] [--json]
    python -m tools.plan --serve --recipe A --recipe B ... --cluster C [...]

The table: degrees, schedule, microbatches, activation checkpointing, memory GiB/GPU,
predicted tokens/s/GPU, MFU, and GB per step crossing leaf switches (leaving a host) and
the spine (between leaves) under the planned placement. `--placement` prints the best
plan's rank -> host -> switch table and groups, and its cross-switch traffic against
plain rank order on the same (launch-ordered) hosts. `--shuffle-hosts` emulates an
arbitrary rendezvous order; `--slurm-topology`/`--nodelist` take the hosts from Slurm.

`--serve`: the recipe's base as a model resource (`tools.serve` under torchrun, the base
FSDP2-sharded over every GPU, parallel/serve.py): per resource size (1, 2, 4 ... GPUs, then
1, 2, 4 ... nodes up to --nodes, default the profile's), the memory per GPU by part, whether
it fits, the budgets tools.serve would choose, and estimated forward_backward tokens/s and
decode seconds per step; then the smallest resource that holds it. Several `--recipe`: the
bases one `tools.serve --recipe A --recipe B` process holds on one GPU, priced together (each
base's resident part, the largest transient part; parallel.serve.plan_together), and why the
set does not fit when it does not.
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
    positive_arg,
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
        f"{i:>3} {lay.pp:>3} {lay.dp_replicate:>4} {lay.dp_shard:>5} {lay.cp:>3} {lay.tp:>3} "
        f"{p.ep:>3}  "
        f"{sched:<21} {p.microbatches:>4} {p.activation_checkpoint:<9} {p.local_batch_size:>5} "
        f"{p.memory_gib:>7.1f} {p.tokens_per_sec_per_gpu:>9.1f} {mfu:>6} "
        f"{cs.get('leaf', 0):>10.1f} {cs.get('spine', 0):>9.1f}"
    )


HEADER = (
    f"{'#':>3} {'pp':>3} {'rep':>4} {'shard':>5} {'cp':>3} {'tp':>3} {'ep':>3}  {'schedule':<21} "
    f"{'mb':>4} "
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


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """--serve and the resource's options (tools.serve's own names)."""
    from tools.serve import add_resource_args

    p.add_argument("--serve", action="store_true", help="price the base as a model resource")
    p.add_argument("--context", type=int, default=None,
                   help="--serve: tokens per sequence (default training.seq_len)")  # fmt: skip
    add_resource_args(p)


def serve_inputs(args: argparse.Namespace, recipe_path: str | None = None):
    """(recipe, cluster profile, served model, resource of 1 device) for --serve, checked
    (`recipe_path`: one of several --recipe; default the first)."""
    from parallel.cluster import load_cluster
    from parallel.serve import served_model
    from recipe.loader import load_recipe
    from tools.serve import check_resource_args, resource_of

    check_resource_args(args)
    if args.context is not None:
        positive_arg(args.context, "--context", bound=1 << 24)
    if args.nodes is not None:
        from core.hardware import MAX_NODES

        positive_arg(args.nodes, "--nodes", MAX_NODES)
    first = args.recipe if isinstance(args.recipe, str) else args.recipe[0]  # tools.predict: one
    recipe = load_recipe(recipe_path or first, args.overrides)
    cluster = load_cluster(args.cluster)
    return recipe, cluster, served_model(recipe, args.context), resource_of(args, recipe, 1)


def serve_row(cp) -> str:
    b = cp.plan.memory.breakdown_gib()
    sp = cp.speed
    fb = f"{sp.forward_backward_tokens_per_s:>10,.0f}" if sp else f"{'-':>10}"
    dec = f"{sp.decode_step_s:>8.3f}" if sp else f"{'-':>8}"
    mem = cp.plan.memory
    return (
        f"{cp.devices:>6} {cp.nodes:>5} {'yes' if cp.plan.fits else 'NO':>4} "
        f"{mem.required_gib_on(cp.plan.kind):>7.1f} {b['base_shard']:>6.1f} "
        f"{b['unsharded_blocks']:>6.1f} {b['adapters'] + b['sampler_snapshots']:>6.1f} "
        f"{b['training_microbatch']:>6.1f} {b['generator_kv_and_work']:>6.1f} "
        f"{mem.microbatch_tokens:>8,} {mem.generator_tokens:>9,} {cp.plan.concurrent_samples:>5} "
        f"{fb} {dec}"
    )


SERVE_HEADER = (
    f"{'GPUs':>6} {'nodes':>5} {'fits':>4} {'GiB/GPU':>7} {'base':>6} {'gather':>6} "
    f"{'adapt':>6} {'train':>6} {'gen':>6} {'mb tok':>8} {'gen tok':>9} {'rows':>5} "
    f"{'fb tok/s':>10} {'dec s':>8}"
)


def serve_together(args: argparse.Namespace) -> None:
    """Several --recipe: the bases one `tools.serve` process holds on one GPU, priced
    together (parallel.serve.plan_together: residents add up, one operation at a time)."""
    from parallel.memory import GIB
    from parallel.serve import plan_together, together_gib, together_problem

    inputs = [serve_inputs(args, r) for r in args.recipe]
    cluster = inputs[0][1]
    names = [f"{r.job.name} ({r.model.flavor})" for r, _, _, _ in inputs]
    models, resources = [m for _, _, m, _ in inputs], [r for _, _, _, r in inputs]
    plans = plan_together(models, resources, cluster.hbm_bytes, cluster.gpu)
    why = together_problem(names, plans, cluster.hbm_bytes)
    if args.json:
        out = {
            "bases": [
                {
                    "recipe": r.source,
                    "context": m.context,
                    "resident_gib": round(p.memory.resident / GIB, 3),
                    "transient_gib": round((p.memory.allocated - p.memory.resident) / GIB, 3),
                    "microbatch_tokens": p.memory.microbatch_tokens,
                    "generator_tokens": p.memory.generator_tokens,
                    "problems": [{"key": k, "why": w} for k, w in p.problems],
                }
                for (r, _, m, _), p in zip(inputs, plans, strict=True)
            ],
            "gib_per_device": round(together_gib(plans), 2),
            "device_gib": round(cluster.hbm_bytes / GIB, 1),
            "fits": why is None,
            "problem": why,
        }
        json.dump(out, sys.stdout, indent=2)
        print()
        return
    print(
        f"{len(plans)} bases served together by one tools.serve process on one {cluster.gpu} "
        f"({cluster.hbm_bytes / GIB:.1f} GiB, {cluster.name}): the residents add up, one "
        "operation runs at a time (a model resource over several GPUs serves one base)"
    )
    print(f"{'base':<36} {'context':>7} {'resident':>8} {'transient':>9} {'mb tok':>8} "
          f"{'gen tok':>9} {'rows':>5} fits")  # fmt: skip
    for name, m, p in zip(names, models, plans, strict=True):
        mem = p.memory
        print(
            f"{name[:36]:<36} {m.context:>7,} {mem.resident / GIB:>8.2f} "
            f"{(mem.allocated - mem.resident) / GIB:>9.2f} {mem.microbatch_tokens:>8,} "
            f"{mem.generator_tokens:>9,} {p.concurrent_samples:>5} {'yes' if p.fits else 'NO'}"
        )
    print(f"together: {together_gib(plans):.2f} GiB per device with fragmentation and runtime "
          "(GiB: resident = base + adapters + snapshots; transient = the larger of a training "
          "microbatch and the generator's work)")  # fmt: skip
    print(why if why is not None else "fits")


def serve_main(args: argparse.Namespace) -> None:
    from dataclasses import replace

    from parallel.serve import plan_on_cluster, resource_sizes

    if len(args.recipe) > 1:
        serve_together(args)
        return
    recipe, cluster, model, res = serve_inputs(args)
    nodes = args.nodes or cluster.nodes
    rows = [
        plan_on_cluster(model, replace(res, devices=n), cluster)
        for n in resource_sizes(cluster.gpus_per_node, nodes)
    ]
    best = next((r for r in rows if r.plan.fits), None)
    if args.json:
        out = {"resources": [r.to_json() for r in rows],
               "smallest": best.to_json() if best else None}  # fmt: skip
        json.dump(out, sys.stdout, indent=2)
        print()
        return
    gen = (
        f"generator {'auto' if not res.generator_tokens else f'{res.generator_tokens:,} tokens'}"
        if res.generators
        else "no generator"
    )
    print(
        f"{recipe.model.flavor} served as a LoRA resource ({recipe.training.dtype}, context "
        f"{model.context:,}, rank {model.lora_rank}, {res.adapters} adapters, {gen}, AC "
        f"{recipe.training.activation_checkpoint}) on {cluster.gpu} "
        f"({cluster.hbm_bytes / 2**30:.1f} GiB, {cluster.name}); FSDP2 over every GPU, tp 1"
    )
    print(SERVE_HEADER)
    for r in rows:
        print(serve_row(r))
    print("(GiB per GPU with fragmentation and runtime; gather: FSDP's unsharded blocks; "
          "train/gen: the larger counts; fb tok/s: the whole resource; dec s: one decode step "
          "of every row)")  # fmt: skip
    if best is None:
        print(f"no resource of up to {nodes} nodes holds it: {rows[-1].plan.problems[0][1]}")
        return
    print(
        f"smallest resource: {best.devices} x {cluster.gpu} ({best.nodes} node(s)): "
        f"{best.plan.memory.describe(cluster.gpu)}"
    )


@exit_on_config_error
def main(argv: list[str] | None = None) -> None:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_recipe_cluster_args(
        p,
        repeat=True,
        recipe_help="recipe TOML or a name in recipes/; with --serve, repeat it to price "
        "several bases served by one process",
    )
    add_serve_args(p)
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
    if args.serve:
        serve_main(args)
        return
    if len(args.recipe) > 1:
        raise ConfigError("several recipes are priced together only with --serve", key="--recipe")
    args.recipe = args.recipe[0]
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
    for i, pl in enumerate(top, 1):
        if pl.ep > 1:  # MoE: where each plan's expert all-to-all runs
            print(f"plan {i}: ep {pl.ep} all-to-all over {pl.ep_fabric}; {pl.ep_placement}")
    if text_extra:
        print(text_extra)


if __name__ == "__main__":
    run(main)
