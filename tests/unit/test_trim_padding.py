"""`packing = "none"` batches are cut after their last trained pair (data.loader.trim_padding)
where runtime.build allows varying shapes: the loss and its gradient are those of the full
rows (checked against a forward/backward of the untrimmed batch), on fewer tokens."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torchtitan.components.loss import IGNORE_INDEX

from core.axes import Layout
from data.loader import collate_rows, trim_padding
from data.packing import LOSS_WEIGHT_DELTA, LOSS_WEIGHTS, Piece, Row, materialize
from recipe.loader import load_recipe
from runtime.build import padding_trim
from tests.helpers.tiny_llama import tiny_llama

PAD = 2


def rows_of(docs: list[list[int]], seq_len: int, trained_from: int):
    """One padded row per document (the 'none' packer), tokens from `trained_from` on trained
    (prompt tokens stored as -1 - id, data.chat's encoding)."""
    out = []
    for i, d in enumerate(docs):
        enc = [t if k >= trained_from else -1 - t for k, t in enumerate(d)]
        row = Row((Piece(i, 0, len(d) - 1, len(d) - 1),), seq_len)
        inp, lab, pos = materialize(row, {i: torch.tensor(enc).numpy()}, PAD)
        out.append(({"input": torch.from_numpy(inp), "positions": torch.from_numpy(pos)},
                    torch.from_numpy(lab)))  # fmt: skip
    return out


def test_cut_after_the_last_trained_pair_rounded_up():
    docs = [list(range(10, 20)), list(range(30, 43)), list(range(50, 55))]  # 10, 13, 5 tokens
    batch, labels = collate_rows(rows_of(docs, 64, trained_from=3))
    cut, cut_labels = trim_padding(batch, labels, 8)
    # the longest document has 12 pairs (its last label at column 11): 12 -> 16 columns
    assert cut_labels.shape == (3, 16) and cut["input"].shape == cut["positions"].shape == (3, 16)
    assert torch.equal(cut_labels, labels[:, :16]) and torch.equal(
        cut["input"], batch["input"][:, :16]
    )
    assert (labels[:, 16:] == IGNORE_INDEX).all()  # nothing trained was cut
    assert int((cut_labels != IGNORE_INDEX).sum()) == int((labels != IGNORE_INDEX).sum())
    # through the loader's collate (what TitanscaleDataLoader passes to torch's DataLoader)
    b2, l2 = collate_rows(rows_of(docs, 64, trained_from=3), trim_to=8)
    assert l2.shape == (3, 16) and torch.equal(b2["input"], cut["input"])


def test_weights_are_cut_with_the_tokens_and_full_rows_stay():
    docs = [list(range(10, 20)), list(range(30, 35))]
    rows = rows_of(docs, 32, trained_from=2)
    rows[0][0][LOSS_WEIGHTS] = (rows[0][1] != IGNORE_INDEX).float() * 2
    rows[0][0][LOSS_WEIGHT_DELTA] = torch.tensor(3.0, dtype=torch.float64)
    batch, labels = collate_rows(rows, trim_to=8)
    assert batch[LOSS_WEIGHTS].shape == labels.shape == (2, 16)
    assert batch[LOSS_WEIGHT_DELTA].shape == (2,)  # per-row scalars untouched
    # a batch whose trained pairs reach the last column keeps every column
    full = rows_of([list(range(10, 43))], 32, trained_from=1)
    _, lab = collate_rows(full, trim_to=8)
    assert lab.shape == (1, 32)
    # a batch with no trained pair (padding rows of a finite stream's last group)
    empty = {"input": torch.full((2, 32), PAD), "positions": torch.arange(32).repeat(2, 1)}
    cut, lab = trim_padding(empty, torch.full((2, 32), IGNORE_INDEX), 8)
    assert lab.shape == (2, 8)


def test_loss_and_gradient_equal_the_full_rows():
    """Independent reference: the same model's loss and gradients on the untrimmed batch."""
    docs = [[0, *range(100, 111), 1], [0, *range(200, 205), 1], [0, *range(300, 318), 1]]
    batch, labels = collate_rows(rows_of(docs, 64, trained_from=4))
    cut, cut_labels = trim_padding(batch, labels, 8)
    assert cut_labels.shape[1] == 24 < 64
    model = tiny_llama(layers=2)

    def loss_and_grads(b, lab):
        model.zero_grad()
        pos = b["positions"]
        logits = model(b["input"], pos, model.get_attention_masks(positions=pos))
        loss = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1).float(), lab.flatten(), ignore_index=IGNORE_INDEX
        )
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    full_loss, full_g = loss_and_grads(batch, labels)
    cut_loss, cut_g = loss_and_grads(cut, cut_labels)
    torch.testing.assert_close(cut_loss, full_loss, rtol=0, atol=1e-6)
    for a, b in zip(cut_g, full_g, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


LAYOUT = Layout(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1)


@pytest.mark.parametrize(
    ("sets", "layout", "attention", "graphs", "want"),
    [
        (["data.packing=none"], LAYOUT, "dense", False, 8),
        (["data.packing=none"], LAYOUT, "varlen", False, 8),
        (["data.packing=bfd"], LAYOUT, "dense", False, 0),  # packed rows: nothing to cut
        (["data.packing=none"], dataclasses.replace(LAYOUT, pp=2), "dense", False, 0),
        (["data.packing=none"], dataclasses.replace(LAYOUT, tp=2), "dense", False, 0),
        (["data.packing=none"], dataclasses.replace(LAYOUT, cp=2), "dense", False, 0),
        (["data.packing=none"], LAYOUT, "flex", False, 0),  # a compiled mask per shape
        (["data.packing=none"], LAYOUT, "varlen", True, 0),  # CUDA graphs: fixed shapes
        (["data.packing=none", "training.compile=true"], LAYOUT, "dense", False, 0),
    ],
)
def test_trimming_only_where_shapes_may_vary(sets, layout, attention, graphs, want):
    recipe = load_recipe("recipes/debug.toml", sets)
    assert padding_trim(recipe, layout, attention, cuda_graphs=graphs) == want
