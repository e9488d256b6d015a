"""Every private torch (and torchtitan) name the dry run (tools/dryrun/) relies on, checked.

The dry run patches torch internals to run a whole training step on fake tensors (a fake
process group, pipeline metadata without peers, the CUDA rms_norm path) and subclasses
MemTracker to price it. A torch upgrade that renames or removes one of these would otherwise
fail deep inside a dry run or, for a patched attribute, silently stop being patched. This
test fails first, naming the name, how the dry run uses it and where. Same pattern as
tests/unit/test_torchtitan_private_names.py.
"""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch.distributed  # noqa: F401  (registers torch.ops._c10d_functional, as in the dry run)

WHERE = "tools/dryrun/"

# (module, attribute path, how the dry run relies on it)
TORCH_PRIVATE: list[tuple[str, str, str]] = [
    # fake_world: the fake-tensor process and its patches
    ("torch._subclasses.fake_tensor", "FakeTensorMode", "entered for the whole step"),
    ("torch._subclasses.fake_tensor", "unset_fake_temporarily", "real tensors inside"),
    ("torch._subclasses.fake_tensor", "CONSTANT_NUMEL_LIMIT", "patched (constant batch)"),
    ("torch.testing._internal.distributed.fake_pg", "FakeStore", "the 'fake' process group"),
    ("torch.distributed.tensor._sharding_prop",
     "ShardingPropagator._propagate_tensor_meta_non_cached", "patched (wrapped)"),
    ("torch.distributed.tensor._dispatch", "is_rng_supported_mesh", "patched"),
    ("torch.nn.init", "_no_grad_trunc_normal_", "patched (no data read)"),
    ("torch.nn.attention.flex_attention", "_validate_device", "patched (CPU backward)"),
    ("torch.distributed.device_mesh", "DeviceMesh.__init__", "patched (real tensors)"),
    # pipeline stages without peers: metadata passed through the boundary file
    ("torch.distributed.pipelining.schedules", "_PipelineSchedule._warmup_p2p", "patched"),
    ("torch.distributed.pipelining.stage", "PipelineStage._send_meta", "patched"),
    ("torch.distributed.pipelining.stage", "PipelineStage._recv_meta", "patched"),
    ("torch.distributed.pipelining._utils", "InferenceMode.DYNAMIC", "set on each stage"),
    ("torch.distributed.pipelining._utils", "_StageBackwardMeta", "built"),
    ("torch.distributed.pipelining._utils", "_StageForwardMeta", "read by type name"),
    ("torch.distributed.pipelining._utils", "_derive_grad_metas", "called"),
    # the CUDA rms_norm path on CPU
    ("torch", "_fused_rms_norm", "called (CUDA's fused forward)"),
    ("torch", "ops.aten._fused_rms_norm_backward", "called"),
    # the memory tracker (MemTracker without its ModTracker)
    ("torch.distributed._tools.mem_tracker", "_TOTAL_KEY", "imported"),
    ("torch.distributed._tools.mem_tracker", "_MemRefType.PARAM", "imported"),
    *[
        ("torch.distributed._tools.mem_tracker", f"MemTracker.{m}", "called from the subclass")
        for m in ("_update_and_maybe_create_winfos", "_track_module_params_and_buffers",
                  "_register_global_optimizer_hook", "_track_resize", "_restore_resize",
                  "_deregister_param_and_optimizer_hooks", "_track", "get_tracker_snapshot")
    ],
    *[
        ("torch.distributed._tools.mem_tracker", f"MemTracker.{a}", "attribute it sets, read")
        for a in ("_param_to_grad_hook_handles", "_in_opt", "_curr_mem_snap", "_peak_mem",
                  "_peak_mem_snap", "_depth")
    ],
    ("torch._guards", "active_fake_mode", "called"),
    ("torch.utils._python_dispatch", "TorchDispatchMode", "subclassed (trackers)"),
    ("torch.utils._pytree", "tree_map_only", "called"),
    ("torch._C", "_current_autograd_node", "called (forward or backward?)"),
    ("torch._ops", "HigherOrderOperator", "isinstance check"),
    ("torch", "ops._c10d_functional.wait_tensor.default", "compared against"),
    ("torch.distributed._tools.fake_collectives", "CollectiveOp", "imported"),
    ("torch.distributed._tools.fake_collectives", "collective_ops", "imported"),
    ("torch.distributed._tools.fake_collectives", "sync_ops", "imported"),
    ("torch.distributed.fsdp._fully_shard._fsdp_param_group", "FSDPParamGroup.post_backward",
     "patched (gradients tagged)"),
    ("torch.distributed.fsdp._fully_shard._fsdp_param", "_chunk_with_empty",
     "patched (this rank's and the first shard's views only)"),
    # a CPU recipe's float32 grouped GEMM (MoE experts) past CUDA's meta rule
    ("torch._meta_registrations", "_meta_grouped_mm_common", "patched (wrapped: float32 on CPU)"),
    ("torch._meta_registrations", "_create_grouped_mm_output_tensor", "called"),
    # tools/dryrun/posttrain.py: the step layer's value reads on fake tensors give 0
    ("torch._subclasses.fake_impls", "op_implementations_dict",
     "entry replaced (_local_scalar_dense: 0 instead of DataDependentOutputException)"),
    ("torch._subclasses.fake_tensor", "DataDependentOutputException", "caught"),
    # torchtitan, patched by the same fake world
    ("torchtitan.tools.utils", "get_local_device", "patched"),
    ("torchtitan.distributed.utils", "set_determinism", "patched"),
    ("torchtitan.components.quantization.float8", "has_cuda_capability", "patched"),
    ("torchtitan.components.quantization.mx", "has_cuda_capability", "patched"),
    # MoE under expert parallelism: balanced split sizes instead of a host read of fake counts
    ("torchtitan.models.common.token_dispatcher", "AllToAllTokenDispatcher._local_reorder",
     "patched (wrapped: counts the routed copies)"),
    ("torchtitan.models.common.token_dispatcher",
     "AllToAllTokenDispatcher._sync_token_count_exchange", "patched (balanced splits)"),
]  # fmt: skip


