"""The FlashAttention probes name the modules torch itself imports (torch/nn/attention/_fa3.py
and _fa4.py), so "installed" here means torch can activate it."""

from __future__ import annotations

import inspect

import torch.nn.attention._fa3 as fa3
import torch.nn.attention._fa4 as fa4

from kernels.caps import FEATURE_MODULES


def test_probes_match_torch_module_paths():
    fa3_default = inspect.signature(fa3.register_flash_attention_fa3).parameters["module_path"]
    fa4_default = inspect.signature(fa4.register_flash_attention_fa4).parameters["module_path"]
    assert FEATURE_MODULES["fa3"] == fa3_default.default == "flash_attn_interface"
    assert FEATURE_MODULES["fa4"] == fa4_default.default == "flash_attn.cute.interface"
