"""Exact masked attention for CPU: the BlockMask's mask_mod, materialised densely.

Why: on CPU, FlexAttention has no backward ("FlexAttention does not support backward on
CPU") and varlen needs `aten::_flash_attention_forward` (CUDA only), while torchtitan 0.3.0
accepts only those two for language models. This backend subclasses FlexAttention so the
decoder still builds the same causal + packed-document BlockMask (one mask definition for
every backend), then evaluates that mask's `mask_mod` on the full (B, 1, L, L) grid and
calls SDPA's math path with a boolean mask.

Cost: O(B x L^2) booleans for the mask and O(B x H x L^2) for the scores: fine for the debug
model and tests (seq 256-2048), never for real training. `kernels.attention = "dense"`
selects it; `auto` selects it on CPU only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask
from torchtitan.models.common.attention import FlexAttention


def dense_mask_from_block_mask(block_mask: BlockMask, batch: int, q_len: int, kv_len: int):
    """Evaluate `block_mask.mask_mod` on every (b, q, kv): a (B, 1, Lq, Lkv) bool tensor."""
    device = block_mask.kv_num_blocks.device
    b = torch.arange(batch, device=device).view(batch, 1, 1)
    h = torch.zeros(1, 1, 1, dtype=torch.long, device=device)
    q = torch.arange(q_len, device=device).view(1, q_len, 1)
    kv = torch.arange(kv_len, device=device).view(1, 1, kv_len)
    # torchtitan's mask_mods index per-batch tensors with `b` and compare indices, so they
    # broadcast over these grids exactly as flex evaluates them block by block.
    mask = block_mask.mask_mod(b, h, q, kv)
    return mask.expand(batch, q_len, kv_len).unsqueeze(1)


class DenseMaskAttention(FlexAttention):
    """Drop-in for FlexAttention (same inputs, same mask) that runs anywhere, exactly."""

    @dataclass(kw_only=True, slots=True)
    class Config(FlexAttention.Config):
        pass

    def forward(  # type: ignore[override]
        self,
        q_BLNH: torch.Tensor,
        k_BLNH: torch.Tensor,
        v_BLNH: torch.Tensor,
        *,
        attention_masks: BlockMask,
        score_mod=None,
        scale: float | None = None,
        enable_gqa: bool = False,
        out_transform=None,
        **kwargs,
    ) -> torch.Tensor:
        if score_mod is not None:
            raise NotImplementedError("dense attention supports plain masked attention only")
        if not isinstance(attention_masks, BlockMask):
            raise TypeError(f"expected a BlockMask, got {type(attention_masks).__name__}")
        B, Lq = q_BLNH.shape[:2]
        Lkv = k_BLNH.shape[1]
        mask = dense_mask_from_block_mask(attention_masks, B, Lq, Lkv)
        q, k, v = (t.transpose(1, 2) for t in (q_BLNH, k_BLNH, v_BLNH))
        if out_transform is not None:
            return out_transform(*_attention_with_lse(q, k, v, mask, scale))
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa
        )
        return out.transpose(1, 2)


def _attention_with_lse(q, k, v, mask, scale):  # noqa: ANN001, ANN202
    """(out (B, L, N, H), logsumexp (B, L, N)) of masked softmax attention on (B, N, L, H)
    inputs: what flex / varlen hand an `out_transform` (GPT-OSS's attention sinks rescale
    the output by sigmoid(lse - sink)). Explicit scores: the same O(L^2) as the SDPA path."""
    if k.shape[1] != q.shape[1]:  # grouped-query attention: repeat the key/value heads
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = (q @ k.transpose(-2, -1)) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.softmax(scores, dim=-1) @ v
    return out.transpose(1, 2), lse.transpose(1, 2)


def all_partial_block_mask(mask_mod, batch: int, seq_len: int, block_size, device) -> BlockMask:
    """A BlockMask whose every (query block, key block) tile is partial: `mask_mod` decides
    every entry. A valid mask for any consumer (flex would just skip no tile), built from
    index tensors alone: no mask evaluation, no compilation. `block_size`: an int or
    torch's (query, key) pair."""
    q_bs, kv_bs = (block_size, block_size) if isinstance(block_size, int) else block_size
    nq, nkv = -(-seq_len // q_bs), -(-seq_len // kv_bs)
    num = torch.full((batch, 1, nq), nkv, dtype=torch.int32, device=device)
    idx = torch.arange(nkv, dtype=torch.int32, device=device).expand(batch, 1, nq, nkv)
    return BlockMask.from_kv_blocks(
        num,
        idx.contiguous(),
        BLOCK_SIZE=(q_bs, kv_bs),
        mask_mod=mask_mod,
        seq_lengths=(seq_len, seq_len),
    )


def _install_uncompiled_masks() -> None:
    """Masks for DenseMaskAttention without torch.compile.

    torchtitan's decoder builds every FlexAttention-family mask with a `torch.compile`d
    `create_block_mask` (torchtitan.models.common.attention.create_attention_mask), and has no
    seam to choose otherwise. On CPU that compile (inductor, C++) costs seconds to tens of
    seconds per new (batch, length) shape, and torch recompiles once more with dynamic shapes
    after the second one: measured 8 s and 27 s under load (benchmarks/peers.md), i.e. the
    first step of every CPU run, the first two GRPO updates (rollout lengths vary) and the
    service's first forward_backward calls. The dense backend only reads the mask's
    `mask_mod`, so for models configured with it the decoder's mask builder is replaced by
    `all_partial_block_mask` (microseconds); every other backend keeps torchtitan's path.
    Installed once, when this module is imported (a DenseMaskAttention config cannot exist
    before that)."""
    from torch.nn.attention.flex_attention import and_masks
    from torchtitan.models.common.decoder import Decoder

    original = Decoder._create_flex_attention_mask
    if getattr(original, "_titanscale_dense", False):
        return

    def _create_flex_attention_mask(self, positions, attn_config, mask_mods):
        inner = attn_config.inner_attention
        if not isinstance(inner, DenseMaskAttention.Config):
            return original(self, positions, attn_config, mask_mods)
        B, L = positions.shape
        return all_partial_block_mask(
            and_masks(*mask_mods), B, L, inner.block_size, positions.device
        )

    _create_flex_attention_mask._titanscale_dense = True  # type: ignore[attr-defined]
    Decoder._create_flex_attention_mask = _create_flex_attention_mask  # type: ignore[method-assign]


_install_uncompiled_masks()
