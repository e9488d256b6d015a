"""Model families and shapes read from torchtitan's own registries (never copied by hand).

The planner, the memory and performance models and recipe validation need a model's
dimensions without building it. `model_shape(flavor, family)` builds torchtitan's model
*config* (no tensors) once and keeps the numbers. The flavor names below are checked
against torchtitan's registries by a test (they are listed here so that loading a recipe
never imports torch).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from core.errors import did_you_mean

# torchtitan's llama3 registry keys; the recipe contract names these four (1B/3B also work).
LLAMA3_FLAVORS = ("debugmodel", "1B", "3B", "8B", "70B", "405B")
# torchtitan's dense qwen3 registry keys (the MoE ones are in QWEN3_MOE_FLAVORS).
QWEN3_FLAVORS = ("debugmodel", "debugmodel_non_fused_qkv", "0.6B", "1.7B", "4B", "8B", "14B", "32B")
QWEN3_MOE_FLAVORS = ("debugmodel_moe", "30B-A3B", "235B-A22B")

# family -> (torchtitan module, dense flavors). Hugging Face model_type per family is used to
# check a `checkpoint.load_hf` folder's config.json.
FAMILIES: dict[str, tuple[str, ...]] = {"llama3": LLAMA3_FLAVORS, "qwen3": QWEN3_FLAVORS}
HF_MODEL_TYPE = {"llama3": "llama", "qwen3": "qwen3"}
# Families and flavors torchtitan 0.3.0 ships that titanscale does not train yet (MoE: the
# planner, memory model and FLOP count are dense-only).
UNSUPPORTED_FAMILIES = ("deepseek_v3", "gpt_oss", "kimi_k2_7", "qwen3_5", "llama4")
UNSUPPORTED_FLAVORS = {"qwen3": QWEN3_MOE_FLAVORS}


def check_flavor(family: str, flavor: str) -> str | None:
    """None when `family`/`flavor` is trainable, else the problem (for a ConfigError)."""
    if family not in FAMILIES:
        if family in UNSUPPORTED_FAMILIES:
            return f"family {family!r} (MoE) is not supported yet; use one of {list(FAMILIES)}"
        return f"unknown family {family!r}{did_you_mean(family, FAMILIES)}; known: {list(FAMILIES)}"
    if flavor in UNSUPPORTED_FLAVORS.get(family, ()):
        return (
            f"{family} flavor {flavor!r} is a mixture-of-experts model: not supported yet "
            f"(dense {family} flavors: {', '.join(FAMILIES[family])})"
        )
    if flavor not in FAMILIES[family]:
        hint = did_you_mean(flavor, FAMILIES[family])
        return f"unknown {family} flavor {flavor!r}{hint}; known: {', '.join(FAMILIES[family])}"
    return None


@dataclass(frozen=True)
class ModelShape:
    """The dimensions of a dense decoder (Llama 3 or Qwen3), as torchtitan builds it."""

    flavor: str
    n_layers: int
    dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_hidden: int
    vocab_size: int
    weight_tying: bool
    family: str = "llama3"
    qk_norm: bool = False  # Qwen3: RMSNorm over each head's queries and keys
    # Longest sequence the flavor's RoPE supports (torchtitan refuses a longer seq_len only
    # after the process group starts; recipe.model_checks checks it before). 0 = unknown.
    max_seq_len: int = 0

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.dim

    @property
    def params_per_layer(self) -> int:
        attn = self.dim * (self.n_heads + 2 * self.n_kv_heads) * self.head_dim
        attn += self.n_heads * self.head_dim * self.dim
        ffn = 3 * self.dim * self.ffn_hidden
        norms = 2 * self.dim + (2 * self.head_dim if self.qk_norm else 0)
        return attn + ffn + norms

    @property
    def total_params(self) -> int:
        head = 0 if self.weight_tying else self.vocab_size * self.dim
        return self.embedding_params + self.n_layers * self.params_per_layer + self.dim + head

    @property
    def non_embedding_params(self) -> int:
        # torchtitan's FLOP count excludes the input embedding table only.
        return self.total_params - self.embedding_params

    def flops_per_token(self, seq_len: int) -> float:
        """torchtitan's count: 6 x non-embedding params + 12 x layers x heads x head_dim x seq.

        With tied embeddings (1B, 3B) the shared matrix is the output projection's weight
        and torchtitan counts it (get_dense_model_nparams_and_flops).
        """
        matmul_params = self.total_params if self.weight_tying else self.non_embedding_params
        return 6 * matmul_params + 12 * self.n_layers * self.n_heads * self.head_dim * seq_len


def model_config(flavor: str, family: str = "llama3"):  # noqa: ANN201 (torchtitan type)
    """torchtitan's model config for `family`/`flavor` (KeyError for unknown flavors)."""
    if family == "qwen3":
        from torchtitan.models.qwen3 import qwen3_configs

        return qwen3_configs[flavor](attn_backend="flex")
    if family != "llama3":
        raise KeyError(family)
    from torchtitan.models.llama3 import llama3_configs

    return llama3_configs[flavor](attn_backend="flex")


@cache
def model_shape(flavor: str, family: str = "llama3") -> ModelShape:
    """Shape of torchtitan's `family` `flavor` (KeyError for unknown flavors)."""
    cfg = model_config(flavor, family)
    layer = cfg.layers[0]
    attn = layer.attention
    n_kv = attn.n_kv_heads or attn.n_heads
    head_dim = attn.head_dim or cfg.dim // attn.n_heads
    return ModelShape(
        flavor=flavor,
        n_layers=len(cfg.layers),
        dim=cfg.dim,
        n_heads=attn.n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        ffn_hidden=layer.feed_forward.w1.out_features,
        vocab_size=cfg.vocab_size,
        weight_tying=bool(getattr(cfg, "enable_weight_tying", False)),
        family=family,
        qk_norm=getattr(attn, "qk_norm", None) is not None,
        max_seq_len=int(getattr(getattr(attn, "rope", None), "max_seq_len", 0) or 0),
    )


# Pipeline schedules torchtitan accepts, and how many stages each puts on one rank by default.
PP_SCHEDULES_SINGLE = ("GPipe", "1F1B")
PP_SCHEDULES_MULTI = ("Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
PP_SCHEDULES = PP_SCHEDULES_SINGLE + PP_SCHEDULES_MULTI


def stages_per_rank(schedule: str, requested: int = 0) -> int:
    """Stages per pipeline rank: `requested` (a recipe's `parallel.pp_stages_per_rank`)
    when set, else the schedule's default (torchtitan: 1 single-stage, 2 otherwise)."""
    if requested:
        return requested
    return 1 if schedule in PP_SCHEDULES_SINGLE else 2


def pp_layer_weights(n_layers: int, num_stages: int) -> tuple[int, int] | None:
    """How torchtitan should count embedding/head so that stages get equal layer counts.

    torchtitan splits `n_layers + first_less + last_less` effective layers evenly over the
    stages. We accept a split only when it is even: first with embedding and head counted as
    one layer each (torchtitan's default; 405B's 126 layers are chosen for it), else counting
    neither (Megatron's convention; 70B's 80 layers over 4 or 8 stages). None: no even split.
    """
    if num_stages <= 1:
        return (1, 1)
    if (n_layers + 2) % num_stages == 0 and (n_layers + 2) // num_stages >= 1:
        return (1, 1)
    if n_layers % num_stages == 0:
        return (0, 0)
    return None
