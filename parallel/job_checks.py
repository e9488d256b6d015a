"""The checks training makes before its process group, for the tools that plan, predict or
launch without one (tools.plan, tools.predict, tools.launch, the planner itself).

Training (`runtime.session.prepare`) checks the recipe (`recipe.loader.check_recipe`: the
model, fine-tuning, world size, degrees against heads and layers) and the kernels against its
device (`kernels.registry.check_kernels`). A tool has no device, so it checks the same
functions against the cluster profile's GPU kind (`planning_caps`): a plan training would
refuse (MXFP8 on H100, varlen attention with context parallelism, a CPU profile with flex
attention) is refused here with the same line, exit 2, instead of being ranked.
"""

from __future__ import annotations

from core.axes import Layout
from kernels.caps import FEATURE_MODULES, KNOWN_GPUS, DeviceCaps
from parallel.cluster import Cluster
from recipe.loader import check_model_fields, check_recipe
from recipe.schema import Recipe


def planning_caps(gpu_kind: str) -> DeviceCaps:
    """A profile's GPU kind as the kernels registry sees a device. The optional kernel
    packages (FlashAttention 3/4, torchao) count as installed: what a login node has says
    nothing about the nodes, and training checks them on the node before its process group.
    The GPU's compute capability is what a profile knows, and it is checked here."""
    if gpu_kind not in KNOWN_GPUS and gpu_kind.upper() not in KNOWN_GPUS:  # "cpu"
        return DeviceCaps.cpu()
    return DeviceCaps.gpu(gpu_kind, features=frozenset(FEATURE_MODULES))


def check_kernels_on(recipe: Recipe, cluster: Cluster, cp: int = 1):  # -> KernelChoice
    """`[kernels]` on the profile's GPU (training's own check, `check_kernels`), for a layout
    with context-parallel degree `cp`. ConfigError naming kernels.linear / kernels.attention."""
    from kernels.registry import check_kernels  # imports torchtitan: only when checking

    return check_kernels(recipe, planning_caps(cluster.gpu), cp=cp)


def check_before_search(recipe: Recipe, cluster: Cluster) -> None:
    """What the planner checks before choosing degrees: the model and fine-tuning fields and
    the kernels on this GPU (context parallelism is checked per candidate)."""
    check_model_fields(recipe)
    check_tokenizer_on_hand(recipe)
    check_kernels_on(recipe, cluster, cp=1)


def check_job(recipe: Recipe, cluster: Cluster, world_size: int) -> Layout:
    """Training's checks for the recipe's own layout on `world_size` GPUs of `cluster`
    (tools.predict, tools.launch): the recipe against the world size and the model, then
    the kernels on the profile's GPU with the layout's cp. Returns the layout."""
    layout = check_recipe(recipe, world_size)
    check_tokenizer_on_hand(recipe)
    check_kernels_on(recipe, cluster, cp=1 if recipe.parallel.auto else layout.cp)
    return layout


def check_tokenizer_on_hand(recipe: Recipe) -> None:
    """Training's vocabulary check (`recipe.model_checks.check_vocab`: the tokenizer's ids fit
    the model's embedding table) when `model.tokenizer` is a folder this machine has. A tool
    often plans on a login node for paths that exist only on the cluster: a missing or
    unreadable folder is left to training, which reports it before its process group."""
    from pathlib import Path

    spec = recipe.model.tokenizer
    if spec == "embedded" or not Path(spec).is_dir():
        return
    from data.tokenizer import tokenizer_id_count
    from recipe.model_checks import check_vocab

    try:
        ids = tokenizer_id_count(spec)
    except Exception:  # a malformed tokenizer.json: training names it (check_tokenizer)
        return
    if ids is not None:
        check_vocab(recipe, ids, spec)