def missing(module: str, path: str) -> str | None:
    """Why `module.path` is not there (None when it is). A `Class.attr` that is an instance
    attribute counts when the class's source still assigns `self.attr`."""
    try:
        obj = importlib.import_module(module)
    except ImportError as e:
        return f"{module} does not import ({e})"
    parts = path.split(".")
    for i, p in enumerate(parts):
        if hasattr(obj, p):
            obj = getattr(obj, p)
            continue
        if i == len(parts) - 1 and inspect.isclass(obj):
            try:
                src = inspect.getsource(obj)
            except (OSError, TypeError):
                src = ""
            if f"self.{p} " in src or f"self.{p}:" in src or f"self.{p}=" in src:
                return None
        return f"{module}.{'.'.join(parts[: i + 1])} is gone"
    return None


@pytest.mark.parametrize(
    "module,path,how", TORCH_PRIVATE, ids=[f"{m}.{p}" for m, p, _ in TORCH_PRIVATE]
)
def test_private_name_the_dry_run_uses_exists(module, path, how):
    why = missing(module, path)
    assert why is None, (
        f"{why}: {WHERE} relies on it ({how}). The installed torch differs from the one the "
        "dry run was written for; update the dry run (docs/dryrun.md)"
    )


def test_every_patch_in_the_dry_run_is_listed():
    """Each `set(<module>, "<name>", ...)` patch and `set_item(<module>.<table>, ...)` table
    entry in the dry run's files (every module of tools/dryrun/) names an attribute this list guards (a new patch without a
    guard fails here)."""
    import re

    from tests.helpers.runs import ROOT

    src = "\n".join(f.read_text() for f in sorted((ROOT / WHERE).glob("*.py")))
    patched = set(re.findall(r"\.set\(\s*[\w.]+,\s*\"(\w+)\"", src))
    patched |= set(re.findall(r"\.set_item\(\s*[\w.]+\.(\w+),", src))
    assert "op_implementations_dict" in patched  # the scan sees table patches
    listed = {p.split(".")[-1] for _, p, _ in TORCH_PRIVATE}
    # Public torch names patched by the dry run (guarded by torch's API, not by this list).
    public = {"rms_norm"}
    assert patched - public <= listed, sorted(patched - public - listed)


def test_the_check_sees_a_missing_name():
    assert missing("torch.nn", "Linear") is None
    assert (
        missing("torch.nn", "Linear.no_such_thing_39") == "torch.nn.Linear.no_such_thing_39 is gone"
    )
    assert missing("no_such_module_39", "x").startswith("no_such_module_39 does not import")
