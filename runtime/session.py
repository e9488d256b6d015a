"""One training job, in two phases: `prepare` (no process group) and `run`.

`prepare` does every check that can fail on user input or the environment (recipe keys and
values, world size, output folder, tokenizer, data source, kernel capabilities) and builds
torchtitan's Trainer.Config, so a typo costs seconds, not a queue wait and a crash an hour in.
`run` starts the process group (inside torchtitan's Trainer), trains and closes.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchtitan.trainer import Trainer

from core.axes import Layout
from core.errors import ConfigError
from core.launch_env import (
    check_visible_devices,
    fill_single_process,
    launch_env,
    require_launch_vars,
)
from core.models import model_shape
from parallel.cluster import Cluster, load_cluster
from parallel.memory import posttrain_load
from parallel.planner import apply_plan, best_plan
from recipe.loader import (
    blamed,
    check_recipe,
    check_trainable_fault_tolerance,
    effective_shape,
    load_recipe,
    replica_group_recipe,
    replica_groups,
)
from recipe.schema import Recipe
from runtime import faults
from runtime.budget import choose_microbatch_tokens
from runtime.build import KernelChoice, build_trainer_config, choose_kernels
from runtime.platform import BRIDGED, Platform, check_pipeline_step

# Below this much free space in the output folder a checkpoint write is likely to fail
# half-way; refuse to start instead.
MIN_FREE_BYTES = 256 * 2**20


@dataclass
class Job:
    recipe: Recipe
    layout: Layout
    platform: Platform
    kernels: KernelChoice
    tokenizer_path: str
    config: Trainer.Config
    world_size: int
    cluster: Cluster | None = None  # sized to this launch; its fabric feeds the startup check
    plan: str | None = None  # the planner's choice, when parallel.auto
    microbatch_tokens: int = 0  # RL / [[adapters]]: the token budget (runtime.steps)


def _launch_env() -> int:
    """World size from torchrun's environment (checked: `core.launch_env`, one line and exit 2
    on a malformed variable); a plain `python train.py` is a 1-process job."""
    env = launch_env()
    fill_single_process(os.environ)
    return env.world_size


# A full checkpoint holds fp32 parameters and AdamW's two fp32 moments: 12 bytes/parameter.
CHECKPOINT_BYTES_PER_PARAM = 12


def _probe_writable(folder: Path, *, file: str, key: str) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".write-probe-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except (OSError, ValueError) as e:  # ValueError: a NUL byte in the path
        why = getattr(e, "strerror", None) or str(e)
        raise ConfigError(f"folder {folder} is not writable: {why}", file=file, key=key) from None


def checkpoint_bytes(recipe: Recipe) -> int:
    """Estimated size of one full checkpoint (all ranks together)."""
    return effective_shape(recipe).total_params * CHECKPOINT_BYTES_PER_PARAM  # a slice: its layers


def check_environment(recipe: Recipe) -> None:
    """Output (and checkpoint) folders writable with room for a checkpoint; checkpoints not
    silently reused; the checkpoint to start from present and intact."""
    f = recipe.source
    out = Path(recipe.output_dir)
    _probe_writable(out, file=f, key="job.output_dir")
    need, what = MIN_FREE_BYTES, "metrics"
    where, key = out, "job.output_dir"
    # runtime.build enables checkpointing (a save at the last step at least) for either.
    if recipe.checkpoint.enabled:
        where = Path(recipe.checkpoint_dir)
        key = "checkpoint.folder" if recipe.checkpoint.folder else "job.output_dir"
        _probe_writable(where, file=f, key=key)
        # One checkpoint is written in full before the oldest is pruned.
        need += checkpoint_bytes(recipe)
        what = f"metrics and one {checkpoint_bytes(recipe) / 2**30:.1f} GiB checkpoint"
        if recipe.checkpoint.export_hf:
            # The export's weights (2 or 4 bytes/parameter); assumed on the same disk.
            per_param = 2 if recipe.checkpoint.export_dtype == "bfloat16" else 4
            export = model_shape(recipe.model.flavor, recipe.model.family).total_params
            need += export * per_param
            what += f" and a {export * per_param / 2**30:.1f} GiB Hugging Face export"
    free = shutil.disk_usage(where).free
    if free < need:
        raise ConfigError(
            f"only {free / 2**30:.2f} GiB free under {where}; need at least "
            f"{need / 2**30:.2f} GiB for {what} (the disk would fill mid-run)",
            file=f,
            key=key,
        )
    # [[adapters]] checkpoint each adapter under <output_dir>/adapters/<name>.
    folders = [Path(recipe.checkpoint_dir)]
    folders += [Path(recipe.output_dir) / "adapters" / a.name for a in recipe.adapters]
    for ckpt in folders:
        if not recipe.checkpoint.resume and ckpt.is_dir() and any(ckpt.glob("step-*")):
            raise ConfigError(
                f"{ckpt} holds checkpoints but resume = false; move them away or set resume = "
                "true (refusing to overwrite them)",
                file=f,
                key="checkpoint.resume",
            )
    if recipe.checkpoint.export_hf:
        _probe_writable(Path(recipe.export_dir), file=f, key="checkpoint.export_folder")
        from runtime.hf import (
            check_export_target,
            check_scratch_export,
            export_run_id,
            export_steps,
        )

        ck = recipe.checkpoint
        from recipe.loader import effective_shape

        check_scratch_export(
            recipe.model.family,
            export=True,
            load_hf=ck.load_hf,
            file=f,
            moe_bias=effective_shape(recipe).is_moe and recipe.moe.load_balance != "none",
        )
        steps = export_steps(recipe.training.steps, ck.interval, ck.export_hf_every_checkpoint)
        check_export_target(recipe.export_dir, steps, export_run_id(recipe.checkpoint_dir), file=f)
    if recipe.checkpoint.load_hf:
        from recipe.loader import effective_shape
        from runtime.hf import check_load_hf

        check_load_hf(recipe.checkpoint.load_hf, effective_shape(recipe), file=f)
    if recipe.checkpoint.load_from:
        from runtime.checkpoint import not_a_checkpoint, verify_checkpoint

        why = not_a_checkpoint(recipe.checkpoint.load_from)
        if why:
            raise ConfigError(why, file=f, key="checkpoint.load_from")

        # Sizes and metadata only (cheap); the checksums are checked when it is loaded.
        problems = verify_checkpoint(recipe.checkpoint.load_from, checksums=False)
        if problems:
            raise ConfigError(
                f"checkpoint {recipe.checkpoint.load_from} is damaged: " + "; ".join(problems),
                file=f,
                key="checkpoint.load_from",
            )


def check_checkpoint_fit(recipe: Recipe, config: Trainer.Config) -> None:
    """The checkpoint this run will load holds exactly the model's tensors (and, on a
    resume, optimizer state for exactly the trained parameters): the newest intact one of
    checkpoint.folder, else checkpoint.load_from. A partial load is refused, never silent;
    every checkpoint damaged is refused too (never a silent start from step 0). The same
    check runs again in the checkpointer, on the live model, before each load."""
    if not recipe.checkpoint.enabled:
        return
    from runtime.checkpoint import committed_steps, no_loadable_message, verify_checkpoint
    from runtime.checkpoint_fit import check_fits, expected_from_config

    f = recipe.source
    folder = recipe.checkpoint_dir
    path, key, model_only = "", "", True
    damaged: dict[int, str] = {}
    for s in reversed(committed_steps(folder)):
        p = os.path.join(folder, f"step-{s}")
        problems = verify_checkpoint(p, checksums=False)  # cheap; checksums come at load
        if not problems:
            path, key, model_only = p, "checkpoint.folder", s == 0
            break
        damaged[s] = "; ".join(problems)
    if not path and damaged:
        raise ConfigError(no_loadable_message(folder, damaged), file=f, key="checkpoint.folder")
    if not path and recipe.checkpoint.load_hf:  # this run starts from the HF folder
        from runtime.hf import hf_expected, verify_hf_folder

        env = launch_env()  # each rank scans its share of the values
        verify_hf_folder(recipe.checkpoint.load_hf, hf_expected(config.model_spec), file=f,
                         rank=env.rank, world=env.world_size)  # fmt: skip
    if not path and recipe.checkpoint.load_from:
        path, key = recipe.checkpoint.load_from, "checkpoint.load_from"  # verified above
    if not path:
        return
    assert config.model_spec is not None
    problem = check_fits(path, expected_from_config(config.model_spec.model), model_only=model_only)
    if problem:
        m = recipe.model
        model = f"{m.family} {m.flavor}" + (f", model.layers = {m.layers}" if m.layers else "")
        raise ConfigError(f"{path} does not fit the model ({model}): {problem}", file=f, key=key)


def check_tokenizer(path: str, recipe: Recipe) -> None:
    """The tokenizer folder's tokenizer.json parses (JSON; nothing executable is loaded)."""
    tj = Path(path) / "tokenizer.json"
    if not tj.exists():
        return  # vocab.json + merges.txt: torchtitan reads them as plain text/JSON
    try:
        from tokenizers import Tokenizer

        Tokenizer.from_file(str(tj))
    except Exception as e:
        raise ConfigError(
            f"{tj} is not a valid tokenizer: {str(e).splitlines()[0][:200]}",
            file=recipe.source,
            key="model.tokenizer",
        ) from None


