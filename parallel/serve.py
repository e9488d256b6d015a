"""A served model resource, priced per device (pure: no torch, no process group).

`tools.serve` under torchrun is one resource: N devices holding one frozen base, the LoRA
adapters of every session on it, and (unless `--generators 0`) a generator. How it is laid
out (service/distributed.py, service/titan_backend.py), and what that costs per device:

- base: FSDP2 shards the frozen base over all N devices (tp = 1, see docs/service.md
  "Model resources" for why not TP): `total_params x dtype bytes / N`, in the served
  dtype (`training.dtype`: the service builds the base in it, no float32 master copy).
- unsharded: while an operation runs, FSDP gathers one block at a time plus the next
  (prefetch), and the root's embedding and output matrices stay gathered for the operation
  (FSDP2 does not reshard the root after forward). 0 on one device (nothing is sharded).
- adapters: `adapters` resident LoRA adapters (one per training client) at `lora.rank` on
  every linear (the fused qkv, wo, w1, w2, w3 of each block and the output), replicated on
  every device: parameter, gradient and AdamW's two moments in the served dtype; and one
  sampler snapshot (the weights alone) each.
- transient, the larger of (operations run one at a time, so they never coexist):
  - training: one microbatch of `microbatch_tokens` (at least one full-context datum: rows
    are not split) as `parallel.memory.posttrain_memory` counts the per-token terms
    (activations, workspace, the step layer's logits; on CPU the dense attention's scores);
  - generation: the generator's KV cache of `generator_tokens` positions plus one prompt's
    prefill row (every device decodes every row: replicated, see below), the last
    position's logits of up to GENERATOR_MAX_ROWS rows, and a full-context prompt-logprob
    forward (its logits, float32 log-softmax).
- reserved = allocated x (1 + ALLOCATOR_FRAGMENTATION); fitting adds the runtime overhead
  (parallel.memory), as for training.

The generator shares the trainer's base (no second copy: weights move from trainer to
generator by reference, the adapter snapshot included); `generators = 0` prices none of its
memory. On several devices it decodes with the whole base gathered once per sample request
when that fits next to its KV cache (`whole_base_decode`: the rest of the base, transiently),
else gathering one layer at a time for every decode step (FSDP's working set, no more). Time (estimates, not measurements): a forward_backward as parallel.perf prices a LoRA
step on the resource's FSDP layout; a decode step all-gathers the whole base once
(replicated decode: every device runs every row) and reads it from memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from parallel.memory import (
    ALLOCATOR_FRAGMENTATION,
    GIB,
    MICROBATCH_LADDER,
    PostTrain,
    posttrain_memory,
    runtime_overhead_gib,
)
from parallel.workload import Workload

DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
# Rows the generator decodes at once at most (rl.generator.Generator's default max_batch).
GENERATOR_MAX_ROWS = 256
DEFAULT_ADAPTERS = 4
# Samples per request the service accepts (service.core.Limits.max_samples): the automatic
# generator capacity is at most this many full-context rows.
DEFAULT_MAX_SAMPLES = 64


@dataclass(frozen=True)
class Resource:
    """What a served resource is asked to hold (tools.serve / tools.plan / tools.predict)."""

    devices: int = 1  # FSDP shards the base over all of them
    adapters: int = DEFAULT_ADAPTERS  # training clients resident at once
    generators: int = 1  # 0: SFT only (no generator, no KV cache)
    generator_tokens: int = 0  # KV-cache positions held at once; 0: the most that fit
    microbatch_tokens: int = 0  # forward/backward budget; 0: the largest that fits


@dataclass(frozen=True)
class ServedModel:
    """The served base as the price needs it (from a recipe: `served_model`)."""

    workload: Workload  # the recipe's shape and dtype (layout, batch ignored)
    context: int  # tokens per sequence, prompt + sampled
    lora_rank: int
    dense_attention: bool = False  # the CPU kernel keeps L x L scores (kernels.registry)

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.workload.dtype]

    @property
    def lora_params(self) -> int:
        """One adapter's tensors: rank x (in + out) on every linear, the output included."""
        s = self.workload.shape
        qd, kv, d, f = s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim, s.dim, s.ffn_hidden
        ios = [(d, qd + 2 * kv), (qd, d), (d, f), (d, f), (f, d)]
        per_layer = sum(i + o for i, o in ios)
        return self.lora_rank * (s.n_layers * per_layer + d + s.vocab_size)

    @property
    def kv_bytes_per_position(self) -> int:
        s = self.workload.shape
        return 2 * s.n_layers * s.n_kv_heads * s.head_dim * self.dtype_bytes


