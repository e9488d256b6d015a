"""Model shapes read from torchtitan's own llama3 flavor registry (never copied by hand).

The planner, the memory and performance models and recipe validation need a model's
dimensions without building it. `model_shape(flavor)` builds torchtitan's model *config*
(no tensors) once and keeps the numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

# torchtitan's llama3 registry keys; the recipe contract names these four (1B/3B also work).
LLAMA3_FLAVORS = ("debugmodel", "1B", "3B", "8B", "70B", "405B")


@dataclass(frozen=True)
class ModelShape:
    """The dimensions of a Llama-family decoder, as torchtitan builds it."""

    flavor: str
    n_layers: int
    dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_hidden: int
    vocab_size: int
    weight_tying: bool

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.dim

    @property
    def params_per_layer(self) -> int:
        attn = self.dim * (self.n_heads + 2 * self.n_kv_heads) * self.head_dim
        attn += self.n_heads * self.head_dim * self.dim
        ffn = 3 * self.dim * self.ffn_hidden
        norms = 2 * self.dim
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


@cache
def model_shape(flavor: str) -> ModelShape:
    """Shape of torchtitan's llama3 `flavor` (KeyError for unknown flavors)."""
    from torchtitan.models.llama3 import llama3_configs

    cfg = llama3_configs[flavor](attn_backend="flex")
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
    )


# Pipeline schedules torchtitan accepts, and how many stages each puts on one rank by default.
PP_SCHEDULES_SINGLE = ("GPipe", "1F1B")
PP_SCHEDULES_MULTI = ("Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
PP_SCHEDULES = PP_SCHEDULES_SINGLE + PP_SCHEDULES_MULTI


def stages_per_rank(schedule: str) -> int:
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
