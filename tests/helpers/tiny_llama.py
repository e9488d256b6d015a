"""Tiny torchtitan decoders for RL unit tests (dense attention, CPU, float32): Llama 3 and
Qwen3 (whose attention adds per-head RMSNorm on queries and keys)."""

from __future__ import annotations

import dataclasses

import torch


def _tiny(family: str, layers: int, seed: int, max_seq_len: int) -> torch.nn.Module:
    import importlib

    from kernels.attention import set_inner_attention
    from kernels.dense_attention import DenseMaskAttention

    registry = importlib.import_module(f"torchtitan.models.{family}").model_registry
    cfg = registry("debugmodel").model
    cfg.layers = cfg.layers[:layers]
    for layer in cfg.layers:
        layer.attention.rope = dataclasses.replace(layer.attention.rope, max_seq_len=max_seq_len)
    set_inner_attention(cfg, DenseMaskAttention.Config())
    torch.manual_seed(seed)
    model = cfg.build()
    model.init_states()
    return model


def tiny_llama(layers: int = 2, seed: int = 0, max_seq_len: int = 256) -> torch.nn.Module:
    return _tiny("llama3", layers, seed, max_seq_len)


def tiny_qwen3(layers: int = 2, seed: int = 0, max_seq_len: int = 256) -> torch.nn.Module:
    return _tiny("qwen3", layers, seed, max_seq_len)