def check_wandb(recipe: Recipe) -> None:
    """W&B importable (torchtitan would log an error and train without it)."""
    if not recipe.metrics.wandb:
        return
    import importlib.util

    if importlib.util.find_spec("wandb") is None:
        raise ConfigError(
            "the wandb package is not installed (pip install wandb, or metrics.wandb = false)",
            file=recipe.source,
            key="metrics.wandb",
        )


def check_data_source(recipe: Recipe) -> None:
    """The data source(s) exist and are readable in kind (no data read, no process group);
    mixing weights give every source a row per window."""
    from data.sources import check_records, check_source

    d = recipe.data
    sft = d.format == "sft"
    _check_sft_not_store(recipe)  # before the record scan, which would misread a store

    def check(spec: str, key: str, *, chats: bool, text_field: str = "text") -> None:
        # Kind first (exists, a file or folder of one kind), then one usable record: an
        # empty or all-bad source stops here, not after the device mesh exists.
        check_source(spec, file=recipe.source, key=key)
        check_records(spec, text_field=text_field, sft=chats, file=recipe.source, key=key)

    if d.eval_source:
        check(d.eval_source, "data.eval_source", chats=True)
    for i, a in enumerate(recipe.adapters):
        check(a.source, f"adapters[{i}].source", chats=True)
        if a.eval_source:
            check(a.eval_source, f"adapters[{i}].eval_source", chats=True)
    if recipe.validation.enable and recipe.validation.source:
        check(
            recipe.validation.source,
            "validation.source",
            chats=sft,
            text_field=recipe.validation.text_field,
        )
    if not d.sources:
        check(d.source, "data.source", chats=sft, text_field=d.text_field)
        return
    # An sft mix never reaches here: check_recipe (recipe.loader.check_finetune) refused it.
    from data.store_stream import mix_counts

    for i, e in enumerate(d.sources):
        check(e.source, f"data.sources[{i}].source", chats=False, text_field=e.text_field)
    try:
        mix_counts([e.weight for e in d.sources], d.mix_window)
    except ValueError as e:
        raise ConfigError(str(e), file=recipe.source, key="data.mix_window") from None