@dataclass(frozen=True)
class ResourceMemory:
    """Bytes per device of a resource, by part (see the module docstring)."""

    devices: int
    base_shard: float
    unsharded: float
    adapters: float
    snapshots: float
    training: float  # one microbatch's activations, workspace, logits
    generation: float  # KV cache and decode / prompt-logprob work
    microbatch_tokens: int
    generator_tokens: int
    gathered_base: float = 0.0  # the rest of the base, gathered for a whole sample request
    whole_base_decode: bool = False  # decode with the base gathered once per request

    @property
    def resident(self) -> float:
        return self.base_shard + self.adapters + self.snapshots

    @property
    def allocated(self) -> float:
        decode = self.gathered_base if self.whole_base_decode else self.unsharded
        return self.resident + max(self.unsharded + self.training, decode + self.generation)

    @property
    def reserved_gib(self) -> float:
        return self.allocated * (1 + ALLOCATOR_FRAGMENTATION) / GIB

    def required_gib_on(self, kind: str) -> float:
        return self.reserved_gib + runtime_overhead_gib(kind)

    def breakdown_gib(self) -> dict[str, float]:
        return {
            "base_shard": self.base_shard / GIB,
            "unsharded_blocks": self.unsharded / GIB,
            "adapters": self.adapters / GIB,
            "sampler_snapshots": self.snapshots / GIB,
            "training_microbatch": self.training / GIB,
            "generator_kv_and_work": self.generation / GIB,
            "gathered_base_for_decode": (self.gathered_base if self.whole_base_decode else 0.0)
            / GIB,
            "allocator_fragmentation": self.allocated * ALLOCATOR_FRAGMENTATION / GIB,
        }

    def describe(self, kind: str) -> str:
        parts = ", ".join(f"{k} {v:.2f}" for k, v in self.breakdown_gib().items() if v >= 0.005)
        return (
            f"{self.required_gib_on(kind):.2f} GiB per device over {self.devices} device(s) "
            f"({parts}, runtime {runtime_overhead_gib(kind):.1f}; training and generation "
            "never run at once: the larger counts)"
        )


def served_model(recipe: Any, context: int | None = None, *, cpu: bool = False) -> ServedModel:
    """The recipe's base as served (`context`: tokens per sequence, default training.seq_len;
    `cpu`: priced with the CPU attention kernel's dense scores)."""
    from core.axes import Layout
    from parallel.workload import workload_from_recipe

    w = workload_from_recipe(recipe, Layout())
    w = replace(w, lora_rank=0, compile=False, grad_accum=1, local_batch_size=1)
    return ServedModel(w, context or recipe.training.seq_len, recipe.lora.rank, cpu)


