"""Honest token and FLOP accounting for packed batches.

- useful tokens: labels != IGNORE_INDEX (what the loss learns from); all tokens: labels.numel()
  (what torchtitan's `tps` counts, padding included).
- attention FLOPs under the document mask vs full causal: the document mask skips every
  (query, key) pair across documents. torchtitan's MFU counts attention as
  12 x layers x heads x head_dim x seq_len FLOPs per token (fwd + bwd, the full L x L score
  matrix); `doc_masked_flops_per_token` swaps that term for the pairs the mask keeps, so a
  second MFU ("mfu_doc_masked_pct") can say how busy the GPU is with work that was done.

Pure functions of the `positions` tensor (documents start where positions == 0, the same
convention torchtitan's masks use).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from data.packing import IGNORE_INDEX


def useful_tokens(labels: torch.Tensor) -> int:
    return int((labels != IGNORE_INDEX).sum())


def document_lengths(positions: torch.Tensor) -> list[list[int]]:
    """Per row, the lengths of its documents (padding counts as one document)."""
    if positions.dim() == 1:
        positions = positions.unsqueeze(0)
    out = []
    L = positions.shape[1]
    for row in positions:
        starts = (row == 0).nonzero(as_tuple=True)[0].tolist()
        if not starts or starts[0] != 0:
            # torchtitan's masks assume every row starts a document; say so loudly.
            raise ValueError("each row's positions must start at 0")
        ends = starts[1:] + [L]
        out.append([e - s for s, e in zip(starts, ends, strict=True)])
    return out


@dataclass(frozen=True)
class AttentionPairs:
    """(query, key) pairs computed per batch: document-masked causal vs plain causal vs full."""

    doc_causal: int
    causal: int
    full: int

    @property
    def doc_over_causal(self) -> float:
        return self.doc_causal / self.causal if self.causal else 0.0


def attention_pairs(positions: torch.Tensor) -> AttentionPairs:
    """Pairs attended (including the diagonal) in a batch with this `positions` tensor."""
    if positions.dim() == 1:
        positions = positions.unsqueeze(0)
    B, L = positions.shape
    doc = sum(n * (n + 1) // 2 for row in document_lengths(positions) for n in row)
    return AttentionPairs(doc_causal=doc, causal=B * L * (L + 1) // 2, full=B * L * L)


def doc_masked_flops(shape, tokens: int, doc_pairs: int) -> float:
    """Training FLOPs (fwd + bwd) of `tokens` positions whose attention kept `doc_pairs`
    (query, key) pairs: accumulate both per logging interval (`attention_pairs(positions)`
    per batch) and divide by interval time x devices for a document-masked MFU."""
    attn = 12 * shape.n_layers * shape.n_heads * shape.head_dim * doc_pairs
    return 6 * shape.non_embedding_params * tokens + attn


def doc_masked_flops_per_token(shape, positions: torch.Tensor) -> float:
    """FLOPs per token (fwd + bwd) with attention counted only over document-masked pairs.

    `shape` is a `core.models.ModelShape`. Same parameter term as torchtitan
    (6 x non-embedding params); the attention term 12 x layers x heads x head_dim x L per
    token is 12 x layers x heads x head_dim x (pairs / tokens) with pairs = L^2 per row in
    torchtitan's count, and here the pairs the document mask keeps.
    """
    tokens = positions.numel()
    return doc_masked_flops(shape, tokens, attention_pairs(positions).doc_causal) / tokens


def mfu_doc_masked_pct(
    shape, positions: torch.Tensor, all_tokens_per_sec_per_gpu: float, peak_flops: float
) -> float:
    """MFU (percent) counting only the attention work the document mask leaves.

    `all_tokens_per_sec_per_gpu` counts every position, padding included (torchtitan's
    `tps`): the FLOPs per token above are per position, padding's matmuls included.
    """
    flops = doc_masked_flops_per_token(shape, positions)
    return 100.0 * flops * all_tokens_per_sec_per_gpu / peak_flops
