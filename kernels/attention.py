"""Putting an inner-attention backend into a torchtitan model config.

torchtitan's `model_registry(flavor, attn_backend=...)` knows only the strings "flex",
"flex_flash" and "varlen"; the dense CPU path (and any config instance) goes in here, on
every attention layer, through `Configurable.Config.traverse`. The decoder builds its masks
from the first layer's inner-attention type (a BlockMask for FlexAttention configs and
subclasses such as DenseMaskAttention, VarlenMetadata for VarlenAttention), so one backend
per model, set on every layer, keeps masks and kernels consistent.
"""

from __future__ import annotations

import dataclasses

from torchtitan.models.common.attention import BaseAttention


def set_inner_attention(model_config, attention_config) -> int:
    """Replace `inner_attention` on every attention layer; returns how many were set.

    Each layer gets its own copy, so a later per-layer edit cannot leak into the others.
    """
    n = 0
    for _fqn, cfg, _parent, _attr in model_config.traverse(BaseAttention.Config):
        cfg.inner_attention = dataclasses.replace(attention_config)
        n += 1
    if n == 0:
        raise ValueError(f"{type(model_config).__qualname__} has no attention layers")
    return n


def inner_attention_types(model_config) -> set[type]:
    return {
        type(cfg.inner_attention) for _f, cfg, _p, _a in model_config.traverse(BaseAttention.Config)
    }
