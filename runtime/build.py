"""Recipe -> torchtitan `Trainer.Config`: the single translation between our contract and theirs.

Everything here is plain construction of torchtitan's own config objects (model registry,
converters, loss, optimizer, scheduler, parallelism, checkpoint, AC, compile); titanscale
adds its own components only at torchtitan's seams: the dataloader
(`data.loader.TitanscaleDataLoader`), the metrics processor (`runtime.metrics`) and the
inner-attention config chosen by the kernels layer.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
from torchtitan.components.validate import Validator
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.config.configs import CommConfig, DebugConfig
from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
from torchtitan.models.common.attention import FlexAttention
from torchtitan.models.common.config_utils import decoder_vocab_size
from torchtitan.models.llama3 import model_registry
from torchtitan.trainer import Trainer

from data.loader import TitanscaleDataLoader
from kernels.dense_attention import DenseMaskAttention
from parallel.axes import Layout
from recipe.models import pp_layer_weights, stages_per_rank
from recipe.schema import Recipe
from runtime.metrics import TitanscaleMetrics
from runtime.platform import Platform


@dataclass
class KernelChoice:
    """What the kernels layer decided: attention config, linear converters, notices."""

    attention: str = "dense"
    converters: list = field(default_factory=list)
    precision: str = "bf16"
    notices: list[str] = field(default_factory=list)


def choose_kernels(recipe: Recipe, platform: Platform) -> KernelChoice:
    """Minimal selection until the kernels registry lands: flex on CUDA, dense on CPU."""
    att = recipe.kernels.attention
    if att == "auto":
        att = "dense" if platform.is_cpu else "flex"
    return KernelChoice(attention=att, precision="bf16")


def _set_inner_attention(model_cfg, attention: str) -> None:
    if attention != "dense":
        return
    for _, _cfg, parent, attr in model_cfg.traverse(FlexAttention.Config):
        if parent is None:
            raise ValueError("model config is itself an attention config")
        if isinstance(parent, list):
            parent[attr] = DenseMaskAttention.Config()
        else:
            setattr(parent, attr, DenseMaskAttention.Config())


def build_trainer_config(
    recipe: Recipe,
    layout: Layout,
    *,
    platform: Platform,
    kernels: KernelChoice,
    tokenizer_path: str,
) -> Trainer.Config:
    tr, par = recipe.training, recipe.parallel
    spec = model_registry(
        recipe.model.flavor,
        attn_backend="varlen" if kernels.attention == "varlen" else "flex",
        converters=kernels.converters or None,
    )
    if recipe.model.layers:
        spec.model.layers = spec.model.layers[: recipe.model.layers]
    _set_inner_attention(spec.model, kernels.attention)
    if recipe.model.vocab_size:
        spec.model.vocab_size = recipe.model.vocab_size
        spec.model.tok_embeddings.num_embeddings = recipe.model.vocab_size
        spec.model.lm_head.out_features = recipe.model.vocab_size

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
        checkpoint=CheckpointManager.Config(
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
        ),
        activation_checkpoint=ac,
        compile=CompileConfig(enable=tr.compile),
        comm=CommConfig(),
        validator=Validator.Config(enable=False),
        debug=DebugConfig(seed=tr.seed),
    )
