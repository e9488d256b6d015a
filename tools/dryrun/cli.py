"""Build and step the real model at the recipe's full world size on one CPU: a dry run.

    python -m tools.dryrun --recipe R [--cluster C] [--nodes N] [--rank r ...] [--set k=v ...]
                           [--json]

For each chosen rank (default: rank 0, and with pipeline parallelism also the last rank, so
the first and the last stage are both covered) one process initialises torch's `fake`
process-group backend at the job's world size, builds the model exactly as training does
(recipe -> `runtime.build.build_trainer_config` -> torchtitan's Trainer: the same
parallelize function, FSDP2 x TP x PP x CP, converters, activation checkpointing) under
`FakeTensorMode`, and runs one full training step (forward, chunked loss, backward,
gradient clipping, optimizer step; with PP the rank's own stages under the real schedule).
Nothing is allocated and collectives are no-ops; torch's `MemTracker` measures the rank's
memory and `CommDebugMode` its collectives, by mesh axis, beside the planner's memory model
(`parallel.memory`) and the performance model's communication volumes (`parallel.perf`).

What the fake backend cannot carry is named in every report (`not_covered`) and in
docs/dryrun.md: pipeline send/recv carries no data (the stage-boundary metadata comes from
stage 0's own forward instead), backward on fake *cuda* tensors (the step runs on the cpu
device type), torch.compile and async TP (eager instead), CUDA graphs, and memory outside
the caching allocator's tensors (NCCL buffers, fragmentation, CUDA context).

This module is the command line (`python -m tools.dryrun`, tools/dryrun/__main__.py); the
rest of the package is listed in tools/dryrun/__init__.py.
"""

from __future__ import annotations

import argparse
import json
import sys

from core.errors import exit_on_config_error
from tools.cli import ArgumentParser, add_cluster_arg, add_override_arg, add_recipe_arg
from tools.dryrun.job import prepare
from tools.dryrun.report import render
from tools.dryrun.runner import run_job, run_worker


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(
        prog="python -m tools.dryrun",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_recipe_arg(p, required=True)
    add_cluster_arg(p, help="cluster profile (default: the recipe's parallel.cluster)")
    p.add_argument("--nodes", type=int, default=None,
                   help="nodes (default: the recipe's world size / GPUs per node)")  # fmt: skip
    p.add_argument("--rank", type=int, action="append", default=None,
                   help="rank to simulate (repeatable; default 0, and the last rank with PP)")  # fmt: skip
    add_override_arg(p, "override a recipe key (repeatable), the same keys as train.py")
    p.add_argument("--microbatches", type=int, default=None,
                   help="pipeline microbatches to run (default: the recipe's; see docs/dryrun.md)")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--state", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


@exit_on_config_error
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    job = prepare(args.recipe, args.overrides, cluster_name=args.cluster, nodes=args.nodes,
                  ranks=args.rank, microbatches=args.microbatches)  # fmt: skip
    if args.worker is not None:
        run_worker(job, args.worker, args.state)
        return 0
    result = run_job(job)
    if args.json:
        json.dump(result, sys.stdout, indent=1)
        print()
    else:
        print(render(result))
    return 1 if any("error" in r for r in result["ranks"]) else 0
