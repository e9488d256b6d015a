"""Admission control: what a request will cost in memory and time, priced before it is queued.

One function per request kind prices it with the project's own models, never a second copy:
- forward_backward: `parallel.memory.estimate_memory` on the recipe's `Workload` reshaped to
  the microbatch the backend will run (rows x padded length: today's backend runs the whole
  request as one batch padded to its longest datum), keeping the per-token activation,
  workspace and logits terms (the resident weights and adapter states are paid at start-up and
  at create_model, not per request), plus the attention scores of the CPU attention kernel
  (`kernels/dense_attention.py` materialises B x H x L x L scores per layer, which the GPU
  model, flex attention, does not keep). Time: `parallel.perf.model_flops_per_token` x tokens.
- sample: the KV cache the generator allocates (`rl.generator.Generator._prefill_inputs`:
  k and v of B x (prompt + max_tokens) x kv_heads x head_dim per layer), its prefill mask
  (B x P x total booleans) and scores on the CPU kernel, and the last-position logits.

`CostModel.microbatch_tokens` is the backend's token budget per forward/backward microbatch
(`Backend.microbatch_tokens`, None for today's single batch): a microbatched backend is priced
per microbatch and so admits more, through this same function.

The budget (`Limits.max_request_bytes`, `tools.serve --max-request-gib`) is memory a single
request may use beyond the resident model; requests run one at a time (one worker), so a
request within it cannot push the process past the device. Priced bytes include
`ALLOCATOR_FRAGMENTATION`; the test (tests/integration/test_service_admission.py) measures the
server's peak RSS against the price.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, replace

from parallel.memory import (
    ALLOCATOR_FRAGMENTATION,
    GIB,
    estimate_memory,
    layer_activation_bytes,
    steps_logits_bytes,
)
from parallel.perf import model_flops_per_token
from parallel.workload import Workload

# Until the first forward_backward is measured: a deliberately low guess of achieved FLOP/s
# (one loaded CPU core; a GPU is faster, which only makes Retry-After hints pessimistic).
DEFAULT_FLOPS_PER_S = 1e10


@dataclass(frozen=True)
class CostModel:
    workload: Workload  # the served recipe's training configuration on one device
    attention: str  # the attention kernel (kernels.registry): "dense" keeps L x L scores
    microbatch_tokens: int | None = None  # the backend's tokens per microbatch; None: one batch
    generator_bytes: int = 4  # the generator's dtype (float32)
    generator_max_batch: int = 256  # rows it decodes at once (rl.generator.Generator)


@dataclass(frozen=True)
class Price:
    bytes: float  # peak memory beyond the resident model
    flops: float
    microbatches: int = 1
    rows: int = 0  # sequences per microbatch
    length: int = 0  # padded length per sequence

    @property
    def gib(self) -> float:
        return self.bytes / GIB


class Throughput:
    """Achieved FLOP/s, learned from the operations the worker ran (for time prices)."""

    def __init__(self, flops_per_s: float = DEFAULT_FLOPS_PER_S):
        self._rate = flops_per_s
        self._lock = threading.Lock()

    def observe(self, flops: float, seconds: float) -> None:
        if flops > 0 and seconds > 0:
            with self._lock:
                self._rate = 0.8 * self._rate + 0.2 * (flops / seconds)

    def seconds(self, flops: float) -> float:
        with self._lock:
            return flops / self._rate


def dense_attention_bytes(cm: CostModel, rows: int, q_len: int, kv_len: int) -> float:
    """One layer's attention scores and boolean mask under the CPU kernel (kernels/
    dense_attention.py: SDPA's math path on a (B, 1, Lq, Lkv) mask); 0 on flex/varlen."""
    if cm.attention != "dense":
        return 0.0
    s = cm.workload.shape
    elt = 4 if cm.workload.dtype == "float32" else 2
    return rows * q_len * kv_len * (s.n_heads * elt + 1)


