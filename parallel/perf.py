"""Analytical step-time model for Llama-family training under FSDP2/TP/PP/CP (torchtitan).

Per microbatch and pipeline rank: matmul time (FLOPs per GEMM at an achievable fraction of
the precision's peak, lower for narrow GEMMs), attention (causal or document-masked
FLOPs at a fraction of the BF16 peak), memory-bound work (norms, residuals, RoPE, SwiGLU,
loss, FP8 casts) at HBM bandwidth, and the collectives of every parallel axis over the
links their groups actually span (`GroupSpan`): NVLink inside a domain, one NIC per GPU
between domains, leaf oversubscription across leaves. Overlap: FSDP's all-gather and
reduce-scatter hide behind the block they prefetch for; TP's collectives are exposed
unless async TP; CP all-gather is exposed, ring rotation hides behind attention; PP adds
its p2p transfers and its schedule's bubble.

The named constants below are the whole calibration: global, few, each with its reason.
`benchmarks/calibration.md` (from `python -m tools.predict --calibration`) shows every
published row against the prediction.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from core.hardware import GPUS, peak_flops
from parallel.cluster import Cluster
from parallel.memory import MemoryEstimate, estimate_memory, rank_stages, stage_layers
from parallel.moe import (
    MoEDims,
    a2a_per_layer,
    a2a_time,
    busiest_load,
    fabric_of_ep,
    gathered_layer_params,
    moe_dims,
)
from parallel.stacks import Stack, load_stack
from parallel.workload import GroupSpan, Workload, expert_spans, planned_spans

# --- hardware constants (stack-independent) ------------------------------------------
# The software stack's efficiency constants (GEMM, attention, fusion, overlap, optimizer)
# live in stacks/<name>.toml (`parallel.stacks`); what stays here is the hardware's.
# Achievable fraction of HBM bandwidth for pointwise kernels and the optimizer.
HBM_EFF = 0.80
# Bus-bandwidth efficiency of NCCL rings: NVLink (NVSwitch) and the inter-node network.
NVLINK_EFF = 0.85
NET_EFF = 0.80
# Per-step latency of a ring collective (one hop), seconds.
ALPHA_NVLINK = 5e-6
ALPHA_NET = 15e-6
# Sustained clock under a power cap: (cap / TDP) ** POWER_CLOCK_EXPONENT (dynamic power
# ~ f * V^2 with V roughly tracking f on the DVFS curve gives an exponent near 1/3..1/2).
POWER_CLOCK_EXPONENT = 0.8
# A CPU rank has no tensor-core peak: FLOP/s one gloo rank sustains in fp32 (rough).
CPU_FLOPS_PER_RANK = 2.0e10

# Bubble of each schedule in units of (p - 1) x one rank's microbatch time, before
# dividing by the stages per rank v (interleaving shortens each slot to 1/v). Zero-bubble
# schedules fill about two thirds of it with deferred weight-gradient work (ZB-H1).
BUBBLE_FACTOR = {
    "GPipe": 1.0,
    "1F1B": 1.0,
    "Interleaved1F1B": 1.0,
    "InterleavedZeroBubble": 1.0 / 3,
    "ZBVZeroBubble": 1.0 / 3,
    "DualPipeV": 1.0 / 3,
}


@dataclass(frozen=True)
class Collective:
    """One collective of the step: `count` calls of `kind` on `nbytes` (the full buffer)."""

    axis: str
    kind: str  # all_gather | reduce_scatter | all_reduce | p2p
    nbytes: float
    count: float
    what: str


@dataclass
class Prediction:
    step_time_s: float
    tokens_per_sec_per_gpu: float
    tokens_per_sec_per_node: float
    mfu_pct: float | None  # model FLOPs against the BF16 dense peak
    mfu_pct_precision_peak: float | None  # against the peak of the linear's precision
    memory: MemoryEstimate
    breakdown: dict[str, float] = field(default_factory=dict)
    tp_total_s: float = 0.0  # TP collective time before async-TP hiding (information)
    workload: Workload | None = None
    layers_per_rank: int = 0
    moe: dict = field(default_factory=dict)  # MoE only: ep, its fabric, params, convention

    @property
    def collectives(self) -> list[Collective]:
        """Every collective of one step (computed on demand: the planner rarely needs it)."""
        assert self.workload is not None
        return _collectives(self.workload, self.layers_per_rank)

    def to_json(self) -> dict:
        return {
            "tokens_per_sec_per_gpu": round(self.tokens_per_sec_per_gpu, 1),
            "tokens_per_sec_per_node": round(self.tokens_per_sec_per_node, 1),
            "mfu_pct": None if self.mfu_pct is None else round(self.mfu_pct, 2),
            "step_time_s": round(self.step_time_s, 4),
            "memory_gib_per_gpu": round(self.memory.reserved_gib, 2),
            "breakdown": {k: round(v, 4) for k, v in self.breakdown.items()},
            **({"moe": self.moe} if self.moe else {}),
        }


# ----------------------------------------------------------------------------------------
# Building blocks


def sp_collectives_per_layer(ac: str) -> tuple[int, int]:
    """(all-gathers, reduce-scatters) of sequence-parallel TP per layer per microbatch.

    2 all-gathers + 2 reduce-scatters forward, the mirror image backward; the recompute
    repeats the forward's (selective saves reduce-scatter outputs only)."""
    return 4 + (2 if ac in ("full", "selective") else 0), 4 + (2 if ac == "full" else 0)


