"""What the models say for a dry-run rank: the memory model (parallel.memory) and the
performance model's collectives (parallel.perf) for the rank's pipeline stage."""

from __future__ import annotations

from typing import Any

from parallel.memory import GIB
from tools.dryrun.job import DryRunJob


def _layers_of(job: DryRunJob, pp_rank: int) -> tuple[list[int], int]:
    """(stage indices, transformer blocks) pipeline rank `pp_rank` holds, as the memory model
    splits them (parallel.memory: torchtitan's split)."""
    from parallel.memory import rank_stages, stage_layers
    from parallel.workload import workload_from_recipe

    w = workload_from_recipe(job.recipe, job.layout, job.cluster)
    per_stage = stage_layers(w.shape.n_layers, job.layout.pp * w.stages_per_rank)
    stages = rank_stages(pp_rank, job.layout.pp, w.pp_schedule, w.stages_per_rank)
    return stages, sum(per_stage[i] for i in stages)


def planned(job: DryRunJob, rank: int) -> dict[str, Any]:
    """The memory model (parallel.memory) and the perf model's collectives (parallel.perf)
    for this rank's pipeline stage, as the dry run runs it (eager) and as the recipe asks
    (compiled, when it does)."""
    from parallel.memory import estimate_rank, runtime_overhead_gib
    from parallel.perf import _collectives  # the volumes the time model prices
    from parallel.workload import workload_from_recipe

    pp_rank = job.pp_rank(rank)
    w = workload_from_recipe(job.recipe, job.layout, job.cluster)
    eager = estimate_rank(w.with_(compile=False), pp_rank)
    stages, layers = _layers_of(job, pp_rank)
    colls: dict[str, dict[str, float]] = {}
    for c in _collectives(w, layers, expert=True):
        row = colls.setdefault(f"{c.axis}.{c.kind}", {"count": 0, "gib": 0.0})
        row["count"] += c.count
        row["gib"] += c.nbytes * c.count / GIB
    terms = {k: round(v, 3) for k, v in eager.breakdown_gib().items()}
    terms["runtime_overhead"] = runtime_overhead_gib(job.cluster.gpu)
    out: dict[str, Any] = {
        "planned_gib": round(eager.allocated / GIB, 3),
        "planned": terms,
        "planned_reserved_gib": round(eager.reserved_gib, 3),
        "planned_required_gib": round(
            eager.reserved_gib + runtime_overhead_gib(job.cluster.gpu), 3
        ),
        "planned_stages": stages,
        "planned_layers": layers,
        "predicted_collectives": {
            k: {"count": round(v["count"], 1), "gib": round(v["gib"], 3)}
            for k, v in sorted(colls.items())
        },
    }
    if w.compile:
        comp = estimate_rank(w, pp_rank)
        out["planned_gib_compiled"] = round(comp.allocated / GIB, 3)
    if job.microbatch_tokens:
        # The step layer runs eager (no compiled figure: tools.launch takes nothing off).
        out.pop("planned_gib_compiled", None)
        out.update(_planned_posttrain(job, w))
    return out


def _planned_posttrain(job: DryRunJob, w: Any) -> dict[str, Any]:
    """RL: tools.predict's post-training figure (parallel.memory.posttrain_memory: the
    trainer with one microbatch of the budget, the step layer's logits, the generator
    copies, the reference and the KV cache), eager, as the dry run steps it."""
    from dataclasses import replace

    from parallel.job_checks import planning_caps
    from parallel.memory import (
        estimate_rank,
        posttrain_load,
        posttrain_memory,
        runtime_overhead_gib,
    )

    pt = posttrain_load(job.recipe, job.microbatch_tokens)
    assert pt is not None
    if not planning_caps(job.cluster.gpu).is_cuda:  # CPU ranks: dense attention's scores
        pt = replace(pt, dense_attention_len=job.recipe.training.seq_len)
    if job.recipe.rl.generator == "vllm":  # the engine's memory is its own process's
        pt = replace(pt, generator_copies=0, generation=False)
    est = posttrain_memory(w.with_(compile=False), pt)
    terms = {k: round(v, 3) for k, v in est.breakdown_gib().items()}
    terms["runtime_overhead"] = runtime_overhead_gib(job.cluster.gpu)
    return {
        "planned_gib": round(est.allocated / GIB, 3),
        "planned": terms,
        "planned_reserved_gib": round(est.reserved_gib, 3),
        "planned_required_gib": round(est.required_gib_on(job.cluster.gpu), 3),
        "planned_trainer_step_gib": round(
            estimate_rank(w.with_(compile=False), 0).allocated / GIB, 3
        ),
    }
