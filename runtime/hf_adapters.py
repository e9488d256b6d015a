"""Hugging Face state-dict adapters where torchtitan 0.3.0's does not read transformers' format.

GPT-OSS: torchtitan's `GptOssStateDictAdapter` maps OpenAI's MXFP4 release
(`mlp.experts.gate_up_proj_blocks`) onto expert parameter names the model no longer has
(`mlp1_weight` for `mlp1_weight_EGD`), so a transformers `GptOssForCausalLM` folder (and its
export) silently kept the experts at their initial values. `GptOssHFAdapter` keeps every
non-expert mapping of torchtitan's and maps the experts of transformers' layout:

    gate_up_proj      (E, D, 2F)  <->  mlp1_weight_EGD (E, 2F, D)   transposed
    gate_up_proj_bias (E, 2F)     <->  mlp1_bias_EG
    down_proj         (E, F, D)   <->  mlp2_weight_EDF (E, D, F)    transposed
    down_proj_bias    (E, D)      <->  mlp2_bias_ED

Gate and up stay interleaved (columns 0::2 and 1::2) in both: transformers and torchtitan's
swiglu read them the same way. The routing bias of aux-loss-free balancing (`expert_bias_E`,
zero at start) has no Hugging Face tensor and is neither read nor written.
`to_hf` makes the transposed experts contiguous copies (safetensors refuses strided views):
a transient copy of the expert weights during a load or export. Loading reads into those
copies and `from_hf` transposes them back (torchtitan's checkpointer loads `from_hf`'s result
into the model), so nothing depends on the copy aliasing the parameter. Experts sharded on
dim 0 (FSDP, EP) stay so through the transpose.
"""

from __future__ import annotations

import re
from typing import Any

from torchtitan.models.gpt_oss.state_dict_adapter import GptOssStateDictAdapter

_EXPERTS = "layers.{}.moe.routed_experts.inner_experts."
# HF suffix under model.layers.{}.mlp.experts. -> (torchtitan parameter, transposed)
EXPERT_KEYS = {
    "gate_up_proj": ("mlp1_weight_EGD", True),
    "gate_up_proj_bias": ("mlp1_bias_EG", False),
    "down_proj": ("mlp2_weight_EDF", True),
    "down_proj_bias": ("mlp2_bias_ED", False),
}
_TT_EXPERT = re.compile(r"layers\.(\d+)\.moe\.routed_experts\.inner_experts\.(\w+)$")
_HF_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\w+)$")


class GptOssHFAdapter(GptOssStateDictAdapter):
    """torchtitan's GPT-OSS adapter with transformers' expert layout (module docstring)."""

    def __init__(self, model_config: Any, hf_assets_path: str | None) -> None:
        super().__init__(model_config, hf_assets_path)
        for k in [k for k in self.from_hf_map if ".mlp.experts." in k]:
            del self.from_hf_map[k]  # the MXFP4-release names; ours below

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        experts = {k: v for k, v in state_dict.items() if _TT_EXPERT.search(k)}
        out = super().to_hf({k: v for k, v in state_dict.items() if k not in experts})
        by_tt = {tt: (hf, t) for hf, (tt, t) in EXPERT_KEYS.items()}
        for key, value in experts.items():
            m = _TT_EXPERT.search(key)
            assert m is not None
            layer, name = m.groups()
            if name in by_tt:
                hf, transposed = by_tt[name]
                out[f"model.layers.{layer}.mlp.experts.{hf}"] = (
                    value.transpose(1, 2).contiguous() if transposed else value
                )
        return out

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        experts = {k: v for k, v in hf_state_dict.items() if _HF_EXPERT.search(k)}
        out = super().from_hf({k: v for k, v in hf_state_dict.items() if k not in experts})
        for key, value in experts.items():
            m = _HF_EXPERT.search(key)
            assert m is not None
            layer, name = m.groups()
            if name in EXPERT_KEYS:
                tt, transposed = EXPERT_KEYS[name]
                out[_EXPERTS.format(layer) + tt] = value.transpose(1, 2) if transposed else value
        return out


# family -> the adapter titanscale uses in place of torchtitan's.
HF_ADAPTERS = {"gpt_oss": GptOssHFAdapter}
