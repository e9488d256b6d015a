"""The planner: every valid parallel plan for a recipe on a cluster, ranked by predicted
training tokens/s per GPU; plans that do not fit in memory are dropped with the reason.

Search space, for world size W = nodes x gpus_per_node:
- tp x cp divides the NVLink domain (every tp and cp group inside one domain; tp also
  divides the query and key/value heads), pp splits the layers evenly
  (`recipe.loader.check_layout`, the same check a hand-written recipe gets), and
  dp_replicate x dp_shard takes the rest in every factorisation;
- pp_schedule (all of torchtitan's, when pp > 1; zero-bubble schedules only without
  activation checkpointing, which torchtitan cannot combine with them) and microbatches
  (divisors of the local batch, at least pp);
- activation checkpointing none / selective / full;
- the batch: with `training.global_batch_size` set, the global batch is kept and each
  plan picks the largest local batch that fits (the rest is gradient accumulation; with
  pp the whole share is one pipelined step); with -1 the recipe's local batch is kept.

Everything is a pure function of (recipe, cluster): no torch.distributed, no GPU.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any, NamedTuple, cast

from parallel.axes import Layout
from parallel.cluster import Cluster
from parallel.memory import MemoryProfile, memory_profile, runtime_overhead_gib
from parallel.perf import Prediction, predict
from parallel.placement import planned_traffic
from parallel.workload import Workload, linear_for, lora_fields, planned_spans
from recipe.errors import ConfigError
from recipe.loader import check_layout
from recipe.models import PP_SCHEDULES, model_shape
from recipe.schema import Recipe

AC_MODES = ("none", "selective", "full")
ZERO_BUBBLE = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


@dataclass
class Plan:
    layout: Layout
    pp_schedule: str | None  # None without pp
    microbatches: int  # PP microbatches, or gradient-accumulation microsteps without pp
    activation_checkpoint: str
    local_batch_size: int
    global_batch_size: int
    prediction: Prediction
    cross_switch: dict[str, float] = field(default_factory=dict)  # GB/step: leaf, spine

    @property
    def tokens_per_sec_per_gpu(self) -> float:
        return self.prediction.tokens_per_sec_per_gpu

    @property
    def memory_gib(self) -> float:
        return self.prediction.memory.reserved_gib

    def describe(self) -> str:
        sched = f" {self.pp_schedule} x{self.microbatches}" if self.pp_schedule else ""
        return f"{self.layout.describe()}{sched} ac={self.activation_checkpoint}"

    def to_json(self) -> dict:
        lay = self.layout
        p = self.prediction
        return {
            "dp_replicate": lay.dp_replicate,
            "dp_shard": lay.dp_shard,
            "tp": lay.tp,
            "pp": lay.pp,
            "cp": lay.cp,
            "pp_schedule": self.pp_schedule,
            "microbatches": self.microbatches,
            "activation_checkpoint": self.activation_checkpoint,
            "memory_gib_per_gpu": round(p.memory.reserved_gib, 2),
            "tokens_per_sec_per_gpu": round(p.tokens_per_sec_per_gpu, 1),
            "mfu_pct": None if p.mfu_pct is None else round(p.mfu_pct, 2),
            "cross_switch_gb_per_step": dict(self.cross_switch),
            "local_batch_size": self.local_batch_size,
            "global_batch_size": self.global_batch_size,
            "step_time_s": round(p.step_time_s, 4),
            "tokens_per_sec_per_node": round(p.tokens_per_sec_per_node, 1),
        }


class Rejected(NamedTuple):
    layout: Layout
    pp_schedule: str | None
    microbatches: int
    activation_checkpoint: str
    reason: str


@dataclass
class SearchResult:
    plans: list[Plan]  # fitting plans, best first
    rejected: list[Rejected]
    world_size: int
    candidates: int

    def reasons(self) -> dict[str, int]:
        """Rejection counts by the kind of reason (first clause)."""
        out: dict[str, int] = {}
        for r in self.rejected:
            k = r.reason.split(":")[0]
            out[k] = out.get(k, 0) + 1
        return out


def _divisors(n: int) -> list[int]:
    small, large = [], []
    i = 1
    while i * i <= n:
        if n % i == 0:
            small.append(i)
            if i * i != n:
                large.append(n // i)
        i += 1
    return small + large[::-1]


def world_for(recipe: Recipe, cluster: Cluster, nodes: int | None) -> tuple[Cluster, int]:
    """The cluster for the job: `nodes`, else the recipe's declared world size, else the
    profile's node count."""
    if nodes is None and recipe.parallel.world_size:
        ws = recipe.parallel.world_size
        if ws % cluster.gpus_per_node == 0:
            nodes = ws // cluster.gpus_per_node
    if nodes is not None and nodes != cluster.nodes:
        cluster = cluster.with_nodes(nodes)
    return cluster, cluster.world_size


