"""The planner: every valid parallel plan for a recipe on a cluster, ranked by predicted
training tokens/s per GPU; plans that do not fit in memory are dropped with the reason.

Search space, for world size W = nodes x gpus_per_node:
- tp x cp divides the NVLink domain (every tp and cp group inside one domain; tp also
  divides the query and key/value heads), pp splits the layers evenly
  (`recipe.loader.check_layout`, the same check a hand-written recipe gets), and
  dp_replicate x dp_shard takes the rest in every factorisation;
- ep (mixture-of-experts models only): every divisor of the routed experts that divides
  dp_shard x cp x tp (torchtitan carves the EP groups, `ep` consecutive ranks, out of
  them; parallel.moe). The all-to-all stays inside one NVLink domain when ep fits in it
  (an NVL72 rack holds EP 64: 16 of its 18 trays); otherwise each plan names the fabric it
  crosses (`ep_fabric`) and the time model prices the NIC share of it;
- pp_schedule (all of torchtitan's, when pp > 1; zero-bubble schedules only without
  activation checkpointing, which torchtitan cannot combine with them) and microbatches
  (divisors of the local batch, at least pp);
- activation checkpointing none / selective / full;
- the batch: tokens per step are held fixed across plans. With
  `training.global_batch_size` set, that global batch; with -1, local batch x world size
  (what pure data parallelism would train), capped at 16M tokens per step with a warning
  naming the key (`planned_global_batch`). Each plan picks the largest local batch that
  fits (the rest is gradient accumulation; with pp the whole share is one pipelined step).

Everything is a pure function of (recipe, cluster): no torch.distributed, no GPU.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple, cast

from core.axes import Layout
from core.errors import ConfigError
from core.hardware import MAX_NODES, MAX_WORLD_SIZE
from core.models import PP_SCHEDULES, pp_layer_weights, stages_per_rank
from parallel.cluster import Cluster
from parallel.job_checks import check_before_search, check_kernels_on
from parallel.memory import MemoryProfile, memory_profile, runtime_overhead_gib
from parallel.moe import ep_placement, ep_reason, fabric_of_ep, moe_dims
from parallel.perf import Prediction, predict
from parallel.placement import planned_traffic
from parallel.stacks import load_stack
from parallel.workload import (
    Workload,
    expert_spans,
    linear_for,
    lora_fields,
    moe_fields,
    planned_spans,
)
from recipe.loader import check_layout, effective_shape, uses_cuda_graphs
from recipe.schema import Recipe

AC_MODES = ("none", "selective", "full")
# Tokens per optimizer step the planner never exceeds on its own: 16M, Llama 3 405B's
# pretraining batch at 8K (Llama 3 paper, Table 4); past it, larger batches stop paying.
TOKENS_PER_STEP_CEILING = 16 * 2**20
# The most tokens per step the planner searches: 64x the ceiling above. A global batch past it
# is a typo, and its divisor search (local batches, microbatches) would grow with it.
MAX_TOKENS_PER_STEP = 64 * TOKENS_PER_STEP_CEILING
# Microbatch counts per schedule and dp_replicate x dp_shard splits the search prices per
# degree tuple: all of them when there are this many or fewer (the shipped recipes have at
# most 10), else this many spread over them. A batch or world with hundreds of divisors
# (720,720 GPUs has 240) would otherwise price hundreds of thousands of candidates.
MAX_OPTIONS = 12
log = logging.getLogger(__name__)
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
    ep: int = 1  # expert-parallel degree (MoE; torchtitan carves it out of dp_shard x cp x tp)
    ep_fabric: str = "none"  # where the expert all-to-all runs (parallel.moe.fabric_of_ep)
    ep_placement: str = ""  # how the EP groups lie in the NVLink domains

    @property
    def tokens_per_sec_per_gpu(self) -> float:
        return self.prediction.tokens_per_sec_per_gpu

    @property
    def memory_gib(self) -> float:
        return self.prediction.memory.reserved_gib

    def describe(self) -> str:
        sched = f" {self.pp_schedule} x{self.microbatches}" if self.pp_schedule else ""
        ep = f" ep{self.ep}" if self.ep > 1 else ""
        return f"{self.layout.describe()}{ep}{sched} ac={self.activation_checkpoint}"

    def to_json(self) -> dict:
        lay = self.layout
        p = self.prediction
        return {
            "dp_replicate": lay.dp_replicate,
            "dp_shard": lay.dp_shard,
            "tp": lay.tp,
            "pp": lay.pp,
            "cp": lay.cp,
            "ep": self.ep,
            "ep_fabric": self.ep_fabric,
            "ep_placement": self.ep_placement,
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
            **({"moe": p.moe} if p.moe else {}),
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
    warnings: list[str] = field(default_factory=list)

    def reasons(self) -> dict[str, int]:
        """Rejection counts by the kind of reason (first clause)."""
        out: dict[str, int] = {}
        for r in self.rejected:
            k = r.reason.split(":")[0]
            out[k] = out.get(k, 0) + 1
        return out


def _divisors(n: int, limit: int | None = None) -> list[int]:
    """The divisors of n up to `limit` (all when None), ascending. O(min(sqrt n, limit))
    steps: every search below passes a bound from the model or the batch, so a huge n
    costs no more than a small one."""
    top = math.isqrt(n) if limit is None else min(math.isqrt(n), limit)
    small, large = [], []
    for i in range(1, top + 1):
        if n % i == 0:
            small.append(i)
            j = n // i
            if j != i and (limit is None or j <= limit):
                large.append(j)
    return small + large[::-1]


def _spread(options: list[int], most: int) -> list[int]:
    """At most `most` of the sorted `options`, evenly spaced by index, first and last kept
    (all of them when there are few, as for every shipped recipe)."""
    n = len(options)
    if n <= most:
        return options
    return sorted({options[round(i * (n - 1) / (most - 1))] for i in range(most)})


def world_for(recipe: Recipe, cluster: Cluster, nodes: int | None) -> tuple[Cluster, int]:
    """The cluster for the job: `nodes`, else the recipe's declared world size, else the
    profile's node count."""
    key = "--nodes"
    if nodes is None and recipe.parallel.world_size:
        ws = recipe.parallel.world_size
        if ws > MAX_WORLD_SIZE:
            raise ConfigError(
                f"{ws:,} processes is too large: at most {MAX_WORLD_SIZE:,} GPUs "
                "(core.hardware.MAX_WORLD_SIZE)",
                file=recipe.source,
                key="parallel.world_size",
            )
        if ws % cluster.gpus_per_node == 0:
            nodes, key = ws // cluster.gpus_per_node, "parallel.world_size"
    if nodes is not None and nodes != cluster.nodes:
        cluster = cluster.with_nodes(nodes, key=key)
    return cluster, cluster.world_size