def resource_memory(m: ServedModel, r: Resource, mb: int, gen_tokens: int) -> ResourceMemory:
    """Peak bytes per device with microbatch budget `mb` and `gen_tokens` of KV cache."""
    s = m.workload.shape
    n, b = r.devices, m.dtype_bytes
    base = s.total_params * b / n
    unsharded = 0.0
    if n > 1:
        root = s.embedding_params + (0 if s.weight_tying else s.embedding_params)
        unsharded = (2 * s.params_per_layer + root) * b * (n - 1) / n
    lora = m.lora_params * b
    tokens = max(mb, m.context)  # a datum is never split: one full-context row at least
    pt = PostTrain(
        microbatch_tokens=tokens, dense_attention_len=m.context if m.dense_attention else 0
    )
    w = m.workload.with_(layout=replace(m.workload.layout, dp_shard=n))
    est = posttrain_memory(w, pt)
    training = est.train.activations + est.train.workspace + est.train.logits
    generation = 0.0
    if r.generators:
        kv = (gen_tokens + m.context) * m.kv_bytes_per_position
        rows = min(GENERATOR_MAX_ROWS, max(1, gen_tokens // 2))
        decode = rows * s.vocab_size * (b + 8)  # logits, float32 log-softmax and probs
        score = m.context * s.vocab_size * (b + 8)  # prompt logprobs: every position's
        if m.dense_attention:  # prefill scores of one full-context prompt, float32
            score += m.context * m.context * s.n_heads * 4
        generation = kv + max(decode, score)
    return ResourceMemory(
        devices=n,
        base_shard=base,
        unsharded=unsharded,
        adapters=r.adapters * lora * 4,  # parameter, gradient, exp_avg, exp_avg_sq
        snapshots=r.adapters * lora,
        training=training,
        generation=generation,
        microbatch_tokens=tokens,
        generator_tokens=gen_tokens if r.generators else 0,
        gathered_base=s.total_params * b * (n - 1) / n,
    )


@dataclass(frozen=True)
class ResourcePlan:
    """What a resource of `devices` can run on devices of `device_bytes`: the chosen budgets,
    its memory, and the problems that stop it (each (key, sentence); empty: it fits)."""

    resource: Resource
    memory: ResourceMemory
    device_bytes: float
    kind: str
    context: int
    problems: list[tuple[str, str]] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return not self.problems

    @property
    def concurrent_samples(self) -> int:
        """Full-context samples the generator decodes at once."""
        return self.memory.generator_tokens // self.context


def _fits(mem: ResourceMemory, device_bytes: float, kind: str) -> bool:
    return mem.required_gib_on(kind) * GIB <= device_bytes


def plan_resource(
    m: ServedModel,
    r: Resource,
    device_bytes: float,
    kind: str,
    *,
    max_samples: int = DEFAULT_MAX_SAMPLES,
) -> ResourcePlan:
    """Choose the microbatch budget and generator capacity (unless given) that fit, and say
    what does not. Pure."""
    problems: list[tuple[str, str]] = []
    gib = device_bytes / GIB
    floor_mb = r.microbatch_tokens or MICROBATCH_LADDER[0]
    gen_floor = r.generator_tokens or m.context
    least = resource_memory(m, r, floor_mb, gen_floor if r.generators else 0)
    bare = replace(least, training=0.0, generation=0.0)
    if not _fits(bare, device_bytes, kind):
        need = min_devices(m, r, device_bytes, kind)
        more = f"at least {need} devices of this kind" if need else "more memory per device"
        problems.append(
            ("model.flavor",
             f"a resource of {r.devices} device(s) cannot hold this base: {bare.describe(kind)}; "
             f"each has {gib:.1f} GiB: it needs {more} (tools.plan --serve)")
        )  # fmt: skip
        return ResourcePlan(r, least, device_bytes, kind, m.context, problems)
    mb = r.microbatch_tokens
    if not mb:
        for t in MICROBATCH_LADDER:
            if _fits(resource_memory(m, replace(r, generators=0), t, 0), device_bytes, kind):
                mb = t
        mb = mb or MICROBATCH_LADDER[0]
    train_only = resource_memory(m, replace(r, generators=0), mb, 0)
    if not _fits(train_only, device_bytes, kind):
        key = "--microbatch-tokens" if r.microbatch_tokens else "--context"
        problems.append(
            (key, f"one forward_backward of {train_only.microbatch_tokens:,} tokens does not fit: "
                  f"{train_only.describe(kind)}; each device has {gib:.1f} GiB")
        )  # fmt: skip
    gen = 0
    if r.generators:
        gen = r.generator_tokens
        if not gen:  # the most full-context rows (up to max_samples) that fit
            rows = 0
            for k in range(1, max_samples + 1):
                if not _fits(resource_memory(m, r, mb, k * m.context), device_bytes, kind):
                    break
                rows = k
            gen = rows * m.context
        if gen < m.context or not _fits(resource_memory(m, r, mb, gen), device_bytes, kind):
            shown = max(gen, m.context)
            mem = resource_memory(m, r, mb, shown)
            problems.append(
                ("--generator-tokens",
                 f"a generator holding {shown:,} tokens of KV cache (at least one "
                 f"{m.context}-token context) does not fit: {mem.describe(kind)}; each device "
                 f"has {gib:.1f} GiB: lower --generator-tokens or --context, or serve with "
                 "--generators 0 (SFT only)")
            )  # fmt: skip
    mem = resource_memory(m, r, mb, gen)
    if r.generators and r.devices > 1:
        # Decode with the whole base gathered once per request when it fits next to the KV
        # cache: no all-gather per token (per layer and step otherwise).
        whole = replace(mem, whole_base_decode=True)
        if _fits(whole, device_bytes, kind):
            mem = whole
    return ResourcePlan(r, mem, device_bytes, kind, m.context, problems)


def min_devices(
    m: ServedModel, r: Resource, device_bytes: float, kind: str, limit: int = 1 << 16
) -> int:
    """The fewest devices whose resource holds the base and its resident adapters with the
    smallest budgets (0: none up to `limit`)."""
    n = 1
    while n <= limit:
        rr = replace(r, devices=n)
        mem = resource_memory(m, rr, r.microbatch_tokens or MICROBATCH_LADDER[0],
                              (r.generator_tokens or m.context) if r.generators else 0)  # fmt: skip
        if _fits(mem, device_bytes, kind):
            return n
        n *= 2
    return 0


# ------------------------------------------------------------------------------- time


@dataclass(frozen=True)
class ResourceSpeed:
    """Estimates from the performance model (parallel.perf), not measurements."""

    forward_backward_tokens_per_s: float  # the whole resource, microbatches of the budget
    decode_step_s: float  # one token for every row being decoded
    decode_allgather_s: float  # of which: gathering the sharded base


def resource_speed(m: ServedModel, plan: ResourcePlan, cluster: Any) -> ResourceSpeed:
    """forward_backward throughput as parallel.perf prices a LoRA step of one microbatch per
    device on FSDP over the resource; a decode step as one read of the whole base from memory
    (bandwidth-bound decode) plus, when the base is gathered layer by layer, one all-gather of
    it (`decode_allgather_s`; with `whole_base_decode` that all-gather is paid once per
    request instead)."""
    from core.axes import Layout
    from parallel.perf import coll_time, links_of, predict
    from parallel.workload import planned_spans

    n = plan.resource.devices
    layout = Layout(dp_shard=n)
    w = m.workload
    rows = max(1, plan.memory.microbatch_tokens // m.context)
    lw = w.with_(layout=layout, seq_len=m.context, local_batch_size=rows,
                 lora_rank=m.lora_rank, lora_adapters=1)  # fmt: skip
    pred = predict(lw, cluster)
    fb = pred.tokens_per_sec_per_gpu * n
    links = links_of(cluster)
    base = w.shape.total_params * m.dtype_bytes
    ag = coll_time("all_gather", base, planned_spans(layout, cluster)["fsdp"], links)
    read = base / links.hbm if links.hbm > 0 else 0.0
    per_step = 0.0 if plan.memory.whole_base_decode else ag
    return ResourceSpeed(fb, per_step + read, ag)


# ----------------------------------------------------------------------------- clusters


def resource_sizes(gpus_per_node: int, nodes: int) -> list[int]:
    """Resource sizes worth listing: 1, 2, 4 ... GPUs within a node, then 1, 2, 4 ... whole
    nodes up to `nodes` (FSDP over a power of two divides the blocks evenly)."""
    out = []
    n = 1
    while n < gpus_per_node:
        out.append(n)
        n *= 2
    k = 1
    while k <= nodes:
        out.append(k * gpus_per_node)
        k *= 2
    return out


@dataclass(frozen=True)
class ClusterPlan:
    """A resource of `devices` GPUs of a cluster profile: its plan and (when it fits) speed."""

    devices: int
    nodes: int
    plan: ResourcePlan
    speed: ResourceSpeed | None

    def to_json(self) -> dict[str, Any]:
        mem = self.plan.memory
        out: dict[str, Any] = {
            "devices": self.devices,
            "nodes": self.nodes,
            "fits": self.plan.fits,
            "memory_gib_per_device": round(mem.required_gib_on(self.plan.kind), 2),
            "device_gib": round(self.plan.device_bytes / GIB, 1),
            "memory_breakdown_gib": {k: round(v, 2) for k, v in mem.breakdown_gib().items()},
            "microbatch_tokens": mem.microbatch_tokens,
            "generator_tokens": mem.generator_tokens,
            "concurrent_samples": self.plan.concurrent_samples,
            "problems": [{"key": k, "why": w} for k, w in self.plan.problems],
        }
        if self.speed is not None:
            out["forward_backward_tokens_per_s"] = round(
                self.speed.forward_backward_tokens_per_s, 1
            )
            out["decode_step_s"] = round(self.speed.decode_step_s, 4)
            out["decode_allgather_s"] = round(self.speed.decode_allgather_s, 4)
        return out


def plan_on_cluster(m: ServedModel, r: Resource, cluster: Any) -> ClusterPlan:
    """`r` (its `devices` GPUs, whole nodes beyond one node) on cluster profile `cluster`."""
    nodes = max(1, -(-r.devices // cluster.gpus_per_node))
    plan = plan_resource(m, r, cluster.hbm_bytes, cluster.gpu)
    speed = resource_speed(m, plan, cluster.with_nodes(nodes)) if plan.fits else None
    return ClusterPlan(r.devices, nodes, plan, speed)


# ------------------------------------------------------------------------ several bases


def plan_together(
    models: list[ServedModel],
    resources: list[Resource],
    device_bytes: float,
    kind: str,
    *,
    max_samples: int = DEFAULT_MAX_SAMPLES,
) -> list[ResourcePlan]:
    """Several bases served by one process on the same device(s) (`tools.serve --recipe A
    --recipe B`): each base's resident part (its base shard, adapters and snapshots) is held
    for the life of the service, so they add up; operations run one at a time on the one
    worker over every base, so only one base's transient part (a training microbatch or a
    generator's KV cache and work) exists at once. Each base is planned as alone on a device
    of `device_bytes` less the others' resident parts (with fragmentation): every plan that
    fits keeps the whole set within the device, since the peak is the residents' sum plus
    the largest transient part. Pure."""
    if len(models) != len(resources):
        raise ValueError("one Resource per base")
    resident = [
        resource_memory(m, replace(r, generators=0), m.context, 0).resident
        for m, r in zip(models, resources, strict=True)
    ]
    total = sum(resident)
    return [
        plan_resource(
            m,
            r,
            device_bytes - (total - own) * (1 + ALLOCATOR_FRAGMENTATION),
            kind,
            max_samples=max_samples,
        )
        for m, r, own in zip(models, resources, resident, strict=True)
    ]


def together_gib(plans: list[ResourcePlan]) -> float:
    """GiB per device of several bases planned by `plan_together`: every resident part, the
    largest transient part, fragmentation, the runtime once."""
    resident = sum(p.memory.resident for p in plans)
    transient = max(p.memory.allocated - p.memory.resident for p in plans)
    kind = plans[0].kind
    return (resident + transient) * (1 + ALLOCATOR_FRAGMENTATION) / GIB + runtime_overhead_gib(kind)


def together_problem(
    names: list[str], plans: list[ResourcePlan], device_bytes: float
) -> str | None:
    """One sentence naming the bases and the numbers when the set does not fit (None: it
    fits): each base's resident and transient GiB, the total and the device's."""
    bad = [(n, p) for n, p in zip(names, plans, strict=True) if p.problems]
    if not bad:
        return None
    parts = ", ".join(
        f"{n} {p.memory.resident / GIB:.2f} GiB resident + "
        f"{(p.memory.allocated - p.memory.resident) / GIB:.2f} transient"
        for n, p in zip(names, plans, strict=True)
    )
    return (
        f"the {len(plans)} bases do not fit together on one device of "
        f"{device_bytes / GIB:.1f} GiB ({plans[0].kind}): {parts} (residents add up, one "
        f"operation runs at a time): at least {together_gib(plans):.2f} GiB with "
        f"fragmentation and runtime, {', '.join(n for n, _ in bad)} left without room; serve "
        "fewer bases per process, or lower --context / --adapters / --generator-tokens"
    )
