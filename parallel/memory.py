"""Peak GPU memory per rank for a Workload, as torchtitan lays it out.

What is counted (bytes, per GPU, on the pipeline rank that needs the most):
- states: FSDP2 keeps fp32 master weights, fp32 gradients and AdamW's two fp32 moments,
  sharded over dp_shard x cp (torchtitan's `fsdp` mesh); tp and pp split the model first.
  16 bytes per parameter / (tp x pp x dp_shard x cp); 12 at the peak when the step frees
  its gradients (no CUDA graphs, no accumulation). HSDP replicas hold full copies.
- unsharded: without PP, FSDP gathers one block at a time (reshard after forward): two
  blocks' bf16 weights in flight (current + prefetch) and one block's bf16 gradient plus
  its fp32 reduce-scatter input. With PP, torchtitan does not reshard after forward and
  gradients accumulate unsharded over the microbatches: the whole stage's bf16 weights
  and fp32 gradients stay resident.
- activations per layer and token under none/selective/full checkpointing, counted tensor
  by tensor for torchtitan's Llama block (fused QKV, flex attention, SwiGLU) with sequence
  parallel under TP (see `layer_activation_bytes`), times the layers and the microbatches a
  rank holds at its peak under its pipeline schedule (`inflight_stage_microbatches`; the
  zero-bubble schedules also hold deferred weight gradients, `deferred_weight_grads`, and
  every pipeline rank one receive buffer per microbatch, `recv_buffer_bytes`), plus one
  checkpointed layer's recompute as backward workspace.
- logits: the last stage's (tokens x vocab/tp) bf16 logits, fp32 upcast and fp32
  log-softmax (10 bytes per element eager; compiled cross-entropy keeps 6), for one of
  the stack's loss chunks at a time (torchtitan: 8).
Checked rank by rank against the real torchtitan step on a fake process group at full
world size: `tools.dryrun`, benchmarks/dryrun.md.
- FP8 extras: FP8 copies of one block's weights and of the linear inputs.
- LoRA (Workload.lora_rank): the frozen base keeps 4 bytes per parameter (no gradient, no
  optimizer state), adapters 16; no gradient buffers for the base blocks.

Reported memory is what torchtitan logs ("max reserved"): allocated peak x
(1 + ALLOCATOR_FRAGMENTATION). Fitting needs that plus RUNTIME_OVERHEAD_GIB (CUDA context,
NCCL and cuBLAS workspaces outside the caching allocator) to be under the GPU's memory.
Checked against the published memory column: benchmarks/calibration.md and docs/perf_model.md.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from core.models import pp_layer_weights
from parallel.moe import (
    busiest_load,
    dispatch_buffer_bytes,
    gathered_layer_params,
    layer_params,
    moe_activation_bytes,
    moe_dims,
)
from parallel.stacks import Stack, load_stack
from parallel.workload import Workload

GIB = 2**30

# Caching-allocator slack: reserved / allocated at peak. PyTorch's allocator rounds and
# splits blocks; with FSDP's per-block all-gather buffers torchtitan's runs typically show
# reserved 5-15% above allocated. One constant, fitted to the published memory column.
ALLOCATOR_FRAGMENTATION = 0.10

# Memory outside the caching allocator on every GPU: CUDA context and kernels (~0.5-1 GiB),
# NCCL channel buffers for each communicator (~0.3 GiB per group kind), cuBLAS/cuDNN
# workspaces. Not in torchtitan's "reserved" figure, but it must fit too.
RUNTIME_OVERHEAD_GIB = 3.0
# A CPU rank (gloo): the Python process with torch imported, ~0.8 GiB resident.
CPU_RUNTIME_OVERHEAD_GIB = 0.8


def runtime_overhead_gib(gpu: str) -> float:
    return CPU_RUNTIME_OVERHEAD_GIB if gpu == "cpu" else RUNTIME_OVERHEAD_GIB


# Bytes per logit element alive at the loss: bf16 logits (2) + fp32 upcast (4) + fp32
# log-softmax kept for backward (4). torch.compile fuses the upcast into the loss.
LOGIT_BYTES_EAGER = 10
LOGIT_BYTES_COMPILED = 6

# AdamW with fp32 master weights: param 4 + grad 4 + exp_avg 4 + exp_avg_sq 4.
STATE_BYTES_PER_PARAM = 16
FROZEN_BYTES_PER_PARAM = 4  # LoRA base: the fp32 parameter only


def layer_activation_bytes(w: Workload, mode: str | None = None, st: Stack | None = None) -> float:
    """Bytes kept for backward per token (of the tp group's microbatch) in one layer.

    Tensors of torchtitan's Llama block, bf16 (x2 for fp32 training):
      sequence-sharded under SP (/tp): block input x, attention_norm output, residual h,
        ffn_norm output (8d)
      gathered full-sequence inputs of the column-parallel linears (only with tp > 1;
        with tp = 1 they are the norm outputs above): wqkv input, w1/w3 input (4d)
      head/hidden-sharded (/tp): a contiguous copy of v, rope'd q and k, attention output
        with its fp32 logsumexp and row max, SwiGLU's w1 out, silu out, w3 out, product
        (8f); per token, RoPE's factors (not sharded)
    selective (torchtitan's per-op policy: saves attention, every other matmul output and
    reduce-scatter outputs; recomputes the rest): x, qkv, attention output, w1 output and
    w2's output. full: only the block input x (sequence-sharded).
    torch.compile's partitioner recomputes SwiGLU's pointwise outputs (silu, product).

    Stacks differ (`stacks/*.toml`): Megatron-Core / TE keeps the sequence shard of the
    column-parallel inputs and gathers again in backward (`sp_saves_gathered = false`),
    applies RoPE in place of the saved q/k (fused RoPE) and keeps fc1's output and the
    SwiGLU output (`fused_ffn_activations`: 6 bytes per hidden element).
    """
    st = st or load_stack(w.stack)
    s = w.shape
    mode = mode or w.ac
    t = w.layout.tp
    m = moe_dims(s)
    if m is not None:
        # The average block: attention as below; the FFN share is the dense SwiGLU's on the
        # dense layers and the MoE layer's (parallel.moe) on the others.
        dense = replace(s, n_routed_experts=0)
        attn = layer_activation_bytes(w.with_(shape=replace(dense, ffn_hidden=0)), mode, st)
        dense_ffn = layer_activation_bytes(w.with_(shape=dense), mode, st)
        imb = busiest_load(w, st)
        moe = moe_activation_bytes(m, mode, imb, t) * (2 if w.dtype == "float32" else 1)
        return attn + (1 - m.moe_fraction) * (dense_ffn - attn) + m.moe_fraction * moe
    d, qd, kv, f = s.dim, s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim, s.ffn_hidden
    lse = 4 * s.n_heads  # fp32 logsumexp per head
    if mode == "full":
        b = 2 * d / t
    elif mode == "selective":
        w2_out = 2 * d  # partial sums before the reduce-scatter (full sequence)
        b = (2 * d + 2 * (qd + 2 * kv) + 2 * qd + lse + 2 * f) / t + (w2_out if t > 1 else 2 * d)
        if w.lora_rank:
            # A LoRA linear adds two matmuls, so the per-op policy also saves the adapter's
            # full-width lora_b output beside each saved base output (wqkv, w1, w2); measured
            # live at the peak by tools.dryrun on sft_llama3_8b_lora (benchmarks/dryrun.md).
            b += 2 * (qd + 2 * kv) / t + 2 * f / t + (w2_out if t > 1 else 2 * d)
    elif not st.sp_saves_gathered:
        # Megatron-style: LN inputs and outputs (sequence-sharded), rope'd q/k/v and the
        # attention output, fc1 output (gate and up) and the SwiGLU output.
        ffn = 6 * f if st.fused_ffn_activations else 8 * f
        b = (8 * d + 2 * (qd + 2 * kv) + 2 * qd + lse + ffn) / t
        if st.fp8_saves_fp8_inputs and w.linear != "bf16":
            # The two norm outputs (wqkv, fc1 inputs) and the SwiGLU output (fc2 input)
            # are kept as 1-byte FP8 copies instead of bf16.
            b -= (2 * d + f) / t
    else:
        seq = 8 * d / t
        gathered = 4 * d if t > 1 else 0
        ffn = (4 if w.compile else 8) * f
        # Measured (tools.dryrun, benchmarks/dryrun.md): the fused qkv output is not kept;
        # v is made contiguous (2kv), q and k kept as RoPE'd copies, flex attention keeps
        # its output with the fp32 logsumexp and row max (2 x 4 B per head), and each layer
        # keeps the token's RoPE factors (head_dim/2 complex64, not split by tp).
        head = 2 * kv + 2 * qd + 2 * kv + 2 * qd + 2 * lse + ffn
        b = seq + gathered + head / t + 4 * s.head_dim
    return b * (2 if w.dtype == "float32" else 1)


def stage_layers(n_layers: int, num_stages: int) -> list[int]:
    """Transformer blocks per pipeline stage, as torchtitan splits them."""
    if num_stages <= 1:
        return [n_layers]
    wts = pp_layer_weights(n_layers, num_stages)
    if wts is None:  # uneven: spread the remainder over the first stages
        base, rem = divmod(n_layers, num_stages)
        return [base + (1 if i < rem else 0) for i in range(num_stages)]
    first, last = wts
    per = (n_layers + first + last) // num_stages
    out = [per] * num_stages
    out[0] -= first
    out[-1] -= last
    return out


def rank_stages(rank: int, pp: int, schedule: str, v: int) -> list[int]:
    """Stage indices held by pipeline rank `rank` (loop style, or V style for ZBV/DualPipeV)."""
    if v == 1:
        return [rank]
    if schedule in ("ZBVZeroBubble", "DualPipeV"):
        return [rank, 2 * pp - 1 - rank]
    return [rank + i * pp for i in range(v)]


def inflight_stage_microbatches(w: Workload, rank: int) -> float:
    """Stage-microbatches whose activations pipeline rank `rank` holds at its peak.

    Units: one stage's activations for one microbatch, held from its forward until its
    weight gradient. GPipe holds all m; 1F1B holds p - rank; Interleaved1F1B warms up
    (v-1)p + 2(p-1-rank) chunks and holds one more (torch's order). The zero-bubble
    schedules hold p x v on every rank (ZBV: 2p; DualPipeV 2p + 1), not fewer on later
    ranks: they defer weight gradients instead (`deferred_weight_grads`). Checked against torch's
    own schedule orders in tests/unit/test_dryrun.py (tools.dryrun measured the ZBV ranks:
    benchmarks/dryrun.md).
    """
    p, m, v = w.layout.pp, w.microbatches, w.stages_per_rank
    if p == 1:
        return 1
    sched = w.pp_schedule
    if sched == "GPipe":
        return m * v
    if v == 1:
        return min(m, p - rank)
    if sched == "DualPipeV":  # its overlapped F+B runs the forward first: one more
        return min(m * v, 2 * p + 1)
    if sched in ("ZBVZeroBubble", "InterleavedZeroBubble"):
        return min(m * v, p * v)
    return min(m * v, (v - 1) * p + 2 * (p - 1 - rank) + 1)


# --- tools.dryrun corrections (benchmarks/dryrun.md). Separate hunk: measured per rank on
# torch's fake process group at each recipe's full world size (the real torchtitan step).


def zbv_order(p: int, m: int, rank: int) -> list[tuple[int, str, int]]:
    """torch's ScheduleZBVZeroBubble order for `rank` as (chunk, kind, microbatch), kind in
    F (forward), I (input gradient), W (weight gradient); chunk 0 is stage `rank`, chunk 1
    stage 2p-1-rank. A transcription of torch 2.14's `_calculate_single_rank_operations`
    (pure, for the planner); tests/unit/test_dryrun.py compares it with torch's."""
    n = max(2 * p - 1, m)
    ops: list[tuple[int, str, int]] = []
    f0 = f1 = b0 = b1 = 0
    for _ in range(2 * (p - rank) - 1):
        ops.append((0, "F", f0))
        f0 += 1
    for _ in range(rank):
        ops += [(1, "F", f1), (0, "F", f0)]
        f1, f0 = f1 + 1, f0 + 1
    for _ in range(p - rank):
        ops += [(1, "F", f1), (1, "I", b1), (1, "W", b1)]
        f1, b1 = f1 + 1, b1 + 1
    while f1 < f0 or f0 < n:
        if f0 < n:
            ops.append((0, "F", f0))
            f0 += 1
        ops += [(0, "I", b0), (0, "W", b0), (1, "F", f1), (1, "I", b1), (1, "W", b1)]
        b0, f1, b1 = b0 + 1, f1 + 1, b1 + 1
    w0, w1 = b0, b1
    for _ in range(rank):
        ops += [(0, "I", b0), (1, "I", b1)]
        b0, b1 = b0 + 1, b1 + 1
    for _ in range(p - rank):
        ops += [(0, "I", b0), (0, "W", w0)]
        b0, w0 = b0 + 1, w0 + 1
    ops += [(1, "W", i) for i in range(w1, b1)] + [(0, "W", i) for i in range(w0, b0)]
    return [op for op in ops if op[2] < m]


def deferred_weight_grads(w: Workload, rank: int) -> float:
    """Stage-microbatches whose input gradient has run but whose weight gradient waits
    (zero-bubble schedules), at the rank's peak: they keep the gradients of every linear's
    output besides their activations. InterleavedZeroBubble and DualPipeV: rank + 1; ZBV:
    2 x rank + 1 (torch's order, `zbv_order`). The most at once; `held_and_deferred` gives
    what coincides with the peak."""
    p, m, v = w.layout.pp, w.microbatches, w.stages_per_rank
    if p == 1 or w.pp_schedule not in ("ZBVZeroBubble", "DualPipeV", "InterleavedZeroBubble"):
        return 0
    if w.pp_schedule == "ZBVZeroBubble":
        return _zbv_peak(p, m, rank, act=0.0, grads=1.0)[1]
    return min(m * v, rank + 1)


def held_and_deferred(w: Workload, rank: int, act: float, grads: float) -> tuple[float, float]:
    """(held, deferred) stage-microbatches at the moment `act x held + grads x deferred` is
    largest on pipeline rank `rank` (`act`, `grads`: bytes per stage-microbatch). ZBV:
    replayed from torch's order; DualPipeV: the corners of torch's order for m >= 2p
    (2p + 1 held and none deferred; 2p and 1 below the last rank; p and rank + 1 from the
    second rank on; tests/unit/test_dryrun.py replays torch's); the others: the two maxima
    (InterleavedZeroBubble: an upper bound, they need not coincide)."""
    p, m = w.layout.pp, w.microbatches
    if p > 1 and w.pp_schedule == "ZBVZeroBubble":
        return _zbv_peak(p, m, rank, act, grads)
    if p > 1 and w.pp_schedule == "DualPipeV" and m >= 2 * p:
        corners = [(2 * p + 1, 0)] + [(2 * p, 1)] * (rank < p - 1) + [(p, rank + 1)] * (rank > 0)
        return max(corners, key=lambda c: act * c[0] + grads * c[1])
    return inflight_stage_microbatches(w, rank), deferred_weight_grads(w, rank)


def _zbv_peak(p: int, m: int, rank: int, act: float, grads: float) -> tuple[int, int]:
    """(held, deferred) stage-microbatches at the moment `act x held + grads x deferred` is
    largest in torch's ZBV order (the two peak together in the cool-down of later ranks)."""
    held = deferred = 0
    best, at = -1.0, (0, 0)
    for _chunk, kind, _mb in zbv_order(p, m, rank):
        if kind == "F":
            held += 1
        elif kind == "I":
            deferred += 1
        else:
            held, deferred = held - 1, deferred - 1
        if act * held + grads * deferred > best:
            best, at = act * held + grads * deferred, (held, deferred)
    return at


def layer_weight_grad_bytes(w: Workload) -> float:
    """Bytes per token per layer a deferred weight gradient keeps (zero-bubble schedules):
    the gradient of every linear's output (torch.autograd.grad for the inputs retains the
    graph's intermediate gradients until the weight step). wqkv and w1/w3 outputs are
    head/hidden-sharded (/tp); wo and w2 outputs are gathered to the full sequence under
    sequence parallelism. Measured on llama3_70b's last ZBV rank: 7 deferred stage-micro-
    batches held 19.8 GiB against 2.54 GiB each here."""
    s, t = w.shape, w.layout.tp
    qd, kv, d, f = s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim, s.dim, s.ffn_hidden
    b = 2 * (qd + 2 * kv) / t + 4 * f / t + 4 * d
    return b * (2 if w.dtype == "float32" else 1)


def recv_buffer_bytes(w: Workload, rank: int) -> float:
    """torch's pipeline stages allocate one receive buffer per microbatch up front: the
    activation from the previous stage (not on stage 0) and the gradient from the next
    (not on the last stage), each tokens/cp x dim/tp (sequence-parallel) elements."""
    p, v = w.layout.pp, w.stages_per_rank
    if p == 1:
        return 0.0
    one = w.tokens_per_microbatch / w.layout.cp * w.shape.dim / w.layout.tp
    stages = rank_stages(rank, p, w.pp_schedule, v)
    n_stages = p * v
    bufs = sum((i > 0) + (i < n_stages - 1) for i in stages)
    return bufs * w.microbatches * one * w.bytes_per_param_compute


@dataclass(frozen=True)
class MemoryEstimate:
    states: float
    unsharded: float
    activations: float
    workspace: float
    logits: float
    fp8: float
    rank: int  # pipeline rank this peak is for

    @property
    def allocated(self) -> float:
        return (
            self.states
            + self.unsharded
            + self.activations
            + self.workspace
            + self.logits
            + self.fp8
        )

    @property
    def reserved(self) -> float:
        """Bytes torchtitan would report as max reserved."""
        return self.allocated * (1 + ALLOCATOR_FRAGMENTATION)

    @property
    def reserved_gib(self) -> float:
        return self.reserved / GIB

    @property
    def required_gib(self) -> float:
        """What must fit in a GPU: reserved plus memory outside the allocator."""
        return self.reserved_gib + RUNTIME_OVERHEAD_GIB

    def required_gib_on(self, gpu: str) -> float:
        return self.reserved_gib + runtime_overhead_gib(gpu)

    def breakdown_gib(self) -> dict[str, float]:
        return {
            "states": self.states / GIB,
            "unsharded_params_grads": self.unsharded / GIB,
            "activations": self.activations / GIB,
            "workspace": self.workspace / GIB,
            "logits": self.logits / GIB,
            "fp8": self.fp8 / GIB,
            "allocator_fragmentation": (self.reserved - self.allocated) / GIB,
            "runtime_overhead": RUNTIME_OVERHEAD_GIB,
        }


def estimate_memory(w: Workload, st: Stack | None = None) -> MemoryEstimate:
    """Peak memory per GPU (the pipeline rank with the highest peak)."""
    return memory_profile(w, st).at(w.layout.dp_shard * w.layout.cp)


@dataclass(frozen=True)
class MemoryProfile:
    """Per-pipeline-rank estimates with FSDP shard count 1: only the sharded states
    depend on dp_shard, so one profile serves every dp_replicate x dp_shard split."""

    ranks: tuple[MemoryEstimate, ...]

    def _peak(self, fsdp: int) -> tuple[MemoryEstimate, float]:
        best, best_alloc = self.ranks[0], -1.0
        for est in self.ranks:
            alloc = est.allocated - est.states + est.states / fsdp
            if alloc > best_alloc:
                best, best_alloc = est, alloc
        return best, best_alloc

    def required_gib(self, fsdp: int, overhead_gib: float = RUNTIME_OVERHEAD_GIB) -> float:
        """`at(fsdp).required_gib`, without building the estimate (the planner's hot path)."""
        return self._peak(fsdp)[1] * (1 + ALLOCATOR_FRAGMENTATION) / GIB + overhead_gib

    def at(self, fsdp: int) -> MemoryEstimate:
        best, _ = self._peak(fsdp)
        return replace(best, states=best.states / fsdp)


def memory_profile(w: Workload, st: Stack | None = None) -> MemoryProfile:
    st = st or load_stack(w.stack)
    p = w.layout.pp
    ranks = sorted({0, min(1, p - 1), p - 1})
    return MemoryProfile(tuple(_memory_for_rank(w, r, st) for r in ranks))


def _memory_for_rank(w: Workload, rank: int, st: Stack) -> MemoryEstimate:
    s = w.shape
    lay = w.layout
    t, c, p = lay.tp, lay.cp, lay.pp
    v = w.stages_per_rank
    n_stages = p * v
    per_stage = stage_layers(s.n_layers, n_stages)
    stages = rank_stages(rank, p, w.pp_schedule, v)
    layers = sum(per_stage[i] for i in stages)
    has_first = 0 in stages
    has_last = (n_stages - 1) in stages
    emb = s.vocab_size * s.dim
    head = 0 if s.weight_tying else s.vocab_size * s.dim
    params: float = layers * layer_params(s)
    params += emb if has_first else 0
    params += (head + s.dim) if has_last else 0
    params /= t
    # What FSDP gathers per block on this GPU (MoE: the local experts only, parallel.moe).
    layer_gather = gathered_layer_params(s, t, w.ep)
    gathered = (
        layers * layer_gather
        + ((emb if has_first else 0) + ((head + s.dim) if has_last else 0)) / t
    )

    elt = w.bytes_per_param_compute
    fsdp = lay.dp_shard * c
    fp8 = w.linear != "bf16"
    ag_bytes = 1 if (fp8 and w.fp8_all_gather) else elt
    unit: float = max(layer_gather, (head if has_last else 0) / t, (emb if has_first else 0) / t)
    grad_bytes = 4  # torchtitan: fp32 gradients (reduce_dtype float32)
    if w.lora_rank:
        # Frozen base: its weights only (sharded like the states); rank-r adapters on
        # the block's linears carry the full 16 B/param of trainable state.
        # (torchtitan keeps the frozen base's fp32 parameter, sharded like the states.)
        adapters = layers * w.lora_params_per_layer
        states = params * FROZEN_BYTES_PER_PARAM + adapters * STATE_BYTES_PER_PARAM
        unsharded = (params if p > 1 else 2 * unit) * ag_bytes
    elif st.data_parallel == "distributed_optimizer" and lay.dp_shard == 1:
        # ZeRO-1 (Megatron distributed optimizer): bf16 weights and the gradient buffer
        # resident; fp32 master weights and both moments (12 B) sharded over dp x cp.
        # `at` divides `states` by the FSDP count (cp here): pre-multiply to get dp x cp.
        dpg = lay.dp_replicate * c
        states = params * (STATE_BYTES_PER_PARAM - 4) * fsdp / dpg
        unsharded = params * (elt + max(st.grad_reduce_bytes, elt))
    else:
        states = params * STATE_BYTES_PER_PARAM  # divided by the FSDP shard count in `at`
        if not (w.cuda_graphs or w.grad_accum > 1):
            # torchtitan frees the gradients at each step (zero_grad(set_to_none=True) unless
            # CUDA graphs keep them) and the sharded fp32 ones are made by the reduce-scatter
            # after the peak; with accumulation the first microstep's are there (measured:
            # tools.dryrun, llama3_70b_h100's ranks hold none at their peak).
            states = params * (STATE_BYTES_PER_PARAM - 4)
        if p > 1:
            # No reshard after forward under PP; gradients accumulate unsharded in fp32.
            unsharded = gathered * (ag_bytes + grad_bytes)
        else:
            unsharded = unit * (2 * ag_bytes + elt + grad_bytes)

    tokens = w.tokens_per_microbatch / c  # per GPU of a tp group (tp shares tokens)
    per_layer_tok = layer_activation_bytes(w, st=st)
    mean_layers_per_stage = layers / len(stages)
    # One stage-microbatch's activations, with the embedding output and the final norm's
    # input (seq-sharded); and what a deferred weight gradient keeps besides them.
    stage_act = mean_layers_per_stage * per_layer_tok * tokens + tokens * 2 * s.dim / t
    stage_wgrad = mean_layers_per_stage * layer_weight_grad_bytes(w) * tokens
    inflight, deferred = held_and_deferred(w, rank, stage_act, stage_wgrad)
    activations = inflight * stage_act + deferred * stage_wgrad
    if st.pp_recv_buffers_per_microbatch:
        activations += recv_buffer_bytes(w, rank)
    # Backward recomputes one checkpointed layer at a time (measured: without AC the peak
    # comes at the start of backward, before any layer's workspace).
    workspace = (layer_activation_bytes(w, "none", st) - per_layer_tok) * tokens
    m = moe_dims(s)
    if m is not None:
        # One MoE layer's dispatch at a time: send/receive buffers under imbalance, router.
        imb = busiest_load(w, st)
        workspace += dispatch_buffer_bytes(m, imb, t) * tokens * (2 if w.dtype == "float32" else 1)
    logits = 0.0
    if has_last:
        fused = st.loss_bytes_eager <= st.loss_bytes_compiled  # fused cross-entropy
        lb = LOGIT_BYTES_COMPILED if (w.compile or fused) else LOGIT_BYTES_EAGER
        elt_f = 2 if w.dtype == "float32" else 1
        # One loss chunk's logits at a time (torchtitan's ChunkedLossWrapper), plus the
        # fp32 gradient of the hidden states it assembles across chunks.
        logits = tokens / st.loss_chunks * (s.vocab_size / t) * lb * elt_f
        if st.loss_chunks > 1:
            logits += tokens * s.dim / t * 4
    fp8_bytes = 0.0
    if fp8:
        copies = 1 if w.linear == "fp8_tensorwise" else 2  # rowwise: both orientations
        fp8_bytes = unit * copies + tokens * (2 * s.dim + s.ffn_hidden / t) * copies
        if w.linear == "nvfp4":  # 4-bit codes + an e4m3 scale per 16 elements: 0.5625 B
            fp8_bytes *= 0.5625
    return MemoryEstimate(
        states=states,
        unsharded=unsharded,
        activations=activations,
        workspace=workspace,
        logits=logits,
        fp8=fp8_bytes,
        rank=rank,
    )


def estimate_rank(w: Workload, pp_rank: int, st: Stack | None = None) -> MemoryEstimate:
    """The estimate for one pipeline rank (its stages' layers, embedding and head), states
    divided by the FSDP shard count: what `tools.dryrun` compares a measured rank with."""
    est = _memory_for_rank(w, pp_rank, st or load_stack(w.stack))
    return replace(est, states=est.states / (w.layout.dp_shard * w.layout.cp))


# ---------------------------------------------------------------------------------------------
# Post-training: RL, [[adapters]] and the service run microbatches under a token budget
# (runtime.steps), next to the generator's model copies and KV cache.

# runtime.logprobs computes float32 log-softmax over this many tokens at a time.
LOGPROB_CHUNK_TOKENS = 1024
# Budgets tried when choosing one from memory (runtime.budget, tools.predict).
MICROBATCH_LADDER = tuple(2**k for k in range(8, 18))  # 256 .. 131072 tokens


@dataclass(frozen=True)
class PostTrain:
    """What a post-training job adds to its Workload's memory.

    microbatch_tokens: padded tokens per forward/backward (the budget). generator_copies:
    full, unsharded model copies of the generator side (RL: 1; async adds the probe that
    re-scores trained batches; the service's sampler: 1). reference_copies: a frozen
    float32 copy (RL with a KL term). generation: whether a KV cache is decoded (its
    positions are bounded by the same budget: the loop calls the generator in chunks)."""

    microbatch_tokens: int
    generator_copies: int = 0
    generator_bytes_per_param: int = 4
    reference_copies: int = 0
    generation: bool = False
    # The CPU's dense attention keeps float32 scores and probabilities per layer, head and
    # (query, key) pair for backward: per token, layers x heads x row length x 8 bytes.
    dense_attention_len: int = 0


@dataclass(frozen=True)
class PostTrainMemory:
    train: MemoryEstimate  # the trainer with one microbatch of `microbatch_tokens` in flight
    generator: float
    reference: float
    kv_cache: float
    microbatch_tokens: int

    @property
    def allocated(self) -> float:
        return self.train.allocated + self.generator + self.reference + self.kv_cache

    @property
    def reserved_gib(self) -> float:
        return self.allocated * (1 + ALLOCATOR_FRAGMENTATION) / GIB

    def required_gib_on(self, gpu: str) -> float:
        return self.reserved_gib + runtime_overhead_gib(gpu)

    def breakdown_gib(self) -> dict[str, float]:
        out = {k: v for k, v in self.train.breakdown_gib().items() if k != "runtime_overhead"}
        out.update(
            generator_copies=self.generator / GIB,
            reference_copy=self.reference / GIB,
            kv_cache=self.kv_cache / GIB,
            allocator_fragmentation=(self.reserved_gib * GIB - self.allocated) / GIB,
        )
        return out

    def describe(self, gpu: str) -> str:
        parts = {k: v for k, v in self.breakdown_gib().items() if v >= 0.05}
        listing = ", ".join(f"{k} {v:.1f}" for k, v in parts.items())
        return (
            f"{self.required_gib_on(gpu):.1f} GiB per GPU with {self.microbatch_tokens:,}-token "
            f"microbatches ({listing}, runtime {runtime_overhead_gib(gpu):.1f})"
        )


def steps_logits_bytes(w: Workload, tokens: float, *, backward: bool = True) -> float:
    """Logits of `tokens` tokens as runtime.steps keeps them (the service and the post-training
    step layer): the whole microbatch's logits in the compute dtype (and their gradient when
    `backward`), plus one chunk of float32 log-softmax work. Not the pretraining loss's
    chunked logits (`Stack.loss_chunks`): the logprob matrix is needed whole."""
    vocab = w.shape.vocab_size / w.layout.tp
    held = tokens * vocab * (2 if backward else 1) * w.bytes_per_param_compute
    return held + min(tokens, LOGPROB_CHUNK_TOKENS) * vocab * 12


def posttrain_memory(w: Workload, pt: PostTrain, st: Stack | None = None) -> PostTrainMemory:
    """Peak memory per GPU of a post-training job: the trainer's states and one microbatch
    of `pt.microbatch_tokens` tokens (activations as the pretraining model counts them;
    logits as runtime.steps keeps them: the microbatch's logits and their gradient in the
    compute dtype, one chunk of float32 softmax work), plus the generator side."""
    s = w.shape
    mb = w.with_(local_batch_size=1, seq_len=pt.microbatch_tokens, pp_microbatches=0)
    train = estimate_memory(mb, st)
    tokens = pt.microbatch_tokens / w.layout.cp
    train = replace(train, logits=steps_logits_bytes(w, tokens))
    if pt.dense_attention_len:
        heads = s.n_heads / w.layout.tp
        dense = tokens * s.n_layers * heads * pt.dense_attention_len * 8
        train = replace(train, activations=train.activations + dense)
    params = s.total_params
    kv_per_position = s.n_layers * 2 * s.n_kv_heads * s.head_dim * pt.generator_bytes_per_param
    return PostTrainMemory(
        train=train,
        generator=pt.generator_copies * params * pt.generator_bytes_per_param,
        reference=pt.reference_copies * params * 4,
        kv_cache=(pt.microbatch_tokens * kv_per_position) if pt.generation else 0.0,
        microbatch_tokens=pt.microbatch_tokens,
    )


def fit_microbatch_tokens(
    w: Workload, pt: PostTrain, device_bytes: float, gpu: str, st: Stack | None = None
) -> int:
    """The largest budget of MICROBATCH_LADDER whose job fits `device_bytes` (0: none)."""
    best = 0
    for tokens in MICROBATCH_LADDER:
        est = posttrain_memory(w, replace(pt, microbatch_tokens=tokens), st)
        if est.required_gib_on(gpu) * GIB > device_bytes:
            break
        best = tokens
    return best


def posttrain_load(recipe, microbatch_tokens: int = 0) -> PostTrain | None:
    """The PostTrain of a recipe's job (None for pretraining and Trainer-path SFT): RL's
    generator copies (one; async adds the probe), its KL reference, or [[adapters]]. (The
    service is a model resource, priced by parallel/serve.py: its generator shares the base.)"""
    tokens = microbatch_tokens or recipe.training.microbatch_tokens or MICROBATCH_LADDER[0]
    rl = recipe.rl
    if rl.enabled:
        return PostTrain(
            microbatch_tokens=tokens,
            generator_copies=1 + (rl.mode == "async"),
            generator_bytes_per_param=2 if rl.generator_dtype == "bfloat16" else 4,
            reference_copies=1 if rl.kl_coef > 0 else 0,
            generation=True,
        )
    if recipe.adapters:
        return PostTrain(microbatch_tokens=tokens)
    return None
