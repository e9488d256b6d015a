"""Model checks torchtitan would otherwise make only after the process group starts.

Pure functions of the recipe and the model's shape (torchtitan's own config numbers, through
`core.models.model_shape`), so training (`runtime.session.prepare`) and the planning tools
(tools.plan / predict / launch) make the same checks and print the same line:

    check_model(recipe)                       # seq_len vs RoPE, head/layer arithmetic, MoE
    check_expert_parallel(recipe, layout)     # parallel.ep vs the experts and the mesh
    check_vocab(recipe, tokenizer_ids, path)  # the tokenizer's ids vs the model's vocabulary

Each raises `ConfigError` naming the recipe file and the key to change.
"""

from __future__ import annotations

from core.axes import Layout
from core.errors import ConfigError
from core.models import ModelShape
from recipe.loader import effective_shape
from recipe.schema import Recipe

# Token ids travel as int32 (data.loader, data.store, packing): a vocabulary must fit.
MAX_VOCAB = 2**31 - 1


def _where(recipe: Recipe) -> str:
    return f"{recipe.model.family} {recipe.model.flavor}"


def check_seq_len(recipe: Recipe, shape: ModelShape | None = None) -> None:
    """`training.seq_len` within the model's RoPE maximum (torchtitan raises "Training
    sequence length ... exceeds attention RoPE maximum" only inside the Trainer)."""
    shape = shape or effective_shape(recipe)
    seq = recipe.training.seq_len
    if shape.max_seq_len and seq > shape.max_seq_len:
        raise ConfigError(
            f"{seq} exceeds the model's maximum sequence length {shape.max_seq_len} (the RoPE "
            f"table of {_where(recipe)}, set by model.family/model.flavor); use at most "
            f"{shape.max_seq_len} or a flavor with a longer context",
            file=recipe.source,
            key="training.seq_len",
        )


def check_model_dims(recipe: Recipe, shape: ModelShape | None = None) -> None:
    """Attention arithmetic torchtitan asserts while building: key/value heads divide the
    query heads (grouped-query attention), whole heads, at least one layer."""
    shape = shape or effective_shape(recipe)
    f = recipe.source
    if shape.n_layers < 1:
        raise ConfigError(f"{_where(recipe)} has no layers", file=f, key="model.layers")
    if shape.n_kv_heads < 1 or shape.n_heads % shape.n_kv_heads:
        raise ConfigError(
            f"{_where(recipe)}: {shape.n_kv_heads} key/value heads do not divide "
            f"{shape.n_heads} query heads",
            file=f,
            key="model.flavor",
        )
    if shape.head_dim < 1 or shape.head_dim % 2:
        raise ConfigError(
            f"{_where(recipe)}: head_dim {shape.head_dim} must be a positive even number (RoPE "
            "rotates pairs)",
            file=f,
            key="model.flavor",
        )
    lora = recipe.finetune.mode == "lora" or recipe.adapters
    if lora and recipe.lora.rank > shape.dim:
        raise ConfigError(
            f"rank {recipe.lora.rank} exceeds the model width {shape.dim} of {_where(recipe)}: "
            "a LoRA update of rank r <= width already spans every direction",
            file=f,
            key="lora.rank",
        )
    if recipe.model.vocab_size > MAX_VOCAB:
        raise ConfigError(
            f"{recipe.model.vocab_size} entries do not fit int32 token ids (at most {MAX_VOCAB})",
            file=f,
            key="model.vocab_size",
        )


def loss_chunks() -> int:
    """How many equal chunks torchtitan's ChunkedLossWrapper (runtime.build uses its default)
    splits each rank's sequence into for the output projection and loss (8 in 0.3.0)."""
    import dataclasses

    from torchtitan.components.loss import ChunkedLossWrapper

    (f,) = (f for f in dataclasses.fields(ChunkedLossWrapper.Config) if f.name == "num_chunks")
    return int(f.default)  # type: ignore[arg-type]


def check_loss_chunks(recipe: Recipe, tp: int = 1, cp: int = 1) -> None:
    """Each rank's share of a sequence (seq_len / (tp x cp) under sequence and context
    parallelism) must split into `loss_chunks()` equal chunks (torchtitan checks it in the
    first loss, after the process group starts)."""
    chunks = loss_chunks()
    seq = recipe.training.seq_len
    if seq % (chunks * tp * cp):
        raise ConfigError(
            f"{seq} must be a multiple of {chunks * tp * cp}: the loss splits each rank's "
            f"share of a sequence (seq_len / (tp {tp} x cp {cp})) into {chunks} equal "
            "chunks (torchtitan's ChunkedLossWrapper)",
            file=recipe.source,
            key="training.seq_len",
        )


