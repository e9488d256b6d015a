"""The fake world: torch's fake process group at the job's world size and every patch of
torch and torchtitan internals a whole step needs on fake tensors (`fake_world`, undone on
exit). Each private name patched here is guarded by tests/unit/test_dryrun_torch_internals.py."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any


class Patches:
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


class Boundary:
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
PROPAGATING = [0]


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
def fake_world(world: int, rank: int, caps, boundary: Boundary) -> Iterator[Any]:
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
    p = Patches()
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
        PROPAGATING[0] += 1
        try:
            return meta_fn(self, op_schema)
        finally:
            PROPAGATING[0] -= 1

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
