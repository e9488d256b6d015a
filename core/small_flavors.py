"""titanscale's own small flavors of the DeepSeek-V3 architecture (`debugmodel_sigmoid`).

torchtitan's DeepSeek-V3 and Kimi debug flavors route with softmax, which transformers'
DeepseekV3 (sigmoid only) cannot express, and its sigmoid flavors (DeepSeek-V3 671B,
Moonlight 16B-A3B) are too large for a CPU even cut to a few layers. `debugmodel_sigmoid`
is the big sigmoid flavor of its family at debug size: the router (sigmoid scores with the
aux-loss-free routing bias, top-k, group-limited routing, renormalisation, routed scaling
factor), the RoPE (DeepSeek-V3's YaRN, Moonlight's plain RoPE), the attention's YaRN mscale
and the shared-expert count are read from that flavor's torchtitan config, never copied by
hand; only the widths, expert count and layer count are ours. Layers are built with the
family's own torchtitan builder (its parameter inits), the embedding, head and final norm
are the family's `debugmodel`'s. Kimi's is a text model (no vision tower).
"""

from __future__ import annotations

import dataclasses
from typing import Any

# family -> (torchtitan's sigmoid flavor it reproduces, query LoRA rank, routed experts).
# DeepSeek-V3 671B projects queries through a LoRA (wq_a -> norm -> wq_b) and routes over
# expert groups; Moonlight projects them directly (q_lora_rank 0) and has no groups: the
# two flavors together cover both query paths of the shared adapter and model.
SIGMOID_SOURCE = {
    "deepseek_v3": ("671B", 64, 32),
    "kimi_k2_7": ("moonlight-16B-A3B", 0, 16),
}
SMALL_FLAVORS = {family: ("debugmodel_sigmoid",) for family in SIGMOID_SOURCE}

# Debug-size widths: 3 layers (one dense, then two MoE), 8 heads of MLA.
_DIMS: dict[str, Any] = {
    "n_layers": 3,
    "n_dense_layers": 1,
    "n_heads": 8,
    "kv_lora_rank": 64,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "dense_hidden_dim": 512,
    "moe_hidden_dim": 64,
}


def small_model_config(family: str, flavor: str) -> Any:
    """torchtitan's model config of our `family` `flavor` (KeyError when not ours)."""
    if flavor not in SMALL_FLAVORS.get(family, ()):
        raise KeyError(flavor)
    big_flavor, q_lora_rank, num_experts = SIGMOID_SOURCE[family]
    if family == "deepseek_v3":
        from torchtitan.models import deepseek_v3 as fam

        configs = fam.deepseekv3_configs
        build_layers = fam._build_dsv3_layers  # the family's inits (torchtitan's wrapper)
    else:
        from torchtitan.models import kimi_k2_7 as fam  # type: ignore[no-redef]

        configs = fam.kimi_k2_5_configs
        build_layers = fam._build_kimi_layers
    kw = {"attn_backend": "flex", "moe_comm_backend": "standard"}
    big, debug = configs[big_flavor](**kw), configs["debugmodel"](**kw)
    attn = big.layers[0].attention
    moe = big.layers[-1].moe
    router = moe.router
    shared = moe.shared_experts.w1.out_features // moe.routed_experts.inner_experts.hidden_dim
    groups = router.num_expert_groups
    layers = build_layers(
        **_DIMS,
        dim=debug.dim,
        q_lora_rank=q_lora_rank,
        mscale=attn.mscale,
        num_experts=num_experts,
        num_shared_experts=shared,
        router_top_k=router.top_k,
        router_score_func=router.score_func,
        router_num_expert_groups=groups,
        router_num_limited_groups=router.num_limited_groups,
        router_route_scale=router.route_scale,
        router_route_norm=router.route_norm,
        non_blocking_capacity_factor=None,
        rope=dataclasses.replace(attn.rope, dim=_DIMS["qk_rope_head_dim"]),
        **kw,
    )
    extra: dict[str, Any] = (
        {"mtp_layers": []} if family == "deepseek_v3" else {"vision_encoder": None}
    )
    return dataclasses.replace(debug, layers=layers, **extra)