def check_moe(recipe: Recipe, shape: ModelShape | None = None) -> None:
    """`parallel.ep` against the routed experts, `[moe]` only on MoE models, and the
    expert linear conversions torchtitan 0.3.0 offers (FP8/MXFP8 refused on CPU by the
    kernels layer like every other linear backend)."""
    shape = shape or effective_shape(recipe)
    f = recipe.source
    ep = recipe.parallel.ep
    if not shape.is_moe:
        if ep != 1:
            raise ConfigError(
                f"{_where(recipe)} is a dense model (no experts to split); use ep = 1",
                file=f,
                key="parallel.ep",
            )
        from recipe.schema import MoeSection

        changed = [k for k, v in vars(recipe.moe).items() if getattr(MoeSection(), k) != v]
        if changed:
            raise ConfigError(
                f"[moe] applies to mixture-of-experts models; {_where(recipe)} is dense",
                file=f,
                key=f"moe.{changed[0]}",
            )
        return
    if shape.n_routed_experts % ep:
        raise ConfigError(
            f"ep={ep} must divide the {shape.n_routed_experts} routed experts of {_where(recipe)}",
            file=f,
            key="parallel.ep",
        )


def check_expert_parallel(recipe: Recipe, layout: Layout) -> None:
    """torchtitan's mesh constraint: EP borrows ranks from FSDP, CP and TP, so ep must
    divide dp_shard x cp x tp (ParallelDims raises it only after the process group)."""
    ep = recipe.parallel.ep
    borrow = layout.dp_shard * layout.cp * layout.tp
    if ep > 1 and borrow % ep:
        raise ConfigError(
            f"ep={ep} must divide dp_shard x cp x tp = {layout.dp_shard} x {layout.cp} x "
            f"{layout.tp} = {borrow} (expert parallelism borrows those ranks)",
            file=recipe.source,
            key="parallel.ep",
        )


def check_model(recipe: Recipe) -> None:
    """Every model check that needs no tokenizer (cheap: torchtitan's config only)."""
    shape = effective_shape(recipe)
    check_model_dims(recipe, shape)
    check_seq_len(recipe, shape)
    check_moe(recipe, shape)
    if recipe.finetune.mode == "lora":
        check_lora_targets(recipe)
    rl = recipe.rl
    if rl.enabled and shape.max_seq_len and rl.max_new_tokens >= shape.max_seq_len:
        raise ConfigError(
            f"{rl.max_new_tokens} new tokens (after the prompt) exceed the model's maximum "
            f"sequence length {shape.max_seq_len} (the RoPE table of {_where(recipe)})",
            file=recipe.source,
            key="rl.max_new_tokens",
        )


def model_linear_names(family: str, flavor: str) -> set[str]:
    """Last names of the Linear layers in torchtitan's config tree of the model (what its
    LoRA converter matches `lora.target_modules` against)."""
    from torchtitan.models.common.linear import Linear
    from torchtitan.protocols.module import Module

    from core.models import model_config

    cfg = model_config(flavor, family)
    return {
        fqn.rsplit(".", 1)[-1]
        for fqn, c, _parent, _attr in cfg.traverse(Module.Config, recurse=True)
        if isinstance(c, Linear.Config)
    }


def check_lora_targets(recipe: Recipe) -> None:
    """At least one `lora.target_modules` entry is a Linear layer of the model: with none,
    torchtitan's converter only warns, nothing is trainable and the optimizer fails on an
    empty parameter list after the process group started."""
    names = model_linear_names(recipe.model.family, recipe.model.flavor)
    targets = recipe.lora.target_modules
    if not set(targets) & names:
        raise ConfigError(
            f"{targets} name no Linear layer of {_where(recipe)} (its layers: "
            f"{', '.join(sorted(names))}): nothing would be trained",
            file=recipe.source,
            key="lora.target_modules",
        )


# rl.generator.Generator decodes at most this many rows at once (its max_batch default;
# tests/unit/test_reliability_train_model.py checks they agree).
GENERATOR_MAX_BATCH = 256


def rl_kv_cache_bytes(recipe: Recipe) -> int:
    """The generator's KV cache for one decoding batch: min(prompts x group, max_batch) rows
    x max_new_tokens positions (prompts add a few more), keys and values of every layer."""
    rl, shape = recipe.rl, effective_shape(recipe)
    per = 4 if rl.generator_dtype == "float32" else 2
    rows = min(rl.prompts_per_step * rl.group_size, GENERATOR_MAX_BATCH)
    positions = rows * rl.max_new_tokens
    return positions * shape.n_layers * 2 * shape.n_kv_heads * shape.head_dim * per


