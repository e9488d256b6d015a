"""PEFT export of our LoRA adapters on Qwen3, against transformers' Qwen3ForCausalLM + peft.

Qwen3 differs from Llama where an export can go wrong: q_norm / k_norm after the q/k
projections (the adapter's rows must land before the norm, as PEFT's q_proj LoRA does),
head_dim 128 != dim / n_heads, tied embeddings (an adapter on lm_head adapts the output
projection only; the merged folder is written untied), grouped-query attention in a fused
wqkv. The reference model is built from a Qwen3Config written here by hand (not from our
config.json writer), random weights, no network.
"""

from __future__ import annotations

import pytest
import torch

from posttrain.lora import base_state, lora_modules
from tests.helpers.hf_reference import QWEN3_DEBUG, check_peft_and_merged

RANK, ALPHA = 4, 8.0
N_LAYERS = 2


def _hf_reference():
    """transformers' Qwen3 with torchtitan's qwen3 debugmodel shape, 2 layers."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(**{**QWEN3_DEBUG, "num_hidden_layers": N_LAYERS})
    cfg.attn_implementation = "eager"
    return Qwen3ForCausalLM(cfg).float().eval()


def _lora_qwen3(fuse_qkv: bool, targets: list[str]):
    from torchtitan.components.lora import LoRAConverter
    from torchtitan.models.common.attention import FlexAttention
    from torchtitan.models.qwen3 import model_registry
    from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

    from kernels.dense_attention import DenseMaskAttention

    flavor = "debugmodel" if fuse_qkv else "debugmodel_non_fused_qkv"
    cfg = model_registry(flavor).model
    cfg.layers = cfg.layers[:N_LAYERS]
    for _, _c, parent, attr in cfg.traverse(FlexAttention.Config):
        if isinstance(parent, list):
            parent[attr] = DenseMaskAttention.Config()
        else:
            setattr(parent, attr, DenseMaskAttention.Config())
    cfg = LoRAConverter.Config(rank=RANK, alpha=ALPHA, target_modules=targets).build().convert(cfg)
    torch.manual_seed(0)
    model = cfg.build()
    model.init_states()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        # q_norm / k_norm are ones at init: make them count (a wrong order would show).
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.copy_(1 + 0.5 * torch.randn(p.shape, generator=gen))
        for _, m in lora_modules(model):  # B = 0 at init: give the adapter something to say
            m.lora_b.weight.copy_(torch.randn(m.lora_b.weight.shape, generator=gen) * 0.05)
    return model.eval(), cfg, Qwen3StateDictAdapter(cfg, None)


@pytest.mark.parametrize(
    "fuse_qkv,targets,modules",
    [
        (True, ["wqkv", "wo", "w1", "w2", "w3", "lm_head"], None),
        # Separate projections: torchtitan's config names k and v together (wkv).
        (False, ["wq", "wkv", "wo"], {"wq", "wk", "wv", "wo"}),
    ],
)
def test_qwen3_peft_adapter_and_merged_model_match_our_logits(tmp_path, fuse_qkv, targets, modules):
    model, cfg, sda = _lora_qwen3(fuse_qkv, targets)
    names = {n.rsplit(".", 1)[-1] for n, _ in lora_modules(model)}
    assert names == (modules or set(targets)), names  # every target adapted (the test covers each)
    x = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(2))
    pos = torch.arange(x.shape[1]).expand_as(x).contiguous()
    with torch.no_grad():
        ours = model(x, pos, model.get_attention_masks(positions=pos)).float()

    hf = _hf_reference()
    missing, unexpected = hf.load_state_dict(sda.to_hf(base_state(model)), strict=False)
    # lm_head is tied to embed_tokens (transformers re-ties it); rotary buffers are computed.
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    hf.tie_weights()
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    check_peft_and_merged(tmp_path, model=model, cfg=cfg, sda=sda, hf=hf, x=x, ours=ours,
                          rank=RANK, alpha=ALPHA, family="qwen3")  # fmt: skip
