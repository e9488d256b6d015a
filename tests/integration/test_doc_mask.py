"""Every attention backend honours document boundaries, single process.

Perturbing one document's tokens must leave every other document's logits (and the other
rows') unchanged: exactly, bit for bit, as docs/packing.md claims (the same computation on
the same inputs; a masked score contributes exp(-inf) = 0 exactly). Controls: the perturbation does change its own document, and with
positions that never reset (plain causal attention) it changes the documents after it, so
the check can fail. Backends: dense (CPU path), flex (compiled forward; on CPU it has no
backward, which this test does not need), varlen and flex on CUDA (skipped without a GPU).
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.doc_mask import build_model, contamination, packed_batch

TOL = 1e-5  # CUDA flex only (unverified on hardware): a compiled kernel may tile differently


def check(result: dict[str, float]) -> None:
    assert result["documents"] >= 4
    assert result["outside"] == 0.0, result
    assert result["inside"] > 1e-3, result
    assert result["causal_control"] > 1e-3, result


@pytest.mark.parametrize("backend", ["dense", "flex"])
def test_cpu_backends_keep_documents_apart(backend):
    torch.set_num_threads(1)
    x, pos, _ = packed_batch()
    check(contamination(build_model(backend), x, pos))


def test_moe_keeps_documents_apart():
    """Mixture of experts (DeepSeek-V3 debug, MLA + routed experts): routing is per token and
    dropless, so a packed document's logits depend on its own tokens only."""
    from runtime.platform import Platform

    torch.set_num_threads(1)
    Platform.detect().apply()  # CPU: float32 experts (docs/moe.md)
    x, pos, _ = packed_batch()
    check(contamination(build_model("dense", family="deepseek_v3"), x, pos))


def test_dense_matches_flex_forward():
    x, pos, _ = packed_batch()
    a = build_model("dense")
    b = build_model("flex")
    b.load_state_dict(a.state_dict())
    from tests.helpers.doc_mask import logits

    assert (logits(a, x, pos) - logits(b, x, pos)).abs().max().item() < 1e-4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (flash varlen)")
@pytest.mark.parametrize("backend", ["varlen", "flex"])
def test_cuda_backends_keep_documents_apart(backend):
    from kernels.caps import DeviceCaps
    from kernels.registry import attention_problem

    caps = DeviceCaps.detect()
    if attention_problem(backend, caps):  # e.g. varlen on SM90 without FlashAttention 3
        pytest.skip(
            f"{backend} cannot run on {caps.describe()}: {attention_problem(backend, caps)}"
        )
    x, pos, _ = packed_batch()
    model = build_model(backend, device="cuda")
    # fp32 end to end; varlen (flash) needs half precision inputs, so compare in bf16 there
    # with a tolerance fit for bf16 rounding of an unchanged computation (exactly 0 expected).
    if backend == "varlen":
        model = model.to(torch.bfloat16)
    res = contamination(model, x.cuda(), pos.cuda())
    assert res["outside"] <= (TOL if backend == "flex" else 0.0), res
    assert res["causal_control"] > 1e-3
