"""transformers configs written by hand for torchtitan's debug shapes (the independent
reference in the Hugging Face interop and PEFT export tests), and the PEFT check shared by
the Llama and Qwen3 export tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

# Qwen3Config kwargs for torchtitan's qwen3 "debugmodel" (8 layers; tests may cut it).
QWEN3_DEBUG: dict[str, Any] = {
    "hidden_size": 256,
    "intermediate_size": 3072,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 2048,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    "tie_word_embeddings": True,
}

# Qwen3MoeConfig kwargs for torchtitan's qwen3 "debugmodel_moe" cut to 2 layers (every
# layer sparse: 64 experts of width 768, top-8, softmax routing renormalised over the top-k).
QWEN3_MOE_DEBUG: dict[str, Any] = {
    **{k: v for k, v in QWEN3_DEBUG.items() if k != "intermediate_size"},
    "num_hidden_layers": 2,
    "tie_word_embeddings": False,
    "intermediate_size": 768,
    "num_experts": 64,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
}

# GptOssConfig kwargs for torchtitan's gpt_oss "debugmodel" cut to 2 layers (a sliding-window
# layer then a full one; 8 experts of width 2880, top-4; YaRN RoPE, attention sinks, biases).
GPT_OSS_DEBUG: dict[str, Any] = {
    "hidden_size": 256,
    "intermediate_size": 2880,
    "num_hidden_layers": 2,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "vocab_size": 2048,
    "num_local_experts": 8,
    "num_experts_per_tok": 4,
    "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention"],
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131072,
    "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "original_max_position_embeddings": 4096,
        "truncate": False,
    },
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "attention_bias": True,
}

TOL = 1e-4


def check_peft_and_merged(
    tmp: Path, *, model: Any, cfg: Any, sda: Any, hf: Any, x: torch.Tensor,
    ours: torch.Tensor, rank: int, alpha: float, family: str,
) -> None:  # fmt: skip
    """Our LoRA `model` exported in PEFT format loads with peft on `hf` (transformers' model
    holding our base weights) and gives `ours` within TOL; the merged folder loads with
    transformers' from_pretrained and gives the same logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from posttrain.lora import adapter_state, base_state, export_merged, export_peft

    with torch.no_grad():  # control: the adapter changes the logits (else the test is moot)
        assert (hf(x).logits - ours).abs().max() > 1e-2
    adapter = adapter_state(model)
    export_peft(str(tmp / "adapter"), model_config=cfg, adapter=adapter, state_dict_adapter=sda,
                rank=rank, alpha=alpha)  # fmt: skip
    peft_model = PeftModel.from_pretrained(hf, str(tmp / "adapter")).eval()
    with torch.no_grad():
        got = peft_model(x).logits
    assert (got - ours).abs().max().item() < TOL

    export_merged(str(tmp / "merged"), base=base_state(model), adapter=adapter, model_config=cfg,
                  state_dict_adapter=sda, scale=alpha / rank, family=family)  # fmt: skip
    merged = AutoModelForCausalLM.from_pretrained(str(tmp / "merged"), dtype=torch.float32)
    assert type(merged).__name__ == type(hf).__name__
    with torch.no_grad():
        m_logits = merged.eval()(x).logits
    assert (m_logits - ours).abs().max().item() < TOL
    assert (m_logits - got).abs().max().item() < TOL
