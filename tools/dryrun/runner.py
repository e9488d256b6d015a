"""The dry run's processes: each chosen rank in a fresh process of its own (`run_job`,
`run_worker`; pipeline stage 0 first), and tools.launch's check of a job's ranks before it
queues (`check_before_launch`)."""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

from core.errors import ConfigError
from core.launch_env import worker_python
from parallel.memory import GIB
from tools.cli import ROOT
from tools.dryrun.fake_world import Boundary
from tools.dryrun.job import DryRunJob, prepare
from tools.dryrun.planned import planned
from tools.dryrun.report import NOT_COVERED, compare
from tools.dryrun.step import simulate


def run_worker(job: DryRunJob, rank: int, state: str) -> None:
    """One rank in this process (a fresh one: torch keeps meshes and process-group state
    per process), its entry written to `state`/rank-<r>.json; a failure to build or step
    is written there too, as one line."""
    import logging
    import traceback
    import warnings

    boundary = Boundary(os.path.join(state, "boundary.pkl"))
    logging.getLogger().setLevel(logging.ERROR)  # torchtitan logs on the root logger
    warnings.simplefilter("ignore")
    try:
        entry = compare(simulate(job, rank, boundary), planned(job, rank))
    except Exception as e:  # the finding itself: this rank does not build or step
        last = traceback.extract_tb(e.__traceback__)[-1]
        where = f"{os.path.relpath(last.filename, _site())}:{last.lineno}"
        entry = {"rank": rank, "world_size": job.world_size,
                 "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
                          f" (at {where})"}  # fmt: skip
    boundary.save()
    with open(os.path.join(state, f"rank-{rank}.json"), "w") as f:
        json.dump(entry, f)


def _site() -> str:
    import torch

    return os.path.dirname(os.path.dirname(torch.__file__))


def run_job(job: DryRunJob) -> dict[str, Any]:
    """Every chosen rank in its own process, pipeline stage 0 first (its forward gives the
    stage-boundary metadata the later ranks receive), in `worker_python()`'s interpreter."""
    import subprocess

    ranks = []
    with tempfile.TemporaryDirectory(prefix="dryrun-state-") as state:
        for rank in job.ranks:
            cmd = [worker_python(), "-m", "tools.dryrun", *job.spec, f"--worker={rank}",
                   f"--state={state}"]  # fmt: skip
            # The worker imports this checkout's modules whatever the caller's folder.
            path_env = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
            proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                  text=True, check=False, env={**os.environ, "PYTHONPATH": path_env})  # fmt: skip
            path = os.path.join(state, f"rank-{rank}.json")
            if os.path.exists(path):
                with open(path) as f:
                    ranks.append(json.load(f))
            else:
                tail = [ln for ln in proc.stderr.splitlines() if ln.strip()][-1:] or ["no output"]
                ranks.append({"rank": rank, "world_size": job.world_size,
                              "error": f"worker exited with {proc.returncode}: {tail[0][:300]}"})  # fmt: skip
    lay = job.layout
    return {
        "recipe": job.recipe.source,
        "model": f"{job.recipe.model.family} {job.recipe.model.flavor}",
        "cluster": job.cluster.name,
        "gpu": job.cluster.gpu,
        "world_size": job.world_size,
        "layout": {a: getattr(lay, a) for a in ("pp", "dp_replicate", "dp_shard", "cp", "tp")},
        "local_batch_size": job.recipe.training.local_batch_size,
        "notes": job.notes,
        "not_covered": NOT_COVERED,
        "ranks": ranks,
    }


def check_before_launch(
    recipe_path: str, overrides: list[str], cluster_name: str, nodes: int, ranks: list[int]
) -> list[str]:
    """tools.launch --dry-run-rank: the job's ranks built and stepped at its world size; a
    rank that fails, or whose measured peak with the planner's fragmentation and
    outside-the-allocator terms does not fit the GPU, refuses the job (ConfigError, exit 2)
    before it queues. Returns one summary line per rank."""
    from parallel.memory import ALLOCATOR_FRAGMENTATION, runtime_overhead_gib

    job = prepare(recipe_path, overrides, cluster_name=cluster_name, nodes=nodes, ranks=ranks)
    result = run_job(job)
    hbm = job.cluster.hbm_bytes / GIB
    overhead = runtime_overhead_gib(job.cluster.gpu)
    lines = []
    for r in result["ranks"]:
        if "error" in r:
            raise ConfigError(f"rank {r['rank']} does not build or step at world "
                              f"{job.world_size:,}: {r['error']}", key="--dry-run-rank")  # fmt: skip
        # The dry run is eager; a compiled job keeps less by the planner's count of what
        # compile saves (its SwiGLU and loss fusion), taken off the measured peak.
        saving = r["planned_gib"] - r["planned"].get("planned_gib_compiled", r["planned_gib"])
        peak = r["peak_gib"] - saving
        need = peak * (1 + ALLOCATOR_FRAGMENTATION) + overhead
        how = f" ({r['peak_gib']:.1f} eager less {saving:.1f} compile saves)" if saving else ""
        if need > hbm:
            raise ConfigError(
                f"rank {r['rank']} peaks at {peak:.1f} GiB{how}; with the allocator's "
                f"{ALLOCATOR_FRAGMENTATION:.0%} and {overhead:g} GiB outside it, {need:.1f} "
                f"GiB does not fit the {hbm:.0f} GiB of a {job.cluster.gpu}",
                key="--dry-run-rank",
            )
        lines.append(f"dry run: rank {r['rank']} builds and steps at world {job.world_size:,}; "
                     f"peak {peak:.1f} GiB{how} (planned {r['planned_gib'] - saving:.1f}), "
                     f"{need:.1f} of {hbm:.0f} GiB with fragmentation and overhead")  # fmt: skip
    return lines
