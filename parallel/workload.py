"""What the memory and performance models take: one training configuration, made concrete.

`Workload` is a recipe reduced to the numbers that cost memory and time (model shape,
tokens per microbatch, degrees, schedule, checkpointing, linear precision, compile), plus
the few software options published benchmarks vary that a recipe does not expose
(FP8 all-gathers in TP, CP rotation). `GroupSpan` says how a
parallel group lies on the hardware (NVLink domains, hosts, leaf switches): computed
analytically for the planned placement (`planned_spans`) or measured from a concrete
rank order (`parallel.placement.group_spans`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from core.axes import MESH_ORDER, Layout
from core.models import ModelShape, stages_per_rank
from kernels.caps import auto_linear, simulated_caps
from parallel.cluster import Cluster
from recipe.loader import effective_shape, uses_cuda_graphs


@dataclass(frozen=True)
class Workload:
    shape: ModelShape
    seq_len: int
    local_batch_size: int  # sequences per data-parallel rank per microstep
    layout: Layout = Layout()
    grad_accum: int = 1  # microsteps per optimizer step (without PP)
    pp_schedule: str = "1F1B"
    pp_microbatches: int = 0  # 0 = one sequence per microbatch
    ac: str = "none"  # none | selective | full
    linear: str = "bf16"  # a core.linear_backends name
    compile: bool = False
    dtype: str = "bfloat16"
    async_tp: bool = False
    cuda_graphs: bool = False  # forward+backward replayed from a CUDA graph (pp = 1 only)
    fp8_all_gather: bool = False  # FSDP all-gather in FP8 (tensorwise scaling only)
    # Sequence-parallel TP all-gathers in FP8 (tensorwise only): torchtitan's 2024 float8 TP
    # styles and Transformer Engine do it; torchtitan 0.3 gathers bf16 (kernels.linear).
    fp8_tp_all_gather: bool = False
    cp_rotate: str = "allgather"  # torch CP: allgather (exposed) | alltoall (ring, overlapped)
    doc_len: int = 0  # mean document length under document masking; 0 = causal over seq
    virtual_stages: int = 0  # stages per pipeline rank; 0 = the schedule's default
    stack: str = "torchtitan"  # software-stack profile (stacks/<name>.toml)
    # LoRA fine-tuning (finetune.mode = "lora"): the base frozen (no weight gradients, no
    # optimizer state, fp32 master copy only), adapters of this rank on the block linears
    # (wqkv, wo, w1, w3, w2), `lora_adapters` of them resident. 0 = every weight trained.
    lora_rank: int = 0
    lora_adapters: int = 1
    # lora.target_modules (() = the block linears above); "experts": MoE routed experts, one
    # pair per expert and projection (runtime.moe_experts)
    lora_targets: tuple[str, ...] = ()
    # Mixture of experts (parallel.moe): the expert-parallel degree (torchtitan carves it out
    # of dp_shard x cp x tp; 1 = experts sharded like the dense weights) and the recipe's
    # `moe.capacity_factor` (0 = dropless, torchtitan's only mode).
    ep: int = 1
    capacity_factor: float = 0.0
    # Routed tokens on the busiest EP rank over the mean; 0 = the stack's `moe_imbalance`
    # (NVIDIA's MoE benchmarks force-balance the routing: 1.0).
    load_imbalance: float = 0.0

    @property
    def lora_params_per_layer(self) -> int:
        """Adapter parameters per block and GPU (A: r x in, B: out x r per linear; TP splits
        one of the two, counted as split: an upper bound within a few percent)."""
        if not self.lora_rank:
            return 0
        s, t, r = self.shape, self.layout.tp, self.lora_rank
        qd, kv, d, f = s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim, s.dim, s.ffn_hidden
        on = set(self.lora_targets or ("wqkv", "wo", "w1", "w2", "w3"))
        ios = ([(d, qd + 2 * kv)] if on & {"wqkv", "wq", "wkv", "wk", "wv"} else []) + (
            [(qd, d)] if "wo" in on else []
        )
        attn = sum(r * (i + o) for i, o in ios)
        mlp = lambda h: r * 3 * (d + h) if on & {"w1", "w2", "w3"} and h else 0  # noqa: E731
        if not s.is_moe:
            return self.lora_adapters * (attn + mlp(f)) // t
        # MoE: dense layers' MLP, MoE layers' shared experts and (target "experts") every
        # routed expert's pair, averaged over the layers (routed adapters are not TP-split)
        moe, dense = s.n_moe_layers, s.n_layers - s.n_moe_layers
        shared = mlp(s.n_shared_experts * s.moe_ffn_hidden)
        routed = s.n_routed_experts * r * 3 * (d + s.moe_ffn_hidden) if "experts" in on else 0
        total = s.n_layers * attn // t + dense * mlp(f) // t + moe * (shared // t + routed)
        return self.lora_adapters * total // s.n_layers

    @property
    def microbatches(self) -> int:
        """Microbatches per pipeline step (1 without PP)."""
        if self.layout.pp == 1:
            return 1
        return self.pp_microbatches or self.local_batch_size

    @property
    def seqs_per_microbatch(self) -> int:
        return self.local_batch_size // self.microbatches

    @property
    def tokens_per_microbatch(self) -> int:
        """Tokens one tp x cp group processes in one microbatch (whole sequences)."""
        return self.seqs_per_microbatch * self.seq_len

    @property
    def stages_per_rank(self) -> int:
        if self.layout.pp == 1:
            return 1
        return self.virtual_stages or stages_per_rank(self.pp_schedule)

    @property
    def tokens_per_step(self) -> int:
        """Tokens in one optimizer step over the whole job."""
        return self.local_batch_size * self.seq_len * self.layout.dp * self.grad_accum

    @property
    def bytes_per_param_compute(self) -> int:
        return 4 if self.dtype == "float32" else 2

    def with_(self, **kw) -> Workload:
        return replace(self, **kw)


def linear_for(recipe_linear: str, gpu: str) -> str:
    """Resolve `kernels.linear = "auto"` for a profile's GPU kind: the same rule recipe
    validation applies to the real device (kernels.caps.auto_linear)."""
    if recipe_linear != "auto":
        return recipe_linear
    return auto_linear(simulated_caps(gpu)).name


def workload_from_recipe(
    recipe, layout: Layout, cluster: Cluster | None = None, stack: str = "torchtitan"
) -> Workload:
    """The recipe's training configuration on `layout` (the recipe's own or a plan's), as
    the software stack `stack` (a profile in stacks/) would run it: Megatron-Core's
    distributed optimizer takes the recipe's data-parallel degree (dp_shard becomes
    replicas with a sharded optimizer), folds gradient accumulation under PP into one
    pipeline flush, and runs TE's per-tensor FP8 for an FP8 recipe."""
    from parallel.stacks import load_stack

    st = load_stack(stack)
    tr = recipe.training
    par = recipe.parallel
    gbs = tr.global_batch_size
    per_micro = tr.local_batch_size * layout.dp
    accum = 1 if gbs == -1 else max(1, gbs // per_micro)
    gpu = cluster.gpu if cluster else "H100"
    linear = linear_for(recipe.kernels.linear, gpu)
    # torchtitan's tensorwise converter gathers FSDP weights in FP8 (kernels.linear).
    fp8_all_gather = linear == "fp8_tensorwise"
    if st.fp8_linear and linear.startswith("fp8"):
        linear = st.fp8_linear
    local = tr.local_batch_size
    mbs = par.pp_microbatches if layout.pp > 1 else 0
    if layout.pp > 1 and st.grad_accum_in_pipeline and accum > 1:
        local, mbs, accum = local * accum, (mbs or tr.local_batch_size) * accum, 1
    if st.data_parallel == "distributed_optimizer" and layout.dp_shard > 1:
        layout = replace(layout, dp_replicate=layout.dp, dp_shard=1)
    return Workload(
        shape=effective_shape(recipe),
        seq_len=tr.seq_len,
        local_batch_size=local,
        layout=layout,
        grad_accum=accum if layout.pp == 1 else 1,
        pp_schedule=par.pp_schedule,
        pp_microbatches=mbs,
        ac=tr.activation_checkpoint,
        linear=linear,
        fp8_all_gather=fp8_all_gather,
        fp8_tp_all_gather=bool(st.fp8_linear) and linear == st.fp8_linear == "fp8_tensorwise",
        compile=tr.compile,
        dtype=tr.dtype,
        async_tp=par.async_tp and layout.tp > 1,
        cuda_graphs=uses_cuda_graphs(recipe, layout.pp, recipe.kernels.attention),
        cp_rotate=st.cp_rotate or "allgather",
        virtual_stages=par.pp_stages_per_rank if layout.pp > 1 else 0,
        stack=stack,
        **lora_fields(recipe),
        **moe_fields(recipe),
    )


def moe_fields(recipe) -> dict[str, Any]:
    """Workload fields for a recipe's `parallel.ep` and `[moe]` (absent: a dense recipe)."""
    out: dict[str, Any] = {}
    if recipe.parallel.ep > 1:
        out["ep"] = recipe.parallel.ep
    if recipe.moe.capacity_factor:
        out["capacity_factor"] = float(recipe.moe.capacity_factor)
    return out


def lora_fields(recipe) -> dict[str, Any]:
    """Workload fields for a recipe's [finetune]/[lora] (the planner and tools.predict)."""
    if recipe.finetune.mode != "lora":
        return {}
    return {
        "lora_rank": recipe.lora.rank,
        "lora_adapters": max(1, len(recipe.adapters)),
        "lora_targets": tuple(recipe.lora.target_modules),
    }


# ----------------------------------------------------------------------------------------
# Where a group lies on the hardware


@dataclass(frozen=True)
class GroupSpan:
    """How one parallel group (e.g. a dp_shard group) lies on the fabric.

    size: ranks; domains: NVLink domains it touches; per_domain: the most ranks it has in
    one domain (each uses its own NIC); leaves: leaf switches; ring_leaf_hops: leaf
    changes walking the ring in communicator order (cyclic; 0 inside one leaf);
    ring_node_hops: host changes likewise.
    """

    size: int
    domains: int = 1
    per_domain: int = 1
    nodes: int = 1
    leaves: int = 1
    ring_node_hops: int = 0
    ring_leaf_hops: int = 0

    @property
    def in_nvlink(self) -> bool:
        return self.domains <= 1


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _span(d: int, inner: int, cluster: Cluster) -> GroupSpan:
    g = cluster.gpus_per_node
    dom = cluster.nvlink_domain_gpus
    npl = cluster.topology.nodes_per_leaf or cluster.nodes
    per_node = 1 if inner >= g else max(1, min(d, g // inner))
    nodes = _ceil_div(d, per_node)
    per_domain = 1 if inner >= dom else max(1, min(d, dom // inner))
    domains = _ceil_div(d, per_domain)
    stretch_nodes = max(1, _ceil_div(d * inner, g))
    # The group's hosts spread evenly over its stretch: it touches every leaf of the
    # stretch, but never more leaves than it has hosts.
    leaves = min(nodes, max(1, _ceil_div(stretch_nodes, npl))) if nodes > 1 else 1
    return GroupSpan(
        size=d,
        domains=domains,
        per_domain=per_domain,
        nodes=nodes,
        leaves=leaves,
        ring_node_hops=nodes if nodes > 1 else 0,
        ring_leaf_hops=leaves if leaves > 1 else 0,
    )


# Span keys: the five mesh axes plus "fsdp" (torchtitan shards parameters over dp_shard x
# cp) and "dp" (dp_replicate x dp_shard; no collective of its own, reported only).
_AXIS_NAMES = tuple(a.value for a in MESH_ORDER)
SPAN_KEYS = _AXIS_NAMES + ("fsdp",)


def expert_spans(layout: Layout, ep: int, cluster: Cluster) -> dict[str, GroupSpan]:
    """Spans of the sparse mesh's groups (torchtitan: pp, dp_replicate, efsdp, ep with ep
    innermost): an EP group is `ep` consecutive ranks; efsdp (dp_shard x cp x tp / ep)
    strides over them."""
    efsdp = max(1, layout.dp_shard * layout.cp * layout.tp // max(1, ep))
    return {"ep": _span(ep, 1, cluster), "efsdp": _span(efsdp, ep, cluster)}


def planned_spans(layout: Layout, cluster: Cluster) -> dict[str, GroupSpan]:
    """Spans of each axis's groups under the planned placement (hosts sorted by switch,
    mesh filled row-major with tp innermost), assuming every leaf is full.

    A group of axis a with degree d has its ranks `inner` apart (inner = product of the
    degrees inside a), over a stretch of d x inner consecutive GPUs.
    """
    out: dict[str, GroupSpan] = {}
    inner = 1
    for name in reversed(_AXIS_NAMES):
        d = getattr(layout, name)
        out[name] = _span(d, inner, cluster)
        inner *= d
    out["fsdp"] = _span(layout.dp_shard * layout.cp, layout.tp, cluster)
    return out


def log2i(n: int) -> int:
    return max(0, math.ceil(math.log2(max(1, n))))
