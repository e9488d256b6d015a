"""Render a Slurm batch script for a recipe on a cluster and submit it.

    python -m tools.launch --recipe recipes/llama3_70b_b200.toml --cluster hgx_b200_ib \\
        --nodes 8 --partition gpu [--account A] [--qos Q] --time 04:00:00 [--dry-run] \\
        [--set k=v ...] [--out DIR]

The script (written to <out>/<job name>.sbatch, next to the run's metrics and checkpoints)
runs one torchrun per node with one process per GPU, node ranks in switch order, NCCL
settings from the profile's [nccl] table, `--switches` for the fewest leaf switches, and a
SIGUSR1 before the time limit that checkpoints, stops and requeues. See docs/launch.md.

`--serve` launches a model resource instead of training: `tools.serve` on every GPU of the
nodes (the base FSDP2-sharded over all of them, rank 0 serving HTTP; docs/service.md), its
checkpoints in <out>/service; `--serve-arg` passes tools.serve's options (e.g.
`--serve-arg=--host=0.0.0.0 --serve-arg=--api-key-file=/shared/keys.txt`). The resource is
planned (parallel/serve.py) and its options checked before anything is submitted.

`--local` runs a [fault_tolerance] recipe on this machine instead (no Slurm, no --cluster):

    python -m tools.launch --local --recipe R --set fault_tolerance.enabled=true \\
        --set fault_tolerance.replica_groups=2 --nproc-per-group 2

a torchft lighthouse and one torchrun per replica group; a group that dies is restarted
alone (launch/ft_local.py). On Slurm the same recipe gets a script with the lighthouse as a
job step and one job step per replica group on its own nodes (whole nodes, consecutive in
switch order), a failed group's step re-launched alone (docs/fault_tolerance.md).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

from core.errors import ConfigError, exit_on_config_error
from core.safe_text import SBATCH_PATH, SBATCH_PATH_ALLOWED, check_path, check_word
from tools.cli import ArgumentParser, add_cluster_arg, add_override_arg, add_recipe_arg, run


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from launch.sbatch import DEFAULT_SIGNAL_SECONDS, DEFAULT_SWITCH_WAIT

    p = ArgumentParser(
        prog="python -m tools.launch",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_recipe_arg(p, required=True)
    add_cluster_arg(p, help="cluster profile TOML or a name in clusters/ (not with --local)")
    p.add_argument("--nodes", type=int, default=None, help="nodes to allocate (not with --local)")
    p.add_argument(
        "--local",
        action="store_true",
        help="[fault_tolerance] recipes: run the lighthouse and one torchrun per replica group "
        "on this machine, restarting a dead group alone",
    )
    p.add_argument(
        "--nproc-per-group", type=int, default=1, help="with --local: ranks per replica group"
    )
    p.add_argument(
        "--max-group-restarts",
        type=int,
        default=3,
        help="[fault_tolerance] recipes: group restarts before the launch gives up (--local: "
        "in all; Slurm: per group, each group's job step re-launched alone)",
    )
    p.add_argument("--partition", default="", help="Slurm partition")
    p.add_argument("--time", default="", help="time limit (Slurm format, e.g. 04:00:00)")
    p.add_argument("--account", default="", help="Slurm account")
    p.add_argument("--qos", default="", help="Slurm quality of service")
    p.add_argument("--job-name", default="", help="job name (default: the recipe's job.name)")
    add_override_arg(p, "override a recipe key (repeatable); passed on to train.py")
    p.add_argument("--out", default=None, help="run folder (default: the recipe's job.output_dir)")
    p.add_argument("--dry-run", action="store_true", help="print the script; submit nothing")
    p.add_argument("--no-preflight", action="store_true", help="skip the pre-flight step")
    p.add_argument(
        "--dry-run-rank",
        type=int,
        action="append",
        default=None,
        metavar="RANK",
        help="before writing the script, build the model and run one training step of this "
        "rank on a fake process group at the job's full world size (tools.dryrun, minutes for "
        "the largest models; repeatable); a rank that fails or does not fit refuses the job",
    )
    p.add_argument(
        "--signal-seconds",
        type=int,
        default=DEFAULT_SIGNAL_SECONDS,
        help=f"checkpoint-and-requeue signal this long before the limit ({DEFAULT_SIGNAL_SECONDS})",
    )
    p.add_argument(
        "--switch-wait",
        default=DEFAULT_SWITCH_WAIT,
        help=f"longest wait for the fewest leaf switches ({DEFAULT_SWITCH_WAIT})",
    )
    p.add_argument(
        "--sbatch-arg",
        action="append",
        default=[],
        metavar="OPT",
        help="extra #SBATCH option, e.g. --sbatch-arg=--qos=high (repeatable)",
    )
    p.add_argument(
        "--python", default=sys.executable, help="Python on the nodes (default: this one)"
    )
    p.add_argument("--serve", action="store_true", help="a model resource (tools.serve)")
    p.add_argument(
        "--serve-arg",
        action="append",
        default=[],
        metavar="OPT",
        help="with --serve: an option for tools.serve, e.g. --serve-arg=--port=8000 (repeatable)",
    )
    p.add_argument(
        "--workdir",
        default=None,
        help="this checkout's path as the nodes see it (default: its path here); recipe and "
        "profile paths inside the checkout are rewritten to it",
    )
    return p.parse_args(argv)


def check_serve(args: argparse.Namespace, recipe, cluster) -> None:
    """--serve: tools.serve's own checks of the passed options, and the resource's plan on
    the profile's GPUs (a base the nodes cannot hold is refused before the queue)."""
    from dataclasses import replace

    from parallel.serve import plan_on_cluster, served_model
    from tools.serve import base_options, check_args, resource_of
    from tools.serve import parse_args as serve_parse_args

    if args.serve_arg and not args.serve:
        raise ConfigError("--serve-arg needs --serve", key="--serve-arg")
    if args.dry_run_rank:  # tools.dryrun steps the recipe's training layout, not a resource
        raise ConfigError("--dry-run-rank runs a training step; a resource is sized by "
                          "`tools.plan --serve`", key="--dry-run-rank")  # fmt: skip
    for a in args.serve_arg:
        check_serve_arg(a)
    sargs = serve_parse_args(["--recipe", args.recipe, *args.serve_arg])
    check_args(sargs)
    if len(sargs.recipe) > 1:  # a resource shards one base over its ranks
        raise ConfigError(
            "a model resource serves one base: pass no --recipe through --serve-arg "
            "(several bases: tools.serve --recipe A --recipe B on one device)",
            key="--serve-arg",
        )
    from service.server import ServeOptions, check_exposure

    check_exposure(ServeOptions(host=sargs.host, api_key_file=sargs.api_key_file))
    devices = args.nodes * cluster.gpus_per_node
    model = served_model(recipe, base_options(sargs)[0][1])
    cp = plan_on_cluster(model, replace(resource_of(sargs, recipe, 1), devices=devices), cluster)
    if cp.plan.problems:
        key, why = cp.plan.problems[0]
        raise ConfigError(why, file=recipe.source if "." in key else None, key=key)


