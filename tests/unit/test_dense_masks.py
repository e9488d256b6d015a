"""The dense CPU attention path builds its masks without torch.compile, and they are the
masks torchtitan's own builder makes (benchmarks/peers.md: the compile cost seconds to tens
of seconds per new batch shape on CPU)."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import and_masks, create_block_mask
from torchtitan.models.common import decoder as tt_decoder
from torchtitan.models.common.attention import (
    get_causal_mask_mod,
    get_efficient_causal_mask_mod_for_packed_document,
)

from kernels.dense_attention import all_partial_block_mask, dense_mask_from_block_mask
from tests.helpers.tiny_llama import tiny_llama


def packed_positions(batch: int, docs: list[int]) -> torch.Tensor:
    """Positions restarting at 0 at each document of the given lengths (every row alike)."""
    return torch.cat([torch.arange(n) for n in docs]).repeat(batch, 1)


@pytest.mark.parametrize("block_size", [128, 16, (16, 32)])
def test_all_partial_mask_equals_torch_block_mask(block_size):
    pos = packed_positions(3, [5, 40, 19])  # 64 tokens, three documents
    L = pos.shape[1]
    mm = and_masks(get_causal_mask_mod(), get_efficient_causal_mask_mod_for_packed_document(pos))
    ours = all_partial_block_mask(mm, 3, L, block_size, "cpu")
    ref = create_block_mask(mm, 3, None, L, L, device="cpu", BLOCK_SIZE=block_size)
    a = dense_mask_from_block_mask(ours, 3, L, L)
    b = dense_mask_from_block_mask(ref, 3, L, L)
    assert torch.equal(a, b)
    # and the rule itself: causal, within one document
    doc = (pos == 0).cumsum(-1)
    q, k = torch.arange(L)[:, None], torch.arange(L)[None, :]
    rule = (q >= k) & (doc[:, :, None] == doc[:, None, :])
    assert torch.equal(a[:, 0], rule)
    # a valid BlockMask: its dense block view covers every tile as partial
    assert ours.shape == ref.shape
    assert bool((ours.to_dense() == 1).all())


def test_dense_model_masks_skip_the_compiled_builder(monkeypatch):
    """A model on the dense backend never calls torchtitan's compiled create_block_mask, and
    its logits equal those with torchtitan's own (uncompiled) BlockMask."""
    model = tiny_llama(layers=2).eval()
    pos = packed_positions(2, [7, 9, 16])
    tokens = torch.randint(0, 2048, pos.shape, generator=torch.Generator().manual_seed(0))

    def compiled_builder(*a, **k):
        raise AssertionError("the dense backend called the compiled create_block_mask")

    monkeypatch.setattr(tt_decoder, "create_attention_mask", compiled_builder)
    masks = model.get_attention_masks(positions=pos)
    with torch.no_grad():
        ours = model(tokens, pos, masks)
    L = pos.shape[1]
    mm = and_masks(get_causal_mask_mod(), get_efficient_causal_mask_mod_for_packed_document(pos))
    ref_mask = create_block_mask(mm, 2, None, L, L, device="cpu", BLOCK_SIZE=128)
    with torch.no_grad():
        ref = model(tokens, pos, ref_mask)
    assert torch.equal(ours, ref)
    # the document boundaries matter: a plain causal mask gives other logits
    causal = create_block_mask(get_causal_mask_mod(), 2, None, L, L, device="cpu")
    with torch.no_grad():
        assert not torch.allclose(model(tokens, pos, causal), ours)
