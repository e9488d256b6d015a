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

# config.json of a Llama 3 folder of the debug recipe's shape (what `transformers`'
# LlamaConfig for tests/integration/_hf_interop_worker.hf_model writes), for tests that need
# the file without importing transformers.
LLAMA3_DEBUG_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 6,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "vocab_size": 2048,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
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

# DeepseekV3Config kwargs for titanscale's deepseek_v3 "debugmodel_sigmoid" (core.small_flavors:
# DeepSeek-V3 671B's routing and RoPE at debug size): 3 layers (first_k_dense_replace 1),
# MLA with a query LoRA, 32 experts of width 64 in 8 groups (4 kept), top-8 sigmoid scores
# renormalised and scaled by 2.5, one shared expert, YaRN (factor 40, mscale 1) as in 671B's
# config.json; norms at DeepSeek's 1e-6.
DEEPSEEK_V3_SIGMOID_DEBUG: dict[str, Any] = {
    "vocab_size": 2048,
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "q_lora_rank": 64,
    "kv_lora_rank": 64,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "n_routed_experts": 32,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "n_group": 8,
    "topk_group": 4,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "first_k_dense_replace": 1,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 163840,
    "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 40.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
    },
    "rope_interleave": True,
    "num_mtp_layers": 0,
    "tie_word_embeddings": False,
}

# The same for kimi_k2_7 "debugmodel_sigmoid" (Moonlight-16B-A3B's routing and RoPE, whose
# config.json is a DeepseekV3Config): queries projected directly (q_lora_rank null), 16
# experts in one group, top-6 scaled by 2.446, two shared experts, plain RoPE theta 5e4,
# norms at Moonlight's 1e-5 (transformers keeps MLA's latent norms at 1e-6).
KIMI_SIGMOID_DEBUG: dict[str, Any] = {
    **DEEPSEEK_V3_SIGMOID_DEBUG,
    "q_lora_rank": None,
    "n_routed_experts": 16,
    "n_shared_experts": 2,
    "num_experts_per_tok": 6,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 2.446,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 8192,
    "rope_parameters": {"rope_type": "default", "rope_theta": 50000.0},
}

TOL = 1e-4


def assert_served_logprobs_are_the_folders(sampler: Any, folder: Path, ids: list[int]) -> None:
    """A tinker sampling client's prompt logprobs of `ids` equal transformers' on the HF
    `folder` (float32, within TOL): the service serves that folder's weights."""
    import numpy as np
    import transformers
    from tinker import types

    got = sampler.compute_logprobs(types.ModelInput.from_ints(ids)).result()
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([ids])).logits[0, :-1].float(), -1)
    ref = lp.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].numpy()
    assert got[0] is None
    np.testing.assert_allclose(np.asarray(got[1:], dtype=np.float64), ref, atol=TOL)


def hub_snapshot(hub: Path, name: str, rev: str) -> Path:
    """An empty snapshot folder of `name` (`org/model`) at revision `rev` in Hugging Face's
    hub-cache layout (`models--org--model/snapshots/<rev>`, refs/main naming it): where a
    client's cache, and titanscale's name detection (service/served_base.hf_name), find it."""
    repo = hub / ("models--" + name.replace("/", "--"))
    snap = repo / "snapshots" / rev
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(rev)
    return snap


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
