"""tools.kernel_bench on CPU: every backend runs each shape kind end to end (tiny model)."""

from __future__ import annotations

import pytest

from core.models import model_shape
from kernels.bench import attention_shape, gemm_shapes


def test_shapes_follow_the_model_and_tp():
    s = model_shape("70B")
    g = {x.op: x for x in gemm_shapes("70B", 8, tokens=8192)}
    assert (g["qkv"].n, g["qkv"].k) == ((64 + 2 * 8) * 128 // 8, 8192)
    assert (g["wo"].n, g["wo"].k) == (8192, 8192 // 8)
    assert (g["w1/w3"].n, g["w2"].k) == (s.ffn_hidden // 8, s.ffn_hidden // 8)
    assert (
        g["lm_head"].n == s.vocab_size // 8
        and g["lm_head"].flops == 6 * 8192 * (s.vocab_size // 8) * 8192
    )
    a = attention_shape("8B", 4, batch=1, seq=8192)
    assert (a.heads, a.kv_heads, a.head_dim) == (8, 2, 128)
    # causal forward: 4 * D per attended pair; backward 2.5x forward
    assert a.flops(backward=True) == pytest.approx(3.5 * 4 * 128 * 8192 * 8193 / 2 * 8)
