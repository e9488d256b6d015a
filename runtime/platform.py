"""The one place where CPU and CUDA differ.

`Platform.detect()` says where we run; `platform.apply()` adapts torchtitan 0.3.0 to it. On
CUDA `apply()` changes nothing: torchtitan's own code paths run as shipped. On CPU (gloo) it
answers, item by item, the places where torchtitan assumes CUDA (file:line in torchtitan
0.3.0; see docs/torchtitan_on_cpu.md):

1. tools/utils.py:55 picks `device_type = ... or "cuda"` at import and five modules copy it
   by name; without a GPU the Trainer calls torch.cuda.set_device and dies. -> "cpu" and
   `torch.cpu` everywhere it was copied.
2. components/metrics.py:39-50: DeviceMemoryMonitor calls memory_stats & co on torch.cpu,
   which has none. -> a monitor that reports the process's peak RSS (labelled "host").
3. distributed/utils.py:586: `barrier(device_ids=[torch.cpu.current_device()])` passes the
   string "cpu". -> the same barrier-then-set-timeouts without device_ids.
4. distributed/fsdp.py:41 sets gradient_divide_factor=1.0, so FSDP2 reduces with
   ReduceOp.PREMUL_SUM, which gloo rejects. -> also force plain SUM reductions; with a divide
   factor of 1 that is numerically the same reduction (sum of gradients, no scaling).
5. Attention: flex has no CPU backward and varlen is CUDA-only -> kernels.dense_attention
   (chosen by the kernels layer, `attention = "auto"` -> dense on CPU).

On any device, version bridges (the lent H200 runs an older torch than our pin, 2.11;
`bridge_torch()` runs when the `runtime` package is imported, before any torchtitan import):
6. distributed/utils.py:595 calls `torch.distributed.set_timeout`, which torch < 2.14 lacks.
   -> the same barrier-then-timeouts through c10d's private `_set_pg_timeout`, or keep the
   initial timeout with a warning when that is missing too.
7. distributed/fsdp.py:13 imports `torch.distributed.fsdp.DataParallelMeshDims` at import time
   (newer than torch 2.11). -> a stand-in dataclass of the same shape. It is only ever passed
   to `fully_shard(dp_mesh_dims=...)` under the spmd_types / full_dtensor backends, so
8. the spmd backend becomes "partial_dtensor" (`spmd_backend()`) whenever torch is older than
   2.14 or its `fully_shard` has no `dp_mesh_dims`: spmd_types failed under FSDP/TP on torch
   2.13 ("all parameters must be DTensors", ../shared/notes/torchtitan-0.3.0-on-cpu.md), and
   partial_dtensor gave the same losses on CPU (FSDP2 6.21540 both ways).
9. trainer.py:856 calls `pp_schedule.step(arg_mbs=, kwarg_mbs=, target_mbs=, loss_kwargs=)`,
   which torch 2.13's schedules do not accept. Not bridged (it would mean re-implementing the
   schedule's microbatch split and loss scaling): `check_pipeline_step()` stops such a run
   (pp > 1) before the process group with one line naming the torch version, exit 2.
Anything else torchtitan imports and this torch lacks ends, at the `runtime` import, in one
line naming the torch version and the missing name, exit 2 (`MissingTorchFeature`).

Patches are applied once per process and only to torchtitan module attributes (no source
edits); every patched name is checked to exist, so a torchtitan upgrade fails loudly here.
"""

from __future__ import annotations

import inspect
import os
import re
import resource
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from core.launch_env import launch_env

_APPLIED: set[str] = set()
# Names bridged by bridge_torch() in this process (for the log and the tests).
BRIDGED: list[str] = []


class MissingTorchFeature(SystemExit):
    """This torch lacks something torchtitan 0.3.0 needs and that cannot be bridged: one line
    on stderr, exit 2 (the same contract as a ConfigError, raised where no CLI wrapper may be
    on the stack, e.g. at import)."""

    def __init__(self, line: str):
        print(f"error: {line}", file=sys.stderr)
        super().__init__(2)


def torch_version() -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", torch.__version__)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def _fsdp_has_mesh_dims() -> bool:
    import torch.distributed.fsdp as fsdp

    try:
        return "dp_mesh_dims" in inspect.signature(fsdp.fully_shard).parameters
    except (TypeError, ValueError):
        return False