def check_sft_renders(recipe: Recipe, tokenizer_path: str) -> None:
    """SFT: each chat source holds an example that renders within seq_len + 1 tokens (or is
    cut to it with data.truncate): a file of only too-long examples stops here, not after
    the device mesh exists. Reads until the first such example (data.sources.SCAN_BYTES)."""
    from data.chat import make_renderer
    from data.sources import SCAN_BYTES, local_files, scan_lines

    specs = [("data.source", recipe.data.source)] if recipe.data.format == "sft" else []
    specs += [(f"adapters[{i}].source", a.source) for i, a in enumerate(recipe.adapters)]
    if not specs:
        return
    renderer = make_renderer(tokenizer_path, recipe.data.chat_template)
    limit = recipe.training.seq_len + 1

    def renders(line: str) -> str | None:
        return renderer.render_line(line, max_tokens=limit, truncate=recipe.data.truncate)[2]

    for key, spec in specs:
        if not Path(spec).exists():
            continue
        _kind, files = local_files(Path(spec), file=recipe.source, key=key)
        bad: dict[str, int] = {}
        if scan_lines(files, renders, bad, [SCAN_BYTES]):
            continue
        found = ", ".join(f"{k} {v}" for k, v in sorted(bad.items())) or "no records"
        hint = " (raise training.seq_len or set data.truncate = true)" if "too_long" in bad else ""
        raise ConfigError(
            f"{spec} holds no example that renders within seq_len + 1 = {limit} tokens "
            f"({found}){hint}",
            file=recipe.source,
            key=key,
        )


