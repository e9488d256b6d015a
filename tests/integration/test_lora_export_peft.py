"""PEFT export of our LoRA adapters, checked against transformers + peft (external reference)."""

from __future__ import annotations

import pytest
import torch

from posttrain.lora import base_state, lora_modules
from runtime.hf import hf_config
from tests.helpers.hf_reference import check_peft_and_merged

RANK, ALPHA = 4, 8.0


def _lora_debug_model(n_layers: int = 2, n_kv_heads: int | None = None):
    from torchtitan.components.lora import LoRAConverter
    from torchtitan.models.llama3 import model_registry
    from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter

    cfg = model_registry("debugmodel").model
    cfg.layers = cfg.layers[:n_layers]
    if n_kv_heads:  # grouped-query attention (as in Llama 3 8B): several q heads per kv head
        from functools import partial

        from torchtitan.models.common.config_utils import make_gqa_config

        init = {"weight": partial(torch.nn.init.trunc_normal_, std=0.02)}
        for layer in cfg.layers:
            a = layer.attention
            layer.attention = make_gqa_config(
                dim=cfg.dim, n_heads=a.n_heads, wqkv_param_init=init, wo_param_init=init,
                inner_attention=a.inner_attention, rope=a.rope, n_kv_heads=n_kv_heads,
                fuse_qkv=True,
            )  # fmt: skip
    from torchtitan.models.common.attention import FlexAttention

    from kernels.dense_attention import DenseMaskAttention

    for _, _c, parent, attr in cfg.traverse(FlexAttention.Config):
        if isinstance(parent, list):
            parent[attr] = DenseMaskAttention.Config()
        else:
            setattr(parent, attr, DenseMaskAttention.Config())
    cfg = (
        LoRAConverter.Config(
            rank=RANK, alpha=ALPHA, target_modules=["wqkv", "wo", "w1", "w2", "w3", "lm_head"]
        )
        .build()
        .convert(cfg)
    )
    torch.manual_seed(0)
    model = cfg.build()
    model.init_states()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, m in lora_modules(model):  # B = 0 at init: give the adapter something to say
            m.lora_b.weight.copy_(torch.randn(m.lora_b.weight.shape, generator=gen) * 0.05)
    return model.eval(), cfg, Llama3StateDictAdapter(cfg, None)


@pytest.mark.parametrize("n_kv_heads", [None, 4])
def test_peft_adapter_and_merged_model_match_our_logits(tmp_path, n_kv_heads):
    from transformers import LlamaConfig, LlamaForCausalLM

    model, cfg, sda = _lora_debug_model(n_kv_heads=n_kv_heads)
    x = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(2))
    pos = torch.arange(x.shape[1]).expand_as(x).contiguous()
    with torch.no_grad():
        ours = model(x, pos, model.get_attention_masks(positions=pos)).float()

    hf_cfg = LlamaConfig(**hf_config(cfg, "llama3", "float32"))
    hf_cfg.attn_implementation = "eager"
    hf = LlamaForCausalLM(hf_cfg).float().eval()
    missing, unexpected = hf.load_state_dict(sda.to_hf(base_state(model)), strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    check_peft_and_merged(tmp_path, model=model, cfg=cfg, sda=sda, hf=hf, x=x, ours=ours,
                          rank=RANK, alpha=ALPHA, family="llama3")  # fmt: skip
