"""The one recipe loader: TOML (+ base chain) + --set overrides -> validated `Recipe`.

    recipe = load_recipe("recipes/debug.toml", ["training.steps=5"])
    layout = check_recipe(recipe, world_size=2)   # cross-section checks, needs the world size

Both raise ConfigError (file + dotted key) and never touch torch.distributed.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from core.axes import Layout, resolve_layout
from core.errors import ConfigError
from core.models import ModelShape, model_shape, pp_layer_weights, stages_per_rank
from core.safe_text import check_text
from core.typed_toml import (
    apply_override,
    build_dataclass,
    origin_of,
    read_with_bases,
    resolve_named,
)
from recipe.limits import check_limits
from recipe.schema import Recipe

RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"
DEFAULT_RECIPE = RECIPES_DIR / "debug.toml"


def resolve_recipe_path(path_or_name: str | Path | None) -> str | Path:
    """A path (returned as given, so messages show it as the user wrote it), or a recipe name
    from recipes/ ("llama3_8b"); None = the debug recipe."""
    if not path_or_name:
        return DEFAULT_RECIPE
    resolved = resolve_named(path_or_name, RECIPES_DIR)
    return path_or_name if Path(path_or_name) == resolved else resolved


def load_recipe_dict(
    path: str | Path, overrides: Sequence[str] = (), origins: dict[str, str] | None = None
) -> dict[str, Any]:
    """The merged raw recipe; `origins` receives where each value came from (dotted key ->
    the file, a base file, or `--set key=value`)."""
    data = read_with_bases(resolve_recipe_path(path), origins=origins)
    for o in overrides:
        data = apply_override(data, o, Recipe, origins=origins)
    return data


def blame(err: ConfigError, recipe_or_origins: Recipe | dict[str, str]) -> ConfigError:
    """`err` re-addressed to where its key's value came from: a value given with `--set`
    (or read from a base file) is named as such, not as the recipe file's. Unchanged when
    the key has no recorded origin or the error names another file (a data file, a cluster)."""
    origins = (
        recipe_or_origins if isinstance(recipe_or_origins, dict) else recipe_or_origins.origins
    )
    where = origin_of(err.key, origins)
    if err.key and not (where or "").startswith("--set"):
        # A cross-key check names one key, but the value that broke it may be another one of
        # the same section given with --set and named in the message (`--set parallel.tp=3`
        # -> "parallel.dp_shard: ... x tp x ... does not divide ...").
        section = err.key.split(".")[0]
        for k, src in origins.items():
            leaf = k.rsplit(".", 1)[-1]
            if (
                src.startswith("--set")
                and k.split(".")[0] == section
                and k != err.key
                and re.search(rf"(?<![\w]){re.escape(leaf)}(?![\w])", err.detail)
            ):
                where = src
                break
    source = recipe_or_origins.source if isinstance(recipe_or_origins, Recipe) else None
    if where is None or where == err.file or (source is not None and err.file != source):
        return err
    return ConfigError(err.detail, file=where, key=err.key)


@contextlib.contextmanager
def blamed(recipe: Recipe) -> Iterator[None]:
    """Re-address a ConfigError raised inside to where its value came from (`blame`)."""
    try:
        yield
    except ConfigError as e:
        raise blame(e, recipe) from None


def load_recipe(path: str | Path | None = None, overrides: Sequence[str] = ()) -> Recipe:
    """Load, merge bases, apply overrides and check every key and type."""
    if path:
        check_text(str(path), key="--recipe", what="a recipe path or name")
    path = resolve_recipe_path(path)
    origins: dict[str, str] = {}
    data = load_recipe_dict(path, overrides, origins)
    try:
        recipe = build_dataclass(Recipe, data, file=str(path), prefix="")
    except ConfigError as e:
        # An override's key is named with --set; a base file's key with that file.
        raise blame(e, origins) from None
    recipe.source = str(path)
    recipe.origins = origins
    with blamed(recipe):
        check_limits(recipe)
    return recipe


def recipe_degrees(recipe: Recipe, world_size: int | None = None) -> Layout:
    """The recipe's degrees resolved for `world_size`, without the model checks (cheap: no
    torchtitan import). `world_size` defaults to the declared `parallel.world_size`, else the
    product of the fixed degrees (dp_shard -1 counts as 1). With `auto`, the planner chooses
    later: dp_shard takes the whole world here."""
    f = recipe.source
    par = recipe.parallel
    if par.world_size and world_size is not None and world_size != par.world_size:
        raise ConfigError(
            f"the recipe declares {par.world_size} processes but the launch has {world_size} "
            "(fix the launcher's process count, or the recipe)",
            file=f,
            key="parallel.world_size",
        )
    if world_size is None:
        world_size = par.world_size or (
            par.dp_replicate * max(par.dp_shard, 1) * par.cp * par.tp * par.pp
        )
    if par.auto:
        return Layout(dp_shard=world_size)
    resolved = resolve_layout(
        world_size=world_size,
        dp_replicate=par.dp_replicate,
        dp_shard=par.dp_shard,
        cp=par.cp,
        tp=par.tp,
        pp=par.pp,
    )
    if isinstance(resolved, str):
        raise ConfigError(resolved, file=f, key="parallel.dp_shard")
    return resolved


def check_recipe(
    recipe: Recipe, world_size: int | None = None, *, replica_group: bool = False
) -> Layout:
    """Cross-section checks. Returns the resolved layout for `world_size` (see
    `recipe_degrees`). Raises ConfigError naming the key. `replica_group`: `world_size` is
    one torchft replica group's (`replica_group_recipe`), not the job's."""
    f = recipe.source
    tr = recipe.training
    check_model_fields(recipe)
    layout = recipe_degrees(recipe, world_size)
    from recipe.model_checks import check_loss_chunks

    if not recipe.parallel.auto:
        check_layout(recipe, layout)
        check_loss_chunks(recipe, layout.tp, layout.cp)
    else:  # the planner's tp/cp are not known yet: the layout-free part
        check_loss_chunks(recipe)
    gbs = tr.global_batch_size
    if gbs != -1 and gbs % (tr.local_batch_size * layout.dp):
        raise ConfigError(
            f"{gbs} is not a multiple of local_batch_size x data-parallel size = "
            f"{tr.local_batch_size} x {layout.dp}",
            file=f,
            key="training.global_batch_size",
        )
    if not recipe.parallel.auto:
        check_graph_options(recipe, layout)
    check_fault_tolerance(recipe, layout, replica_group=replica_group)
    return layout


def replica_groups(recipe: Recipe) -> int:
    """torchft replica groups of the recipe: fault_tolerance.replica_groups, else
    parallel.dp_replicate (1 when fault tolerance is off)."""
    ft = recipe.fault_tolerance
    if not ft.enabled:
        return 1
    return ft.replica_groups or recipe.parallel.dp_replicate


def replica_group_recipe(recipe: Recipe) -> Recipe:
    """The recipe one torchft replica group trains (one torchrun): one HSDP replica of the
    model (`dp_replicate` 1, FSDP over the group's ranks), the group count made explicit;
    the groups are torchft's, not the mesh's. train.py checks it against the group's world
    size; tools.launch against a group's share of the nodes."""
    return replace(
        recipe,
        parallel=replace(recipe.parallel, dp_replicate=1),
        fault_tolerance=replace(recipe.fault_tolerance, replica_groups=replica_groups(recipe)),
    )


def check_trainable_fault_tolerance(recipe: Recipe) -> None:
    """train.py and tools.launch: the [fault_tolerance] runs that are built and tested
    (pretraining with FSDP inside each replica group, every step synchronous); the rest
    validates and tools.predict prices it, but is refused, naming the key, rather than run
    unverified (docs/fault_tolerance.md, Status)."""
    ft = recipe.fault_tolerance
    if not ft.enabled:
        return
    par = recipe.parallel
    refused = [
        (par.pp > 1, "parallel.pp", "pipeline parallelism"),
        (par.tp > 1, "parallel.tp", "tensor parallelism"),
        (par.cp > 1, "parallel.cp", "context parallelism"),
        (par.ep > 1, "parallel.ep", "expert parallelism"),
        (par.auto, "parallel.auto", "a planned layout"),
        (recipe.finetune.mode != "off", "finetune.mode", "fine-tuning"),
        (ft.semi_sync != "off", "fault_tolerance.semi_sync", "semi-synchronous training"),
    ]
    for bad, key, what in refused:
        if bad:
            raise ConfigError(
                f"fault tolerance is built for FSDP-only pretraining with every step "
                f"synchronous; {what} under torchft replica groups is not (docs/"
                "fault_tolerance.md, Status)",
                file=recipe.source,
                key=key,
            )


def check_fault_tolerance(recipe: Recipe, layout: Layout, *, replica_group: bool = False) -> None:
    """[fault_tolerance] against the layout: at least two replica groups, each an equal
    share of the world (a group is one HSDP replica), and the loops it is built for. With
    `replica_group` the layout is one group's: its world is a share already."""
    ft = recipe.fault_tolerance
    if not ft.enabled:
        return
    f = recipe.source
    groups = replica_groups(recipe)
    if groups < 2:
        raise ConfigError(
            f"fault tolerance needs at least 2 replica groups, got {groups} (set "
            "fault_tolerance.replica_groups or parallel.dp_replicate)",
            file=f,
            key="fault_tolerance.replica_groups",
        )
    if recipe.parallel.dp_replicate not in (1, groups):
        raise ConfigError(
            f"replica_groups = {groups} but parallel.dp_replicate = "
            f"{recipe.parallel.dp_replicate}: each replica group is one HSDP replica (set them "
            "equal, or dp_replicate = 1)",
            file=f,
            key="fault_tolerance.replica_groups",
        )
    world = layout.world_size
    if world % groups and not replica_group:
        raise ConfigError(
            f"{groups} replica groups do not split {world} processes evenly",
            file=f,
            key="fault_tolerance.replica_groups",
        )
    if ft.min_replicas > groups:
        raise ConfigError(
            f"min_replicas {ft.min_replicas} exceeds the {groups} replica groups",
            file=f,
            key="fault_tolerance.min_replicas",
        )
    if recipe.rl.enabled or recipe.adapters:
        raise ConfigError(
            "fault tolerance covers pretraining and SFT; RL and [[adapters]] jobs restart whole",
            file=f,
            key="fault_tolerance.enabled",
        )


def check_model_fields(recipe: Recipe) -> None:
    """The checks that need no degrees and no world size (the model, fine-tuning): the first
    of check_recipe's, and what the planner checks before its search (parallel.job_checks)."""
    f = recipe.source
    n_layers = model_shape(recipe.model.flavor, recipe.model.family).n_layers
    if recipe.model.layers > n_layers:
        raise ConfigError(
            f"{recipe.model.flavor} has {n_layers} layers; cannot keep {recipe.model.layers}",
            file=f,
            key="model.layers",
        )
    check_finetune(recipe)
    if recipe.model.vocab_size and recipe.model.vocab_size < 260:
        raise ConfigError(
            "a byte-level tokenizer needs at least 260 entries (256 bytes + specials)",
            file=f,
            key="model.vocab_size",
        )
    from recipe.model_checks import check_model  # imports this module

    check_model(recipe)


def check_graph_options(recipe: Recipe, layout: Layout) -> None:
    """`parallel.async_tp` and `training.cuda_graphs` against the concrete degrees (the same
    conditions torchtitan asserts later, as one line naming the key)."""
    f = recipe.source
    if recipe.parallel.async_tp:
        if not recipe.training.compile:
            raise ConfigError(
                "async TP needs training.compile = true (torchtitan enables it through "
                "inductor's micro-pipeline TP pass)",
                file=f,
                key="parallel.async_tp",
            )
        if layout.tp < 2:
            raise ConfigError(
                f"async TP needs tensor parallelism (tp > 1); this layout has tp = {layout.tp}",
                file=f,
                key="parallel.async_tp",
            )
    if recipe.training.cuda_graphs == "on" and layout.pp > 1:
        raise ConfigError(
            f"CUDA graphs cannot capture pipeline parallelism (pp = {layout.pp}) in torchtitan "
            '0.3.0; use cuda_graphs = "auto" or "off"',
            file=f,
            key="training.cuda_graphs",
        )


def uses_cuda_graphs(recipe: Recipe, pp: int, attention: str = "flex") -> bool:
    """Whether `training.cuda_graphs` turns capture on for this layout and attention backend
    (torchtitan captures only on CUDA; on CPU it warns and runs eager). "auto" leaves it off
    under expert parallelism: torchtitan refuses graphs with its all-to-all token dispatcher
    (the dispatch sizes are read back to the host every step)."""
    mode = recipe.training.cuda_graphs
    if mode == "off" or pp > 1:
        return False
    if mode == "auto" and recipe.parallel.ep > 1:
        return False
    return mode == "on" or attention != "varlen"


# First-step deadline when job.init_timeout_s = 0 (see docs/reliability.md, section 4).
INIT_TIMEOUT_EAGER_S = 300
INIT_TIMEOUT_COMPILED_S = 1800


def first_step_timeout_s(recipe: Recipe) -> int:
    """Seconds allowed for process-group setup and the first step (watchdog and torchtitan's
    comm.init_timeout_seconds): the recipe's value, or the automatic one for its compile."""
    if recipe.job.init_timeout_s:
        return recipe.job.init_timeout_s
    return INIT_TIMEOUT_COMPILED_S if recipe.training.compile else INIT_TIMEOUT_EAGER_S


def check_finetune(recipe: Recipe) -> None:
    """[data] format / [finetune] / [[adapters]] consistency."""
    f = recipe.source
    if recipe.data.format == "sft" and recipe.data.sources:
        # SFT records are rendered and masked by data.chat on the streaming path; the mix
        # reads token rows (stores), which carry no chat rendering. Refused here, before any
        # process group (the loader would otherwise fail after it, on "no usable documents").
        raise ConfigError(
            "format 'sft' reads one JSON Lines data.source; [[data.sources]] mixes are not "
            "supported for sft (concatenate the files, or use [[adapters]] per dataset)",
            file=f,
            key="data.sources",
        )
    if recipe.data.format == "sft" and recipe.data.packing == "concat":
        raise ConfigError(
            "sft examples must not be split across rows: use packing 'bfd' (or 'none')",
            file=f,
            key="data.packing",
        )
    if recipe.training.microbatch_tokens and not (recipe.rl.enabled or recipe.adapters):
        # torchtitan's Trainer microbatches by local_batch_size (runtime.steps for the rest).
        raise ConfigError(
            "only post-training loops (rl, [[adapters]], the service) split batches by a "
            "token budget; this job trains local_batch_size rows per microbatch",
            file=f,
            key="training.microbatch_tokens",
        )
    if recipe.adapters:
        if recipe.finetune.mode != "lora":
            raise ConfigError(
                f"[[adapters]] need finetune.mode = 'lora', got {recipe.finetune.mode!r}",
                file=f,
                key="finetune.mode",
            )
        names = [a.name for a in recipe.adapters]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ConfigError(f"adapter names must be unique: {dup}", file=f, key="adapters")
        check_adapter_layout(recipe, recipe.parallel)


def check_adapter_layout(recipe: Recipe, degrees: Any) -> None:
    """[[adapters]] run data parallel only (posttrain.adapters: the base FSDP-sharded, the
    adapters replicated and swapped per turn, which TP/PP/CP sharding would not allow).
    `degrees`: anything with pp/tp/cp (the recipe's [parallel], or the planner's layout)."""
    for axis in ("pp", "tp", "cp"):
        degree = getattr(degrees, axis)
        if degree != 1:
            raise ConfigError(
                f"[[adapters]] run data parallel only; {axis} = {degree} is not supported, "
                "set it to 1",
                file=recipe.source,
                key=f"parallel.{axis}",
            )


def effective_shape(recipe: Recipe) -> ModelShape:
    """The flavor's shape with the recipe's `model.layers` / `model.vocab_size` applied."""
    shape = model_shape(recipe.model.flavor, recipe.model.family)
    return replace(
        shape,
        n_layers=recipe.model.layers or shape.n_layers,
        vocab_size=recipe.model.vocab_size or shape.vocab_size,
    )


def check_layout(recipe: Recipe, layout: Layout) -> None:
    """Checks that depend on concrete degrees (also used by the planner's candidates)."""
    f = recipe.source
    tr = recipe.training
    par = recipe.parallel
    shape = effective_shape(recipe)
    from recipe.model_checks import check_expert_parallel  # imports this module

    check_expert_parallel(recipe, layout)
    if shape.n_heads % layout.tp or shape.n_kv_heads % layout.tp:
        raise ConfigError(
            f"tp={layout.tp} must divide the attention heads ({shape.n_heads} query, "
            f"{shape.n_kv_heads} key/value) of {shape.flavor}",
            file=f,
            key="parallel.tp",
        )
    seq_div = (layout.tp if layout.tp > 1 else 1) * (2 * layout.cp if layout.cp > 1 else 1)
    if tr.seq_len % seq_div:
        raise ConfigError(
            f"seq_len {tr.seq_len} must be divisible by {seq_div} (tp for sequence parallel "
            "x 2 x cp for load-balanced context parallel)",
            file=f,
            key="training.seq_len",
        )
    v = par.pp_stages_per_rank
    if v and layout.pp > 1:
        single = par.pp_schedule in ("GPipe", "1F1B")
        v_shaped = par.pp_schedule in ("ZBVZeroBubble", "DualPipeV")
        if (single and v != 1) or (v_shaped and v != 2) or (not single and v < 2):
            need = "1" if single else ("2" if v_shaped else "at least 2")
            raise ConfigError(
                f"{par.pp_schedule} runs {need} stage(s) per rank, got {v}",
                file=f,
                key="parallel.pp_stages_per_rank",
            )
    if layout.pp > 1:
        stages = layout.pp * stages_per_rank(par.pp_schedule, v)
        if pp_layer_weights(shape.n_layers, stages) is None:
            raise ConfigError(
                f"{shape.n_layers} layers of {shape.flavor} do not split evenly over {stages} "
                f"pipeline stages (pp={layout.pp}, {par.pp_schedule} puts "
                f"{stages_per_rank(par.pp_schedule, v)} on each rank)",
                file=f,
                key="parallel.pp_stages_per_rank" if v else "parallel.pp",
            )
        mbs = par.pp_microbatches or tr.local_batch_size
        if tr.local_batch_size % mbs:
            raise ConfigError(
                f"{mbs} microbatches do not divide local_batch_size {tr.local_batch_size}",
                file=f,
                key="parallel.pp_microbatches",
            )
        if mbs < layout.pp and par.pp_schedule not in ("GPipe",):
            raise ConfigError(
                f"{mbs} microbatches are fewer than pp={layout.pp} stages; the "
                f"{par.pp_schedule} schedule needs at least one per stage",
                file=f,
                key="parallel.pp_microbatches",
            )
    elif par.pp_microbatches > 1:
        raise ConfigError(
            "microbatches only apply with pp > 1 (use training.global_batch_size for "
            "gradient accumulation)",
            file=f,
            key="parallel.pp_microbatches",
        )
