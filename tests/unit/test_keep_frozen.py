"""runtime.build.keep_frozen: a LoRA base stays frozen through parallelize, also when
activation checkpointing renames every block's parameters (`_checkpoint_wrapped_module.`).

The parallelize function below does what torchtitan's does to names and flags: wraps each
block with torch's checkpoint_wrapper (as its activation checkpointing does) and re-registers
every parameter with requires_grad=True (as its spmd-types sharding does). The reference is
torchtitan's LoRA converter's own choice of trainable parameters before parallelize.
"""

from __future__ import annotations

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from runtime.build import keep_frozen, plain_fqn


def _lora_debug_model() -> torch.nn.Module:
    from torchtitan.components.lora import LoRAConverter
    from torchtitan.models.llama3 import model_registry

    cfg = model_registry("debugmodel").model
    cfg.layers = cfg.layers[:2]
    cfg = LoRAConverter.Config(rank=4, alpha=8, target_modules=["wqkv", "w1"]).build().convert(cfg)
    with torch.device("meta"):
        return cfg.build()


def _like_torchtitan(model: torch.nn.Module) -> None:
    for name, block in list(model.layers.named_children()):
        model.layers.register_module(name, checkpoint_wrapper(block))
    for mod in model.modules():
        for pname, p in list(mod.named_parameters(recurse=False)):
            setattr(mod, pname, torch.nn.Parameter(p.detach()))  # requires_grad=True again


def test_lora_base_stays_frozen_under_activation_checkpointing():
    model = _lora_debug_model()
    want = {n for n, p in model.named_parameters() if p.requires_grad}
    assert want and all(".lora_" in n for n in want)  # torchtitan's converter: adapters only

    keep_frozen(_like_torchtitan)(model)

    names = [n for n, _ in model.named_parameters()]
    assert any("_checkpoint_wrapped_module" in n for n in names)  # the names did change
    got = {plain_fqn(n) for n, p in model.named_parameters() if p.requires_grad}
    assert got == want
