"""Build and step the real model at the recipe's full world size on one CPU: a dry run.

    python -m tools.dryrun --recipe R [--cluster C] [--nodes N] [--rank r ...] [--set k=v ...]
                           [--json]

For each chosen rank (default: rank 0, and with pipeline parallelism also the last rank, so
the first and the last stage are both covered) one process initialises torch's `fake`
process-group backend at the job's world size, builds the model exactly as training does
(recipe -> `runtime.build.build_trainer_config` -> torchtitan's Trainer: the same
parallelize function, FSDP2 x TP x PP x CP, converters, activation checkpointing) under
`FakeTensorMode`, and runs one full training step (forward, chunked loss, backward,
gradient clipping, optimizer step; with PP the rank's own stages under the real schedule).
Nothing is allocated and collectives are no-ops; torch's `MemTracker` measures the rank's
memory and `CommDebugMode` its collectives, by mesh axis, beside the planner's memory model
(`parallel.memory`) and the performance model's communication volumes (`parallel.perf`).

What the fake backend cannot carry is named in every report (`not_covered`) and in
docs/dryrun.md: pipeline send/recv carries no data (the stage-boundary metadata comes from
stage 0's own forward instead), backward on fake *cuda* tensors (the step runs on the cpu
device type), torch.compile and async TP (eager instead), CUDA graphs, and memory outside
the caching allocator's tensors (NCCL buffers, fragmentation, CUDA context).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from core.errors import ConfigError, exit_on_config_error
from tools.cli import (
    ROOT,
    ArgumentParser,
    add_cluster_arg,
    add_override_arg,
    add_recipe_arg,
    run,
)

GIB = 2**30

# What this dry run cannot see or carry, in every report (docs/dryrun.md explains each).
NOT_COVERED = [
    "pipeline send/recv carries no data under the fake backend: the boundary tensors' "
    "metadata comes from stage 0's own forward (every boundary carries the residual stream)",
    "tensors are fake on the cpu device type: torch's autograd engine asks the CUDA driver "
    "for a primary context on every backward through a cuda tensor, fake or not",
    "torch.compile, async TP and CUDA graphs are off (eager kernels; compiled memory is the "
    "planner's *_compiled figure)",
    "memory outside the tensors: NCCL buffers, allocator fragmentation, CUDA context and "
    "workspaces (the planner's fragmentation and overhead terms)",
]


# --------------------------------------------------------------------------------------
# The job: recipe, cluster, world, layout and ranks, checked before any process group


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
    by tools.dryrun_posttrain."""
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
    (runtime.steps.choose_microbatch_tokens: training.microbatch_tokens, else the largest
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


# --------------------------------------------------------------------------------------
# The fake world: patches that exist only inside `fake_world` (restored on exit)


class _Patches:
    """Attribute (and table entry) replacements undone in reverse order on exit."""

    def __init__(self) -> None:
        self._undo: list[Any] = []

    def set(self, obj: Any, name: str, value: Any) -> None:
        if not hasattr(obj, name):
            raise RuntimeError(f"dry run: expected {obj!r}.{name} (torch 2.14 / torchtitan 0.3.0)")
        old = getattr(obj, name)
        self._undo.append(lambda: setattr(obj, name, old))
        setattr(obj, name, value)

    def set_item(self, table: dict[Any, Any], key: Any, value: Any) -> None:
        if key not in table:
            raise RuntimeError(f"dry run: expected an entry for {key} (torch 2.14)")
        old = table[key]
        self._undo.append(lambda: table.__setitem__(key, old))
        table[key] = value

    def restore(self) -> None:
        while self._undo:
            self._undo.pop()()


class _Boundary:
    """Pipeline stage-boundary metadata, kept in this process instead of sent.

    torch's schedules infer every stage's input metadata by running stage 0's forward and
    sending each stage's output metadata on (`PipelineStage._send_meta`); under the fake
    backend nothing arrives. Every boundary of a decoder carries the same tensor (the
    residual stream between blocks), so what stage 0 sends is what every later stage
    receives; backward boundaries carry its gradient (what the last stage sends back, or
    torch's own `_derive_grad_metas` of the forward one)."""

    def __init__(self, path: str | None = None) -> None:
        self.sent: dict[str, Any] = {}
        self.path = path
        if path and os.path.exists(path):
            import pickle

            with open(path, "rb") as f:
                self.sent = pickle.load(f)  # written by this tool's own worker, below

    def save(self) -> None:
        if self.path and self.sent:
            import pickle

            with open(self.path, "wb") as f:
                pickle.dump(self.sent, f)

    def send(self, stage: Any, meta: Any, dst: int) -> None:
        self.sent.setdefault(type(meta).__name__, meta)

    def recv(self, stage: Any, src: int) -> Any:
        from torch.distributed.pipelining import _utils as pu

        fwd = self.sent.get("_StageForwardMeta")
        if fwd is None:
            raise RuntimeError("dry run: pipeline stage 0 must run first (boundary metadata)")
        if src < stage.stage_index:
            return fwd
        bwd = self.sent.get("_StageBackwardMeta")
        return bwd or pu._StageBackwardMeta(
            backward_metas=tuple(pu._derive_grad_metas(fwd.forward_metas))
        )


def _cuda_rms_norm():
    """F.rms_norm as CUDA runs it: `_fused_rms_norm` forward, `_fused_rms_norm_backward`
    from the saved (input, weight, rstd) (torch's derivatives for the fused op)."""
    import torch

    class FusedRmsNorm(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, shape, weight, eps):
            out, rstd = torch._fused_rms_norm(x, shape, weight, eps)
            ctx.save_for_backward(x, weight, rstd)
            ctx.shape = shape
            return out

        @staticmethod
        def backward(ctx, grad):
            x, weight, rstd = ctx.saved_tensors
            mask = [ctx.needs_input_grad[0], weight is not None and ctx.needs_input_grad[2]]
            gx, gw = torch.ops.aten._fused_rms_norm_backward(grad, x, ctx.shape, rstd, weight, mask)
            return gx, None, gw, None

    def rms_norm(input, normalized_shape, weight=None, eps=None):
        return FusedRmsNorm.apply(input, list(normalized_shape), weight, eps)

    return rms_norm


# Set while DTensor computes an op's output metadata on global-shape fake tensors: those
# are not allocations of this rank (torch's MemTracker skips them only outside fake mode).
_PROPAGATING = [0]


def _balanced_expert_dispatch(p: Any) -> None:
    """MoE under expert parallelism: torchtitan's all-to-all dispatcher reads the per-rank
    token counts back to the host (`tolist()`) for the split sizes, which fake tensors
    cannot give. The dry run sends each EP peer an equal share of the rank's routed copies
    (balanced routing; the planner's load imbalance is its own term)."""
    import torch
    from torchtitan.models.common import token_dispatcher as td

    cls = td.AllToAllTokenDispatcher
    reorder = cls._local_reorder

    def local_reorder(self, x, scores, ids):
        out = reorder(self, x, scores, ids)
        self._dryrun_routed = int(ids.numel())  # T x K routed copies (shapes are real)
        return out

    def sync_counts(self, local_e, global_ep_e, ep_size):
        global_e = torch.ops._c10d_functional.wait_tensor(global_ep_e).reshape(-1)
        n = getattr(self, "_dryrun_routed", 0)
        splits = [n // ep_size + (1 if i < n % ep_size else 0) for i in range(ep_size)]
        return global_e, splits, list(splits)

    p.set(cls, "_local_reorder", local_reorder)
    p.set(cls, "_sync_token_count_exchange", sync_counts)


def _cpu_grouped_mm(p: Any) -> None:
    """A CPU recipe's MoE experts: torch._grouped_mm runs float32 on CPU (post-training keeps
    experts float32 there), but its meta kernel, which fake tensors use, applies CUDA's rule
    (bf16/fp16 only). For a CPU target, unscaled float32 operands get the output the CPU
    kernel gives (same shape rule, float32); everything else keeps torch's checks."""
    import torch
    from torch import _meta_registrations as meta

    common = meta._meta_grouped_mm_common

    def grouped_mm_common(mat_a, mat_b, scale_a=None, scale_b=None, offs=None, *a, **k):
        if scale_a is None and mat_a.dtype == torch.float32 == mat_b.dtype:
            torch._check(mat_a.size(-1) == mat_b.size(-2 if mat_b.dim() == 3 else 0),
                         lambda: "contraction dimension of mat_a and mat_b must match")  # fmt: skip
            return meta._create_grouped_mm_output_tensor(mat_a, mat_b, offs, torch.float32)
        return common(mat_a, mat_b, scale_a, scale_b, offs, *a, **k)

    p.set(meta, "_meta_grouped_mm_common", grouped_mm_common)


def _own_fsdp_chunks(p: Any) -> None:
    """FSDP2 cuts each parameter into one view per shard (`torch.chunk` into dp_shard x cp
    views: 512 on llama3_405b, ~15 CPU-s of fake views over its 1,134 parameters, a third
    of its dry run) and keeps only two: this rank's (its shard) and the first (the padded
    shard size). The dry run makes those two on demand, the views torch.chunk makes (same
    offsets and sizes); an empty tensor is left to torch's own function."""
    import torch
    from torch.distributed.fsdp._fully_shard import _fsdp_param

    chunk_with_empty = _fsdp_param._chunk_with_empty

    class Chunks:  # the list torch's function returns, as far as FSDPParam reads it
        def __init__(self, tensor: torch.Tensor, num_chunks: int, dim: int) -> None:
            self.tensor, self.n, self.dim = tensor, num_chunks, dim
            self.size = -(-tensor.size(dim) // num_chunks)  # torch.chunk's split size

        def __len__(self) -> int:
            return self.n

        def __getitem__(self, i: int) -> torch.Tensor:
            i = range(self.n)[i]
            start, total = i * self.size, self.tensor.size(self.dim)
            if start >= total:  # past torch.chunk's last chunk: torch's padding
                return self.tensor.new_empty(0)
            return self.tensor.narrow(self.dim, start, min(self.size, total - start))

    def chunks(tensor: torch.Tensor, num_chunks: int, dim: int) -> Any:
        if tensor.size(dim) == 0:
            return chunk_with_empty(tensor, num_chunks, dim)
        return Chunks(tensor, num_chunks, dim)

    p.set(_fsdp_param, "_chunk_with_empty", chunks)


@contextlib.contextmanager
def fake_world(world: int, rank: int, caps, boundary: _Boundary) -> Iterator[Any]:
    """torch's fake process group at `world` ranks as `rank`, and the few patches a whole
    step needs on fake tensors (each says why); yields the FakeTensorMode. The patches are
    undone on exit; the CPU platform layer (`runtime.platform`, what CPU training runs
    with) stays applied for the process."""
    import torch
    import torch.distributed as dist
    import torch.nn.init
    import torchtitan.components.quantization.float8 as tt_float8
    import torchtitan.components.quantization.mx as tt_mx
    import torchtitan.distributed.utils as tt_dist_utils
    import torchtitan.tools.utils as tt_utils
    from torch._subclasses import fake_tensor
    from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.pipelining import schedules as pp_schedules
    from torch.distributed.pipelining import stage as pp_stage
    from torch.distributed.pipelining._utils import InferenceMode
    from torch.distributed.tensor import _dispatch as dtensor_dispatch
    from torch.distributed.tensor._sharding_prop import ShardingPropagator
    from torch.nn.attention import flex_attention
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from runtime.platform import Platform

    Platform("cpu", "cpu", None, "gloo").apply()  # torchtitan on the cpu device type
    p = _Patches()
    # Fake tensors compare devices strictly: "cpu:0" (LOCAL_RANK's index) is not "cpu".
    p.set(tt_utils, "get_local_device", lambda: torch.device("cpu"))
    # Seeding builds DTensor's RNG tracker, which needs a real CUDA generator; the values
    # are fake anyway. Same for the tracker DTensor would create lazily at the first init.
    p.set(tt_dist_utils, "set_determinism", lambda *a, **k: None)
    p.set(dtensor_dispatch, "is_rng_supported_mesh", lambda mesh: False)

    def trunc_normal(tensor, mean, std, a, b, generator=None):
        # torch's rejection loop reads values (`mask.any()`): same shapes, no data.
        with torch.no_grad():
            return tensor.normal_(mean, std, generator=generator).clamp_(a, b)

    p.set(torch.nn.init, "_no_grad_trunc_normal_", trunc_normal)
    # The batch is a constant fake tensor so torchtitan's token counts (`int(...)`) work.
    p.set(fake_tensor, "CONSTANT_NUMEL_LIMIT", 1 << 40)
    # flex_attention refuses backward on CPU; on fake tensors it only computes shapes.
    p.set(flex_attention, "_validate_device", lambda *a: None)
    dm_init = DeviceMesh.__init__

    def mesh_init(self, *a, **k):  # rank coordinates come from nonzero(): real tensors
        with unset_fake_temporarily():
            dm_init(self, *a, **k)

    p.set(DeviceMesh, "__init__", mesh_init)
    meta_fn = ShardingPropagator._propagate_tensor_meta_non_cached

    def propagate(self, op_schema):
        _PROPAGATING[0] += 1
        try:
            return meta_fn(self, op_schema)
        finally:
            _PROPAGATING[0] -= 1

    p.set(ShardingPropagator, "_propagate_tensor_meta_non_cached", propagate)

    def warmup_p2p(self, stages, has_backward, p2p_done):
        for st in stages:  # infer every stage's metadata (stage 0 runs first: `prepare`)
            st._inference_mode = InferenceMode.DYNAMIC

    p.set(pp_schedules._PipelineSchedule, "_warmup_p2p", warmup_p2p)
    _balanced_expert_dispatch(p)
    _own_fsdp_chunks(p)
    p.set(pp_stage.PipelineStage, "_send_meta", lambda st, meta, dst: boundary.send(st, meta, dst))
    p.set(pp_stage.PipelineStage, "_recv_meta", lambda st, src: boundary.recv(st, src))
    if caps.is_cuda:
        # torch.rms_norm takes the fused kernel on CUDA (one node saving input, weight and
        # the fp32 rstd) but decomposes on CPU (saving fp32 copies of the input and of the
        # normalized input, ~10 bytes per element more): the GPU's path, as on the GPU.
        p.set(torch.nn.functional, "rms_norm", _cuda_rms_norm())
    else:
        _cpu_grouped_mm(p)
    if caps.capability is not None:  # FP8 / MXFP8 converters check the GPU they run on
        cc = caps.capability
        for mod in (tt_float8, tt_mx):
            p.set(mod, "has_cuda_capability", lambda major, minor: cc >= (major, minor))
    multithreading = torch.autograd.is_multithreading_enabled()
    torch.autograd.set_multithreading_enabled(False)  # as torchtitan's init_distributed
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        # torchtitan compiles flex_attention with fullgraph=True; under the trackers'
        # dispatch modes dynamo cannot, and the dry run is eager anyway.
        with (
            FakeTensorMode(allow_non_fake_inputs=True) as mode,
            torch.compiler.set_stance("force_eager"),
        ):
            yield mode
    finally:
        dist.destroy_process_group()
        torch.autograd.set_multithreading_enabled(multithreading)
        p.restore()


# --------------------------------------------------------------------------------------
# What is measured: torch's MemTracker and CommDebugMode, made to fit a whole step


def _memory_tracker_class():
    """torch's MemTracker without its module tracker: ModTracker installs multi-grad hooks,
    which `torch.autograd.grad` refuses on leaves, and the pipeline schedules (zero-bubble
    input/weight split, backward metadata inference) call autograd.grad. Categories keep
    MemTracker's meaning: a module's parameters are tagged when it first runs (FSDP2's
    unsharded copies included), gradients by per-parameter hooks and after FSDP's
    reduce-scatter, optimizer state by the optimizer hooks; everything else allocated in
    backward is Temp, in forward (and recompute) Activation. Only the step's peak is kept
    (MemTracker's per-module snapshots cost O(modules) per op)."""
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _MemRefType
    from torch.nn.modules.module import (
        register_module_forward_hook,
        register_module_forward_pre_hook,
    )
    from torch.utils.weak import WeakIdKeyDictionary

    class StepMemory(MemTracker):
        supports_higher_order_operators = True  # flex_attention is a higher-order op

        def __init__(self) -> None:
            super().__init__()
            self._seen: WeakIdKeyDictionary = WeakIdKeyDictionary()
            self._hooks: list[Any] = []
            self._names: dict[int, str] = {}
            self._stack: list[Any] = []
            self.peak_where = ""
            # Post-training updates run in phases (tools.dryrun_posttrain): each phase's
            # peak, GiB, in order.
            self.phases: dict[str, float] = {}
            self.live_after: dict[str, float] = {}  # GiB live when each phase ended
            self._phase_peak = 0

        def end_phase(self, name: str) -> None:
            """Record the peak since the previous phase ended as `name`'s; the next phase
            starts from what is live now."""
            self.phases[name] = self._phase_peak / GIB
            self._phase_peak = sum(s[_TOTAL_KEY] for s in self._curr_mem_snap.values())
            self.live_after[name] = self._phase_peak / GIB

        def name_modules(self, parts: list[Any]) -> None:
            """Module names for `peak_where` (stage-qualified under PP)."""
            for i, part in enumerate(parts):
                for name, mod in part.named_modules():
                    self._names[id(mod)] = (f"part{i}." if len(parts) > 1 else "") + (
                        name or "model"
                    )

        def tag(self, t: Any, kind: str) -> None:
            ref = {"grad": _MemRefType.GRAD, "param": _MemRefType.PARAM}[kind]
            self._update_and_maybe_create_winfos(t, ref)

        def _module_post_forward(self, module, args, out) -> None:
            if self._stack and self._stack[-1] is module:
                self._stack.pop()

        def _module_pre_forward(self, module, args) -> None:
            self._stack.append(module)
            if module not in self._seen:
                self._seen[module] = True
                self._track_module_params_and_buffers(module, install_grad_hooks=False)
                # MemTracker's gradient hooks, on trained parameters only (a frozen LoRA
                # base has no gradient and refuses hooks).
                for p in module.parameters():
                    if p.requires_grad and self._param_to_grad_hook_handles.get(p) is None:
                        self._param_to_grad_hook_handles[p] = (
                            p.register_hook(lambda g: self.tag(g, "grad")),
                            p.register_post_accumulate_grad_hook(
                                lambda q: self.tag(q.grad, "grad")
                            ),
                        )
            else:  # FSDP2 swaps the unsharded parameters in at each call
                for p in module.parameters(recurse=False):
                    self._update_and_maybe_create_winfos(p, _MemRefType.PARAM)

        def __enter__(self):
            self._register_global_optimizer_hook()
            self._hooks = [
                register_module_forward_pre_hook(self._module_pre_forward),
                register_module_forward_hook(self._module_post_forward),
            ]
            self._track_resize()
            self._peak_mem_snap = self.get_tracker_snapshot()
            self._peak_mem = {d: s[_TOTAL_KEY] for d, s in self._peak_mem_snap.items()}
            self._depth = 1
            self._phase_peak = sum(s[_TOTAL_KEY] for s in self._curr_mem_snap.values())
            from torch._guards import active_fake_mode

            self._fake_mode_on_entry = active_fake_mode()
            from torch.utils._python_dispatch import TorchDispatchMode

            TorchDispatchMode.__enter__(self)
            return self

        def __exit__(self, *args) -> None:
            from torch.utils._python_dispatch import TorchDispatchMode

            self._deregister_param_and_optimizer_hooks()
            for h in self._hooks:
                h.remove()
            self._restore_resize()
            self._depth = 0
            TorchDispatchMode.__exit__(self, *args)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            import torch
            from torch.distributed.tensor import DTensor
            from torch.utils._pytree import tree_map_only

            if any(t == DTensor for t in types):
                return NotImplemented
            kwargs = kwargs or {}
            if _PROPAGATING[0]:
                return func(*args, **kwargs)
            if func is torch.ops._c10d_functional.wait_tensor.default:
                return args[0]  # MemTracker's fix: the fake wait must not allocate
            res = func(*args, **kwargs)
            node = torch._C._current_autograd_node()
            if self._in_opt:
                ref = _MemRefType.OPT
            elif node is not None:
                ref = _MemRefType.TEMP
            else:
                ref = _MemRefType.ACT
            tree_map_only(torch.Tensor, lambda t: self._track(ref, t), res)
            now = sum(s[_TOTAL_KEY] for s in self._curr_mem_snap.values())
            self._phase_peak = max(self._phase_peak, now)
            for dev, snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < snap[_TOTAL_KEY]:
                    self._peak_mem[dev] = snap[_TOTAL_KEY]
                    self._peak_mem_snap[dev] = dict(snap)
                    top = self._names.get(id(self._stack[-1]), "?") if self._stack else "-"
                    self.peak_where = (
                        "optimizer step"
                        if self._in_opt
                        else f"backward ({node.name()}, in {top})"
                        if node is not None
                        else f"forward ({top})"
                    )
            return res

        def figures(self, which: str) -> dict[str, float]:
            snap = self._peak_mem_snap if which == "peak" else self._curr_mem_snap
            tot: dict[Any, int] = {}
            for dev_snap in snap.values():
                for k, v in dev_snap.items():
                    tot[k] = tot.get(k, 0) + v
            g = lambda *ks: sum(tot.get(k, 0) for k in ks) / GIB  # noqa: E731
            return {
                "total_gib": g(_TOTAL_KEY),
                "parameters_gib": g(_MemRefType.PARAM, _MemRefType.BUFFER),
                "gradients_gib": g(_MemRefType.GRAD),
                "optimizer_gib": g(_MemRefType.OPT),
                "activations_gib": g(_MemRefType.ACT, _MemRefType.TEMP, _MemRefType.OTH),
            }

    return StepMemory


def _collective_counter_class():
    """CommDebugMode's counts, plus what a comparison with the perf model needs: the
    process group (-> mesh axis) and the bytes of each collective (torch's
    fake_collectives helpers), and point-to-point sends/receives (pipeline). Its module
    tracker is left out for the reason MemTracker's is (autograd.grad under PP)."""
    from torch.distributed._tools.fake_collectives import CollectiveOp, collective_ops, sync_ops
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.utils._python_dispatch import TorchDispatchMode

    kinds = {
        "allgather": "all_gather",
        "all_gather": "all_gather",
        "reduce_scatter": "reduce_scatter",
        "allreduce": "all_reduce",
        "all_reduce": "all_reduce",
        "alltoall": "all_to_all",
        "all_to_all": "all_to_all",
        "broadcast": "broadcast",
        "send": "p2p",
        "recv": "p2p",
        "isend": "p2p",
        "irecv": "p2p",
        "batch_p2p": "p2p",
    }

    def kind_of(func) -> str:
        name = func._overloadpacket.__name__.lstrip("_")
        for k in sorted(kinds, key=len, reverse=True):
            if name.startswith(k):
                return kinds[k]
        return name

    class Collectives(CommDebugMode):
        def __init__(self, axes: dict[frozenset[int], str]) -> None:
            super().__init__()
            self.axes = axes
            self.names: dict[str, str] = {}  # process group name -> axis
            self.by_axis: dict[tuple[str, str], list[float]] = {}

        def axis_of(self, pg) -> str:
            import torch.distributed as dist

            name = self.names.get(pg.group_name)
            if name is None:
                ranks = frozenset(dist.get_process_group_ranks(pg))
                name = self.axes.get(ranks, f"group of {len(ranks)}")
                self.names[pg.group_name] = name
            return name

        def __enter__(self):
            self.comm_counts.clear()
            TorchDispatchMode.__enter__(self)
            return self

        def __exit__(self, *args) -> None:
            TorchDispatchMode.__exit__(self, *args)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            import torch

            if any(t == DTensor for t in types):
                return NotImplemented
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            if isinstance(func, torch._ops.HigherOrderOperator):
                return out
            if func in collective_ops and func not in sync_ops:
                self.comm_counts[func._overloadpacket] += 1
                try:
                    pg = CollectiveOp.get_process_group(func, args)
                    axis = self.axis_of(pg)
                    nbytes = CollectiveOp.get_comm_tensor_size(func, out, args, kwargs)
                except (TypeError, AttributeError, IndexError):
                    axis, nbytes = "?", 0
                row = self.by_axis.setdefault((axis, kind_of(func)), [0, 0.0])
                row[0] += 1
                row[1] += nbytes
            return out

    return Collectives


def axis_groups(layout, rank: int, ep: int = 1) -> dict[frozenset[int], str]:
    """The rank set of each parallel axis's group holding `rank`, named as the performance
    model names them (parallel.perf: tp, cp, fsdp = dp_shard x cp, dp_replicate, pp).
    Collectives are attributed by their group's ranks, not by torchtitan's mesh names:
    several of its meshes share ranks (batch, loss, dp_shard, fsdp), and FSDP2 and
    context parallelism create groups of their own."""
    import itertools

    from core.axes import MESH_ORDER

    order = [a.value for a in MESH_ORDER]
    shape = [getattr(layout, a) for a in order]
    coords, r = [], rank
    for size in reversed(shape):
        coords.append(r % size)
        r //= size
    coords.reverse()

    def group(axes: set[str]) -> frozenset[int]:
        ranges = [
            range(n) if a in axes else [c] for a, n, c in zip(order, shape, coords, strict=True)
        ]
        out = set()
        for point in itertools.product(*ranges):
            idx = 0
            for n, c in zip(shape, point, strict=True):
                idx = idx * n + c
            out.add(idx)
        return frozenset(out)

    named = [
        ("tp", {"tp"}),
        ("cp", {"cp"}),
        ("fsdp", {"dp_shard", "cp"}),
        ("dp_shard", {"dp_shard"}),
        ("dp_replicate", {"dp_replicate"}),
        ("dp", {"dp_replicate", "dp_shard"}),
        ("dp_cp", {"dp_replicate", "dp_shard", "cp"}),
        ("pp", {"pp"}),
        ("world", set(order)),
    ]
    out: dict[frozenset[int], str] = {}
    if ep > 1:
        # torchtitan's sparse mesh (pp, dp_replicate, efsdp, ep), ep innermost: an EP group
        # is `ep` consecutive ranks of the dp_shard x cp x tp block, efsdp strides over them.
        inner = layout.dp_shard * layout.cp * layout.tp
        base = rank - rank % inner
        pos = rank % inner
        out[frozenset(range(base + pos - pos % ep, base + pos - pos % ep + ep))] = "ep"
        efsdp = frozenset(base + pos % ep + k * ep for k in range(inner // ep))
        if len(efsdp) > 1:
            out[efsdp] = "efsdp"
    for name, axes in named:
        g = group(axes)
        if len(g) > 1:
            out.setdefault(g, name)
    return out


# --------------------------------------------------------------------------------------
# The step: torchtitan's Trainer (titanscale's), with a synthetic batch and no I/O


def _synthetic_loader_config():
    """torchtitan's dataloader seam: batches shaped as titanscale's loader yields them
    ({"input", "positions"} and labels, [local batch, seq_len] int64), as constant fake
    tensors (their token counts are read with int(), as training reads real ones)."""
    import torch
    from torch._guards import active_fake_mode
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torchtitan.components.dataloader import BaseDataLoader

    class SyntheticLoader(BaseDataLoader):
        @dataclass(kw_only=True, slots=True)
        class Config(BaseDataLoader.Config):
            pass

        def __init__(self, config, *, seq_len: int, local_batch_size: int, **_: Any) -> None:
            self.seq_len, self.batch = seq_len, local_batch_size

        def __iter__(self):
            mode = active_fake_mode()
            assert mode is not None, "the dry run's loader runs under FakeTensorMode"

            def fake(t):
                return mode.fake_tensor_converter.from_real_tensor(mode, t, make_constant=True)

            while True:
                with unset_fake_temporarily():
                    tokens = torch.zeros(self.batch, self.seq_len, dtype=torch.int64)
                    positions = torch.arange(self.seq_len).repeat(self.batch, 1)
                    labels = tokens.clone()
                yield {"input": fake(tokens), "positions": fake(positions)}, fake(labels)

        def state_dict(self) -> dict[str, Any]:
            return {}

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            pass

    return SyntheticLoader.Config()


@dataclass
class _NoTokenizer:
    """torchtitan's tokenizer seam: the dry run reads no text."""

    @dataclass
    class Config:
        def build(self, **_: Any) -> None:
            return None


def _trainer_class():
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from parallel.mesh import make_parallel_dims
    from runtime.trainer import TitanscaleTrainer

    class DryRunTrainer(TitanscaleTrainer):
        """Training's Trainer; only the process group differs: the fake one is already
        up, and the start-up placement check (an all_gather_object of host names) has
        nothing real to gather."""

        def init_distributed(self):
            import torch.distributed as dist

            with unset_fake_temporarily():
                pd = make_parallel_dims(self.config.parallelism, dist.get_world_size())
                pd.build_mesh()
            return pd

    return DryRunTrainer


def _trainer_config(job: DryRunJob, caps, out_dir: str):
    """runtime.build's Trainer.Config for the job on the profile's GPU, then the dry run's
    few changes: eager (compile and async TP off; torchtitan captures no CUDA graph off a
    GPU), no checkpoint, validation, metrics files, tokenizer or data."""
    from kernels.registry import check_kernels
    from runtime.build import build_trainer_config
    from runtime.platform import Platform

    platform = Platform(caps.device_type, caps.name, caps.capability,
                        "nccl" if caps.is_cuda else "gloo")  # fmt: skip
    kernels = check_kernels(job.recipe, caps, cp=job.layout.cp)
    cfg = build_trainer_config(
        job.recipe, job.layout, platform=platform, kernels=kernels, tokenizer_path=out_dir
    )
    cfg.compile.enable = False
    cfg.compile.enable_async_tensor_parallel = False
    # disable_cuda_graphs stays as built: torchtitan runs the step eagerly off CUDA, and the
    # setting decides whether the step frees its gradients (zero_grad(set_to_none=...)).
    cfg.checkpoint.enable = False
    cfg.validator.enable = False
    cfg.metrics.enable_tensorboard = False
    cfg.metrics.enable_wandb = False
    if hasattr(cfg.metrics, "jsonl"):
        cfg.metrics.jsonl = False
    cfg.dump_folder = out_dir
    cfg.dataloader = _synthetic_loader_config()
    cfg.tokenizer = _NoTokenizer.Config()  # type: ignore[assignment]
    return cfg, kernels


def _layers_of(job: DryRunJob, pp_rank: int) -> tuple[list[int], int]:
    """(stage indices, transformer blocks) pipeline rank `pp_rank` holds, as the memory model
    splits them (parallel.memory: torchtitan's split)."""
    from parallel.memory import rank_stages, stage_layers
    from parallel.workload import workload_from_recipe

    w = workload_from_recipe(job.recipe, job.layout, job.cluster)
    per_stage = stage_layers(w.shape.n_layers, job.layout.pp * w.stages_per_rank)
    stages = rank_stages(pp_rank, job.layout.pp, w.pp_schedule, w.stages_per_rank)
    return stages, sum(per_stage[i] for i in stages)


def simulate(job: DryRunJob, rank: int, boundary: _Boundary) -> dict[str, Any]:
    """One training step of `rank` on fake tensors: its measured memory and collectives."""
    import torch
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    if job.recipe.adapters:  # not torchtitan's Trainer: posttrain.adapters' own job
        from tools.dryrun_posttrain import simulate_adapters

        return simulate_adapters(job, rank, boundary)
    t0 = time.perf_counter()
    with rank_world(job, rank, boundary) as (cfg, kernels):
        trainer = _trainer_class()(cfg)
        built = time.perf_counter() - t0
        # Steady state: AdamW's moments exist before the step (created at step 1).
        params = [p for m in trainer.model_parts for p in m.parameters() if p.requires_grad]
        for p in params:
            p.grad = torch.zeros_like(p)
        trainer.optimizers.step()
        # As the step leaves them: freed, or kept and zeroed under CUDA graphs (RL's step
        # layer frees them: StepEngine.optim_step's zero_grad()).
        trainer.optimizers.zero_grad(
            set_to_none=cfg.training.disable_cuda_graphs or job.recipe.rl.enabled
        )
        trainer.metrics_processor.should_log = lambda step: False  # no loss value to log
        trainer.step = 1
        memory = _memory_tracker_class()()
        update = None
        if job.recipe.rl.enabled:  # one RL update on the step layer, not train_step
            from tools.dryrun_posttrain import RLUpdate

            update = RLUpdate(job, trainer, cfg)
            memory.track_external(*update.resident())
        memory.track_external(*trainer.model_parts, *trainer.optimizers.optimizers)
        memory.name_modules(trainer.model_parts)
        comms = _collective_counter_class()(axis_groups(job.layout, rank, job.recipe.parallel.ep))
        patches = _Patches()
        post_backward = FSDPParamGroup.post_backward

        def tagged_post_backward(group, *a):
            out = post_backward(group, *a)
            for fp in group.fsdp_params:  # the reduce-scattered (sharded) gradients
                if fp.sharded_param.grad is not None:
                    memory.tag(fp.sharded_param.grad, "grad")
            return out

        patches.set(FSDPParamGroup, "post_backward", tagged_post_backward)
        posttrain = None
        try:
            if update is not None:
                from tools.dryrun_posttrain import scalar_reads

                scalar_reads(patches)
            with memory, comms:
                if update is None:
                    trainer.train_step(trainer.batch_generator(trainer.dataloader))
                else:
                    posttrain = update.run(memory)
        finally:
            patches.restore()
        # Read before trainer.close(): "after_step" is what the step left allocated.
        after, peak = memory.figures("current"), memory.figures("peak")
        sched = getattr(trainer, "pp_schedule", None)
        held = getattr(sched, "_stages", None) or [getattr(sched, "_stage", None)]
        stages = sorted(s.stage_index for s in held if s is not None) if sched else [0]
        trainer.close()
    return rank_entry(job, rank, job.pp_rank(rank), stages, kernels, (peak, after),
                      memory.peak_where, comms, posttrain, built, t0)  # fmt: skip


@contextlib.contextmanager
def rank_world(job: Any, rank: int, boundary: Any) -> Iterator[tuple[Any, Any]]:
    """`rank`'s launch environment, a scratch output folder and the fake world at the job's
    size; yields torchtitan's config and the kernels for it, built inside (the FP8 / MXFP8
    converters check the emulated GPU when built). The pretraining step's and the
    post-training rounds' (tools.dryrun_posttrain) one entry."""
    from parallel.job_checks import planning_caps

    caps = planning_caps(job.cluster.gpu)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank % job.cluster.gpus_per_node),
                      WORLD_SIZE=str(job.world_size))  # fmt: skip
    with (
        tempfile.TemporaryDirectory(prefix="dryrun-") as out_dir,
        fake_world(job.world_size, rank, caps, boundary),
    ):
        yield _trainer_config(job, caps, out_dir)


def rank_entry(job: Any, rank: int, pp_rank: int, stages: list[int], kernels: Any,
               figures: tuple[dict[str, float], dict[str, float]], peak_where: Any,
               comms: Any, posttrain: dict[str, Any] | None, built: float,
               t0: float) -> dict[str, Any]:  # fmt: skip
    """One rank's entry of the report (the pretraining step's and the post-training
    updates' alike, tools.dryrun_posttrain): `figures` = the memory tracker's (peak,
    current) read right after the step, its collectives by axis from `comms`, the build
    and total seconds since `t0`."""
    peak, after = figures
    return {
        "rank": rank,
        "world_size": job.world_size,
        "pp_rank": pp_rank,
        "stages": stages,
        "linear": kernels.linear,
        "attention": kernels.attention,
        "peak_gib": round(peak["total_gib"], 3),
        "peak": {k: round(v, 3) for k, v in peak.items()},
        "peak_where": peak_where,
        "after_step": {k: round(v, 3) for k, v in after.items()},
        "collectives": {
            f"{axis}.{kind}": {"count": int(c), "gib": round(b / GIB, 3)}
            for (axis, kind), (c, b) in sorted(comms.by_axis.items())
        },
        "posttrain": posttrain,
        "seconds": {"build": round(built, 1), "total": round(time.perf_counter() - t0, 1)},
    }


# --------------------------------------------------------------------------------------
# What the models say for the same rank


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


# --------------------------------------------------------------------------------------
# The report and the command line


def compare(measured: dict[str, Any], plan: dict[str, Any]) -> dict[str, Any]:
    """One rank's entry: measured and planned side by side, with the differences."""
    peak, want = measured["peak_gib"], plan["planned_gib"]
    keys = sorted(set(measured["collectives"]) | set(plan["predicted_collectives"]))
    zero = {"count": 0, "gib": 0.0}
    colls = {
        k: {
            "measured_count": measured["collectives"].get(k, zero)["count"],
            "predicted_count": plan["predicted_collectives"].get(k, zero)["count"],
            "measured_gib": measured["collectives"].get(k, zero)["gib"],
            "predicted_gib": plan["predicted_collectives"].get(k, zero)["gib"],
        }
        for k in keys
    }
    return {
        **{k: measured[k] for k in ("rank", "world_size", "pp_rank", "stages")},
        "peak_gib": peak,
        "planned_gib": want,
        "error_pct": round(100 * (want - peak) / peak, 1) if peak else None,
        "measured": {k: measured[k] for k in ("peak", "peak_where", "after_step")},
        "planned": {k: v for k, v in plan.items() if k != "planned_gib"},
        "collectives": colls,
        "kernels": {"linear": measured["linear"], "attention": measured["attention"]},
        **({"posttrain": measured["posttrain"]} if measured.get("posttrain") else {}),
        "seconds": measured["seconds"],
    }


def run_worker(job: DryRunJob, rank: int, state: str) -> None:
    """One rank in this process (a fresh one: torch keeps meshes and process-group state
    per process), its entry written to `state`/rank-<r>.json; a failure to build or step
    is written there too, as one line."""
    import logging
    import traceback
    import warnings

    boundary = _Boundary(os.path.join(state, "boundary.pkl"))
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
    stage-boundary metadata the later ranks receive)."""
    import subprocess

    ranks = []
    with tempfile.TemporaryDirectory(prefix="dryrun-state-") as state:
        for rank in job.ranks:
            cmd = [sys.executable, "-m", "tools.dryrun", *job.spec, f"--worker={rank}",
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


def render(result: dict[str, Any]) -> str:
    lay = " x ".join(f"{k}{v}" for k, v in result["layout"].items() if v > 1) or "1 GPU"
    out = [
        f"{result['model']} on {result['world_size']:,} x {result['gpu']} ({result['cluster']}), "
        f"{lay}, local batch {result['local_batch_size']}"
    ]
    out += [f"  note: {n}" for n in result["notes"]]
    for r in result["ranks"]:
        out.append("")
        if "error" in r:
            out.append(f"rank {r['rank']}: FAILED: {r['error']}")
            continue
        m, p = r["measured"]["peak"], r["planned"]["planned"]
        out.append(
            f"rank {r['rank']} (pipeline rank {r['pp_rank']}, stages {r['stages']}): measured "
            f"{r['peak_gib']:.2f} GiB, planned {r['planned_gib']:.2f} GiB ({r['error_pct']:+.1f}%)"
            f"  [{r['seconds']['total']:.0f} s]"
        )
        out.append(f"  peak during {r['measured']['peak_where']}")
        out.append(f"  {'GiB at the peak':<28}{'measured':>10}{'planned':>10}")
        rows = [
            ("parameters (+ unsharded)", m["parameters_gib"], None),
            ("gradients", m["gradients_gib"], None),
            ("optimizer state", m["optimizer_gib"], None),
            ("model states (sharded)", None, p["states"]),
            ("unsharded params + grads", None, p["unsharded_params_grads"]),
            ("activations + temporaries", m["activations_gib"],
             p["activations"] + p["workspace"] + p["logits"] + p["fp8"]),
            *[(k.replace("_", " "), None, p[k])
              for k in ("generator_copies", "reference_copy", "kv_cache") if p.get(k)],
            ("total (allocated)", m["total_gib"], r["planned_gib"]),
            ("+ fragmentation (planner)", None, p["allocator_fragmentation"]),
            ("+ outside allocator (planner)", None, p["runtime_overhead"]),
        ]  # fmt: skip
        for name, a, b in rows:
            sa = f"{a:10.2f}" if a is not None else f"{'':>10}"
            sb = f"{b:10.2f}" if b is not None else f"{'':>10}"
            out.append(f"  {name:<28}{sa}{sb}")
        post = r.get("posttrain")
        if post:
            for name, gib in post["phases_gib"].items():
                out.append(f"  peak of phase: {name:<40}{gib:10.2f}")
            for name, gib in post["resident_gib"].items():
                out.append(f"  measured {name.replace('_', ' '):<40}{gib:10.2f}")
            out += [f"  {n}" for n in post["notes"]]
        out.append(f"  {'collectives (per step)':<28}{'count':>8}{'GiB':>9}{'model count':>13}"
                   f"{'model GiB':>11}")  # fmt: skip
        for k, c in r["collectives"].items():
            out.append(
                f"  {k:<28}{c['measured_count']:>8}{c['measured_gib']:>9.2f}"
                f"{c['predicted_count']:>13g}{c['predicted_gib']:>11.2f}"
            )
    out.append("")
    out += [f"not covered: {n}" for n in result["not_covered"]]
    return "\n".join(out)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(
        prog="python -m tools.dryrun",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_recipe_arg(p, required=True)
    add_cluster_arg(p, help="cluster profile (default: the recipe's parallel.cluster)")
    p.add_argument("--nodes", type=int, default=None,
                   help="nodes (default: the recipe's world size / GPUs per node)")  # fmt: skip
    p.add_argument("--rank", type=int, action="append", default=None,
                   help="rank to simulate (repeatable; default 0, and the last rank with PP)")  # fmt: skip
    add_override_arg(p, "override a recipe key (repeatable), the same keys as train.py")
    p.add_argument("--microbatches", type=int, default=None,
                   help="pipeline microbatches to run (default: the recipe's; see docs/dryrun.md)")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--state", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


@exit_on_config_error
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    job = prepare(args.recipe, args.overrides, cluster_name=args.cluster, nodes=args.nodes,
                  ranks=args.rank, microbatches=args.microbatches)  # fmt: skip
    if args.worker is not None:
        run_worker(job, args.worker, args.state)
        return 0
    result = run_job(job)
    if args.json:
        json.dump(result, sys.stdout, indent=1)
        print()
    else:
        print(render(result))
    return 1 if any("error" in r for r in result["ranks"]) else 0


if __name__ == "__main__":
    run(main)