def price_forward_backward(cm: CostModel, lengths: list[int], *, forward_only: bool) -> Price:
    """Peak memory and FLOPs of one forward(+backward) over datums of these lengths, as the
    backend runs them (padded to the longest; split into microbatches of its token budget)."""
    n, L = len(lengths), max(lengths)
    rows = n
    if cm.microbatch_tokens:
        rows = max(1, min(n, cm.microbatch_tokens // L))
    mbs = math.ceil(n / rows)
    w = replace(cm.workload, local_batch_size=rows, seq_len=L, grad_accum=1)
    est = estimate_memory(w)
    # The backend's logits are runtime.steps' (whole microbatch), not the pretraining loss's
    # chunks that estimate_memory counts.
    # Its backward also holds one layer's intermediate tensors and their gradients at a time
    # (eager, no recompute): twice the un-checkpointed per-token figure. estimate_memory's
    # workspace is the recompute workspace of activation checkpointing, zero without it.
    # Both terms were measured against the server's peak RSS
    # (tests/integration/test_service_admission.py).
    work = 2 * layer_activation_bytes(w, "none") * rows * L
    est = replace(
        est,
        logits=steps_logits_bytes(w, rows * L, backward=not forward_only),
        workspace=max(est.workspace, work),
    )
    layers = w.shape.n_layers
    scores = dense_attention_bytes(cm, rows, L, L)
    if forward_only:  # no_grad: nothing kept for backward, one layer's work at a time
        peak = est.workspace + est.logits + scores
    else:
        peak = est.activations + est.workspace + est.logits + layers * scores
    flops = model_flops_per_token(w.shape, L) * n * L * (1 / 3 if forward_only else 1)
    return Price(peak * (1 + ALLOCATOR_FRAGMENTATION), flops, mbs, rows, L)


def price_sample(
    cm: CostModel, prompt_len: int, max_tokens: int, num_samples: int, *, prompt_logprobs: bool
) -> Price:
    """Peak memory and FLOPs of sampling `num_samples` continuations of one prompt (and the
    prompt's logprobs: a separate no-grad forward after the generation)."""
    s = cm.workload.shape
    rows = min(num_samples, cm.generator_max_batch)
    total = prompt_len + max_tokens
    kv = s.n_layers * 2 * rows * total * s.n_kv_heads * s.head_dim * cm.generator_bytes
    prefill_tokens = rows * prompt_len
    # one layer's intermediate tensors at a time, no grad (the "none" per-token figure)
    w = replace(cm.workload, local_batch_size=rows, seq_len=prompt_len, grad_accum=1)
    work = layer_activation_bytes(w, "none") * prefill_tokens
    mask = rows * prompt_len * total  # booleans, materialised by the generator on any device
    scores = dense_attention_bytes(cm, rows, prompt_len, total)
    logits = rows * s.vocab_size * 4 * 2  # last position: fp32 logits, log-softmax, probs
    peak = kv + work + mask + scores + logits
    if prompt_logprobs:
        one = price_forward_backward(cm, [prompt_len], forward_only=True)
        peak = max(peak, one.bytes / (1 + ALLOCATOR_FRAGMENTATION))
    flops = model_flops_per_token(s, total) / 3 * num_samples * total
    return Price(peak * (1 + ALLOCATOR_FRAGMENTATION), flops, math.ceil(num_samples / rows))


def max_rows(cm: CostModel, length: int, budget: float, limit: int) -> int:
    """The most datums of `length` tokens one forward_backward may carry within `budget`
    (what the service tells the SDK as its chunk size; 0 when even one does not fit)."""
    lo, hi = 0, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if price_forward_backward(cm, [length] * mid, forward_only=False).bytes <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


def cost_model_from_recipe(recipe, *, microbatch_tokens: int | None = None) -> CostModel:
    """The served recipe's cost model on this platform (the attention kernel the backend's
    model is built with: kernels.registry via runtime.build.choose_kernels)."""
    from core.axes import Layout
    from parallel.workload import workload_from_recipe
    from runtime.build import choose_kernels
    from runtime.platform import Platform

    w = workload_from_recipe(recipe, Layout())
    w = replace(w, lora_rank=0, compile=False, grad_accum=1)  # states are resident, not priced
    kernels = choose_kernels(recipe, Platform.detect())
    return CostModel(w, kernels.attention, microbatch_tokens)


def default_budget_bytes() -> int:
    """Per-request memory when --max-request-gib is not given: half of the memory available
    now (after the model was built) on this process's device."""
    import torch

    if torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info()
        return int(free * 0.5)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 // 2
    except OSError:
        pass
    return 2 * GIB
