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


def tiny_qwen3_moe(
    layers: int = 2,
    seed: int = 0,
    *,
    experts: int = 8,
    top_k: int = 2,
    hidden: int = 32,
    rank: int = 0,
    target_modules: list[str] | None = None,
) -> torch.nn.Module:
    """torchtitan's qwen3 `debugmodel_moe` cut to `layers` MoE layers of `experts` routed
    experts (top-`top_k`, expert hidden `hidden`), float32 experts (runtime.moe_experts
    compute_dtype "param"); `rank` > 0: torchtitan's LoRA converter on `target_modules`
    (default none of the linears) plus LoRA on the routed experts."""
    import importlib

    from kernels.attention import set_inner_attention
    from kernels.dense_attention import DenseMaskAttention
    from runtime.moe_experts import convert_experts

    cfg = importlib.import_module("torchtitan.models.qwen3").qwen3_configs["debugmodel_moe"](
        attn_backend="flex"
    )
    cfg.layers = cfg.layers[:layers]
    for layer in cfg.layers:
        layer.attention.rope = dataclasses.replace(layer.attention.rope, max_seq_len=256)
        moe = layer.moe
        moe.num_experts = experts
        moe.router.num_experts = experts
        moe.router.top_k = top_k
        moe.router.gate.out_features = experts
        inner = moe.routed_experts.inner_experts
        inner.num_experts, inner.hidden_dim = experts, hidden
        disp = moe.routed_experts.token_dispatcher
        disp.num_experts, disp.top_k = experts, top_k
    set_inner_attention(cfg, DenseMaskAttention.Config())
    if rank:
        from torchtitan.components.lora import LoRAConverter

        conv = LoRAConverter.Config(rank=rank, alpha=16.0, target_modules=target_modules or [])
        cfg = conv.build().convert(cfg)
    cfg = convert_experts(cfg, rank=rank, compute_dtype="param", freeze_base=bool(rank))
    torch.manual_seed(seed)
    model = cfg.build()
    model.init_states()
    return model
