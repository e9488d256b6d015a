"""The tiny models the vLLM engine tests serve: torchtitan's debug Llama (2 layers), LoRA-
converted (rank 8 on wqkv, wo, w1, w2, w3; vLLM's LoRA kernels take ranks 8, 16, ...) with
dense attention, and a fresh adapter with a random B (so it changes the model's output)."""

from __future__ import annotations

from typing import Any

import torch

RANK, ALPHA = 8, 16.0


def lora_llama(layers: int = 2, seed: int = 0) -> tuple[torch.nn.Module, Any, Any]:
    """(model, config, state-dict adapter): the base weights from `seed`."""
    from torchtitan.components.lora import LoRAConverter
    from torchtitan.models.llama3 import model_registry
    from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter

    from kernels.attention import set_inner_attention
    from kernels.dense_attention import DenseMaskAttention

    cfg = model_registry("debugmodel").model
    cfg.layers = cfg.layers[:layers]
    set_inner_attention(cfg, DenseMaskAttention.Config())
    cfg = (
        LoRAConverter.Config(
            rank=RANK, alpha=ALPHA, target_modules=["wqkv", "wo", "w1", "w2", "w3"]
        )
        .build()
        .convert(cfg)
    )
    torch.manual_seed(seed)
    model = cfg.build()
    model.init_states()
    return model.eval().requires_grad_(False), cfg, Llama3StateDictAdapter(cfg, None)


def random_adapter(
    model: torch.nn.Module, seed: int, scale: float = 0.5
) -> dict[str, torch.Tensor]:
    """Adapter tensors (posttrain.lora names): torchtitan's A init, B random (not zero)."""
    from posttrain.lora import init_adapter

    ad = {k: v.detach().clone() for k, v in init_adapter(model, seed).params.items()}
    gen = torch.Generator().manual_seed(seed + 1)
    for k in ad:
        if k.endswith("lora_b.weight"):
            ad[k] = torch.randn(ad[k].shape, generator=gen) * scale
    return ad


def bound(model: torch.nn.Module, adapter: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A copy of `model` with `adapter` loaded into its LoRA linears."""
    import copy

    m = copy.deepcopy(model)
    m.load_state_dict(adapter, strict=False)
    return m
