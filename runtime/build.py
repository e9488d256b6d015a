"""Recipe -> torchtitan `Trainer.Config`: the single translation between our contract and theirs.

Everything here is plain construction of torchtitan's own config objects (model registry,
converters, loss, optimizer, scheduler, parallelism, checkpoint, AC, compile); titanscale
adds its own components only at torchtitan's seams: the dataloader
(`data.loader.TitanscaleDataLoader`), the metrics processor (`runtime.metrics`), the
checkpoint manager (`runtime.checkpoint.AtomicCheckpointManager`) and the inner-attention
config chosen by the kernels layer. The loops that are not the Trainer's ([[adapters]], RL)
get their optimizer, LR schedule and checkpoint manager from the recipe here too
(`recipe_optimizer`, `recipe_checkpointer`), so they are built as the Trainer's are.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

from torchtitan.components.lora import LoRAConverter
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.config.configs import CommConfig, DebugConfig
from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
from torchtitan.models.common.config_utils import decoder_vocab_size
from torchtitan.protocols.model_spec import ModelSpec
from torchtitan.tools.profiler import Profiler
from torchtitan.trainer import Trainer

from core.axes import Layout
from core.models import pp_layer_weights, stages_per_rank
from data.loader import TitanscaleDataLoader
from kernels.caps import DeviceCaps, detect_features
from kernels.registry import KernelChoice, apply_kernels, check_kernels
from recipe.loader import first_step_timeout_s, uses_cuda_graphs
from recipe.schema import Recipe
from runtime.checkpoint import AtomicCheckpointManager
from runtime.loss import WeightedChunkedLoss, WeightedCrossEntropyLoss
from runtime.metrics import TitanscaleMetrics
from runtime.moe_experts import convert_experts
from runtime.moe_metrics import record_expert_load
from runtime.platform import Platform, spmd_backend
from runtime.validation import TitanscaleValidator


def choose_kernels(
    recipe: Recipe, platform: Platform, layout: Layout | None = None
) -> KernelChoice:
    """`[kernels]` resolved against this platform (kernels.registry); ConfigError (exit 2) when
    the device cannot run the requested backend. Optional kernel packages (FlashAttention 3/4)
    are probed on this machine."""
    caps = DeviceCaps(
        platform.device_type, platform.device_name, platform.compute_capability, detect_features()
    )
    choice = check_kernels(recipe, caps, cp=layout.cp if layout is not None else None)
    check_moe_precision(recipe, choice, platform)
    return choice


def check_moe_precision(recipe: Recipe, choice: KernelChoice, platform: Platform) -> None:
    """FP8/MXFP8 on a mixture-of-experts model needs a GPU: torchtitan's low-precision
    expert GEMMs (grouped float8 / MX kernels) have no CPU emulation, unlike the dense
    linears. One line naming kernels.linear (exit 2) instead of a kernel error mid-step."""
    from core.errors import ConfigError
    from recipe.loader import effective_shape

    if platform.is_cpu and choice.linear != "bf16" and effective_shape(recipe).is_moe:
        raise ConfigError(
            f"{choice.linear} on a mixture-of-experts model needs a GPU (torchtitan's "
            "low-precision grouped expert GEMMs have no CPU emulation); use bf16 on CPU",
            file=recipe.source,
            key="kernels.linear",
        )


def lora_converter(recipe: Recipe) -> LoRAConverter.Config:
    """`[lora]` as torchtitan's LoRA converter config."""
    lo = recipe.lora
    # "experts" is runtime.moe_experts' target (routed experts), not a Linear
    targets = [t for t in lo.target_modules if t != "experts"]
    return LoRAConverter.Config(rank=lo.rank, alpha=lo.alpha, target_modules=targets)


def post_train_experts(recipe: Recipe, model_config: Any, *, cpu: bool) -> Any:
    """Post-training on an MoE base (finetune or RL): torchtitan's routed experts swapped for
    runtime.moe_experts' (LoRA on them when lora.target_modules has "experts"; base frozen
    in LoRA mode; float32 experts on CPU, where the routing-replay logprob equality holds to
    1e-5, bfloat16 as torchtitan on GPU). Dense models and pretraining: unchanged."""
    if recipe.finetune.mode == "off" and not recipe.rl.enabled:
        return model_config
    lora = recipe.finetune.mode == "lora"
    rank = recipe.lora.rank if lora and "experts" in recipe.lora.target_modules else 0
    return convert_experts(
        model_config,
        rank=rank,
        alpha=recipe.lora.alpha,
        compute_dtype="param" if cpu else "bfloat16",
        freeze_base=lora,
    )


