"""Useful-token and document-masked attention FLOP accounting."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import and_masks, create_block_mask
from torchtitan.models.common.attention import (
    get_causal_mask_mod,
    get_efficient_causal_mask_mod_for_packed_document,
)

from core.models import model_shape
from data.accounting import (
    attention_pairs,
    doc_masked_flops_per_token,
    document_lengths,
    mfu_doc_masked_pct,
    useful_tokens,
)
from kernels.dense_attention import dense_mask_from_block_mask


def positions_for(rows: list[list[int]]) -> torch.Tensor:
    return torch.stack([torch.cat([torch.arange(n) for n in r]) for r in rows])


def test_document_lengths_and_pairs():
    pos = positions_for([[3, 5], [8]])
    assert document_lengths(pos) == [[3, 5], [8]]
    p = attention_pairs(pos)
    assert p.doc_causal == (6 + 15) + 36
    assert p.causal == 2 * 36
    assert p.full == 2 * 64
    with pytest.raises(ValueError):
        document_lengths(torch.tensor([[1, 0, 1]]))


@pytest.mark.parametrize("rows", [[[40, 24], [64]], [[1] * 64, [10, 30, 20, 4]]])
def test_pairs_equal_the_mask_torchtitan_builds(rows):
    """The pair count is the number of True entries in torchtitan's own document mask."""
    pos = positions_for(rows)
    B, L = pos.shape
    mask_mod = and_masks(
        get_causal_mask_mod(), get_efficient_causal_mask_mod_for_packed_document(pos)
    )
    bm = create_block_mask(mask_mod, B, None, L, L, device="cpu")
    dense = dense_mask_from_block_mask(bm, B, L, L)
    assert int(dense.sum()) == attention_pairs(pos).doc_causal


def test_doc_masked_flops_against_torchtitans_count():
    shape = model_shape("8B")
    L = 8192
    one_doc = positions_for([[L]])
    # One document per row: the masked count keeps half of torchtitan's L^2 (plus diagonal).
    attn_tt = shape.flops_per_token(L) - 6 * shape.non_embedding_params
    attn_doc = doc_masked_flops_per_token(shape, one_doc) - 6 * shape.non_embedding_params
    assert attn_doc == pytest.approx(attn_tt * (L + 1) / (2 * L))
    # Eight documents per row: an eighth of that again.
    eight = positions_for([[L // 8] * 8])
    attn8 = doc_masked_flops_per_token(shape, eight) - 6 * shape.non_embedding_params
    assert attn8 == pytest.approx(attn_doc * (L // 8 + 1) / (L + 1))
    mfu = mfu_doc_masked_pct(shape, eight, 1000.0, 989e12)
    assert mfu == pytest.approx(100 * doc_masked_flops_per_token(shape, eight) * 1000 / 989e12)


def test_useful_tokens():
    labels = torch.tensor([[5, 6, -100, -100], [1, -100, 2, 3]])
    assert useful_tokens(labels) == 5
