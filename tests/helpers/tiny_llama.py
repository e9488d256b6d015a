"""A tiny torchtitan Llama for RL unit tests (dense attention, CPU, float32)."""

from __future__ import annotations

import dataclasses

import torch


def tiny_llama(layers: int = 2, seed: int = 0, max_seq_len: int = 256) -> torch.nn.Module:
    from torchtitan.models.llama3 import model_registry

    from kernels.attention import set_inner_attention
    from kernels.dense_attention import DenseMaskAttention

    cfg = model_registry("debugmodel").model
    cfg.layers = cfg.layers[:layers]
    for layer in cfg.layers:
        layer.attention.rope = dataclasses.replace(layer.attention.rope, max_seq_len=max_seq_len)
    set_inner_attention(cfg, DenseMaskAttention.Config())
    torch.manual_seed(seed)
    model = cfg.build()
    model.init_states()
    return model