def spmd_backend() -> str:
    """torchtitan's `parallelism.spmd_backend` for this torch: its default "spmd_types" on
    torch >= 2.14 with a native DataParallelMeshDims, else "partial_dtensor" (bridge 8)."""
    native = "DataParallelMeshDims" not in BRIDGED and _fsdp_has_mesh_dims()
    return "spmd_types" if torch_version() >= (2, 14) and native else "partial_dtensor"


def bridge_torch() -> None:
    """Install the import-time bridges (7) and check that torchtitan imports; idempotent.

    Must run before the first `import torchtitan.distributed`: torchtitan binds the names at
    import. Cost: one attribute check per symbol, once per process.
    """
    if "bridges" in _APPLIED:
        return
    _APPLIED.add("bridges")
    import torch.distributed.fsdp as fsdp

    if not hasattr(fsdp, "DataParallelMeshDims"):
        from dataclasses import dataclass as _dc

        @_dc
        class DataParallelMeshDims:  # same fields as torch 2.14's (never used on this torch)
            shard: str | tuple[str, ...] | None = None
            replicate: str | tuple[str, ...] | None = None

        setattr(fsdp, "DataParallelMeshDims", DataParallelMeshDims)  # noqa: B010 (mypy: a stand-in type)
        BRIDGED.append("DataParallelMeshDims")
    if not hasattr(torch.distributed, "set_timeout"):
        BRIDGED.append("set_timeout")  # patched into torchtitan by Platform.apply()
    try:
        import torchtitan.distributed.utils  # noqa: F401
        import torchtitan.trainer  # noqa: F401
    except ImportError as e:
        what = f"{e.name}" if e.name else str(e).splitlines()[0]
        if e.name and e.name.split(".")[0] != "torch":  # torchao, torchdata, tyro, ...
            raise MissingTorchFeature(
                f"torchtitan 0.3.0 needs the Python package '{e.name}', not installed here "
                "(on the lent GPU carry it as a wheel: docs/gpu.md)"
            ) from None
        raise MissingTorchFeature(
            f"torch {torch.__version__} lacks {what} that torchtitan 0.3.0 imports "
            f"({str(e).splitlines()[0][:160]}); use torch >= 2.14"
        ) from None


def pipeline_step_missing() -> list[str]:
    """The keyword arguments torchtitan 0.3.0 passes to a pipeline schedule's step() that this
    torch's schedules do not accept (empty on torch >= 2.14)."""
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle

    need = ("arg_mbs", "kwarg_mbs", "target_mbs", "loss_kwargs")
    missing: list[str] = []
    for cls in (PipelineScheduleSingle, PipelineScheduleMulti):
        params = inspect.signature(cls.step).parameters
        missing += [k for k in need if k not in params and k not in missing]
    return missing


def check_pipeline_step(pp: int) -> None:
    """Bridge 9 is impossible: with pp > 1 on a torch whose schedules lack the pre-split step
    arguments, stop before the process group with one line, exit 2."""
    if pp <= 1:
        return
    missing = pipeline_step_missing()
    if missing:
        raise MissingTorchFeature(
            f"torch {torch.__version__}: pipeline schedules' step() lacks "
            f"{', '.join(missing)} that torchtitan 0.3.0 passes; pipeline parallelism "
            f"(pp = {pp}) needs torch >= 2.14 (set parallel.pp = 1 on this machine)"
        )


@dataclass(frozen=True)
class Platform:
    device_type: str  # "cuda" or "cpu"
    device_name: str  # e.g. "NVIDIA H100 80GB HBM3", or "cpu"
    compute_capability: tuple[int, int] | None
    backend: str  # "nccl" or "gloo"

    @property
    def is_cpu(self) -> bool:
        return self.device_type == "cpu"

    @staticmethod
    def detect() -> Platform:
        if torch.cuda.is_available():
            idx = launch_env().local_rank % max(torch.cuda.device_count(), 1)
            return Platform(
                device_type="cuda",
                device_name=torch.cuda.get_device_name(idx),
                compute_capability=torch.cuda.get_device_capability(idx),
                backend="nccl",
            )
        return Platform(
            device_type="cpu", device_name="cpu", compute_capability=None, backend="gloo"
        )

    def apply(self) -> None:
        """Adapt torchtitan to this platform (idempotent; a no-op on CUDA with our torch)."""
        if not hasattr(torch.distributed, "set_timeout") and "timeout" not in _APPLIED:
            _APPLIED.add("timeout")
            _patch_pg_timeouts(device_barrier=not self.is_cpu)
        if not self.is_cpu or "cpu" in _APPLIED:
            return
        _APPLIED.add("cpu")
        _patch_device_type()
        _patch_memory_monitor()
        if "timeout" not in _APPLIED:
            _APPLIED.add("timeout")
            _patch_pg_timeouts(device_barrier=False)
        _patch_fsdp_reduction()
        _patch_uneven_all_to_all()
        _patch_expert_precision()


