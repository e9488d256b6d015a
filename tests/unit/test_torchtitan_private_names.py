"""Every private (or looked-up-at-call-time) torchtitan name the project relies on, checked.

A torchtitan upgrade that renames or removes one of these would otherwise fail somewhere deep
in a run (or, for an override, silently stop being called). This test fails first, naming the
name, the module that relies on it and what to check. The same list is in docs/torchtitan.md.
"""

from __future__ import annotations

import importlib
import inspect

import pytest

# (torchtitan module, attribute path, how we rely on it, our module)
PRIVATE_NAMES: list[tuple[str, str, str, str]] = [
    (
        "torchtitan.components.checkpoint",
        "CheckpointManager._load",
        "override + super()",
        "runtime/checkpoint.py",
    ),
    (
        "torchtitan.components.checkpoint",
        "CheckpointManager._find_load_step",
        "override + super()",
        "runtime/checkpoint.py",
    ),
    (
        "torchtitan.components.checkpoint",
        "CheckpointManager._purge_stale_checkpoints",
        "override + super()",
        "runtime/checkpoint.py",
    ),
    (
        "torchtitan.components.checkpoint",
        "CheckpointManager._should_purge",
        "override",
        "runtime/checkpoint.py",
    ),
    (
        "torchtitan.components.checkpoint",
        "CheckpointManager._create_checkpoint_id",
        "called",
        "runtime/checkpoint.py",
    ),
    *[
        (
            "torchtitan.components.checkpoint",
            f"CheckpointManager.{name}",
            "override + super()",
            "runtime/checkpoint.py",
        )
        for name in ("_save", "_wait_for_saving", "_close")  # the async save's verified commit
    ],
    ("torchtitan.components.metrics", "_get_metrics_rank", "imported", "runtime/metrics.py"),
    (
        "torchtitan.distributed.parallel_dims",
        "init_device_mesh",
        "swapped while build_mesh runs",
        "parallel/mesh.py",
    ),
    (
        "torchtitan.distributed.parallel_dims",
        "ParallelDims._world_mesh",
        "read after build_mesh",
        "runtime/startup.py",
    ),
    (
        "torchtitan.hf_datasets.text_datasets",
        "HuggingFaceTextDataset._inputs_buffer",
        "read (dropped tail)",
        "data/packstats.py",
    ),
    (
        "torchtitan.components.lora",
        "_get_lora_cls._lora_scaling",
        "set per adapter (alpha / the adapter's own rank)",
        "service/titan_backend.py",
    ),
    (
        "torchtitan.trainer",
        "Trainer._forward_backward_body",
        "override + super() (per-token SFT weights to the loss)",
        "runtime/trainer.py",
    ),
    (
        "torchtitan.components.loss",
        "_LossParallelCrossEntropy",
        "called with reduction 'none' (weighted CE under TP)",
        "runtime/loss.py",
    ),
    (
        "torchtitan.protocols.module",
        "Module._distribute_states",
        "override + super() (routed-expert adapters placed as the base experts)",
        "runtime/moe_experts.py",
    ),
    (
        "torchtitan.models.common.moe",
        "GroupedExperts._grouped_mm",
        "called (the adapters' grouped GEMMs)",
        "runtime/moe_experts.py",
    ),
]

# Module attributes that torchtitan looks up at call time and the CPU layer replaces
# (runtime/platform.py; public names, but the seam is that they are read at call time).
PATCHED_ATTRIBUTES: list[tuple[str, str]] = [
    *[
        (m, "device_type")
        for m in (
            "torchtitan.tools.utils",
            "torchtitan.components.metrics",
            "torchtitan.distributed.parallel_dims",
            "torchtitan.distributed.utils",
            "torchtitan.models.common.token_dispatcher",
        )
    ],
    *[
        (m, "device_module")
        for m in (
            "torchtitan.tools.utils",
            "torchtitan.components.metrics",
            "torchtitan.distributed.utils",
            "torchtitan.models.common.token_dispatcher",
            "torchtitan.tools.profiler",
        )
    ],
    ("torchtitan.components.metrics", "build_device_memory_monitor"),
    ("torchtitan.distributed.utils", "set_pg_timeouts"),
    ("torchtitan.distributed.fsdp", "disable_fsdp_gradient_division"),
]