def keep_frozen(parallelize_fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a model's parallelize function so parameters frozen before it stay frozen.

    Why: torchtitan 0.3.0's spmd-types sharding (`Module._spmd_distribute_state`)
    re-registers each parameter as `nn.Parameter(tensor)`, which resets requires_grad to
    True: without this, LoRA's frozen base would train (and the optimizer would hold all of
    it). Names are stable through parallelization (FSDP2 keeps FQNs), so the frozen set is
    restored by name before the optimizer is built.

    MoE: the routers' aux-loss-free expert bias is a buffer that torchtitan's optimizer
    pre-hook moves by load_balance_coeff x sign(load imbalance) each step; under LoRA the
    router is frozen, so the coefficient is set to 0.0 after the build (the buffer stays, as
    the base checkpoint has it; the hook then adds exactly 0 and still resets the counts).
    """

    def parallelize(model: Any, *args: Any, **kwargs: Any) -> Any:
        frozen = {plain_fqn(n) for n, p in model.named_parameters() if not p.requires_grad}
        out = parallelize_fn(model, *args, **kwargs)
        for n, p in (out if out is not None else model).named_parameters():
            if plain_fqn(n) in frozen:
                p.requires_grad_(False)
        for m in (out if out is not None else model).modules():
            if getattr(m, "load_balance_coeff", None) is not None and hasattr(m, "router"):
                m.load_balance_coeff = 0.0  # the frozen router's bias does not move
        return out

    return parallelize


def fsdp_is_identity(world_size: int, training: TrainingConfig) -> bool:
    """Whether FSDP2 would change nothing but the step's cost: one process (no shard to
    gather, no gradient to reduce), parameters, compute and gradient reduction all in
    float32 (no mixed-precision cast to install: torchtitan 0.3.0 has no autocast path, FSDP
    is its only mixed-precision mechanism) and no CPU offload (FSDP's offload policy).
    Then a float32 gradient's reduce-scatter over one rank is a copy, and accumulating it
    into the sharded gradient is the same `a + b` autograd does in `.grad`."""
    return (
        world_size == 1
        and training.dtype == "float32"
        and training.mixed_precision_param == "float32"
        and training.mixed_precision_reduce == "float32"
        and not training.enable_cpu_offload
    )


def unsharded_when_alone(parallelize_fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a model's parallelize function so a run where FSDP2 is the identity
    (`fsdp_is_identity`) skips it; any other run calls `parallelize_fn` unchanged.

    Why: torchtitan's `parallelize_llama` / `parallelize_qwen3` always apply
    `apply_fsdp_to_decoder`, even at world size 1 (for its mixed-precision policy). On one
    process that is pure overhead: hooks around every block, a copy-in/copy-out of every
    gradient in the post-backward reduce, unshard waits; 20% of a full fine-tune step on CPU
    (benchmarks/peers.md). Without it the parameters stay plain tensors, and every consumer
    already takes both (DCP reshards plain <-> DTensor on load, torchtitan's
    `clip_grad_norm_`, rl.policy's weight copy, the HF export).

    What runs instead is the rest of torchtitan's own function, in its order: the
    spmd-types state distribution (`Module.parallelize`, a no-op layout at one process but it
    wraps forwards and types the tensors as torchtitan expects), activation checkpointing,
    per-block compile. That is what torchtitan's `parallelize_qwen3(skip_dp=True)` does;
    llama3's function has no such switch, so it is composed here from the same parts.
    """

    def parallelize(model: Any, **kwargs: Any) -> Any:
        # torchtitan's Trainer and pipelining_fn pass everything but the model by keyword.
        parallel_dims = kwargs["parallel_dims"]
        if not fsdp_is_identity(parallel_dims.world_size, kwargs["training"]):
            return parallelize_fn(model, **kwargs)
        from torchtitan.distributed.compile import apply_compile
        from torchtitan.distributed.full_dtensor import validate_config

        parallelism, compile_config = kwargs["parallelism"], kwargs["compile_config"]
        if parallelism.spmd_backend in ("full_dtensor", "spmd_types"):
            validate_config(parallel_dims, model)
            model.parallelize(parallel_dims)
        # (partial_dtensor: torchtitan parallelizes only for TP, CP or EP, none at world 1.)
        if kwargs["ac_config"] is not None:
            kwargs["ac_config"].build(dump_folder=kwargs["dump_folder"]).apply(model)
        if compile_config.enable and "model" in compile_config.components:
            apply_compile(model, compile_config=compile_config, parallel_dims=parallel_dims)
        return model

    return parallelize


# Module wrappers that parallelize inserts into parameter names: activation checkpointing
# (torch's checkpoint_wrapper), torch.compile, FSDP1. Comparing names without them is what
# keeps a LoRA base frozen under activation checkpointing (found by tools.dryrun: with
# `_checkpoint_wrapped_module.` in every block's names nothing matched and all 7B base
# weights of sft_llama3_8b_lora trained).
_WRAPPER_PARTS = frozenset({"_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module"})


def plain_fqn(name: str) -> str:
    """A parameter's name with module-wrapper components removed."""
    return ".".join(p for p in name.split(".") if p not in _WRAPPER_PARTS)


def model_spec(family: str, flavor: str) -> ModelSpec:
    """torchtitan's ModelSpec (config, parallelize fn, HF adapter, MoE load-balancing hook)
    for a recipe's model; the model config is core.models.model_config's (one home)."""
    import importlib

    from core.models import model_config
    from core.small_flavors import SMALL_FLAVORS
    from runtime.hf_adapters import HF_ADAPTERS

    registry = importlib.import_module(f"torchtitan.models.{family}").model_registry
    # titanscale's own flavors are not in torchtitan's registry: its debugmodel's spec
    # (parallelize fn, adapter, hooks) carries them, with their config below.
    spec = registry("debugmodel" if flavor in SMALL_FLAVORS.get(family, ()) else flavor)
    spec.flavor = flavor
    spec.model = model_config(flavor, family)
    spec.state_dict_adapter = HF_ADAPTERS.get(family, spec.state_dict_adapter)
    return spec


def configure_moe(model: Any, recipe: Recipe) -> None:
    """`[moe]` onto every MoE layer config (MTP layers included): the aux-loss-free bias
    update's speed (torchtitan's load_balance_coeff; None = no bias, no update)."""
    mo = recipe.moe
    coeff = mo.bias_update_speed if mo.load_balance == "aux_loss_free" else None
    for layer in [*model.layers, *(getattr(model, "mtp_layers", None) or ())]:
        if getattr(layer, "moe", None) is not None:
            layer.moe.load_balance_coeff = coeff


# lr_schedule -> torchtitan's decay_type; wsd's cooldown is 1 - sqrt (Hägele et al. 2024,
# "Scaling Laws and Compute-Optimal Training Beyond Fixed Training Durations").
_DECAY_TYPE = {"linear": "linear", "cosine": "cosine", "wsd": "sqrt"}
WSD_DEFAULT_DECAY_RATIO = 0.2


def lr_scheduler_config(recipe: Recipe) -> LRSchedulersContainer.Config:
    """`[training]` lr_schedule / min_lr_ratio / decay_ratio as torchtitan's scheduler config."""
    tr = recipe.training
    ratio: float | None = tr.decay_ratio
    if ratio == -1.0:
        ratio = WSD_DEFAULT_DECAY_RATIO if tr.lr_schedule == "wsd" else None
    if ratio is not None and ratio >= 1.0:
        ratio = None  # every step after warmup (torchtitan would clip 1.0 with a warning)
    return LRSchedulersContainer.Config(
        warmup_steps=tr.warmup_steps,
        decay_ratio=ratio,
        decay_type=_DECAY_TYPE[tr.lr_schedule],  # type: ignore[arg-type]
        min_lr_factor=tr.min_lr_ratio,
    )


def validator_config(recipe: Recipe) -> TitanscaleValidator.Config:
    """`[validation]` as torchtitan's validator, reading through titanscale's loader (same
    tokenizer, packing and seq_len as training; a finite pass over its source). Without its own
    source it reads the training data exactly as `[data]` describes it (subset, mix, store)."""
    v = recipe.validation
    train = dataloader_config(recipe)
    if v.source:
        loader = dataclasses.replace(
            train,
            source=v.source,
            text_field=v.text_field,
            subset="",
            split="train",
            data_files=[],
            sources=[],
            infinite=False,
            weights=False,
        )
    else:
        # Validation loss stays the plain token mean (SFT weights are a training choice).
        loader = dataclasses.replace(train, infinite=False, weights=False)
    return TitanscaleValidator.Config(
        enable=v.enable, freq=v.every, steps=v.steps, dataloader=loader
    )


def dataloader_config(recipe: Recipe) -> TitanscaleDataLoader.Config:
    """The loader component's config from `[data]` (also used by tools.packstats)."""
    d = recipe.data
    return TitanscaleDataLoader.Config(
        source=d.source,
        packing=d.packing,
        text_field=d.text_field,
        window=d.window,
        bad_records=d.bad_records,
        streaming=d.streaming,
        subset=d.subset,
        split=d.split,
        data_files=list(d.data_files),
        sources=[dataclasses.asdict(e) for e in d.sources],
        mix_window=d.mix_window,
        format=d.format,
        chat_template=d.chat_template,
        truncate=d.truncate,
    )


def padding_trim(recipe: Recipe, layout: Layout, attention: str, *, cuda_graphs: bool) -> int:
    """`data.packing = "none"`: the multiple each batch is cut to after its last trained pair
    (data.loader.trim_padding: same loss and gradient, fewer tokens), or 0 where batch
    shapes must stay fixed: pipeline stages (fixed microbatch shapes), tensor and context
    parallelism (a sequence split across ranks), compile and CUDA graphs (one graph per
    shape), flex attention (a compiled mask and kernel per shape). The multiple is the loss
    chunk count: torchtitan's chunked loss splits a sequence into that many equal chunks."""
    if recipe.data.packing != "none" or recipe.training.compile or cuda_graphs:
        return 0
    if layout.pp > 1 or layout.tp > 1 or layout.cp > 1 or attention not in ("dense", "varlen"):
        return 0
    from recipe.model_checks import loss_chunks

    return loss_chunks()


def recipe_model_spec(recipe: Recipe) -> ModelSpec:
    """The ModelSpec for `[model]` (family, flavor, layer and vocabulary overrides), before
    kernels and converters; shared by the Trainer config and the service (service/)."""
    spec = model_spec(recipe.model.family, recipe.model.flavor)
    if recipe.model.layers:
        spec.model.layers = spec.model.layers[: recipe.model.layers]
    if recipe.model.vocab_size:
        spec.model.vocab_size = recipe.model.vocab_size
        spec.model.tok_embeddings.num_embeddings = recipe.model.vocab_size
        spec.model.lm_head.out_features = recipe.model.vocab_size
    configure_moe(spec.model, recipe)
    return spec


def build_trainer_config(
    recipe: Recipe,
    layout: Layout,
    *,
    platform: Platform,
    kernels: KernelChoice,
    tokenizer_path: str,
) -> Trainer.Config:
    tr, par = recipe.training, recipe.parallel
    spec = recipe_model_spec(recipe)
    # After every change to the model's dimensions: attention backend + linear conversion
    # (torchtitan's converters), with the converted/skipped list kept for the log.
    spec.model = apply_kernels(spec.model, kernels, tp=layout.tp).model_config
    spec.parallelize_fn = unsharded_when_alone(spec.parallelize_fn)
    spec.post_optimizer_build_fn = record_expert_load(spec.post_optimizer_build_fn)
    if recipe.finetune.mode == "lora":
        # Last converter: the base (incl. any quantized linears) frozen, adapters trained.
        spec.model = lora_converter(recipe).build().convert(spec.model)
        spec.parallelize_fn = keep_frozen(spec.parallelize_fn)
    spec.model = post_train_experts(recipe, spec.model, cpu=platform.is_cpu)

    first_less, last_less = (1, 1)
    microbatch_size = 1
    layers_per_stage = None
    if layout.pp > 1:
        stages = layout.pp * stages_per_rank(par.pp_schedule, par.pp_stages_per_rank)
        weights = pp_layer_weights(len(spec.model.layers), stages)
        assert weights is not None  # check_layout rejected uneven splits already
        first_less, last_less = weights
        if par.pp_stages_per_rank:
            # torchtitan derives the stage count from layers per stage, counting the
            # embedding and output as `first_less` / `last_less` layers.
            layers_per_stage = (len(spec.model.layers) + first_less + last_less) // stages
        n_mb = par.pp_microbatches or tr.local_batch_size
        microbatch_size = tr.local_batch_size // n_mb

    ac = {"none": None, "selective": SelectiveAC.Config(), "full": FullAC.Config()}[
        tr.activation_checkpoint
    ]
    ck = recipe.checkpoint
    initial = ck.load_hf or ck.load_from
    # training.cuda_graphs: on where torchtitan allows capture (pp = 1, not varlen); never on
    # CPU (torchtitan would warn and run eager, but keep gradients allocated).
    cuda_graphs = not platform.is_cpu and uses_cuda_graphs(recipe, layout.pp, kernels.attention)
    dataloader = dataloader_config(recipe)
    dataloader.trim_padding_to = padding_trim(
        recipe, layout, kernels.attention, cuda_graphs=cuda_graphs
    )
    config = Trainer.Config(
        model_spec=spec,
        hf_assets_path=tokenizer_path,
        dump_folder=recipe.output_dir,
        # torchtitan's chunked CE, plus SFT's optional per-token weights (runtime.loss).
        loss=WeightedChunkedLoss.Config(
            loss_fn=WeightedCrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(spec))
        ),
        optimizer=default_adamw(lr=tr.lr, weight_decay=tr.weight_decay),
        lr_scheduler=lr_scheduler_config(recipe),
        training=TrainingConfig(
            local_batch_size=tr.local_batch_size,
            global_batch_size=tr.global_batch_size,
            seq_len=tr.seq_len,
            max_norm=tr.max_norm,
            steps=tr.steps,
            mixed_precision_param=tr.dtype,
            disable_cuda_graphs=not cuda_graphs,
        ),
        parallelism=ParallelismConfig(
            data_parallel_replicate_degree=layout.dp_replicate,
            data_parallel_shard_degree=layout.dp_shard,
            tensor_parallel_degree=layout.tp,
            context_parallel_degree=layout.cp,
            pipeline_parallel_degree=layout.pp,
            pipeline_parallel_schedule=par.pp_schedule,
            pipeline_parallel_microbatch_size=microbatch_size,
            pipeline_parallel_first_stage_less_layers=first_less,
            pipeline_parallel_last_stage_less_layers=last_less,
            # "spmd_types" (torchtitan's default) on torch >= 2.14, else "partial_dtensor"
            # (runtime.platform, bridge 8).
            spmd_backend=spmd_backend(),  # type: ignore[arg-type]
            pipeline_parallel_layers_per_stage=layers_per_stage,
            expert_parallel_degree=par.ep,
        ),
        dataloader=dataloader,
        metrics=TitanscaleMetrics.Config(
            log_freq=recipe.metrics.log_every,
            enable_tensorboard=recipe.metrics.tensorboard,
            jsonl=recipe.metrics.jsonl,
            summary_skip_steps=recipe.metrics.summary_skip_steps,
            straggler_ratio=recipe.metrics.straggler_ratio,
            straggler_steps=recipe.metrics.straggler_steps,
            precision=kernels.precision,
            device_name=platform.device_name,
            flavor=recipe.model.flavor,
            family=recipe.model.family,
            enable_wandb=recipe.metrics.wandb,
            wandb_project=recipe.metrics.wandb_project,
            wandb_entity=recipe.metrics.wandb_entity,
            wandb_run_name=recipe.metrics.wandb_run_name or recipe.job.name,
            n_layers=recipe.model.layers,
            disable_color_printing=True,
        ),
        checkpoint=AtomicCheckpointManager.Config(
            enable=ck.enabled,
            folder=os.path.abspath(recipe.checkpoint_dir),
            interval=ck.interval or tr.steps,
            keep_latest_k=ck.keep_latest,
            initial_load_path=os.path.abspath(initial) if initial else None,
            # torchtitan warns when this is set without a path to load from.
            initial_load_model_only=bool(initial),
            initial_load_in_hf=bool(ck.load_hf),
            # The last save stays a full, resumable DCP checkpoint; the Hugging Face export
            # is written next to it (AtomicCheckpointManager.export_hf) in export_dtype.
            last_save_model_only=False,
            export_dtype=ck.export_dtype,
            async_mode=ck.async_mode,
            checksums=ck.checksums,
            export_hf=ck.export_hf,
            export_hf_every_checkpoint=ck.export_hf_every_checkpoint,
            export_folder=os.path.abspath(recipe.export_dir),
            export_family=recipe.model.family,
            export_base_config=os.path.abspath(ck.load_hf) if ck.load_hf else "",
            tokenizer_dir=tokenizer_path,
            recipe_file=recipe.source or "",
        ),
        activation_checkpoint=ac,
        compile=CompileConfig(
            enable=tr.compile,
            # parallel.async_tp: checked at load (compile, tp > 1) and in session (CUDA).
            enable_async_tensor_parallel=par.async_tp and layout.tp > 1,
        ),
        comm=CommConfig(
            init_timeout_seconds=first_step_timeout_s(recipe),
            train_timeout_seconds=recipe.job.collective_timeout_s,
        ),
        validator=validator_config(recipe),
        profiler=Profiler.Config(
            enable_profiling=recipe.profiling.trace,
            profile_freq=recipe.profiling.every,
            profiler_warmup=recipe.profiling.warmup,
            profiler_active=1,
            enable_memory_snapshot=recipe.profiling.memory_snapshot,
            memory_snapshot_freq=recipe.profiling.memory_snapshot_every or None,
        ),
        debug=DebugConfig(seed=tr.seed),
    )
    if recipe.torchtitan:
        from torchtitan.tools.logging import logger

        from runtime.torchtitan_overrides import apply_overrides

        for line in apply_overrides(config, recipe.torchtitan, file=recipe.source):
            logger.info(f"[torchtitan] override: {line}")
    return config