def check_vocab(recipe: Recipe, tokenizer_ids: int, tokenizer_path: str) -> None:
    """The tokenizer's largest id + 1 (`tokenizer_ids`) must fit the model's embedding table;
    otherwise the first such token is an index error inside the model (a device-side assert
    on GPU)."""
    model_vocab = effective_shape(recipe).vocab_size
    if tokenizer_ids <= model_vocab:
        return
    set_by = (
        f"model.vocab_size = {recipe.model.vocab_size}"
        if recipe.model.vocab_size
        else f"model.vocab_size = 0: the {_where(recipe)} vocabulary"
    )
    raise ConfigError(
        f"the tokenizer ({tokenizer_path}, model.tokenizer) has ids up to {tokenizer_ids - 1}, "
        f"but the model's vocabulary ({set_by}) has {model_vocab} entries; set "
        f"model.vocab_size to at least {tokenizer_ids} or use the model's own tokenizer",
        file=recipe.source,
        key="model.vocab_size",
    )


def _largest_batch(recipe: Recipe) -> tuple[int, str]:
    """The largest rows-per-step any trainer runs ([[adapters]] may set their own)."""
    best = (recipe.training.local_batch_size, "training.seq_len")
    for i, a in enumerate(recipe.adapters):
        if a.local_batch_size > best[0]:
            best = (a.local_batch_size, f"adapters[{i}].local_batch_size")
    return best


def dense_attention_bytes(recipe: Recipe, tp: int = 1) -> int:
    """Bytes the dense attention backend (CPU) holds for one layer's forward: the float32
    scores and probabilities, local batch x heads on this rank x seq_len^2 each."""
    heads = max(effective_shape(recipe).n_heads // max(tp, 1), 1)
    return 2 * 4 * _largest_batch(recipe)[0] * heads * recipe.training.seq_len**2


def check_dense_attention_memory(recipe: Recipe, total_bytes: int, tp: int = 1) -> None:
    """Refuse a seq_len (or batch) whose dense attention matrices alone exceed the machine's
    memory (the first forward would end in an allocation error after training starts)."""
    need = dense_attention_bytes(recipe, tp)
    if need > total_bytes:
        batch, key = _largest_batch(recipe)
        raise ConfigError(
            f"{batch} x {recipe.training.seq_len} tokens need {need / 2**30:,.1f} GiB for one "
            f"layer's dense attention (local batch x heads x seq_len^2, float32 scores and "
            f"probabilities); this machine has {total_bytes / 2**30:,.1f} GiB. Use a shorter "
            "seq_len, a smaller batch or a GPU attention backend (kernels.attention)",
            file=recipe.source,
            key=key,
        )


# fp32 weights, gradients and AdamW's two moments; a LoRA base is frozen (weights only).
TRAIN_BYTES_PER_PARAM = 16
FROZEN_BYTES_PER_PARAM = 4


def check_host_memory(recipe: Recipe, total_bytes: int) -> None:
    """On CPU every rank lives on this machine: the model's training state (all ranks
    together, FSDP or not) must fit its memory, or the first allocation fails after the
    process group starts. Names model.vocab_size when it is set (the usual culprit of a
    huge embedding), else model.flavor / model.layers."""
    rl = recipe.rl
    if rl.enabled and rl_kv_cache_bytes(recipe) > total_bytes:
        raise ConfigError(
            f"{rl.prompts_per_step} prompts x {rl.group_size} samples x {rl.max_new_tokens} "
            f"new tokens need {rl_kv_cache_bytes(recipe) / 2**30:,.1f} GiB of generator KV "
            f"cache, more than this machine's {total_bytes / 2**30:,.1f} GiB",
            file=recipe.source,
            key="rl.max_new_tokens",
        )
    shape = effective_shape(recipe)
    frozen = recipe.finetune.mode == "lora" or bool(recipe.adapters)
    per = FROZEN_BYTES_PER_PARAM if frozen else TRAIN_BYTES_PER_PARAM
    need = shape.total_params * per
    if need <= total_bytes:
        return
    key = "model.vocab_size" if recipe.model.vocab_size else "model.flavor"
    raise ConfigError(
        f"{_where(recipe)} with {shape.n_layers} layers and a {shape.vocab_size:,}-entry "
        f"vocabulary has {shape.total_params / 1e9:,.2f}B parameters: {need / 2**30:,.1f} GiB "
        f"to train ({per} bytes each), more than this machine's {total_bytes / 2**30:,.1f} "
        "GiB (use model.layers for a slice, a smaller flavor, or GPUs)",
        file=recipe.source,
        key=key,
    )