def _layout_recipe(recipe: Recipe, schedule: str, mbs: int, local: int) -> Recipe:
    """A shallow copy with the fields check_layout reads set (no validation re-run)."""
    r = copy.copy(recipe)
    r.parallel = copy.copy(recipe.parallel)
    r.parallel.pp_schedule = schedule  # type: ignore[assignment]
    r.parallel.pp_microbatches = mbs
    r.training = copy.copy(recipe.training)
    r.training.local_batch_size = local
    r.source = recipe.source
    return r


def search(recipe: Recipe, cluster: Cluster, nodes: int | None = None) -> SearchResult:
    """All candidates, fitting plans ranked by predicted tokens/s per GPU."""
    cluster, world = world_for(recipe, cluster, nodes)
    shape = model_shape(recipe.model.flavor, recipe.model.family)
    tr = recipe.training
    linear = linear_for(recipe.kernels.linear, cluster.gpu)
    hbm_gib = cluster.hbm_bytes / 2**30
    overhead = runtime_overhead_gib(cluster.gpu)
    dom = cluster.nvlink_domain_gpus
    gbs = tr.global_batch_size
    plans: list[Plan] = []
    rejected: list[Rejected] = []
    candidates = 0
    base = Workload(
        shape=shape,
        seq_len=tr.seq_len,
        local_batch_size=tr.local_batch_size,
        linear=linear,
        compile=tr.compile,
        dtype=tr.dtype,
        **lora_fields(recipe),
    )
    # Memory depends on dp only through dp_shard (the FSDP shard count); validity not on
    # dp at all. Both are cached across the dp_replicate x dp_shard factorisations.
    valid: dict[tuple, str] = {}
    profiles: dict[tuple, MemoryProfile] = {}

    def why_invalid(layout: Layout, sched: str, mbs: int, local: int) -> str:
        key = (layout.tp, layout.cp, layout.pp, sched, mbs, local)
        if key not in valid:
            try:
                check_layout(_layout_recipe(recipe, sched, mbs, local), layout)
                valid[key] = ""
            except ConfigError as e:
                valid[key] = f"invalid: {e.detail}"
        return valid[key]

    for inner in _divisors(min(world, dom)):
        if world % inner or dom % inner:
            continue
        for tp in _divisors(inner):
            cp = inner // tp
            for pp in _divisors(world // inner):
                dp = world // (inner * pp)
                if gbs != -1 and gbs % dp:
                    continue
                share = tr.local_batch_size if gbs == -1 else gbs // dp
                if pp > 1:
                    schedules = list(PP_SCHEDULES)
                    locals_ = [share]
                else:
                    schedules = [recipe.parallel.pp_schedule]
                    locals_ = [share] if gbs == -1 else sorted(_divisors(share), reverse=True)
                options = []  # (schedule, microbatches) that pass the layout checks
                probe = Layout(pp=pp, dp_shard=dp, cp=cp, tp=tp)
                for sched in schedules:
                    mb_opts = [0]
                    if pp > 1:
                        mb_opts = [m for m in _divisors(share) if m >= pp or sched == "GPipe"]
                        mb_opts = mb_opts or [share]
                    for mbs in mb_opts:
                        reason = why_invalid(probe, sched, mbs, locals_[-1])
                        options.append((sched, mbs, reason))
                for rep in _divisors(dp):
                    layout = Layout(pp=pp, dp_replicate=rep, dp_shard=dp // rep, cp=cp, tp=tp)
                    spans = None
                    for sched, mbs, reason in options:
                        sched_out = sched if pp > 1 else None
                        if reason:
                            candidates += 1
                            rejected.append(Rejected(layout, sched_out, mbs, "-", reason))
                            continue
                        for ac in AC_MODES:
                            candidates += 1
                            if pp > 1 and sched in ZERO_BUBBLE and ac != "none":
                                rejected.append(
                                    Rejected(
                                        layout,
                                        sched,
                                        mbs,
                                        ac,
                                        "unsupported: torchtitan's zero-bubble schedules "
                                        "cannot run with activation checkpointing",
                                    )
                                )
                                continue
                            fit = None
                            last_reason = ""
                            for local in locals_:
                                mkey = (tp, cp, pp, sched, mbs, ac, local)
                                accum = 1 if (pp > 1 or gbs == -1) else gbs // (dp * local)
                                prof = profiles.get(mkey)
                                if prof is None:
                                    prof = profiles[mkey] = memory_profile(
                                        dataclasses.replace(
                                            base,
                                            layout=probe,
                                            local_batch_size=local,
                                            pp_schedule=sched if pp > 1 else "1F1B",
                                            pp_microbatches=mbs,
                                            ac=ac,
                                        )
                                    )
                                need = prof.required_gib((dp // rep) * cp, overhead)
                                if need <= hbm_gib:
                                    fit = (local, accum, prof.at((dp // rep) * cp))
                                    break
                                last_reason = (
                                    f"memory: needs {need:.1f} GiB of "
                                    f"{hbm_gib:.1f} (local batch {local})"
                                )
                            if fit is None:
                                rejected.append(Rejected(layout, sched_out, mbs, ac, last_reason))
                                continue
                            local, accum, mem = fit
                            w = dataclasses.replace(
                                base,
                                layout=layout,
                                local_batch_size=local,
                                grad_accum=accum,
                                pp_schedule=sched if pp > 1 else "1F1B",
                                pp_microbatches=mbs,
                                ac=ac,
                            )
                            if spans is None:
                                spans = planned_spans(layout, cluster)
                            pred = predict(w, cluster, spans, memory=mem)
                            plans.append(
                                Plan(
                                    layout=layout,
                                    pp_schedule=sched_out,
                                    microbatches=w.microbatches if pp > 1 else w.grad_accum,
                                    activation_checkpoint=ac,
                                    local_batch_size=local,
                                    global_batch_size=w.tokens_per_step // w.seq_len,
                                    prediction=pred,
                                )
                            )
    plans.sort(
        key=lambda p: (
            -p.tokens_per_sec_per_gpu,
            p.memory_gib,
            (p.layout.pp, p.layout.dp_replicate, p.layout.tp, p.layout.cp),
        )
    )
    return SearchResult(plans=plans, rejected=rejected, world_size=world, candidates=candidates)


def add_traffic(plans: list[Plan], cluster: Cluster) -> None:
    """Fill `cross_switch` (GB per step over leaf / spine) for the planned placement."""
    for p in plans:
        spans = planned_spans(p.layout, cluster)
        t = planned_traffic(p.prediction.collectives, p.layout, spans)
        p.cross_switch = t.to_json()


def plan(recipe: Recipe, cluster: Cluster, nodes: int | None = None) -> list[Plan]:
    """Fitting plans for `recipe` on `cluster` (x `nodes`), best predicted tokens/s first."""
    res = search(recipe, cluster, nodes)
    return res.plans


def best_plan(recipe: Recipe, cluster: Cluster, nodes: int | None = None) -> Plan:
    """The best plan; ConfigError naming the closest misses when nothing fits."""
    res = search(recipe, cluster, nodes)
    if not res.plans:
        mem = [r for r in res.rejected if r.reason.startswith("memory")]
        hint = ""
        if mem:
            hint = "; smallest need: " + min(mem, key=lambda r: _need(r.reason)).reason
        raise ConfigError(
            f"no parallel plan for {recipe.model.flavor} fits {res.world_size} GPUs of "
            f"{cluster.gpu} ({len(res.rejected)} candidates rejected: {res.reasons()}){hint}",
            file=recipe.source,
            key="parallel.auto",
        )
    best = res.plans[0]
    add_traffic([best], world_for(recipe, cluster, nodes)[0])
    return best


def _need(reason: str) -> float:
    try:
        return float(reason.split("needs ")[1].split(" ")[0])
    except (IndexError, ValueError):
        return float("inf")


def apply_plan(recipe: Recipe, plan: Plan) -> Recipe:
    """A copy of `recipe` with the plan's degrees, schedule, checkpointing and batch set
    (`parallel.auto` cleared, so the usual layout checks apply to the result)."""
    r = copy.deepcopy(recipe)
    lay = plan.layout
    r.parallel = dataclasses.replace(
        r.parallel,
        world_size=lay.world_size,
        dp_replicate=lay.dp_replicate,
        dp_shard=lay.dp_shard,
        tp=lay.tp,
        pp=lay.pp,
        cp=lay.cp,
        pp_schedule=cast(Any, plan.pp_schedule or r.parallel.pp_schedule),
        pp_microbatches=plan.microbatches if lay.pp > 1 else 0,
        auto=False,
    )
    r.training = dataclasses.replace(
        r.training,
        activation_checkpoint=cast(Any, plan.activation_checkpoint),
        local_batch_size=plan.local_batch_size,
        global_batch_size=(
            recipe.training.global_batch_size if recipe.training.global_batch_size != -1 else -1
        ),
    )
    r.source = recipe.source
    return r