def _layout_recipe(recipe: Recipe, schedule: str, mbs: int, local: int) -> Recipe:
    """A shallow copy with the fields check_layout reads set (no validation re-run)."""
    r = copy.copy(recipe)
    r.parallel = copy.copy(recipe.parallel)
    r.parallel.pp_schedule = schedule  # type: ignore[assignment]
    r.parallel.pp_microbatches = mbs
    r.parallel.pp_stages_per_rank = 0  # plans use each schedule's default
    r.parallel.ep = 1  # the planner checks each candidate's ep itself (parallel.moe.ep_reason)
    r.training = copy.copy(recipe.training)
    r.training.local_batch_size = local
    r.source = recipe.source
    return r


def planned_global_batch(recipe: Recipe, world: int) -> tuple[int, str]:
    """(global batch in sequences every plan trains, warning or ""). The recipe's
    `training.global_batch_size`; without one, local batch x world (pure data
    parallelism's batch), held at TOKENS_PER_STEP_CEILING when it would pass it."""
    tr = recipe.training
    if tr.global_batch_size != -1:
        if tr.global_batch_size * tr.seq_len > MAX_TOKENS_PER_STEP:
            raise ConfigError(
                f"{tr.global_batch_size:,} sequences x seq_len {tr.seq_len:,} = "
                f"{tr.global_batch_size * tr.seq_len:,} tokens per step; the planner searches "
                f"at most {MAX_TOKENS_PER_STEP:,} ({MAX_TOKENS_PER_STEP // 2**20}M, 64x Llama 3 "
                "405B's batch)",
                file=recipe.source,
                key="training.global_batch_size",
            )
        return tr.global_batch_size, ""
    g = tr.local_batch_size * world
    if g * tr.seq_len <= TOKENS_PER_STEP_CEILING:
        return g, ""
    held = max(1, TOKENS_PER_STEP_CEILING // tr.seq_len)
    return held, (
        f"{recipe.source or 'recipe'}: training.global_batch_size is not set: local batch "
        f"{tr.local_batch_size} x {world} GPUs would train {g * tr.seq_len / 1e6:,.0f}M tokens "
        f"per step, past {TOKENS_PER_STEP_CEILING / 2**20:.0f}M; the planner holds {held} "
        f"sequences ({held * tr.seq_len / 2**20:.1f}M tokens) per step. Set "
        "training.global_batch_size to choose."
    )


def search(
    recipe: Recipe, cluster: Cluster, nodes: int | None = None, stack: str = "torchtitan"
) -> SearchResult:
    """All candidates, fitting plans ranked by predicted tokens/s per GPU, priced on
    `stack` (a profile in stacks/; recipes run torchtitan). The steps: degrees
    (`_degrees`), the schedule options each passes the layout checks with
    (`_Search.options`), memory (`_Search.fit`), then the prediction (`_Search.price`)."""
    cluster, world = world_for(recipe, cluster, nodes)
    # Training's own checks first (the model, the kernels on this GPU): a recipe training
    # would refuse is refused here, not ranked.
    check_before_search(recipe, cluster)
    gbs, warning = planned_global_batch(recipe, world)
    derived = recipe.training.global_batch_size == -1
    run = _Search(recipe, cluster, stack)
    # pp is bounded by the layers (a stage holds at least one; embedding and head may count
    # as one each: pp_layer_weights), dp by the global batch (a rank trains at least one
    # sequence): the search never grows with the world size beyond these.
    max_pp = run.base.shape.n_layers + 2
    for tp, cp, pp, dp in _degrees(world, cluster.nvlink_domain_gpus, max_pp):
        if dp > gbs or (gbs % dp and not derived):
            continue
        # A derived batch (no global_batch_size in the recipe) is held at the largest
        # multiple of dp not above it, so worlds it does not divide plan too.
        share = gbs // dp
        if share:
            run.layouts(tp, cp, pp, dp, share)
    run.plans.sort(
        key=lambda p: (
            -p.tokens_per_sec_per_gpu,
            p.memory_gib,
            (p.layout.pp, p.layout.dp_replicate, p.layout.tp, p.layout.cp, p.ep),
        )
    )
    # Without any candidate, `explain_infeasible` says why (tools.plan, best_plan).
    warnings = [warning] if warning else []
    return SearchResult(
        plans=run.plans,
        rejected=run.rejected,
        world_size=world,
        candidates=run.candidates,
        warnings=warnings,
    )


def _degrees(world: int, dom: int, max_pp: int):
    """(tp, cp, pp, dp) with tp x cp inside one NVLink domain, pp at most `max_pp` and dp
    the rest."""
    for inner in _divisors(min(world, dom)):
        if world % inner or dom % inner:
            continue
        for tp in _divisors(inner):
            for pp in _divisors(world // inner, max_pp):
                yield tp, inner // tp, pp, world // (inner * pp)


_ZERO_BUBBLE_WITH_AC = (
    "unsupported: torchtitan's zero-bubble schedules cannot run with activation checkpointing"
)


class _Search:
    """One search's fixed inputs, caches and results. Memory depends on dp only through
    dp_shard (the FSDP shard count), validity not on dp at all: both are cached across the
    dp_replicate x dp_shard factorisations."""

    def __init__(self, recipe: Recipe, cluster: Cluster, stack: str) -> None:
        tr = recipe.training
        self.recipe, self.cluster = recipe, cluster
        self.hbm_gib = cluster.hbm_bytes / 2**30
        self.overhead = runtime_overhead_gib(cluster.gpu)
        self.zero1_stack = load_stack(stack).data_parallel == "distributed_optimizer"
        self.base = Workload(
            shape=effective_shape(recipe),
            seq_len=tr.seq_len,
            local_batch_size=tr.local_batch_size,
            linear=linear_for(recipe.kernels.linear, cluster.gpu),
            compile=tr.compile,
            dtype=tr.dtype,
            # Only tp > 1 layouts have TP collectives to overlap (perf.layer_costs).
            async_tp=recipe.parallel.async_tp,
            stack=stack,
            capacity_factor=moe_fields(recipe).get("capacity_factor", 0.0),
            **lora_fields(recipe),
        )
        self.moe = moe_dims(self.base.shape)
        self.valid: dict[tuple, str] = {}
        self.profiles: dict[tuple, MemoryProfile] = {}
        self.plans: list[Plan] = []
        self.rejected: list[Rejected] = []
        self.candidates = 0

    def why_invalid(self, layout: Layout, sched: str, mbs: int, local: int) -> str:
        key = (layout.tp, layout.cp, layout.pp, sched, mbs, local)
        if key not in self.valid:
            try:
                check_layout(_layout_recipe(self.recipe, sched, mbs, local), layout)
                if layout.cp > 1:  # the kernels with this cp (varlen has none, token alignment)
                    check_kernels_on(self.recipe, self.cluster, cp=layout.cp)
                self.valid[key] = ""
            except ConfigError as e:
                self.valid[key] = f"invalid: {e.key + ': ' if e.key else ''}{e.detail}"
        return self.valid[key]

    def options(self, probe: Layout, share: int, smallest_local: int) -> list[tuple]:
        """(schedule, microbatches, reason) for every schedule option of these degrees;
        reason is '' where the layout checks pass."""
        pp = probe.pp
        schedules = list(PP_SCHEDULES) if pp > 1 else [self.recipe.parallel.pp_schedule]
        out = []
        for sched in schedules:
            mb_opts = [0]
            if pp > 1:
                mb_opts = [m for m in _divisors(share) if m >= pp or sched == "GPipe"]
                mb_opts = _spread(mb_opts or [share], MAX_OPTIONS)
            for mbs in mb_opts:
                out.append((sched, mbs, self.why_invalid(probe, sched, mbs, smallest_local)))
        return out

    def ep_options(self, layout: Layout) -> list[int]:
        """Expert-parallel degrees torchtitan accepts for `layout` (MoE: divisors of the
        routed experts dividing dp_shard x cp x tp; dense: 1), at most MAX_OPTIONS spread."""
        if self.moe is None:
            return [1]
        room = layout.dp_shard * layout.cp * layout.tp
        eps = [
            e
            for e in _divisors(self.moe.n_routed, room)
            if not ep_reason(e, self.moe.n_routed, layout.dp_shard, layout.cp, layout.tp)
        ]
        return _spread(eps, MAX_OPTIONS)

    def layouts(self, tp: int, cp: int, pp: int, dp: int, share: int) -> None:
        """Every dp_replicate x dp_shard split, schedule and AC mode of these degrees."""
        # With pp the whole share is one pipelined step; without, the largest local batch
        # that fits (the rest is gradient accumulation).
        locals_ = [share] if pp > 1 else sorted(_divisors(share), reverse=True)
        probe = Layout(pp=pp, dp_shard=dp, cp=cp, tp=tp)
        options = self.options(probe, share, locals_[-1])
        for rep in _spread(_divisors(dp), MAX_OPTIONS):
            layout = Layout(pp=pp, dp_replicate=rep, dp_shard=dp // rep, cp=cp, tp=tp)
            spans = None  # the planned spans, computed once per layout when first needed
            for ep in self.ep_options(layout):
                for sched, mbs, reason in options:
                    sched_out = sched if pp > 1 else None
                    if reason:
                        self.candidates += 1
                        self.rejected.append(Rejected(layout, sched_out, mbs, "-", reason))
                        continue
                    for ac in AC_MODES:
                        self.candidates += 1
                        if pp > 1 and sched in ZERO_BUBBLE and ac != "none":
                            self.rejected.append(
                                Rejected(layout, sched, mbs, ac, _ZERO_BUBBLE_WITH_AC)
                            )
                            continue
                        fit, why = self.fit(layout, probe, sched, mbs, ac, locals_, share, ep)
                        if fit is None:
                            self.rejected.append(Rejected(layout, sched_out, mbs, ac, why))
                            continue
                        if spans is None:
                            spans = planned_spans(layout, self.cluster)
                        sp = spans
                        if self.moe is not None:
                            sp = {**spans, **expert_spans(layout, ep, self.cluster)}
                        self.price(layout, sched, mbs, ac, fit, sp, ep)

    def fit(
        self,
        layout: Layout,
        probe: Layout,
        sched: str,
        mbs: int,
        ac: str,
        locals_: list[int],
        share: int,
        ep: int = 1,
    ) -> tuple[Any, str]:
        """((local batch, accumulation, memory), '') for the largest local batch that fits,
        or (None, the last memory reason)."""
        pp, dp, cp = layout.pp, layout.dp_replicate * layout.dp_shard, layout.cp
        rep = layout.dp_replicate
        # A ZeRO-1 stack (no FSDP) shards its optimizer over the replicas: its memory
        # depends on dp_replicate, so price the real layout.
        zero1 = self.zero1_stack and rep == dp

        def need(local: int) -> tuple[float, MemoryProfile]:
            # Whether the step's gradients outlive it (accumulation, CUDA graphs) moves the
            # peak by 4 bytes per parameter (parallel.memory, measured by tools.dryrun).
            accum = 1 if pp > 1 else share // local
            graphs = uses_cuda_graphs(self.recipe, pp, self.recipe.kernels.attention)
            mkey = (layout.tp, cp, pp, sched, mbs, ac, local, zero1, accum > 1 or graphs, ep)
            prof = self.profiles.get(mkey)
            if prof is None:
                prof = self.profiles[mkey] = memory_profile(
                    dataclasses.replace(
                        self.base,
                        layout=layout if zero1 else probe,
                        local_batch_size=local,
                        pp_schedule=sched if pp > 1 else "1F1B",
                        pp_microbatches=mbs,
                        ac=ac,
                        grad_accum=accum,
                        cuda_graphs=graphs,
                        ep=ep,
                    )
                )
            return prof.required_gib((dp // rep) * cp, self.overhead), prof

        # locals_ is largest first and memory grows with the local batch: the first that
        # fits is found by bisection when there are many (a highly composite batch has
        # hundreds of divisors), by a scan otherwise (the same answer either way).
        if len(locals_) > 16:
            lo, hi = 0, len(locals_) - 1
            if need(locals_[hi])[0] <= self.hbm_gib:
                while lo < hi:
                    mid = (lo + hi) // 2
                    if need(locals_[mid])[0] <= self.hbm_gib:
                        hi = mid
                    else:
                        lo = mid + 1
            locals_ = locals_[hi:]
        last_reason = ""
        for local in locals_:
            gib, prof = need(local)
            if gib <= self.hbm_gib:
                accum = 1 if pp > 1 else share // local
                return (local, accum, prof.at((dp // rep) * cp)), ""
            last_reason = f"memory: needs {gib:.1f} GiB of {self.hbm_gib:.1f} (local batch {local})"
        return None, last_reason

    def price(
        self, layout: Layout, sched: str, mbs: int, ac: str, fit: tuple, spans, ep: int = 1
    ) -> None:
        """The performance model's prediction of one fitting candidate, kept as a Plan."""
        local, accum, mem = fit
        pp = layout.pp
        recipe = self.recipe
        w = dataclasses.replace(
            self.base,
            cuda_graphs=uses_cuda_graphs(recipe, pp, recipe.kernels.attention),
            layout=layout,
            local_batch_size=local,
            grad_accum=accum,
            pp_schedule=sched if pp > 1 else "1F1B",
            pp_microbatches=mbs,
            ac=ac,
            ep=ep,
        )
        self.plans.append(
            Plan(
                layout=layout,
                pp_schedule=sched if pp > 1 else None,
                microbatches=w.microbatches if pp > 1 else w.grad_accum,
                activation_checkpoint=ac,
                local_batch_size=local,
                global_batch_size=w.tokens_per_step // w.seq_len,
                prediction=predict(w, self.cluster, spans, memory=mem),
                ep=ep,
                ep_fabric=fabric_of_ep(ep, spans["ep"], self.cluster) if ep > 1 else "none",
                ep_placement=ep_placement(ep, self.cluster),
            )
        )


def add_traffic(plans: list[Plan], cluster: Cluster) -> None:
    """Fill `cross_switch` (GB per step over leaf / spine) for the planned placement."""
    for p in plans:
        spans = planned_spans(p.layout, cluster)
        t = planned_traffic(p.prediction.collectives, p.layout, spans)
        p.cross_switch = t.to_json()


def plan(
    recipe: Recipe, cluster: Cluster, nodes: int | None = None, stack: str = "torchtitan"
) -> list[Plan]:
    """Fitting plans for `recipe` on `cluster` (x `nodes`), best predicted tokens/s first."""
    res = search(recipe, cluster, nodes, stack)
    return res.plans


def best_plan(
    recipe: Recipe, cluster: Cluster, nodes: int | None = None, stack: str = "torchtitan"
) -> Plan:
    """The best plan; when nothing fits, ConfigError naming the binding constraint and the
    nearest changes that fit (`explain_infeasible`). The batch warning
    (`planned_global_batch`) goes to the log."""
    res = search(recipe, cluster, nodes, stack)
    if not res.plans:  # the warnings go into the one line, not before it
        why = explain_infeasible(recipe, cluster, nodes, stack, res)
        raise ConfigError(
            f"no parallel plan for {recipe.model.flavor} fits {res.world_size:,} GPUs of "
            f"{cluster.gpu} ({len(res.rejected)} candidates rejected: {res.reasons()}): "
            + why.one_line(),
            file=recipe.source,
            key="parallel.auto",
        )
    for w in res.warnings:
        log.warning(w)
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
        # async TP applies to the plans with tp > 1 only (it has nothing to overlap at tp 1).
        async_tp=recipe.parallel.async_tp and lay.tp > 1,
        pp_stages_per_rank=0,
        auto=False,
    )
    r.parallel.ep = plan.ep
    r.training = dataclasses.replace(
        r.training,
        activation_checkpoint=cast(Any, plan.activation_checkpoint),
        local_batch_size=plan.local_batch_size,
        # Always explicit: the plan holds tokens per step fixed (`planned_global_batch`).
        global_batch_size=plan.global_batch_size,
    )
    r.source = recipe.source
    return r


# ----------------------------------------------------------------------------------------
# When nothing fits: the binding constraint, with numbers, and the nearest changes that fit


# Searches an explanation may run to check its suggestions (each is one `search`, tens of ms
# once warm): the nearest candidates of each kind are tried in order until one fits.
MAX_CHECKS_PER_SUGGESTION = 4


@dataclass(frozen=True)
class Suggestion:
    """A change that fits, checked by running the search with it."""

    key: str  # "training.global_batch_size" or "nodes"
    value: int
    plans: int  # fitting plans the search found
    best: str  # the best plan's layout (its pipeline degree included)
    tokens_per_sec_per_gpu: float

    def describe(self) -> str:
        what = (
            f"{self.value:,} nodes (--nodes {self.value})"
            if self.key == "nodes"
            else f"{self.key} = {self.value}"
        )
        return (
            f"{what}: {self.plans} plans fit, best {self.best} at "
            f"{self.tokens_per_sec_per_gpu:,.0f} tokens/s/GPU"
        )


@dataclass(frozen=True)
class Infeasible:
    """Why no candidate fits (one sentence with the numbers) and what would."""

    constraint: str
    suggestions: tuple[Suggestion, ...] = ()

    def lines(self) -> list[str]:
        out = [f"nothing fits: {self.constraint}"]
        if self.suggestions:
            out.append("nearest changes that fit (each checked by running the search with it):")
            out += [f"  {s.describe()}" for s in self.suggestions]
        else:
            out.append("no nearby global batch size or node count fits either")
        return out

    def one_line(self) -> str:
        if not self.suggestions:
            return self.constraint
        alts = " or ".join(
            f"{s.value:,} nodes" if s.key == "nodes" else f"{s.key} = {s.value}"
            for s in self.suggestions
        )
        return f"{self.constraint}; nearest that fit: {alts}"


def _factors(n: int) -> str:
    """36864 -> '2^12 x 3^2' (the prime factorisation, for the batch-vs-degree story)."""
    out, p = [], 2
    while p * p <= n:
        k = 0
        while n % p == 0:
            n, k = n // p, k + 1
        if k:
            out.append(f"{p}^{k}" if k > 1 else str(p))
        p += 1
    if n > 1:
        out.append(str(n))
    return " x ".join(out) or "1"


def _brief(values: list[int], most: int = 8) -> str:
    vals = sorted(set(values))
    head = ", ".join(f"{v:,}" for v in vals[:most])
    return head + (f", ... ({len(vals)} values)" if len(vals) > most else "")


class _Shape(NamedTuple):
    """What decides whether degrees can hold the model at all (no memory, no batch)."""

    n_heads: int
    n_kv_heads: int
    n_layers: int
    seq_len: int

    def tp_ok(self, tp: int) -> bool:
        return self.n_heads % tp == 0 and self.n_kv_heads % tp == 0

    def pp_ok(self, pp: int) -> bool:
        """Some schedule splits the layers evenly over pp ranks (check_layout's rule)."""
        if pp == 1:
            return True
        return any(
            pp_layer_weights(self.n_layers, pp * stages_per_rank(s)) is not None
            for s in PP_SCHEDULES
        )

    def seq_ok(self, tp: int, cp: int) -> bool:
        div = (tp if tp > 1 else 1) * (2 * cp if cp > 1 else 1)
        return self.seq_len % div == 0

    def inner_ok(self, inner: int) -> bool:
        """Some tp x cp = inner split passes the head and sequence checks."""
        return any(self.tp_ok(tp) and self.seq_ok(tp, inner // tp) for tp in _divisors(inner))


def explain_infeasible(
    recipe: Recipe,
    cluster: Cluster,
    nodes: int | None = None,
    stack: str = "torchtitan",
    res: SearchResult | None = None,
) -> Infeasible:
    """Name the constraint that leaves no plan, with its numbers, and the nearest global batch
    size and node counts that do fit, each checked by running `search` with it.

    Pure; costs the analysis (divisor enumeration over the batch, the NVLink domain and the
    pipeline degrees) plus at most a few searches per kind of suggestion."""
    cluster, world = world_for(recipe, cluster, nodes)
    res = res or search(recipe, cluster, nodes=cluster.nodes, stack=stack)
    tr = recipe.training
    es = effective_shape(recipe)
    shape = _Shape(es.n_heads, es.n_kv_heads, es.n_layers, tr.seq_len)
    gbs, _ = planned_global_batch(recipe, world)
    derived = tr.global_batch_size == -1
    dom = cluster.nvlink_domain_gpus
    max_pp = es.n_layers + 2
    pps_ok = [pp for pp in range(1, max_pp + 1) if shape.pp_ok(pp)]

    def batch_ok(dp: int) -> bool:
        return dp <= gbs and (derived or gbs % dp == 0)

    tuples = list(_degrees(world, dom, max_pp))
    by_batch = [t for t in tuples if batch_ok(t[3])]
    structural = [
        t for t in by_batch if shape.tp_ok(t[0]) and shape.pp_ok(t[2]) and shape.seq_ok(t[0], t[1])
    ]
    batch_key = "training.global_batch_size"
    domain = f"tp x cp <= {min(world, dom)} (one NVLink domain of {cluster.gpu})"
    gib = cluster.hbm_bytes / 2**30
    short = 1.0  # the smallest memory need over the GPU's memory, when memory binds
    kinds: list[str] = []
    if not by_batch:
        kinds.append("batch")
        dps = sorted({t[3] for t in tuples})
        least = dps[0] if dps else world
        constraint = (
            f"no layout for {world:,} GPUs: the data-parallel degree (the world over "
            f"{domain} and pp <= {max_pp}, the layers + 2) is at least {least:,}, and every "
            f"such degree ({_brief(dps)}) must divide the global batch of {gbs:,} sequences "
            f"({batch_key}{', derived' if derived else ''}; {world:,} = {_factors(world)}, "
            f"{gbs:,} = {_factors(gbs)})"
        )
    elif not structural:
        kinds.append("batch")
        need_pp = sorted({t[2] for t in by_batch if not shape.pp_ok(t[2])})
        need_tp = sorted({t[0] for t in by_batch if not shape.tp_ok(t[0])})
        parts = []
        if need_pp:
            kinds.append("layers")
            parts.append(
                f"pp in {{{_brief(need_pp)}}}, but {shape.n_layers} layers split evenly only "
                f"over pp in {{{_brief(pps_ok, 12)}}} (parallel.pp)"
            )
        if need_tp:
            kinds.append("heads")
            parts.append(
                f"tp in {{{_brief(need_tp)}}}, but tp must divide the {shape.n_heads} query and "
                f"{shape.n_kv_heads} key/value heads (parallel.tp)"
            )
        if not parts:
            parts.append(
                f"tp x 2cp dividing seq_len {shape.seq_len} (training.seq_len), which none does"
            )
        constraint = (
            f"no layout for {world:,} GPUs ({_factors(world)}): a data-parallel degree that "
            f"divides the global batch of {gbs:,} sequences ({batch_key}, {_factors(gbs)}) "
            f"leaves the rest of each replica to {domain} and to " + "; and ".join(parts)
        )
    else:
        mem = [r for r in res.rejected if r.reason.startswith("memory")]
        if mem and len(mem) >= len(res.rejected) / 2:
            kinds.append("memory")
            least = min(mem, key=lambda r: _need(r.reason))
            short = _need(least.reason) / gib
            constraint = (
                f"out of memory in every layout: the smallest need is {_need(least.reason):.1f} "
                f"GiB per GPU of {gib:.1f} ({least.layout.describe()}, activation checkpointing "
                f"{least.activation_checkpoint})"
            )
        else:
            counts: dict[str, int] = {}
            for r in res.rejected:
                counts[r.reason] = counts.get(r.reason, 0) + 1
            top = max(counts, key=lambda k: counts[k]) if counts else "no candidate"
            constraint = f"every layout is refused; most often: {top}"
    suggestions: list[Suggestion] = []
    if "batch" in kinds:
        s = _batch_suggestion(recipe, cluster, stack, world, gbs, shape, max_pp)
        suggestions += [s] if s else []
    at_least = cluster.nodes + 1
    if "memory" in kinds:
        # Sharded states shrink as 1/nodes and the rest does not: fewer nodes than
        # nodes x need / memory cannot fit, so the walk over larger counts starts there.
        at_least = max(at_least, math.ceil(cluster.nodes * short))
    suggestions += _node_suggestions(
        recipe, cluster, stack, gbs, derived, shape, pps_ok, "memory" in kinds, at_least
    )
    return Infeasible(constraint, tuple(suggestions))


def _checked(recipe: Recipe, cluster: Cluster, stack: str, key: str, value: int):
    """Run the search with one change; the Suggestion when something fits, else None."""
    r = recipe
    nodes = cluster.nodes
    if key == "nodes":
        nodes = value
    else:
        r = copy.copy(recipe)
        r.training = dataclasses.replace(recipe.training, global_batch_size=value)
        r.source = recipe.source
    try:
        res = search(r, cluster, nodes=nodes, stack=stack)
    except ConfigError:
        return None
    if not res.plans:
        return None
    best = res.plans[0]
    return Suggestion(key, value, len(res.plans), best.describe(), best.tokens_per_sec_per_gpu)


def _batch_suggestion(
    recipe: Recipe,
    cluster: Cluster,
    stack: str,
    world: int,
    gbs: int,
    shape: _Shape,
    max_pp: int,
) -> Suggestion | None:
    """The global batch nearest the recipe's that a structurally valid layout of this world
    can split, checked by a search."""
    dps = {
        dp
        for tp, cp, pp, dp in _degrees(world, cluster.nvlink_domain_gpus, max_pp)
        if shape.tp_ok(tp) and shape.pp_ok(pp) and shape.seq_ok(tp, cp)
    }
    cap = MAX_TOKENS_PER_STEP // recipe.training.seq_len
    options: set[int] = set()
    for dp in dps:
        lo, hi = (gbs // dp) * dp, -(-gbs // dp) * dp
        options |= {g for g in (lo, hi) if 0 < g <= cap}
    # Nearest first; at equal distance the larger batch (more sequences per replica).
    for g in sorted(options - {gbs}, key=lambda g: (abs(g - gbs), -g))[:MAX_CHECKS_PER_SUGGESTION]:
        found = _checked(recipe, cluster, stack, "training.global_batch_size", g)
        if found:
            return found
    return None


def _node_suggestions(
    recipe: Recipe,
    cluster: Cluster,
    stack: str,
    gbs: int,
    derived: bool,
    shape: _Shape,
    pps_ok: list[int],
    only_more: bool,
    at_least: int,
) -> list[Suggestion]:
    """The nearest node counts below and above the job's whose world some structurally valid
    layout fits with this batch (all degree tuples built from the batch's divisors, the
    domain's and the valid pipeline degrees), each checked by a search. Larger counts start
    at `at_least`."""
    gpn, dom, nodes = cluster.gpus_per_node, cluster.nvlink_domain_gpus, cluster.nodes
    per_domain = cluster.nodes_per_domain
    most = MAX_NODES
    if cluster.topology.switches:
        most = len(cluster.fabric().hosts)
    inners = [i for i in _divisors(dom) if shape.inner_ok(i)]
    # With a derived batch any data-parallel degree up to it works; keep the search bounded.
    dps = _divisors(gbs) if not derived else _divisors(gbs, MAX_NODES)
    worlds = {inner * pp * dp for inner in inners for pp in pps_ok for dp in dps}
    counts = sorted(
        n
        for n in {w // gpn for w in worlds if w % gpn == 0 and 0 < w // gpn <= most}
        # Past one NVLink domain, whole domains (NVL72 racks) only: what one orders.
        if n != nodes and (n <= per_domain or n % per_domain == 0)
    )
    below = [n for n in reversed(counts) if n < nodes and not only_more]
    above = [n for n in counts if n >= at_least]
    out = []
    # Fewer nodes: the nearest few (each step down needs more memory per GPU, so a miss
    # rarely turns into a fit further down).
    for n in below[:MAX_CHECKS_PER_SUGGESTION]:
        found = _checked(recipe, cluster, stack, "nodes", n)
        if found:
            out.append(found)
            break
    # More nodes: gallop (1st, 2nd, 4th, 8th ... candidate) to the first that fits, then
    # bisect back to the nearest: memory per GPU falls as the world grows.
    checks, lo, hi, hit = 0, -1, None, None
    i = 0
    while i < len(above) and checks < 4 * MAX_CHECKS_PER_SUGGESTION:
        checks += 1
        found = _checked(recipe, cluster, stack, "nodes", above[i])
        if found:
            hi, hit = i, found
            break
        lo, i = i, 2 * i + 1
    while hi is not None and hi - lo > 1 and checks < 4 * MAX_CHECKS_PER_SUGGESTION:
        mid = (lo + hi) // 2
        checks += 1
        found = _checked(recipe, cluster, stack, "nodes", above[mid])
        if found:
            hi, hit = mid, found
        else:
            lo = mid
    if hit:
        out.append(hit)
    return out