# -- the post-training loops' optimizer, schedule and checkpointer (runtime.steps' callers)
def recipe_optimizer(
    recipe: Any, module: Any, *, lr: float, warmup_steps: int = -1, steps: int = 0
) -> tuple[Any, Any]:
    """torchtitan's AdamW container over `module`'s trainable parameters with the recipe's
    settings at `lr`, and (steps > 0) its LR schedule (lr_schedule, min_lr_ratio,
    decay_ratio) over `steps` with `warmup_steps`; None: a constant learning rate."""
    opt = default_adamw(lr=lr, weight_decay=recipe.training.weight_decay).build(
        model_parts=[module]
    )
    if steps <= 0:
        return opt, None
    cfg = dataclasses.replace(lr_scheduler_config(recipe), warmup_steps=max(warmup_steps, 0))
    return opt, cfg.build(optimizers=opt, training_steps=steps)


def recipe_checkpointer(recipe: Any, folder: str, *, steps: int, **states: Any) -> Any:
    """The verified checkpoint manager (runtime.checkpoint) for one state of a post-training
    loop over `folder` (step-N subfolders): the recipe's interval (0: `steps`), keep_latest,
    checksums and async mode (async needs a process group). `states`: model_parts,
    optimizers, lr_schedulers, dataloader and states, as torchtitan's manager takes them."""
    import torch.distributed as dist

    ck = recipe.checkpoint
    async_ok = dist.is_available() and dist.is_initialized()
    return AtomicCheckpointManager.Config(
        enable=True,
        folder=folder,
        interval=ck.interval or steps,
        keep_latest_k=ck.keep_latest,
        last_save_model_only=False,  # every save resumes
        async_mode=ck.async_mode if async_ok else "disabled",
        checksums=ck.checksums,
        recipe_file=recipe.source or "",
    ).build(sd_adapter=None, **states)
