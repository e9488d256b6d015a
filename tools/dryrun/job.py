"""The dry run's job: recipe, cluster, world, layout and ranks, every check on user input
made before any process group starts (`prepare`; one line and exit 2 on bad input)."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from core.errors import ConfigError


@dataclass
class DryRunJob:
    recipe: Any  # recipe.schema.Recipe, as training would run it
    cluster: Any  # parallel.cluster.Cluster sized to the world
    world_size: int
    layout: Any  # core.axes.Layout
    ranks: list[int]
    notes: list[str] = field(default_factory=list)
    # How it was asked for: a worker process re-derives the same job from these.
    spec: list[str] = field(default_factory=list)
    # rl / [[adapters]]: the step layer's token budget per microbatch (0: not post-training).
    microbatch_tokens: int = 0

    @property
    def pp_group_size(self) -> int:
        """Ranks per pipeline stage (the pp axis is outermost in the mesh)."""
        return self.world_size // self.layout.pp

    def pp_rank(self, rank: int) -> int:
        return rank // self.pp_group_size


def _scaled_recipe(recipe, world: int, notes: list[str]):
    """The recipe on a world other than the one it declares: tp, cp, pp, dp_replicate and
    the microbatch shape kept, dp_shard takes the rest, the global batch kept (so each
    data-parallel rank trains global / dp sequences when the recipe's local batch x dp
    would exceed it). Each change is listed in `notes`."""
    r = copy.deepcopy(recipe)
    par, tr = r.parallel, r.training
    fixed = par.dp_replicate * par.cp * par.tp * par.pp
    if world % fixed:
        raise ConfigError(
            f"{world:,} GPUs cannot keep {recipe.source}'s dp_replicate x cp x tp x pp = "
            f"{fixed} (it does not divide the world size)",
            key="--nodes",
        )
    dp = world // fixed * par.dp_replicate
    notes.append(f"world {world:,} (the recipe declares {par.world_size:,}): dp_shard "
                 f"{par.dp_shard} -> {world // fixed}")  # fmt: skip
    par.world_size, par.dp_shard = 0, -1
    gbs = tr.global_batch_size
    if gbs != -1 and gbs % (tr.local_batch_size * dp):
        if gbs % dp:
            raise ConfigError(
                f"{gbs:,} sequences cannot be split over {dp:,} data-parallel ranks",
                file=recipe.source,
                key="training.global_batch_size",
            )
        local = gbs // dp
        if par.pp > 1:
            mbs = par.pp_microbatches or tr.local_batch_size
            per_mb = max(1, tr.local_batch_size // mbs)
            if local % per_mb:
                raise ConfigError(
                    f"{local} sequences per data-parallel rank do not split into microbatches "
                    f"of {per_mb}",
                    file=recipe.source,
                    key="training.global_batch_size",
                )
            if par.pp_microbatches:
                notes.append(f"pp_microbatches {par.pp_microbatches} -> {local // per_mb}")
                par.pp_microbatches = local // per_mb
        notes.append(f"local_batch_size {tr.local_batch_size} -> {local} (global {gbs:,})")
        tr.local_batch_size = local
    return r


def _fewer_microbatches(recipe, layout, n: int, notes: list[str]):
    """The recipe with `n` pipeline microbatches of the same size (the local batch shrinks
    with them, no gradient accumulation): a pipeline schedule's memory peak is reached
    once it is full, so any `n` past the schedule's in-flight depth gives the same peak at
    a fraction of the cost (benchmarks/dryrun.md measures it). Collectives are then those
    of `n` microbatches, on both sides of the comparison."""
    from tools.cli import positive_arg

    positive_arg(n, "--microbatches")
    if layout.pp == 1:
        raise ConfigError("only a pipeline (parallel.pp > 1) has microbatches to choose",
                          key="--microbatches")  # fmt: skip
    r = copy.deepcopy(recipe)
    tr, par = r.training, r.parallel
    old = par.pp_microbatches or tr.local_batch_size
    if n > old:
        raise ConfigError(f"the recipe runs {old} microbatches; at most that many",
                          key="--microbatches")  # fmt: skip
    per_mb = tr.local_batch_size // old
    notes.append(f"{n} of the recipe's {old} pipeline microbatches (--microbatches): local "
                 f"batch {tr.local_batch_size} -> {n * per_mb}")  # fmt: skip
    par.pp_microbatches = n
    tr.local_batch_size = n * per_mb
    if tr.global_batch_size != -1:
        tr.global_batch_size = n * per_mb * layout.dp
    return r


def _rl_microbatch(recipe: Any, layout: Any, cluster: Any, notes: list[str]) -> tuple[Any, int]:
    """RL trains on the step layer (runtime.steps), one microbatch of at most
    `training.microbatch_tokens` tokens (0: the largest the memory model fits on the
    profile's GPU) and `local_batch_size` rows at a time: (the recipe with that
    microbatch's rows as its local batch, the token budget). The update itself is stepped
    by tools.dryrun.posttrain."""
    import copy

    from parallel.memory import fit_microbatch_tokens, posttrain_load
    from parallel.workload import workload_from_recipe

    tr = recipe.training
    pt = posttrain_load(recipe)
    assert pt is not None  # rl.enabled
    w = workload_from_recipe(recipe, layout)
    tokens = tr.microbatch_tokens or fit_microbatch_tokens(w, pt, cluster.hbm_bytes, cluster.gpu)
    tokens = tokens or tr.seq_len  # nothing fits: one row (the dry run shows by how much)
    rows = max(1, min(tr.local_batch_size, tokens // tr.seq_len))
    r = copy.deepcopy(recipe)
    r.training.local_batch_size = rows
    notes.append(f"rl: step-layer microbatches of {rows} row(s) x {tr.seq_len} tokens "
                 f"({tokens:,}-token budget)")  # fmt: skip
    return r, tokens


def _adapters_budget(recipe: Any, layout: Any, cluster: Any, notes: list[str]) -> int:
    """[[adapters]]: the step layer's token budget as the job chooses it
    (runtime.budget.choose_microbatch_tokens: training.microbatch_tokens, else the largest
    the memory model fits on the profile's GPU)."""
    from parallel.memory import fit_microbatch_tokens, posttrain_load
    from parallel.workload import workload_from_recipe

    tr = recipe.training
    pt = posttrain_load(recipe)
    assert pt is not None  # [[adapters]]
    w = workload_from_recipe(recipe, layout)
    tokens = tr.microbatch_tokens or fit_microbatch_tokens(w, pt, cluster.hbm_bytes, cluster.gpu)
    tokens = tokens or tr.seq_len
    notes.append(f"[[adapters]]: {len(recipe.adapters)} adapters, {tokens:,}-token budget")
    return tokens


def prepare(
    recipe_path: str,
    overrides: list[str],
    *,
    cluster_name: str | None = None,
    nodes: int | None = None,
    ranks: list[int] | None = None,
    microbatches: int | None = None,
) -> DryRunJob:
    """Every check that can fail on user input, before torch.distributed is touched:
    the recipe (as training loads and validates it), the cluster profile, the world size
    and whether the recipe's degrees split it, the kernels on the profile's GPU, the
    ranks. ConfigError (one line, exit 2) otherwise."""
    from parallel.cluster import load_cluster
    from parallel.job_checks import check_kernels_on
    from parallel.planner import world_for
    from recipe.loader import blamed, check_recipe, load_recipe
    from tools.cli import positive_arg

    if nodes is not None:
        from core.hardware import MAX_NODES

        positive_arg(nodes, "--nodes", MAX_NODES)
    recipe = load_recipe(recipe_path, overrides)
    notes: list[str] = []
    with blamed(recipe):
        name = cluster_name or recipe.parallel.cluster or "local_cpu"
        cluster = load_cluster(name)
        declared = recipe.parallel.world_size
        if nodes is None and declared and declared % cluster.gpus_per_node:
            if declared > cluster.gpus_per_node:
                raise ConfigError(
                    f"{declared:,} processes are not whole nodes of {cluster.gpus_per_node} "
                    f"GPUs ({cluster.name})",
                    file=recipe.source,
                    key="parallel.world_size",
                )
            # A partial node (one GPU of gpu_slice_70b): one host of that size, as training
            # sizes the profile (runtime.session.cluster_for_job).
            cluster = load_cluster(name, nodes=1, overrides=[
                f"gpus_per_node={declared}", f"nvlink_domain_gpus={declared}"])  # fmt: skip
        cluster, world = world_for(recipe, cluster, nodes)
        if declared and declared != world:
            recipe = _scaled_recipe(recipe, world, notes)
        if recipe.parallel.auto:
            # What training does at start-up (runtime.session.apply_auto_plan).
            from parallel.planner import apply_plan, best_plan

            plan = best_plan(recipe, cluster, nodes=cluster.nodes)
            planned = apply_plan(recipe, plan)
            planned.source = recipe.source
            recipe = planned
            notes.append(f"parallel.auto: the planner's plan, {plan.describe()}")
        layout = check_recipe(recipe, world)
        budget = 0
        if recipe.rl.enabled:
            recipe, budget = _rl_microbatch(recipe, layout, cluster, notes)
            layout = check_recipe(recipe, world)
        elif recipe.adapters:
            budget = _adapters_budget(recipe, layout, cluster, notes)
        if microbatches is not None:
            recipe = _fewer_microbatches(recipe, layout, microbatches, notes)
            layout = check_recipe(recipe, world)
        check_kernels_on(recipe, cluster, cp=layout.cp)
    spec = [f"--recipe={recipe_path}", *(f"--set={o}" for o in overrides)]
    spec += [f"--cluster={cluster_name}"] if cluster_name else []
    spec += [f"--nodes={nodes}"] if nodes is not None else []
    spec += [f"--microbatches={microbatches}"] if microbatches is not None else []
    job = DryRunJob(recipe, cluster, world, layout, [], notes, spec, budget)
    chosen = list(ranks) if ranks else [0]
    for r in chosen:
        if not 0 <= r < world:
            raise ConfigError(f"rank {r} is outside the world of {world:,} ranks (0..{world - 1})",
                              key="--rank")  # fmt: skip
    if not ranks and layout.pp > 1:
        chosen.append(world - 1)  # the last pipeline rank: the last (or middle V) stages
    if layout.pp > 1 and all(job.pp_rank(r) for r in chosen):
        chosen.insert(0, 0)
        notes.append("rank 0 (pipeline stage 0) added: its forward gives the stage-boundary "
                     "metadata the fake backend cannot send")  # fmt: skip
    job.ranks = sorted(dict.fromkeys(chosen), key=lambda r: (job.pp_rank(r) != 0, r))
    return job
