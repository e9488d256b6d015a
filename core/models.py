"""Model families and shapes read from torchtitan's own registries (never copied by hand;
titanscale's few own flavors are built from them by core.small_flavors).

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
from core.small_flavors import SMALL_FLAVORS

# torchtitan's llama3 registry keys; the recipe contract names these four (1B/3B also work).
LLAMA3_FLAVORS = ("debugmodel", "1B", "3B", "8B", "70B", "405B")
# torchtitan's dense qwen3 registry keys (the MoE ones are in QWEN3_MOE_FLAVORS).
QWEN3_FLAVORS = ("debugmodel", "debugmodel_non_fused_qkv", "0.6B", "1.7B", "4B", "8B", "14B", "32B")
QWEN3_MOE_FLAVORS = ("debugmodel_moe", "30B-A3B", "235B-A22B")
# torchtitan's deepseekv3_configs, gptoss_configs and kimi_k2_5_configs keys. Kimi: the text
# models only (Moonlight 16B-A3B; `debugmodel` is trained as its text tower, the vision tower
# dropped); the vision-language flavors are refused (KIMI_VISION_FLAVORS).
DEEPSEEK_V3_FLAVORS = ("debugmodel", "16B", "236B", "671B")
GPT_OSS_FLAVORS = ("debugmodel", "20b", "120b")
KIMI_FLAVORS = ("debugmodel", "moonlight-16B-A3B")
KIMI_VISION_FLAVORS = ("Kimi-VL-A3B", "Kimi-K2.5")

# family -> the flavors titanscale trains: torchtitan's, plus titanscale's own small
# sigmoid-routed DeepSeek-V3 / Kimi shapes (core.small_flavors).
FAMILIES: dict[str, tuple[str, ...]] = {
    "llama3": LLAMA3_FLAVORS,
    "qwen3": QWEN3_FLAVORS + QWEN3_MOE_FLAVORS,
    "deepseek_v3": DEEPSEEK_V3_FLAVORS + SMALL_FLAVORS["deepseek_v3"],
    "gpt_oss": GPT_OSS_FLAVORS,
    "kimi_k2_7": KIMI_FLAVORS + SMALL_FLAVORS["kimi_k2_7"],
}
MOE_FAMILIES = ("deepseek_v3", "gpt_oss", "kimi_k2_7")  # every flavor MoE (qwen3: some)
# Hugging Face model_type per family (a `checkpoint.load_hf` folder's config.json is checked
# against it; see hf_model_type for the per-flavor exceptions).
HF_MODEL_TYPE = {
    "llama3": "llama",
    "qwen3": "qwen3",
    "deepseek_v3": "deepseek_v3",
    "gpt_oss": "gpt_oss",
    # Moonlight's published config.json says deepseek_v3 (same architecture).
    "kimi_k2_7": "deepseek_v3",
}
# Families torchtitan 0.3.0 ships that titanscale refuses, and why (one line each).
UNSUPPORTED_FAMILIES = {
    "qwen3_5": "needs the fla gated-delta-rule kernels (GPU only); unverified, not trained here",
    "llama4": "is not in torchtitan 0.3.0",
}
UNSUPPORTED_FLAVORS = {
    "kimi_k2_7": {
        f: "is a vision-language model (only the text models train here)"
        for f in KIMI_VISION_FLAVORS
    }
}


def hf_model_type(family: str, flavor: str) -> str:
    """The Hugging Face model_type of `family`/`flavor` (Qwen3's MoE flavors: qwen3_moe)."""
    if family == "qwen3" and flavor in QWEN3_MOE_FLAVORS:
        return "qwen3_moe"
    return HF_MODEL_TYPE[family]


def check_flavor(family: str, flavor: str) -> str | None:
    """None when `family`/`flavor` is trainable, else the problem (for a ConfigError)."""
    if family not in FAMILIES:
        if family in UNSUPPORTED_FAMILIES:
            return f"family {family!r} {UNSUPPORTED_FAMILIES[family]}; use one of {list(FAMILIES)}"
        return f"unknown family {family!r}{did_you_mean(family, FAMILIES)}; known: {list(FAMILIES)}"
    why = UNSUPPORTED_FLAVORS.get(family, {}).get(flavor)
    if why:
        return f"{family} flavor {flavor!r} {why}; known: {', '.join(FAMILIES[family])}"
    if flavor not in FAMILIES[family]:
        hint = did_you_mean(flavor, FAMILIES[family])
        return f"unknown {family} flavor {flavor!r}{hint}; known: {', '.join(FAMILIES[family])}"
    return None


@dataclass(frozen=True)
class ModelShape:
    """The dimensions of a decoder as torchtitan builds it: dense (Llama 3, Qwen3) or
    mixture-of-experts (DeepSeek-V3, Qwen3 MoE, GPT-OSS, Kimi/Moonlight).

    MoE: layers [0, n_dense_layers) have a dense FFN of width `ffn_hidden`; the others a
    router over `n_routed_experts` experts of width `moe_ffn_hidden` (each token goes to
    `top_k`) plus `n_shared_experts` always-active experts of the same width.
    """

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
    # --- mixture of experts (0 for dense models) ---
    n_routed_experts: int = 0
    n_shared_experts: int = 0
    top_k: int = 0
    moe_ffn_hidden: int = 0
    n_dense_layers: int = 0  # for a dense model every layer is dense (n_moe_layers = 0)
    # --- attention: "gqa" or "mla" (multi-head latent attention: DeepSeek-V3, Kimi) ---
    attention: str = "gqa"
    q_lora_rank: int = 0  # MLA: 0 = queries projected directly (wq), else wq_a -> norm -> wq_b
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    n_mtp_layers: int = 0  # multi-token prediction modules (DeepSeek-V3)
    # --- GPT-OSS extras: biases on attention projections, experts and router; attention
    # sinks (one scalar per head per layer) ---
    attn_bias: bool = False
    expert_bias: bool = False
    router_bias: bool = False
    attn_sinks: bool = False

    @property
    def is_moe(self) -> bool:
        return self.n_routed_experts > 0

    @property
    def n_moe_layers(self) -> int:
        # max: a `model.layers` slice may keep fewer layers than the dense ones.
        return max(0, self.n_layers - self.n_dense_layers) if self.is_moe else 0

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.dim

    @property
    def attention_params(self) -> int:
        """Attention parameters of one layer (projections, biases, sinks, q/k/kv norms)."""
        if self.attention == "mla":
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            if self.q_lora_rank:
                q = self.dim * self.q_lora_rank + self.q_lora_rank
                q += self.q_lora_rank * self.n_heads * qk
            else:
                q = self.dim * self.n_heads * qk
            kv = self.dim * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
            kv += self.kv_lora_rank * self.n_heads * (self.qk_nope_head_dim + self.v_head_dim)
            return q + kv + self.n_heads * self.v_head_dim * self.dim
        qkv_out = (self.n_heads + 2 * self.n_kv_heads) * self.head_dim
        attn = self.dim * qkv_out + self.n_heads * self.head_dim * self.dim
        if self.attn_bias:
            attn += qkv_out + self.dim
        if self.attn_sinks:
            attn += self.n_heads
        return attn + (2 * self.head_dim if self.qk_norm else 0)

    @property
    def routed_expert_params(self) -> int:
        """Parameters of ONE routed expert (gate, up, down; GPT-OSS: + their biases)."""
        p = 3 * self.dim * self.moe_ffn_hidden
        return p + (2 * self.moe_ffn_hidden + self.dim if self.expert_bias else 0)

    @property
    def router_params(self) -> int:
        return self.dim * self.n_routed_experts + (self.n_routed_experts if self.router_bias else 0)

    @property
    def shared_expert_params(self) -> int:
        """All shared experts of one MoE layer (torchtitan fuses them into one FFN)."""
        return 3 * self.dim * self.moe_ffn_hidden * self.n_shared_experts

    @property
    def dense_layer_params(self) -> int:
        return self.attention_params + 3 * self.dim * self.ffn_hidden + 2 * self.dim

    def moe_layer_params(self, *, active: bool = False) -> int:
        experts = self.top_k if active else self.n_routed_experts
        return (
            self.attention_params
            + self.router_params
            + self.shared_expert_params
            + experts * self.routed_expert_params
            + 2 * self.dim
        )

    @property
    def params_per_layer(self) -> int:
        """A dense layer's parameters (dense models: every layer's)."""
        return self.dense_layer_params

    def mtp_params(self, *, active: bool = False) -> int:
        """DeepSeek-V3's multi-token prediction modules: a full MoE layer each plus two
        input norms, the 2*dim -> dim projection and an output norm (embedding and head
        shared with the model)."""
        per = self.moe_layer_params(active=active) + 3 * self.dim + 2 * self.dim**2
        return self.n_mtp_layers * per

    def _params(self, *, active: bool) -> int:
        head = 0 if self.weight_tying else self.vocab_size * self.dim
        dense_layers = self.n_layers - self.n_moe_layers
        layers = dense_layers * self.dense_layer_params
        layers += self.n_moe_layers * self.moe_layer_params(active=active)
        return self.embedding_params + layers + self.mtp_params(active=active) + self.dim + head

    @property
    def total_params(self) -> int:
        """Every parameter, all experts (= torchtitan's model built on the meta device)."""
        return self._params(active=False)

    @property
    def active_params(self) -> int:
        """Parameters one token touches: top_k routed experts per MoE layer, shared experts,
        router, attention, dense layers, norms, embedding and head (= total for dense)."""
        return self._params(active=True)

    @property
    def non_embedding_params(self) -> int:
        # torchtitan's FLOP count excludes the input embedding table only.
        return self.total_params - self.embedding_params

    @property
    def active_non_embedding_params(self) -> int:
        return self.active_params - self.embedding_params

    @property
    def attention_head_dims(self) -> int:
        """torchtitan's `head_dims` in the attention FLOP term: qk + v width per head."""
        if self.attention == "mla":
            return self.qk_nope_head_dim + self.qk_rope_head_dim + self.v_head_dim
        return 2 * self.head_dim

    def flops_per_token(self, seq_len: int) -> float:
        """torchtitan's count: 6 x active non-embedding params + 6 x layers x heads x
        (qk + v head dims) x seq (MLA: nope + rope + v). Dense: 12 x L x H x head_dim x seq.

        With tied embeddings (1B, 3B) the shared matrix is the output projection's weight
        and torchtitan counts it (get_dense_model_nparams_and_flops). MoE: routed experts
        count top_k/n_routed_experts of their parameters (get_moe_model_nparams_and_flops).
        """
        matmul = self.active_params if self.weight_tying else self.active_non_embedding_params
        return 6 * matmul + 6 * self.n_layers * self.n_heads * self.attention_head_dims * seq_len


# RMSNorm epsilons of the DeepSeek-V3 architecture (deepseek_v3, kimi_k2_7). torchtitan 0.3.0
# leaves every norm of these configs at RMSNorm's default 1e-5; the released models differ:
# MLA's latent norms (q_a_layernorm, kv_a_layernorm) are 1e-6 in transformers' DeepseekV3
# and DeepSeek's own code whatever config.json says, and the layer and final norms are
# config.json's rms_norm_eps: 1e-6 for DeepSeek-V3 (V2 alike), 1e-5 for Moonlight and
# Kimi-K2.5. With torchtitan's 1e-5 the small sigmoid flavor's logits were 0.18 off
# transformers' on the same weights (tests/integration/test_hf_interop.py).
MLA_LATENT_NORM_EPS = 1e-6
MLA_LAYER_NORM_EPS = {"deepseek_v3": 1e-6, "kimi_k2_7": 1e-5}


def _set_mla_norm_eps(cfg, family: str) -> None:  # noqa: ANN001 (torchtitan config)
    """Every RMSNorm of a DeepSeek-V3/Kimi text model at the released models' epsilon."""
    import dataclasses

    from torchtitan.models.common import RMSNorm

    def walk(c, layer_eps: float) -> None:  # noqa: ANN001
        for f in dataclasses.fields(c):
            v = getattr(c, f.name)
            if isinstance(v, RMSNorm.Config):
                v.eps = MLA_LATENT_NORM_EPS if f.name in ("q_norm", "kv_norm") else layer_eps
            elif dataclasses.is_dataclass(v) and f.name != "vision_encoder":
                walk(v, layer_eps)

    eps = MLA_LAYER_NORM_EPS[family]
    for layer in [*cfg.layers, *(getattr(cfg, "mtp_layers", None) or ())]:
        walk(layer, eps)
    cfg.norm.eps = eps


def model_config(flavor: str, family: str = "llama3"):  # noqa: ANN201 (torchtitan type)
    """torchtitan's model config for `family`/`flavor` (KeyError for unknown flavors).

    MoE families are built with torchtitan's "standard" token dispatch (all-to-all under
    expert parallelism, local otherwise); Kimi's vision tower is dropped (text model).
    titanscale's own flavors (core.small_flavors) are built there. DeepSeek-V3 and Kimi norms
    take the released models' epsilons (MLA_LAYER_NORM_EPS).
    """
    if family in MLA_LAYER_NORM_EPS:
        cfg = _mla_model_config(flavor, family)
        _set_mla_norm_eps(cfg, family)
        return cfg
    if family == "qwen3":
        from torchtitan.models.qwen3 import qwen3_configs

        return qwen3_configs[flavor](attn_backend="flex")
    if family == "llama3":
        from torchtitan.models.llama3 import llama3_configs

        return llama3_configs[flavor](attn_backend="flex")
    if family == "gpt_oss":
        from torchtitan.models.gpt_oss import gptoss_configs

        return gptoss_configs[flavor](attn_backend="flex", moe_comm_backend="standard")
    raise KeyError(family)


def _mla_model_config(flavor: str, family: str):  # noqa: ANN202 (torchtitan type)
    """torchtitan's DeepSeek-V3 / Kimi text config of `flavor`, or ours (core.small_flavors)."""
    if flavor in SMALL_FLAVORS.get(family, ()):
        from core.small_flavors import small_model_config

        return small_model_config(family, flavor)
    if family == "deepseek_v3":
        from torchtitan.models.deepseek_v3 import deepseekv3_configs

        return deepseekv3_configs[flavor](attn_backend="flex", moe_comm_backend="standard")
    import dataclasses

    from torchtitan.models.kimi_k2_7 import kimi_k2_5_configs

    cfg = kimi_k2_5_configs[flavor](attn_backend="flex", moe_comm_backend="standard")
    return dataclasses.replace(cfg, vision_encoder=None)


@cache
def model_shape(flavor: str, family: str = "llama3") -> ModelShape:
    """Shape of torchtitan's `family` `flavor` (KeyError for unknown flavors)."""
    return shape_of_config(model_config(flavor, family), flavor, family)


def shape_of_config(cfg, flavor: str, family: str) -> ModelShape:  # noqa: ANN001 (torchtitan)
    """The ModelShape of a torchtitan decoder config (read from its layer configs)."""
    layers = list(cfg.layers)
    moe_layers = [layer for layer in layers if getattr(layer, "moe", None) is not None]
    dense = [layer for layer in layers if getattr(layer, "moe", None) is None]
    # MoE layers follow the dense ones in every torchtitan MoE family (DeepSeek-V3's
    # n_dense_layers); the count below relies on it.
    if moe_layers and layers.index(moe_layers[0]) != len(dense):
        raise ValueError(f"{family} {flavor}: dense layers are not all first")
    attn = layers[0].attention
    mla = hasattr(attn, "kv_lora_rank")
    moe_fields: dict = {}
    if moe_layers:
        moe = moe_layers[0].moe
        experts = moe.routed_experts.inner_experts
        shared = moe.shared_experts
        moe_fields = {
            "n_routed_experts": moe.num_experts,
            "n_shared_experts": shared.w1.out_features // experts.hidden_dim if shared else 0,
            "top_k": moe.router.top_k,
            "moe_ffn_hidden": experts.hidden_dim,
            "n_dense_layers": len(dense),
            "router_bias": bool(moe.router.gate.bias),
            "expert_bias": hasattr(experts, "swiglu_limit"),  # GPT-OSS's biased experts
        }
    ffn = dense[0].feed_forward.w1.out_features if dense else 0
    if mla:
        attn_fields: dict = {
            "attention": "mla",
            "n_kv_heads": attn.n_heads,
            "head_dim": attn.qk_nope_head_dim + attn.qk_rope_head_dim,
            "q_lora_rank": attn.q_lora_rank,
            "kv_lora_rank": attn.kv_lora_rank,
            "qk_nope_head_dim": attn.qk_nope_head_dim,
            "qk_rope_head_dim": attn.qk_rope_head_dim,
            "v_head_dim": attn.v_head_dim,
        }
    else:
        qkv = getattr(attn, "qkv_linear", None)
        first = getattr(qkv, "wqkv", None) or getattr(qkv, "wq", None)
        attn_fields = {
            "n_kv_heads": attn.n_kv_heads or attn.n_heads,
            "head_dim": attn.head_dim or cfg.dim // attn.n_heads,
            "qk_norm": getattr(attn, "qk_norm", None) is not None,
            "attn_bias": bool(getattr(first, "bias", False)),
            "attn_sinks": family == "gpt_oss",  # GptOss Attention always has sinks
        }
    return ModelShape(
        flavor=flavor,
        n_layers=len(layers),
        dim=cfg.dim,
        n_heads=attn.n_heads,
        ffn_hidden=ffn,
        vocab_size=cfg.vocab_size,
        weight_tying=bool(getattr(cfg, "enable_weight_tying", False)),
        family=family,
        max_seq_len=int(getattr(getattr(attn, "rope", None), "max_seq_len", 0) or 0),
        n_mtp_layers=len(getattr(cfg, "mtp_layers", None) or ()),
        **attn_fields,
        **moe_fields,
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