# Instance attributes set in __init__/methods, not on the class: found in the class source.
INSTANCE_ATTRIBUTES = {
    "ParallelDims._world_mesh",
    "HuggingFaceTextDataset._inputs_buffer",
    "_get_lora_cls._lora_scaling",  # LoRALinear is built inside this function
}


def missing(module: str, path: str) -> str | None:
    """Why `module.path` is not usable, or None."""
    try:
        obj = importlib.import_module(module)
    except ImportError as e:
        return f"module {module} does not import ({e})"
    parts = path.split(".")
    if path in INSTANCE_ATTRIBUTES:
        cls = getattr(obj, parts[0], None)
        if cls is None:
            return f"{module}.{parts[0]} is gone"
        if f"self.{parts[1]}" not in inspect.getsource(cls):
            return f"{module}.{parts[0]} no longer sets self.{parts[1]}"
        return None
    for p in parts:
        if not hasattr(obj, p):
            return f"{module}.{path} is gone"
        obj = getattr(obj, p)
    return None


@pytest.mark.parametrize(
    "module,path,how,ours", PRIVATE_NAMES, ids=[p for _, p, _, _ in PRIVATE_NAMES]
)
def test_private_torchtitan_name_exists(module, path, how, ours):
    why = missing(module, path)
    assert why is None, (
        f"{why}: {ours} relies on it ({how}). The installed torchtitan differs from 0.3.0; "
        f"update {ours} to the new name (see docs/torchtitan.md)"
    )


@pytest.mark.parametrize(
    "module,name", PATCHED_ATTRIBUTES, ids=[f"{m}.{n}" for m, n in PATCHED_ATTRIBUTES]
)
def test_patched_attribute_exists(module, name):
    why = missing(module, name)
    assert why is None, f"{why}: runtime/platform.py replaces it on CPU (see docs/torchtitan.md)"


def test_build_mesh_still_looks_init_device_mesh_up_at_call_time():
    """parallel/mesh.py swaps the module attribute; that works only while build_mesh calls
    `init_device_mesh` by its module-level name."""
    from torchtitan.distributed.parallel_dims import ParallelDims

    assert "init_device_mesh(" in inspect.getsource(ParallelDims), (
        "ParallelDims no longer calls init_device_mesh: parallel/mesh.py's placed mesh would "
        "silently fall back to plain rank order"
    )


def test_overrides_match_a_torchtitan_method():
    """Every underscore method our checkpoint manager overrides exists on torchtitan's class
    (an override of a renamed method would silently never run)."""
    from torchtitan.components.checkpoint import CheckpointManager

    from runtime.checkpoint import AtomicCheckpointManager

    ours = {
        n
        for n, v in vars(AtomicCheckpointManager).items()
        if n.startswith("_") and not n.startswith("__") and inspect.isfunction(v)
    }
    theirs = {n for n in dir(CheckpointManager) if n.startswith("_")}
    listed = {p.split(".")[1] for m, p, _, _ in PRIVATE_NAMES if p.startswith("CheckpointManager.")}
    overrides = ours & theirs
    assert overrides <= listed, f"unlisted private overrides: {sorted(overrides - listed)}"


def test_the_check_sees_a_missing_name():
    assert missing("torchtitan.components.checkpoint", "CheckpointManager._no_such") is not None
    assert missing("torchtitan.distributed.parallel_dims", "ParallelDims._no_such") is not None
    assert missing("torchtitan.components.checkpoint", "CheckpointManager._load") is None