def _set(module, name: str, value) -> None:
    if not hasattr(module, name):
        raise RuntimeError(
            f"titanscale's CPU layer expected {module.__name__}.{name} (torchtitan 0.3.0); "
            "the installed torchtitan differs"
        )
    setattr(module, name, value)


def _patch_device_type() -> None:
    import torchtitan.components.metrics as metrics
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.models.common.token_dispatcher as token_dispatcher
    import torchtitan.tools.profiler as profiler
    import torchtitan.tools.utils as tt_utils

    for mod in (tt_utils, metrics, parallel_dims, dist_utils, token_dispatcher):
        _set(mod, "device_type", "cpu")
    for mod in (tt_utils, metrics, dist_utils, token_dispatcher, profiler):
        _set(mod, "device_module", torch.cpu)


class HostMemoryMonitor:
    """Stands in for torchtitan's DeviceMemoryMonitor on CPU: peak RSS of this process.

    ru_maxrss never decreases, so "peak since reset" is the process peak; that is the honest
    figure for a CPU run (there is no separate device pool).
    """

    def __init__(self, device: str = "cpu"):
        self.device = torch.device("cpu")
        self.device_name = "cpu"
        self.device_index = 0
        try:
            pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            pages = 0
        self.device_capacity = pages or 1
        self.device_capacity_gib = self.device_capacity / 2**30

    def _peak_bytes(self) -> int:
        kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return kb if sys.platform == "darwin" else kb * 1024

    def get_peak_stats(self):
        from torchtitan.components.metrics import DeviceMemStats

        peak = self._peak_bytes()
        gib = peak / 2**30
        pct = 100 * peak / self.device_capacity
        return DeviceMemStats(gib, pct, gib, pct, 0, 0)

    def reset_peak_stats(self) -> None:
        pass


def _patch_memory_monitor() -> None:
    import torchtitan.components.metrics as metrics

    _set(metrics, "build_device_memory_monitor", lambda: HostMemoryMonitor())


def _set_group_timeout(timeout: timedelta, group) -> None:
    if hasattr(torch.distributed, "set_timeout"):
        torch.distributed.set_timeout(timeout, group)
        return
    private = getattr(torch.distributed.distributed_c10d, "_set_pg_timeout", None)
    if private is None:
        from torchtitan.tools.logging import logger

        logger.warning(
            "this torch cannot change a process group's timeout; keeping the initial one"
        )
        return
    private(timeout, group)


def _patch_pg_timeouts(*, device_barrier: bool) -> None:
    import torchtitan.distributed.utils as dist_utils

    def set_pg_timeouts(timeout: timedelta, parallel_dims) -> None:
        # Same invariant as torchtitan's: every rank reaches this barrier before any group's
        # timeout shrinks, so no rank times out waiting for a slower rank's initialisation.
        if device_barrier:
            torch.distributed.barrier(device_ids=[torch.cuda.current_device()])
            torch.cuda.synchronize()
        else:
            torch.distributed.barrier()
        groups = [m.get_group() for m in parallel_dims.get_all_one_dimensional_meshes().values()]
        for group in [*groups, None]:
            _set_group_timeout(timeout, group)

    _set(dist_utils, "set_pg_timeouts", set_pg_timeouts)


def _patch_fsdp_reduction() -> None:
    import torchtitan.distributed.fsdp as tt_fsdp
    from torch.distributed.fsdp import FSDPModule

    def disable_fsdp_gradient_division(model: torch.nn.Module) -> None:
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)
                # gloo has no PREMUL_SUM; SUM with factor 1.0 is the same reduction.
                module.set_force_sum_reduction_for_comms(True)

    _set(tt_fsdp, "disable_fsdp_gradient_division", disable_fsdp_gradient_division)


