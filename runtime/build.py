"""Recipe -> torchtitan `Trainer.Config`: the single translation between our contract and theirs.

Everything here is plain construction of torchtitan's own config objects (model registry,
converters, loss, optimizer, scheduler, parallelism, checkpoint, AC, compile); titanscale
adds its own components only at torchtitan's seams: the dataloader
(`data.loader.TitanscaleDataLoader`), the metrics processor (`runtime.metrics`), the
checkpoint manager (`runtime.checkpoint.AtomicCheckpointManager`) and the inner-attention
config chosen by the kernels layer.
"""

from __future__ import annotations

import os

from torchtitan.components.lora import LoRAConverter
from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
from torchtitan.components.validate import Validator
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.config.configs import CommConfig, DebugConfig
from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
from torchtitan.models.common.config_utils import decoder_vocab_size
from torchtitan.models.llama3 import model_registry
from torchtitan.trainer import Trainer

from data.loader import TitanscaleDataLoader
from kernels.caps import DeviceCaps, detect_features
from kernels.registry import KernelChoice, apply_kernels, check_kernels
from parallel.axes import Layout
from recipe.models import pp_layer_weights, stages_per_rank
from recipe.schema import Recipe
from runtime.checkpoint import AtomicCheckpointManager
from runtime.metrics import TitanscaleMetrics
from runtime.platform import Platform


def choose_kernels(
    recipe: Recipe, platform: Platform, layout: Layout | None = None
) -> KernelChoice:
    """`[kernels]` resolved against this platform (kernels.registry); ConfigError (exit 2) when
    the device cannot run the requested backend. Optional kernel packages (FlashAttention 3/4)
    are probed on this machine."""
    caps = DeviceCaps(
        platform.device_type, platform.device_name, platform.compute_capability, detect_features()
    )
    return check_kernels(recipe, caps, cp=layout.cp if layout is not None else None)


def lora_converter(recipe: Recipe) -> LoRAConverter.Config:
    """`[lora]` as torchtitan's LoRA converter config."""
    lo = recipe.lora
    return LoRAConverter.Config(
        rank=lo.rank, alpha=lo.alpha, target_modules=list(lo.target_modules)
    )


def model_spec(recipe: Recipe):
    """torchtitan's ModelSpec for `[model]` (flavor, layer and vocabulary overrides), before
    kernels and converters; shared by the Trainer config and the service (service/)."""
    spec = model_registry(recipe.model.flavor)
    if recipe.model.layers:
        spec.model.layers = spec.model.layers[: recipe.model.layers]
    if recipe.model.vocab_size:
        spec.model.vocab_size = recipe.model.vocab_size
        spec.model.tok_embeddings.num_embeddings = recipe.model.vocab_size
        spec.model.lm_head.out_features = recipe.model.vocab_size
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
    spec = model_spec(recipe)
    # After every change to the model's dimensions: attention backend + linear conversion
    # (torchtitan's converters), with the converted/skipped list kept for the log.
    spec.model = apply_kernels(spec.model, kernels, tp=layout.tp).model_config
    if recipe.finetune.mode == "lora":
        # Last converter: the base (incl. any quantized linears) frozen, adapters trained.
        spec.model = lora_converter(recipe).build().convert(spec.model)

    first_less, last_less = (1, 1)
    microbatch_size = 1
    if layout.pp > 1:
        stages = layout.pp * stages_per_rank(par.pp_schedule)
        weights = pp_layer_weights(len(spec.model.layers), stages)
        assert weights is not None  # check_layout rejected uneven splits already
        first_less, last_less = weights
        n_mb = par.pp_microbatches or tr.local_batch_size
        microbatch_size = tr.local_batch_size // n_mb

    ac = {"none": None, "selective": SelectiveAC.Config(), "full": FullAC.Config()}[
        tr.activation_checkpoint
    ]
    ckpt_enabled = recipe.checkpoint.interval > 0 or bool(recipe.checkpoint.load_from)
    return Trainer.Config(
        model_spec=spec,
        hf_assets_path=tokenizer_path,
        dump_folder=recipe.output_dir,
        loss=ChunkedLossWrapper.Config(
            loss_fn=CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(spec))
        ),
        optimizer=default_adamw(lr=tr.lr, weight_decay=tr.weight_decay),
        lr_scheduler=LRSchedulersContainer.Config(
            warmup_steps=tr.warmup_steps,
            decay_ratio=0.8,
            decay_type="linear",
            min_lr_factor=0.0,
        ),
        training=TrainingConfig(
            local_batch_size=tr.local_batch_size,
            global_batch_size=tr.global_batch_size,
            seq_len=tr.seq_len,
            max_norm=tr.max_norm,
            steps=tr.steps,
            mixed_precision_param=tr.dtype,
            # CUDA graphs need static shapes and no PP; the eager path is the measured one.
            disable_cuda_graphs=True,
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
        ),
        dataloader=TitanscaleDataLoader.Config(
            format=recipe.data.format,
            chat_template=recipe.data.chat_template,
            truncate=recipe.data.truncate,
            source=recipe.data.source,
            packing=recipe.data.packing,
            text_field=recipe.data.text_field,
            window=recipe.data.window,
            bad_records=recipe.data.bad_records,
            streaming=recipe.data.streaming,
        ),
        metrics=TitanscaleMetrics.Config(
            log_freq=recipe.metrics.log_every,
            enable_tensorboard=recipe.metrics.tensorboard,
            jsonl=recipe.metrics.jsonl,
            summary_skip_steps=recipe.metrics.summary_skip_steps,
            precision=kernels.precision,
            device_name=platform.device_name,
            flavor=recipe.model.flavor,
            n_layers=recipe.model.layers,
            disable_color_printing=True,
        ),
        checkpoint=AtomicCheckpointManager.Config(
            enable=ckpt_enabled,
            folder=os.path.abspath(recipe.checkpoint_dir),
            interval=recipe.checkpoint.interval or tr.steps,
            keep_latest_k=recipe.checkpoint.keep_latest,
            initial_load_path=(
                os.path.abspath(recipe.checkpoint.load_from)
                if recipe.checkpoint.load_from
                else None
            ),
            initial_load_model_only=True,
            last_save_model_only=False,
            checksums=recipe.checkpoint.checksums,
        ),
        activation_checkpoint=ac,
        compile=CompileConfig(enable=tr.compile),
        comm=CommConfig(
            init_timeout_seconds=recipe.job.init_timeout_s,
            train_timeout_seconds=recipe.job.collective_timeout_s,
        ),
        validator=Validator.Config(enable=False),
        debug=DebugConfig(seed=tr.seed),
    )