def _check_sft_not_store(recipe: Recipe) -> None:
    """SFT records (data.format = 'sft', every [[adapters]] source) are JSON Lines rendered
    by data.chat; a prepared token store holds plain token rows without the chat masks."""
    from data.store import is_store

    keys = [(f"adapters[{i}].source", a.source) for i, a in enumerate(recipe.adapters)]
    if recipe.data.format == "sft" and not recipe.adapters:
        keys.append(("data.source", recipe.data.source))
    for key, spec in keys:
        if is_store(spec):
            raise ConfigError(
                f"{spec} is a prepared token store; sft reads JSON Lines of chats or "
                "prompt/completion pairs (point it at the .jsonl)",
                file=recipe.source,
                key=key,
            )


def check_data_tokenizer(recipe: Recipe, tokenizer_path: str) -> None:
    """A prepared store must have been tokenized with this tokenizer (one line, exit 2)."""
    from data.store import TokenStore, is_store

    specs = [e.source for e in recipe.data.sources] or [recipe.data.source]
    for spec in specs:
        if is_store(spec):
            TokenStore(spec).check_tokenizer(tokenizer_path, file=recipe.source)


def cluster_for_job(recipe: Recipe, world_size: int, platform: Platform) -> Cluster | None:
    """The recipe's cluster profile sized to this launch (None when none applies)."""
    name = recipe.parallel.cluster or ("local_cpu" if platform.is_cpu else "")
    if not name:
        return None
    cluster = load_cluster(name)
    if world_size < cluster.gpus_per_node:
        # A partial node (e.g. 2 CPU processes on local_cpu's 8 slots): one host of that size.
        return load_cluster(
            name,
            nodes=1,
            overrides=[f"gpus_per_node={world_size}", f"nvlink_domain_gpus={world_size}"],
        )
    if world_size % cluster.gpus_per_node:
        raise ConfigError(
            f"{world_size} processes are not whole nodes of {cluster.gpus_per_node} GPUs",
            file=recipe.source,
            key="parallel.cluster",
        )
    return load_cluster(name, nodes=world_size // cluster.gpus_per_node)


def apply_auto_plan(recipe: Recipe, cluster: Cluster | None) -> tuple[Recipe, str]:
    """`[parallel] auto = true`: the planner's best plan for this launch, and its summary."""
    if cluster is None:
        raise ConfigError(
            "auto planning needs a cluster profile on GPUs (e.g. hgx_h100_ib)",
            file=recipe.source,
            key="parallel.cluster",
        )
    plan = best_plan(recipe, cluster, nodes=cluster.nodes)
    planned = apply_plan(recipe, plan)
    planned.source = recipe.source
    pred = plan.prediction
    return planned, (
        f"planner ({cluster.name}, {cluster.world_size} GPUs): {plan.describe()}, "
        f"local batch {plan.local_batch_size}; predicted {pred.tokens_per_sec_per_gpu:,.0f} "
        "tokens/s/GPU"
    )


def prepare(recipe_path: str | None, overrides: list[str]) -> Job:
    """Everything up to (not including) the process group. Raises ConfigError on bad input,
    naming where the offending value came from (the file, a base file or `--set`)."""
    recipe = load_recipe(recipe_path, overrides)
    with blamed(recipe):
        return _prepare(recipe)


def _prepare(recipe: Recipe) -> Job:
    world_size = _launch_env()
    platform = Platform.detect()
    if not platform.is_cpu:
        import torch

        check_visible_devices(launch_env(), torch.cuda.device_count())
    cluster = cluster_for_job(recipe, world_size, platform)
    plan = None
    if recipe.parallel.auto:
        recipe, plan = apply_auto_plan(recipe, cluster)
    check_trainable_fault_tolerance(recipe)
    ft_group = None
    if recipe.fault_tolerance.enabled:
        from runtime import fault_tolerance as rft

        # One torchrun is one replica group: its layout is one HSDP replica.
        ft_group = rft.replica_id(os.environ, replica_groups(recipe))
        recipe = replica_group_recipe(recipe)
        rft.torchft_env(recipe, os.environ)
    layout = check_recipe(recipe, world_size, replica_group=ft_group is not None)
    check_pipeline_step(layout.pp)
    if recipe.parallel.async_tp and platform.is_cpu and layout.tp > 1:
        raise ConfigError(
            "async TP needs CUDA (symmetric-memory collectives); this machine has no GPU",
            file=recipe.source,
            key="parallel.async_tp",
        )
    if recipe.profiling.memory_snapshot and platform.is_cpu:
        raise ConfigError(
            "memory snapshots record the CUDA caching allocator; this run is on CPU",
            file=recipe.source,
            key="profiling.memory_snapshot",
        )
    if recipe.checkpoint.async_mode == "async_with_pinned_mem" and platform.is_cpu:
        raise ConfigError(
            "async_with_pinned_mem stages to pinned host memory from a GPU; use 'async' on CPU",
            file=recipe.source,
            key="checkpoint.async_mode",
        )
    kernels = choose_kernels(recipe, platform, layout)
    check_posttrain_keys(recipe, layout)
    if platform.is_cpu:
        from recipe.model_checks import check_dense_attention_memory, check_host_memory

        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        check_host_memory(recipe, ram)
        if kernels.attention == "dense":
            check_dense_attention_memory(recipe, ram, layout.tp)
    check_environment(recipe)
    check_data_source(recipe)
    from data.tokenizer import resolve_tokenizer, tokenizer_id_count
    from recipe.model_checks import check_vocab

    vocab = (
        recipe.model.vocab_size or model_shape(recipe.model.flavor, recipe.model.family).vocab_size
    )
    tokenizer_path = resolve_tokenizer(
        recipe.model.tokenizer, vocab_size=vocab, recipe_file=recipe.source
    )
    check_tokenizer(tokenizer_path, recipe)
    ids = tokenizer_id_count(tokenizer_path)
    if ids is not None:
        check_vocab(recipe, ids, tokenizer_path)
    check_data_tokenizer(recipe, tokenizer_path)
    check_sft_renders(recipe, tokenizer_path)
    faults.check()
    check_wandb(recipe)
    config = build_trainer_config(
        recipe, layout, platform=platform, kernels=kernels, tokenizer_path=tokenizer_path
    )
    if ft_group is not None:
        config = rft.as_fault_tolerant(config, recipe, ft_group)
        config.dump_folder = rft.group_dump_folder(recipe.output_dir, ft_group)
    check_checkpoint_fit(recipe, config)
    # RL / [[adapters]]: the token budget, or one line saying what the job needs (memory).
    tokens = choose_microbatch_tokens(recipe, layout, platform) if posttrain_load(recipe) else 0
    require_launch_vars()
    return Job(recipe, layout, platform, kernels, tokenizer_path, config, world_size, cluster,
               plan, tokens)  # fmt: skip


def run(job: Job, trainer_cls: type | None = None, **trainer_kwargs: Any) -> dict[str, Any] | None:
    """Train; returns the steady-state summary on the metrics rank (None elsewhere).
    `trainer_cls`: a TitanscaleTrainer subclass (post-training passes its own)."""
    import torch
    from torchtitan.tools.logging import logger

    from runtime.trainer import TitanscaleTrainer

    job.platform.apply()
    if BRIDGED:
        logger.info(
            f"torch {torch.__version__}: bridged {', '.join(BRIDGED)} (runtime.platform); "
            f"spmd backend {job.config.parallelism.spmd_backend}"
        )
    if job.plan:
        logger.info(job.plan)
    for line in job.kernels.log_lines():
        logger.info(line)
    logger.info(
        f"titanscale: {job.recipe.source} | {job.recipe.model.family} "
        f"{job.recipe.model.flavor} | "
        f"{job.layout.describe()} (world {job.world_size}) | device {job.platform.device_name}"
        f" | attention {job.kernels.attention} | linear {job.kernels.linear}"
        f"{' (emulated)' if job.kernels.emulated else ''} ({job.kernels.precision})"
    )
    fabric = job.cluster.fabric() if job.cluster else None
    if trainer_cls is None and job.recipe.fault_tolerance.enabled:
        from runtime import fault_tolerance as rft

        trainer_cls = rft.trainer_class()
        rid = rft.replica_id(os.environ, replica_groups(job.recipe))
        trainer_kwargs["ft"] = rft.fault_tolerance_config(job.recipe, rid, cpu=job.platform.is_cpu)
    trainer = (trainer_cls or TitanscaleTrainer)(job.config, fabric=fabric, **trainer_kwargs)
    try:
        trainer.train()
    finally:
        trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return trainer.summary


def create_seed_checkpoint(job: Job, folder: str) -> str:
    """Save freshly initialised weights (one process, unsharded) to `folder`/step-0.

    Every layout that loads this seed starts from bit-identical weights, which is what makes
    losses comparable across layouts (torchtitan's seed-checkpoint mechanism).
    """
    import torch

    from runtime.trainer import TitanscaleTrainer

    if job.world_size != 1:
        raise ConfigError("a seed checkpoint is written by one process", key="WORLD_SIZE")
    job.platform.apply()
    cfg = job.config
    cfg.checkpoint.enable = True
    cfg.checkpoint.create_seed_checkpoint = True
    cfg.checkpoint.folder = os.path.abspath(folder)
    cfg.checkpoint.initial_load_path = None
    cfg.checkpoint.initial_load_in_hf = False
    trainer = TitanscaleTrainer(cfg)
    try:
        trainer.checkpointer.save(curr_step=0, last_step=True)
    finally:
        trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return os.path.join(os.path.abspath(folder), "step-0")


def check_posttrain_keys(recipe: Any, layout: Any) -> None:
    """Keys a job's path cannot honour: one line each, never ignored. RL trains
    prompts_per_step x group_size rollouts per rank per update (local_batch_size is its
    microbatch's row limit); an adapter steps on its local_batch_size rows per process."""
    path = "rl" if recipe.rl.enabled else "[[adapters]]"
    f = recipe.source
    if not recipe.rl.enabled and not recipe.adapters:
        return  # (training.microbatch_tokens there: recipe.loader.check_finetune)
    if recipe.validation.enable:
        raise ConfigError(
            f"{path} has no validator (torchtitan's runs in the pretraining/SFT Trainer); "
            "held-out scores come from eval_source / rl.eval_prompts; set "
            "validation.enable = false",
            file=f,
            key="validation.enable",
        )
    dp = layout.dp if layout is not None else 1
    # [[adapters]]: local_batch_size rows per process and step, no accumulation.
    gbs, ok = recipe.training.global_batch_size, recipe.training.local_batch_size * dp
    if recipe.rl.enabled:
        if recipe.finetune.mode != "off" or recipe.adapters:
            raise ConfigError(
                "rl trains the full policy (its generator takes full weights); set "
                "finetune.mode = 'off' and no [[adapters]]",
                file=f,
                key="finetune.mode",
            )
        for axis in ("tp", "pp", "cp"):
            if layout is not None and getattr(layout, axis) != 1:
                # Every rank samples its own prompts: tp/cp peers would see other rows.
                raise ConfigError(
                    f"rl runs data parallel only (each rank samples and trains its own "
                    f"rollouts); {axis} = {getattr(layout, axis)} is not supported, set it to 1",
                    file=f,
                    key=f"parallel.{axis}",
                )
        ok = recipe.rl.prompts_per_step * recipe.rl.group_size * dp
    if gbs not in (-1, ok):
        raise ConfigError(
            f"{path} steps on its own batch (rl: prompts_per_step x group_size rollouts per "
            "rank, in microbatches of at most local_batch_size rows; [[adapters]]: "
            f"local_batch_size rows per process); set -1 or {ok}, got {gbs}",
            file=f,
            key="training.global_batch_size",
        )