def _patch_uneven_all_to_all() -> None:
    """Expert-parallel token exchange on gloo.

    Why: spmd_types' `_AllToAllUneven` (torchtitan's all-to-all token dispatch under the
    spmd_types backend) calls the list form `dist.all_to_all`, which gloo accepts only for
    equal chunk sizes ("ProcessGroupGloo::alltoall: invalid tensor size"); experts receive
    uneven token counts. `all_to_all_single` with split sizes (gloo's alltoallv) moves the
    same rows in the same order: the output is the concatenation of what each rank sent.
    The backward is spmd_types' own (it calls this forward with the splits swapped).
    """
    import spmd_types._collectives as coll

    uneven = coll._AllToAllUneven
    if not hasattr(uneven, "forward"):
        raise RuntimeError("titanscale's CPU layer expected spmd_types' _AllToAllUneven")

    def forward(ctx, x, axis, output_split_sizes, input_split_sizes, dtype_options):  # noqa: ANN001
        ctx.axis = axis
        ctx.backward_options = dtype_options.backward_options
        x = coll._apply_op_dtype(x, dtype_options.op_dtype)
        world_size = torch.distributed.get_world_size(axis)
        if input_split_sizes is None:
            input_split_sizes = [x.shape[0] // world_size] * world_size
        if output_split_sizes is None:
            output_split_sizes = [x.shape[0] // world_size] * world_size
        ctx.output_split_sizes = output_split_sizes
        ctx.input_split_sizes = input_split_sizes
        out = x.new_empty([sum(output_split_sizes), *x.shape[1:]])
        torch.distributed.all_to_all_single(
            out,
            x.contiguous(),
            output_split_sizes=list(output_split_sizes),
            input_split_sizes=list(input_split_sizes),
            group=axis,
        )
        return coll._apply_out_dtype(out, dtype_options.out_dtype)

    uneven.forward = staticmethod(forward)


def _patch_expert_precision() -> None:
    """Routed experts compute in their weights' dtype on CPU (float32 recipes stay float32).

    Why: torchtitan 0.3.0's GroupedExperts / GptOssGroupedExperts cast tokens and expert
    weights to bfloat16 for `torch._grouped_mm` whatever the parameter dtype (the CUDA
    grouped GEMM wants bf16). On CPU `_grouped_mm` runs float32 forward and backward, and a
    `training.dtype = "float32"` run would otherwise carry bf16 rounding in every expert
    (2e-4 per MoE layer against transformers' float32 Qwen3-MoE). The wrapper runs
    torchtitan's own forward with `Tensor.bfloat16` an identity for that call only, and
    only when the experts' weights are float32 and real; bf16 weights (FSDP mixed precision)
    and fake tensors (tools.dryrun) keep torchtitan's path exactly.
    """
    import torchtitan.models.common.moe as common_moe
    import torchtitan.models.gpt_oss.moe as gpt_oss_moe

    for cls in (common_moe.GroupedExperts, gpt_oss_moe.GptOssGroupedExperts):
        if "forward" not in vars(cls):
            raise RuntimeError(f"titanscale's CPU layer expected {cls.__name__}.forward")
        cls.forward = _keep_float32(vars(cls)["forward"])


def _keep_float32(forward):  # noqa: ANN001, ANN202
    def wrapped(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor):  # noqa: N803
        from torch._subclasses.fake_tensor import is_fake

        weight = next(self.parameters())
        local = weight.to_local() if hasattr(weight, "to_local") else weight
        # Fake tensors (tools.dryrun) stand for the GPU run: torchtitan's bf16 path, whose
        # fake grouped-mm kernel also accepts nothing else.
        if local.dtype != torch.float32 or x_RD.dtype != torch.float32 or is_fake(x_RD):
            return forward(self, x_RD, num_tokens_per_expert_E)
        cast = torch.Tensor.bfloat16
        torch.Tensor.bfloat16 = lambda t, *a, **k: t  # type: ignore[method-assign]
        try:
            return forward(self, x_RD, num_tokens_per_expert_E)
        finally:
            torch.Tensor.bfloat16 = cast  # type: ignore[method-assign]

    wrapped.__wrapped__ = forward  # type: ignore[attr-defined]
    return wrapped


def device_memory_bytes(platform: Any) -> tuple[float, str]:
    """(bytes one rank may use, the memory model's device kind): the GPU's memory, or on
    CPU the host's memory shared by the local processes."""
    if platform.is_cpu:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return ram / max(launch_env().local_world_size, 1), "cpu"
    local = launch_env().local_rank
    return float(torch.cuda.get_device_properties(local).total_memory), platform.device_name