def gemm_eff(st: Stack, linear: str, x: float, gpu: str = "H100") -> float:
    """Fraction of the precision's peak a GEMM whose smaller weight dimension is x
    sustains on this stack and GPU: the large-GEMM asymptote times x / (x + half_dim)
    (narrow GEMMs fill fewer tiles per wave and spend more time in epilogues)."""
    return st.matmul(linear) * st.gpu_factor(gpu) * x / (x + st.gemm_half_dim)


def stack_of(w: Workload, stack: Stack | None = None) -> Stack:
    return stack if stack is not None else load_stack(w.stack)


def _linear_kind(w: Workload) -> tuple[str, str]:
    """(forward/dgrad kind, wgrad kind) of the transformer-block linears."""
    if w.linear == "fp8_rowwise_gw_hp":
        return "fp8_rowwise", "bf16"
    if w.linear in ("fp8_tensorwise", "fp8_rowwise", "mxfp8", "nvfp4"):
        return w.linear, w.linear
    return "bf16", "bf16"


def fp8_tp_gather(w: Workload) -> bool:
    """Sequence-parallel all-gathers move FP8 (1 byte) instead of bf16."""
    return w.fp8_tp_all_gather and w.linear == "fp8_tensorwise"


def block_gemms(w: Workload) -> list[tuple[int, int]]:
    """(in, out) per GPU of the block's linears under TP: wqkv, wo, w1, w3, w2."""
    s, t = w.shape, w.layout.tp
    qd, kv, d, f = s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim, s.dim, s.ffn_hidden
    return [(d, (qd + 2 * kv) // t), (qd // t, d), (d, f // t), (d, f // t), (f // t, d)]


def attention_width(shape) -> float:  # noqa: ANN001 (ModelShape)
    """Per-token width of the score and value products: heads x head_dim (GQA); MLA's
    mean of the query/key head dim (nope + rope) and the value head dim."""
    return shape.n_heads * shape.attention_head_dims / 2


def moe_block_gemms(w: Workload, m: MoEDims) -> list[tuple[float, float, float, bool]]:
    """(in, out, share of tokens, recomputed under selective AC) per GPU of the average MoE
    model block's dense linears under TP: attention (MLA's low-rank projections or GQA's),
    the dense SwiGLU on the dense layers, the shared experts and the router on the MoE
    layers. The routed experts are priced apart (grouped GEMMs, `layer_costs`)."""
    s, t = w.shape, w.layout.tp
    d = s.dim
    if s.attention == "mla":
        h, qk, v = s.n_heads, s.qk_nope_head_dim + s.qk_rope_head_dim, s.v_head_dim
        attn: list[tuple[float, float]] = []
        if s.q_lora_rank:
            attn += [(d, s.q_lora_rank), (s.q_lora_rank, h * qk / t)]
        else:
            attn += [(d, h * qk / t)]
        attn += [
            (d, s.kv_lora_rank + s.qk_rope_head_dim),
            (s.kv_lora_rank, h * (qk - s.qk_rope_head_dim + v) / t),
        ]
        attn += [(h * v / t, d)]
    else:
        qd, kv = s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim
        attn = [(d, (qd + 2 * kv) / t), (qd / t, d)]
    out = [(k, n, 1.0, i % 2 == 1) for i, (k, n) in enumerate(attn)]
    dense = 1 - m.moe_fraction
    if dense and s.ffn_hidden:
        f = s.ffn_hidden / t
        out += [(d, f, dense, False), (d, f, dense, True), (f, d, dense, False)]
    if m.n_shared:
        hs = m.n_shared * m.expert_hidden / t
        out += [(d, hs, m.moe_fraction, False), (d, hs, m.moe_fraction, True)]
        out += [(hs, d, m.moe_fraction, False)]
    out.append((d, m.n_routed, m.moe_fraction, False))  # router (replicated over tp)
    return out


def model_flops_per_token(shape, seq_len: int) -> int:
    """Model FLOPs per token as torchtitan counts them (MFU's numerator), built from this
    model's own GEMM list: 6 x (block GEMM weights + norm weights + output projection) +
    12 x layers x heads x head_dim x seq (attention without the causal discount). With
    tied embeddings the output projection is the embedding matrix, counted once."""
    s = shape
    qd, kv, d, f = s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim, s.dim, s.ffn_hidden
    qk_norm = 2 * s.head_dim if s.qk_norm else 0  # Qwen3's per-head q/k RMSNorm weights
    per_layer = d * (qd + 2 * kv) + qd * d + 3 * d * f + 2 * d + qk_norm
    params = s.n_layers * per_layer + d + s.vocab_size * d
    return 6 * params + 12 * s.n_layers * s.n_heads * s.head_dim * seq_len


def hardware_flops_per_token(w: Workload) -> float:
    """FLOPs the GPUs execute per token: causal (or document) attention work only, flash
    attention's backward recompute, and activation-checkpointing recompute."""
    s = w.shape
    qd, kv, d, f = s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim, s.dim, s.ffn_hidden
    gemms = [d * (qd + 2 * kv), qd * d, d * f, d * f, f * d]
    fwd = sum(2 * g for g in gemms)
    recompute = 0.0
    if w.ac == "full":
        recompute = fwd
    elif w.ac == "selective":
        recompute = sum(2 * g for g, r in zip(gemms, SAC_RECOMPUTED, strict=True) if r)
    attn_fwd = 4.0 * attention_keys(w) * qd
    attn = attn_fwd * (1 + 2.5 + (1 if w.ac == "full" else 0))
    head = 6.0 * d * s.vocab_size
    return s.n_layers * (3 * fwd + recompute + attn) + head


# Which block linears per-op SAC recomputes: every second matmul in forward order
# (wqkv saved, wo recomputed, w1 saved, w3 recomputed, w2 saved).
SAC_RECOMPUTED = (False, True, False, True, False)


def attention_keys(w: Workload) -> float:
    """Mean keys each query attends to: causal over a document (or the whole sequence)."""
    doc = w.doc_len if 0 < w.doc_len < w.seq_len else w.seq_len
    return (doc + 1) / 2


def pointwise_bytes(w: Workload) -> float:
    """Eager HBM bytes per token per layer for the block's pointwise ops (fwd + bwd).

    Forward: two RMSNorms with fp32 upcasts (~16 B per element each), two residual adds
    (6 B), RoPE on q and k through fp32 complex numbers (~12 B), SwiGLU's silu and product
    (10 B per hidden element). Backward moves about twice the forward bytes.
    Sequence-parallel / head-sharded: everything divides by tp.
    """
    s, t = w.shape, w.layout.tp
    qd, kv, d, f = s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim, s.dim, s.ffn_hidden
    fwd = 2 * 16 * d + 2 * 6 * d + 12 * (qd + kv) + 10 * f
    return 3 * fwd / t * (2 if w.dtype == "float32" else 1)


def fp8_cast_bytes(w: Workload) -> float:
    """HBM bytes per token per layer spent casting linear operands to FP8 (fwd + bwd).

    Each cast reads bf16 (2 B) and writes fp8 (1 B); tensorwise also reads once for the
    amax (fused by compile). Activation-side operands: forward inputs, backward output
    gradients, and for the weight gradient their transposed casts (tensorwise transposes
    the fp8 copy, 2 B; row-wise scaling must requantize along the other axis, 3 B).
    NVFP4 (torchao's Triton path): an amax pass with the Hadamard transform (reads 2 B), then
    one fused transform-and-quantize that reads 2 B and writes both orientations of 4-bit
    codes with an e4m3 scale per 16 (2 x 0.5625 B): about 5.1 B per operand element.
    """
    if w.linear == "bf16":
        return 0.0
    s, t = w.shape, w.layout.tp
    qd, kv, d, f = s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim, s.dim, s.ffn_hidden
    ins = d + qd / t + d + f / t  # wqkv, wo, w1 (w3 shares w1's cast), w2 inputs
    outs = (qd + 2 * kv) / t + d + 2 * f / t + d  # output gradients
    if w.linear == "fp8_tensorwise":
        return (ins + outs) * (3 + 2)
    if w.linear == "nvfp4":
        return (ins + outs) * (2 + 2 + 2 * 0.5625)
    if w.linear == "fp8_rowwise_gw_hp":
        return (ins + outs) * 3
    return (ins + outs) * (3 + 3)


# ----------------------------------------------------------------------------------------
# Collectives


@dataclass(frozen=True)
class Links:
    """The hardware numbers the time model uses (hashable, for caching)."""

    gpu: str
    clock: float  # sustained clock fraction (power cap)
    nvlink: float  # bytes/s per GPU per direction
    net: float  # bytes/s per GPU per direction
    oversubscription: float
    hbm: float  # achievable HBM bytes/s
    gpus_per_node: int

    @property
    def is_cpu(self) -> bool:
        return self.gpu == "cpu"


def links_of(cluster: Cluster) -> Links:
    return Links(
        gpu=cluster.gpu,
        clock=cluster.power_fraction**POWER_CLOCK_EXPONENT,
        nvlink=cluster.nvlink_bytes_per_s,
        net=cluster.net_bytes_per_s,
        oversubscription=cluster.topology.oversubscription,
        hbm=GPUS[cluster.gpu].hbm_tbps * 1e12 * HBM_EFF,
        gpus_per_node=cluster.gpus_per_node,
    )


def coll_time(kind: str, nbytes: float, span: GroupSpan, links: Links) -> float:
    """Time of one collective on a group with this span (ring algorithm, bus bandwidth).

    Inside an NVLink domain: NVLink. Across domains: each member's own NIC, so the
    group's bandwidth grows with its members per domain (rail-optimised fabrics), capped
    by NVLink, divided by the leaf oversubscription when it leaves a leaf.
    """
    n = span.size
    if n <= 1 or nbytes <= 0:
        return 0.0
    nvl = links.nvlink * NVLINK_EFF
    if span.in_nvlink:
        bw, alpha = nvl, ALPHA_NVLINK
    else:
        net = links.net * NET_EFF * span.per_domain
        if span.leaves > 1:
            net /= links.oversubscription
        bw, alpha = (min(nvl, net) if nvl > 0 else net), ALPHA_NET
    if bw <= 0:
        return float("inf")
    if kind == "p2p":
        return alpha + nbytes / bw
    factor = 2.0 if kind == "all_reduce" else 1.0
    return factor * ((n - 1) * alpha + nbytes * (n - 1) / n / bw)


@dataclass(frozen=True)
class LayerCosts:
    """Seconds per transformer block per microbatch on one GPU."""

    fwd_mm: float
    bwd_mm: float
    recompute_mm: float
    attention: float
    attention_fwd: float
    pointwise: float
    fp8_cast: float
    tp_total: float
    tp_exposed: float
    cp_exposed: float
    interference: float  # compute slowdown under overlapped TP/CP collectives
    head: float  # output projection + loss (last stage only)
    ep_total: float = 0.0  # expert all-to-all (dispatch + combine, fwd + bwd), average block
    ep_exposed: float = 0.0
    moe_overhead: float = 0.0  # host waits of the MoE layers (stack's moe_layer_overhead_s)

    @property
    def compute(self) -> float:
        return (
            self.fwd_mm
            + self.bwd_mm
            + self.recompute_mm
            + self.attention
            + self.pointwise
            + self.fp8_cast
        )

    @property
    def total(self) -> float:
        return (
            self.compute
            + self.tp_exposed
            + self.cp_exposed
            + self.interference
            + self.ep_exposed
            + self.moe_overhead
        )

    @property
    def forward(self) -> float:
        """The forward share (what an FSDP prefetch can hide behind before backward)."""
        return (
            self.fwd_mm
            + self.attention_fwd
            + (self.pointwise + self.fp8_cast) / 3
            + self.tp_exposed / 3
            + self.ep_exposed / 3
        )


def _peak(kind: str, w: Workload, links: Links) -> float:
    if links.is_cpu:
        return CPU_FLOPS_PER_RANK
    bf16 = (peak_flops(links.gpu, "bf16") or CPU_FLOPS_PER_RANK) * links.clock
    if kind == "bf16":
        if w.dtype == "float32":
            return (peak_flops(links.gpu, "tf32") or bf16) * links.clock
        return bf16
    fp8 = peak_flops(links.gpu, "fp8")
    fp4 = peak_flops(links.gpu, "fp4") if kind == "nvfp4" else None
    peak = fp4 or fp8
    return peak * links.clock if peak else bf16


def layer_costs(
    w: Workload,
    links: Links,
    span_tp: GroupSpan,
    span_cp: GroupSpan,
    st: Stack,
    span_ep: GroupSpan | None = None,
) -> LayerCosts:
    """Per-block costs; depends on tp, cp, ep and the microbatch, not on dp or pp (cached).
    An MoE model's block is the average of its dense and MoE layers (parallel.moe)."""
    s = w.shape
    m = moe_dims(s)
    gpu = links.gpu
    t, c = w.layout.tp, w.layout.cp
    is_cpu = links.is_cpu
    elt = w.bytes_per_param_compute
    tok = w.tokens_per_microbatch / c  # tokens each GPU of a tp group works on
    fwd_kind, wgrad_kind = ("bf16", "bf16") if is_cpu else _linear_kind(w)
    p_fwd, p_wgrad, p_bf16 = (
        _peak(fwd_kind, w, links),
        _peak(wgrad_kind, w, links),
        _peak("bf16", w, links),
    )
    fwd_mm = bwd_mm = recompute_mm = 0.0
    gemms: list[tuple[float, float, float, bool]]
    if m is None:
        gemms = [(k, n, 1.0, SAC_RECOMPUTED[i]) for i, (k, n) in enumerate(block_gemms(w))]
    else:
        gemms = moe_block_gemms(w, m)
    for k, n, share, sac_recomputed in gemms:
        fl = 2.0 * tok * k * n * share
        x = min(k, n)
        tf = fl / (p_fwd * (1.0 if is_cpu else gemm_eff(st, fwd_kind, x, gpu)))
        fwd_mm += tf
        if w.lora_rank:
            # Frozen base: input gradients only (no weight-gradient GEMM). Adapters: x A^T then
            # (.) B^T forward, their input and weight gradients backward, at rank-r efficiency.
            r = w.lora_rank
            lt = 2.0 * tok * r * (k + n)  # each token passes through one adapter
            lt /= p_bf16 * (1.0 if is_cpu else gemm_eff(st, "bf16", r, gpu))
            fwd_mm += lt
            bwd_mm += tf + 2 * lt
        else:
            bwd_mm += tf + fl / (p_wgrad * (1.0 if is_cpu else gemm_eff(st, wgrad_kind, x, gpu)))
        if w.ac == "full" or (w.ac == "selective" and sac_recomputed):
            recompute_mm += tf
    ep_total = 0.0
    if m is not None:
        # Routed experts: grouped GEMMs on the busiest EP rank (imbalance x the mean routed
        # copies), each expert's GEMM as wide as the tokens it gets (ep x tokens x top_k /
        # routed experts), at the stack's grouped-GEMM efficiency. Without EP each expert's
        # hidden dim is split by tp; with EP the tokens are whole and spread over the group.
        ep = w.ep
        imb = busiest_load(w, st)
        h = m.expert_hidden / (t if ep == 1 else 1)
        routed_tok = tok / (1 if ep == 1 else t) * m.top_k * imb
        per_expert = max(1.0, routed_tok * max(ep, 1) / m.n_routed)
        fl = 2.0 * routed_tok * 3 * m.dim * h * m.moe_fraction
        x = min(h, per_expert, m.dim)
        g_eff = 1.0 if is_cpu else st.grouped_gemm_eff
        tf = fl / (p_fwd * (1.0 if is_cpu else gemm_eff(st, fwd_kind, x, gpu)) * g_eff)
        fwd_mm += tf
        bwd_mm += tf + fl / (
            p_wgrad * (1.0 if is_cpu else gemm_eff(st, wgrad_kind, x, gpu)) * g_eff
        )
        if w.ac in ("full", "selective"):  # selective recomputes the grouped GEMMs
            recompute_mm += tf
        if ep > 1 and span_ep is not None:
            # Dispatch and combine of the tp shard's tokens (top_k copies of dim each).
            nbytes = tok / t * m.top_k * m.dim * elt
            one = a2a_time(nbytes, ep, span_ep, links, imb)
            ep_total = a2a_per_layer(w.ac) * one * m.moe_fraction
    qd = attention_width(s)
    attn_e = 1.0 if is_cpu else st.attention_eff * st.gpu_factor(gpu)
    attn_fwd = 4.0 * tok * attention_keys(w) * qd / t / (p_bf16 * attn_e)
    # Backward is 2.5 forwards (flash recomputes the scores); full AC reruns the forward.
    attention = attn_fwd * (1 + 2.5 + (1 if w.ac == "full" else 0))
    rerun = 4 / 3 if w.ac == "full" else 1.0
    wp = w
    if m is not None:
        # Pointwise work of the average block's FFN: dense SwiGLU on the dense layers; the
        # shared experts and the busiest rank's routed copies on the MoE layers.
        imb = busiest_load(w, st)
        f_moe = (m.n_shared + m.top_k * imb) * m.expert_hidden
        f_eq = (1 - m.moe_fraction) * s.ffn_hidden + m.moe_fraction * f_moe
        wp = w.with_(shape=replace(s, ffn_hidden=round(f_eq)))
    pw = pointwise_bytes(wp) * (
        st.pointwise_scale_compiled if w.compile else st.pointwise_scale_eager
    )
    pointwise = tok * pw / links.hbm * rerun
    fp8_cast = tok * fp8_cast_bytes(wp) / links.hbm * rerun

    act = tok * s.dim  # elements of one full-sequence (SP-gathered) activation
    tp_total = 0.0
    if t > 1:
        ag = 1 if fp8_tp_gather(w) else elt
        n_ag, n_rs = sp_collectives_per_layer(w.ac)
        tp_total = n_ag * coll_time("all_gather", act * ag, span_tp, links)
        tp_total += n_rs * coll_time("reduce_scatter", act * elt, span_tp, links)
    overlaps = st.tp_overlap == "always" or (w.async_tp and w.compile)
    hidden = st.tp_hidden if overlaps else 0.0
    overlapped = tp_total * hidden
    cp_exposed = 0.0
    if c > 1:
        kv_bytes = tok * 2 * s.n_kv_heads * s.head_dim / t * elt  # this rank's K and V
        if w.cp_rotate == "alltoall":
            # Ring: K/V forward, K/V and dK/dV backward, each (c-1) hops under attention.
            ring = 3 * (c - 1) * coll_time("p2p", kv_bytes, span_cp, links)
            cp_exposed = max(0.0, ring - attention)
            overlapped += min(ring, attention)
        else:
            n_ag = 1 + (1 if w.ac == "full" else 0)
            cp_exposed = n_ag * coll_time("all_gather", kv_bytes * c, span_cp, links)
            cp_exposed += coll_time("reduce_scatter", kv_bytes * c, span_cp, links)

    head_flops = 2.0 * tok * s.dim * s.vocab_size / t
    head_eff = 1.0 if is_cpu else gemm_eff(st, "bf16", min(s.dim, s.vocab_size / t), gpu)
    # Output projection: forward, input gradient, weight gradient (frozen under LoRA).
    head = (2 if w.lora_rank else 3) * head_flops / (_peak("bf16", w, links) * head_eff)
    # Loss over tok x vocab/tp logits: eager upcasts, log-softmax, grad (~20 B/elt);
    # compiled cross-entropy fuses to about a read and a write of each (8 B).
    lb = st.loss_bytes_compiled if w.compile else st.loss_bytes_eager
    loss_bytes = lb * (s.vocab_size / t) * (2 if w.dtype == "float32" else 1)
    head += tok * loss_bytes / links.hbm
    return LayerCosts(
        fwd_mm=fwd_mm,
        bwd_mm=bwd_mm,
        recompute_mm=recompute_mm,
        attention=attention,
        attention_fwd=attn_fwd,
        pointwise=pointwise,
        fp8_cast=fp8_cast,
        tp_total=tp_total,
        tp_exposed=tp_total * (1 - hidden),
        cp_exposed=cp_exposed,
        interference=st.comm_sm_slowdown * overlapped,
        head=head,
        ep_total=ep_total,
        ep_exposed=ep_total * (1 - st.ep_a2a_hidden),
        moe_overhead=0.0 if (m is None or is_cpu) else st.moe_layer_overhead_s * m.moe_fraction,
    )


_LAYER_CACHE: dict[tuple, LayerCosts] = {}


def cached_layer_costs(
    w: Workload,
    links: Links,
    span_tp: GroupSpan,
    span_cp: GroupSpan,
    st: Stack,
    span_ep: GroupSpan | None = None,
) -> LayerCosts:
    """`layer_costs` keyed on what it depends on (the planner calls it for many layouts
    that differ only in dp and pp)."""
    key = (
        w.shape,
        w.seq_len,
        w.seqs_per_microbatch,
        w.layout.tp,
        w.layout.cp,
        w.ac,
        w.linear,
        w.compile,
        w.dtype,
        w.async_tp,
        w.cp_rotate,
        w.doc_len,
        w.lora_rank,
        st,
        links,
        span_tp,
        span_cp,
        w.ep,
        w.capacity_factor,
        w.load_imbalance,
        span_ep,
    )
    hit = _LAYER_CACHE.get(key)
    if hit is None:
        if len(_LAYER_CACHE) > 65536:
            _LAYER_CACHE.clear()
        hit = _LAYER_CACHE[key] = layer_costs(w, links, span_tp, span_cp, st, span_ep)
    return hit


# ----------------------------------------------------------------------------------------
# The model


def predict(
    w: Workload,
    cluster: Cluster,
    spans: dict[str, GroupSpan] | None = None,
    memory: MemoryEstimate | None = None,
    stack: Stack | None = None,
) -> Prediction:
    """Step time (with an additive breakdown), throughput, MFU and memory of `w`.

    `spans` default to the planned placement's (`planned_spans`); pass measured spans
    (`parallel.placement.group_spans`) to price another rank order. `stack` overrides the
    workload's named profile (the calibration fit passes refitted copies).
    """
    spans = spans or planned_spans(w.layout, cluster)
    links = links_of(cluster)
    s = w.shape
    lay = w.layout
    t, c, p = lay.tp, lay.cp, lay.pp
    fsdp = lay.dp_shard * c
    elt = w.bytes_per_param_compute
    st = stack_of(w, stack)
    m = moe_dims(s)
    if m is not None and "ep" not in spans:
        spans = {**spans, **expert_spans(lay, w.ep, cluster)}
    L = cached_layer_costs(w, links, spans["tp"], spans["cp"], st, spans.get("ep"))

    # --- pipeline ranks: the slowest sets the pace ------------------------------------
    v = w.stages_per_rank
    n_stages = p * v
    per_stage = stage_layers(s.n_layers, n_stages)
    t_mb, layers_rank, with_head = -1.0, 0, False
    for r in sorted({0, min(1, p - 1), p - 1}):
        stages = rank_stages(r, p, w.pp_schedule, v)
        layers = sum(per_stage[i] for i in stages)
        last = (n_stages - 1) in stages
        tr = layers * L.total + (L.head if last else 0.0)
        if tr > t_mb:
            t_mb, layers_rank, with_head = tr, layers, last

    # --- data parallelism -------------------------------------------------------------
    # Bytes FSDP moves per block on this GPU (MoE: the local experts only, parallel.moe).
    lp = gathered_layer_params(s, t, w.ep)
    fp8_ag = w.fp8_all_gather and w.linear == "fp8_tensorwise"
    ag_bytes = lp * (1 if fp8_ag else elt)
    # Gradient bytes reduced per parameter (LoRA: the frozen base has no gradients).
    grad_b = 0.0 if w.lora_rank else max(st.grad_reduce_bytes, elt)
    # LoRA: only the adapters' gradients are reduced (fp32 in torchtitan).
    rs_bytes = w.lora_params_per_layer * 4 if w.lora_rank else lp * grad_b
    slots = w.microbatches if p > 1 else w.grad_accum
    zero1 = st.data_parallel == "distributed_optimizer" and lay.dp_shard == 1
    opt_shards = fsdp
    if p > 1:
        p2p_bytes = w.tokens_per_microbatch / c * s.dim / t * elt
        t_p2p_slot = 2 * v * coll_time("p2p", p2p_bytes, spans["pp"], links)
        t_p2p = slots * t_p2p_slot
        t_bubble = (p - 1) * BUBBLE_FACTOR[w.pp_schedule] / v * (t_mb + t_p2p_slot)
    else:
        t_p2p = t_bubble = 0.0
    if zero1:
        # Distributed optimizer (ZeRO-1) over dp x cp: whole bf16 params stay resident;
        # gradients are reduce-scattered and updated params all-gathered once per step,
        # bucketed under the last microbatch's backward and the first one's forward.
        dpg = lay.dp_replicate * c
        opt_shards = dpg
        span = replace(spans["dp_replicate"], size=dpg)
        stage_params = layers_rank * lp
        t_rs = coll_time("reduce_scatter", stage_params * grad_b, span, links)
        t_ag = coll_time("all_gather", stage_params * elt, span, links)
        bwd, fwd = t_mb * 2 / 3, t_mb / 3
        t_fsdp = max(0.0, t_rs - bwd) + max(0.0, t_ag - fwd)
        t_interf_fsdp = st.comm_sm_slowdown * (min(t_rs, bwd) + min(t_ag, fwd))
    elif p == 1:
        fs, rep = spans["fsdp"], spans["dp_replicate"]
        t_ag = coll_time("all_gather", ag_bytes, fs, links) if fsdp > 1 else 0.0
        t_rs = coll_time("reduce_scatter", rs_bytes, fs, links) if fsdp > 1 else 0.0
        t_ar = coll_time("all_reduce", rs_bytes / fsdp, rep, links) if lay.dp_replicate > 1 else 0.0
        # Per microstep: all-gather before forward and again before backward (resharded
        # after forward), reduce-scatter (+ replica all-reduce) after backward; each hides
        # behind the neighbouring block's compute; the first and the last do not, nor do
        # the embedding's and output's.
        emb = s.vocab_size * s.dim / t
        t_edges = t_ag + t_rs + t_ar
        if fsdp > 1:
            t_edges += coll_time("all_gather", emb * elt, fs, links)
            t_edges += coll_time("reduce_scatter", emb * grad_b, fs, links)
        fwd_cover = L.forward
        bwd_cover = L.total - fwd_cover
        exposed = max(0.0, t_ag - fwd_cover) + max(0.0, t_ag + t_rs + t_ar - bwd_cover)
        overlapped = min(t_ag, fwd_cover) + min(t_ag + t_rs + t_ar, bwd_cover)
        t_fsdp = slots * (s.n_layers * exposed + t_edges)
        t_interf_fsdp = slots * s.n_layers * st.comm_sm_slowdown * overlapped
    else:
        fs, rep = spans["fsdp"], spans["dp_replicate"]
        t_ag = coll_time("all_gather", ag_bytes, fs, links) if fsdp > 1 else 0.0
        t_rs = coll_time("reduce_scatter", rs_bytes, fs, links) if fsdp > 1 else 0.0
        t_ar = coll_time("all_reduce", rs_bytes / fsdp, rep, links) if lay.dp_replicate > 1 else 0.0
        # PP: gather the stage once and keep it (no reshard after forward), reduce once at
        # the end; each hides behind half a microbatch slot at best.
        gather, reduce = layers_rank * t_ag, layers_rank * (t_rs + t_ar)
        t_fsdp = max(0.0, gather - t_mb / 2) + max(0.0, reduce - t_mb / 2) + t_ag + t_rs + t_ar
        t_interf_fsdp = st.comm_sm_slowdown * (min(gather, t_mb / 2) + min(reduce, t_mb / 2))

    local_params = (
        s.n_layers * w.lora_params_per_layer / (p * opt_shards)
        if w.lora_rank
        else s.total_params / (t * p * opt_shards)
    )
    t_opt = local_params * st.optimizer_bytes_per_param / links.hbm
    n = slots * layers_rank
    # Eager launches cost host time per kernel; it shows only when the host is slower than
    # the GPU work it launches (small blocks, narrow TP shards). A CUDA graph replays the
    # step from one launch, so that exposed time goes to 0. The GPU work the host races
    # includes the exposed FSDP collectives (they run while the host is still launching):
    # counting them against compute only would charge the same wait twice, and then a slower
    # TP group (more GPU work, less host wait) could predict a faster step.
    host_launch = 0.0
    if not (links.is_cpu or w.cuda_graphs):
        per_block = st.kernels_per_block_compiled if w.compile else st.kernels_per_block_eager
        host_launch = max(0.0, n * per_block * st.kernel_launch_s - n * L.total - t_fsdp)
    breakdown = {
        "matmul_s": n * (L.fwd_mm + L.bwd_mm + L.recompute_mm),
        "attention_s": n * L.attention,
        "memory_bound_s": n * (L.pointwise + L.fp8_cast),
        "output_and_loss_s": slots * L.head if with_head else 0.0,
        "tp_exposed_s": n * L.tp_exposed,
        "cp_exposed_s": n * L.cp_exposed,
        "fsdp_exposed_s": t_fsdp,
        "comm_interference_s": n * L.interference + t_interf_fsdp,
        "pp_p2p_s": t_p2p,
        "pp_bubble_s": t_bubble,
        "optimizer_s": t_opt,
        "host_launch_s": host_launch,
    }
    moe: dict = {}
    if m is not None:
        breakdown["ep_alltoall_s"] = n * L.ep_exposed
        breakdown["moe_overhead_s"] = n * L.moe_overhead
        moe = {
            "ep": w.ep,
            "ep_fabric": fabric_of_ep(w.ep, spans["ep"], cluster),
            "total_params": s.total_params,
            "active_params": getattr(s, "active_params", s.total_params),
            "routed_experts": m.n_routed,
            "top_k": m.top_k,
            "load_imbalance": busiest_load(w, st),
            "capacity_factor": w.capacity_factor,
            "ep_alltoall_total_s": round(n * L.ep_total, 4),
            "mfu_convention": "model FLOPs on active parameters (6 x active + attention, as "
            "Megatron-LM and DeepSeek-V3 count), against the dense BF16 peak",
        }
    step = sum(breakdown.values())

    world = lay.world_size
    tps_gpu = w.tokens_per_step / world / step
    flops_tok = s.flops_per_token(w.seq_len)
    pk = peak_flops(cluster.gpu, "bf16")
    mfu = None if not pk else 100.0 * tps_gpu * flops_tok / pk
    pk_prec = peak_flops(cluster.gpu, "fp8" if w.linear.startswith("fp8") else w.linear)
    mfu_prec = None if not pk_prec else 100.0 * tps_gpu * flops_tok / pk_prec
    return Prediction(
        step_time_s=step,
        tokens_per_sec_per_gpu=tps_gpu,
        tokens_per_sec_per_node=tps_gpu * cluster.gpus_per_node,
        mfu_pct=mfu,
        mfu_pct_precision_peak=mfu_prec,
        memory=memory or estimate_memory(w, st),
        breakdown=breakdown,
        tp_total_s=n * L.tp_total,
        workload=w,
        layers_per_rank=layers_rank,
        moe=moe,
    )


def _collectives(w: Workload, layers_rank: int, expert: bool = False) -> list[Collective]:
    """Every collective of one optimizer step per group (buffer size = full group buffer).

    The same volumes the time model prices; `parallel.placement` turns them into bytes
    crossing leaf and spine switches for a rank order. `expert`: also the MoE layers'
    all-to-alls on the ep axis (tools.dryrun compares them; the placement tables have no
    ep axis).
    """
    s, lay = w.shape, w.layout
    t, c, p = lay.tp, lay.cp, lay.pp
    fsdp = lay.dp_shard * c
    elt = w.bytes_per_param_compute
    tok = w.tokens_per_microbatch / c
    micro = w.grad_accum if p == 1 else w.microbatches
    out: list[Collective] = []
    # What FSDP gathers per GPU (MoE: the local experts only; dense: total / tp).
    head = 0 if s.weight_tying else s.vocab_size * s.dim
    ends = (s.vocab_size * s.dim + head + s.dim) / t
    stage_params = (s.n_layers * gathered_layer_params(s, t, w.ep) + ends) / p
    if t > 1:
        act = tok * s.dim
        ag = 1 if fp8_tp_gather(w) else elt
        n_ag, n_rs = sp_collectives_per_layer(w.ac)
        out.append(Collective("tp", "all_gather", act * ag, n_ag * layers_rank * micro, "SP"))
        out.append(Collective("tp", "reduce_scatter", act * elt, n_rs * layers_rank * micro, "SP"))
    if c > 1:
        kv = tok * 2 * s.n_kv_heads * s.head_dim / t * elt * c
        n = 2 + (1 if w.ac == "full" else 0)
        out.append(Collective("cp", "all_gather", kv, n * layers_rank * micro, "K/V"))
    if fsdp > 1:
        fp8_ag = w.fp8_all_gather and w.linear == "fp8_tensorwise"
        gathers = 1 if p > 1 else 2 * micro
        reduces = 1 if p > 1 else micro
        out.append(
            Collective(
                "fsdp", "all_gather", stage_params * (1 if fp8_ag else elt), gathers, "params"
            )
        )
        out.append(Collective("fsdp", "reduce_scatter", stage_params * 4, reduces, "grads"))
    if lay.dp_replicate > 1:
        reduces = 1 if p > 1 else w.grad_accum
        out.append(
            Collective("dp_replicate", "all_reduce", stage_params * 4 / fsdp, reduces, "grads")
        )
    if p > 1:
        v = w.stages_per_rank
        out.append(
            Collective("pp", "p2p", tok * s.dim / t * elt, 2 * v * w.microbatches, "activations")
        )
    m = moe_dims(s)
    if expert and m is not None and w.ep > 1:
        # Dispatch and combine per MoE layer, forward and backward (the mean routed copies:
        # the busiest rank's share is the time model's business).
        moe_layers = layers_rank * m.moe_fraction
        nbytes = tok / t * m.top_k * m.dim * elt
        out.append(
            Collective(
                "ep", "all_to_all", nbytes, a2a_per_layer(w.ac) * moe_layers * micro, "tokens"
            )
        )
    return out