@exit_on_config_error
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from launch.sbatch import REPO_ROOT, LaunchOptions, check_launch, node_path, render_sbatch
    from parallel.cluster import load_cluster, resolve_cluster_path
    from recipe.loader import load_recipe, resolve_recipe_path

    recipe = load_recipe(args.recipe, args.overrides)
    if args.local:
        return launch_local(args, recipe)
    for key, value in (("--cluster", args.cluster), ("--nodes", args.nodes)):
        if value is None:
            raise ConfigError("required (or --local for a fault-tolerant run here)", key=key)
    cluster = load_cluster(args.cluster)
    cluster_path = resolve_cluster_path(args.cluster).resolve()
    # Checked before Path.resolve (a NUL byte raises there): the folder is written into the
    # job script's #SBATCH --output line (core.safe_text).
    out_key = ("--out", None) if args.out else ("job.output_dir", recipe.source)
    check_path(args.out or recipe.output_dir, key=out_key[0], file=out_key[1])
    out = Path(args.out or recipe.output_dir).resolve()
    check_word(str(out), SBATCH_PATH, SBATCH_PATH_ALLOWED, key=out_key[0], file=out_key[1])
    workdir = args.workdir or str(REPO_ROOT)
    opts = LaunchOptions(
        nodes=args.nodes,
        output_dir=str(out),
        recipe_path=node_path(Path(resolve_recipe_path(args.recipe)), workdir),
        cluster_path=node_path(cluster_path, workdir),
        workdir=workdir,
        overrides=tuple(args.overrides),
        partition=args.partition,
        time=args.time,
        account=args.account,
        qos=args.qos,
        job_name=args.job_name,
        python=args.python,
        # the pre-flight checks the recipe's training layout; a resource shards over all
        preflight=not args.no_preflight and not args.serve,
        signal_seconds=args.signal_seconds,
        switch_wait=args.switch_wait,
        extra_sbatch=tuple(args.sbatch_arg),
        serve_args=tuple(args.serve_arg) if args.serve else None,
        max_group_restarts=args.max_group_restarts,
    )
    if args.serve or args.serve_arg:
        check_serve(args, recipe, cluster)
    layout, warnings = check_launch(recipe, cluster, opts)
    # Training's kernel check on the profile's GPU, and with `auto` the planner's choice that
    # training will make: what would fail on the nodes fails here, before the queue.
    from parallel.job_checks import check_kernels_on

    check_kernels_on(recipe, cluster, cp=layout.cp)
    if recipe.parallel.auto:
        from parallel.job_checks import check_job
        from parallel.planner import apply_plan, best_plan

        plan = best_plan(recipe, cluster, nodes=args.nodes)
        check_job(apply_plan(recipe, plan), cluster, plan.layout.world_size)
    if args.dry_run_rank:
        from tools.dryrun.runner import check_before_launch

        for line in check_before_launch(
            args.recipe, args.overrides, args.cluster, args.nodes, args.dry_run_rank
        ):
            print(line, file=sys.stderr)
    text = render_sbatch(recipe, cluster, layout, opts)
    for w in warnings:
        print(f"warning: {w}", file=sys.stderr)
    if args.dry_run:
        sys.stdout.write(text)
        return 0
    if shutil.which("sbatch") is None:
        raise ConfigError("sbatch not found on PATH (use --dry-run to only print the script)")
    out.mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(exist_ok=True)
    script = out / f"{opts.job_name or recipe.job.name}.sbatch"
    script.write_text(text)
    proc = subprocess.run(
        ["sbatch", "--parsable", str(script)], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        print(f"error: sbatch failed ({proc.returncode}): {proc.stderr.strip()}", file=sys.stderr)
        return 1
    job_id = proc.stdout.strip().split(";")[0]
    (out / "launch.json").write_text(
        json.dumps(
            {
                "job_id": job_id,
                "script": str(script),
                "nodes": opts.nodes,
                "world_size": layout.world_size,
                "layout": layout.describe(),
                "recipe": opts.recipe_path,
                "overrides": list(opts.overrides),
                "cluster": str(cluster_path),
            },
            indent=1,
        )
        + "\n"
    )
    print(f"submitted job {job_id}: {script}")
    print(f"logs: {out / 'logs'}   metrics: {out}")
    return 0


def launch_local(args: argparse.Namespace, recipe) -> int:
    """--local: a [fault_tolerance] recipe's replica groups on this machine
    (launch.ft_local), after the checks train.py makes before any process starts."""
    from launch.ft_local import GroupsPlan, run_groups
    from recipe.loader import check_trainable_fault_tolerance, replica_groups

    if not recipe.fault_tolerance.enabled:
        raise ConfigError(
            "--local runs replica groups: set fault_tolerance.enabled = true",
            file=recipe.source,
            key="fault_tolerance.enabled",
        )
    check_trainable_fault_tolerance(recipe)
    for key, n, lo in (("--nproc-per-group", args.nproc_per_group, 1),
                       ("--max-group-restarts", args.max_group_restarts, 0)):  # fmt: skip
        if n < lo:
            raise ConfigError(f"expected an integer >= {lo}, got {n}", key=key)
    groups = replica_groups(recipe)
    if groups < 2:
        raise ConfigError(
            f"fault tolerance needs at least 2 replica groups, got {groups}",
            file=recipe.source,
            key="fault_tolerance.replica_groups",
        )
    train_args = ["--recipe", args.recipe] if args.recipe else []
    for o in args.overrides:
        train_args += ["--set", o]
    out = args.out or recipe.output_dir
    if args.out:
        train_args += ["--set", f"job.output_dir={out}"]
    plan = GroupsPlan(groups=groups, nproc=args.nproc_per_group,
                      min_replicas=recipe.fault_tolerance.min_replicas,
                      train_args=tuple(train_args), out=str(Path(out).resolve()),
                      max_restarts=args.max_group_restarts)  # fmt: skip
    if args.dry_run:
        from launch.ft_local import group_command

        for g in range(groups):
            print(f"REPLICA_GROUP_ID={g} " + " ".join(group_command(plan)))
        return 0
    return run_groups(plan)


def check_serve_arg(a: str) -> None:
    """One `--serve-arg`: no control character (it ends up on a generated script's line), and
    not one of the launcher's own tools.serve options nor any prefix of one (argparse takes
    `--rec=` for `--recipe`, which silently replaced the planned recipe)."""
    bad = next((c for c in a if ord(c) < 0x20 or ord(c) == 0x7F), None)
    if bad is not None:
        raise ConfigError(f"{a!r} holds the control character {bad!r}", key="--serve-arg")
    name = a.split("=", 1)[0]
    own = [o for o in LAUNCHER_SERVE_OPTIONS if len(name) > 2 and o.startswith(name)]
    if own:
        raise ConfigError(
            f"{name} is (an abbreviation of) {own[0]}, which the launcher sets (--recipe, "
            "<out>/service, --set)",
            key="--serve-arg",
        )


# tools.serve options the launcher sets itself (the recipe, <out>/service, the overrides).
LAUNCHER_SERVE_OPTIONS = ("--recipe", "--storage", "--set")


if __name__ == "__main__":
    run(main)
