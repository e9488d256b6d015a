"""Shared by the document-mask contamination tests (single process and the TP worker).

A batch comes from the real packed stream (bfd, seq 128: several documents per row plus
padding). For each document (and the padding pseudo-document) of each row, its input tokens
are replaced, and every logit outside that document must stay the same.
"""

from __future__ import annotations

import random

import torch

from data.loader import PackedStream
from tests.helpers.tiny_data import CharTokenizer, ListSource

SEQ = 128
BATCH = 2


def packed_batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rng = random.Random(seed)
    alphabet = [chr(c) for c in range(0x4E00, 0x4E00 + 1500)]
    texts = ["".join(rng.choices(alphabet, k=rng.randint(5, 70))) for _ in range(40)]
    s = PackedStream(
        source=ListSource(texts),
        tokenizer=CharTokenizer(),
        seq_len=SEQ,
        dp_rank=0,
        dp_world_size=1,
        packing="bfd",
        window=12,
        infinite=False,
    )
    rows = list(iter(s))
    # Rows with padding and several documents exercise every boundary kind.
    rows.sort(key=lambda r: (-(r[1] == -100).sum().item(), r[0]["input"][0].item()))
    pick = rows[:BATCH]
    x = torch.stack([r[0]["input"] for r in pick])
    pos = torch.stack([r[0]["positions"] for r in pick])
    y = torch.stack([r[1] for r in pick])
    assert (y == -100).any(), "the batch should contain padding"
    return x, pos, y


def spans(pos_row: torch.Tensor) -> list[tuple[int, int]]:
    starts = (pos_row == 0).nonzero(as_tuple=True)[0].tolist()
    return list(zip(starts, starts[1:] + [pos_row.numel()], strict=True))


def build_model(
    backend: str, seed: int = 0, device: str = "cpu", tp: bool = False, family: str = "llama3"
):
    """torchtitan's llama3 debugmodel with the given attention backend, fp32.

    tp: declare torchtitan's llama3 sharding (what Trainer does through
    `update_from_config`), so that `model.parallelize(parallel_dims)` applies TP + SP.
    family "deepseek_v3": its debug model cut to 2 layers (MLA; one dense, one MoE layer).
    """
    from torchtitan.models.common.attention import FlexAttention
    from torchtitan.models.llama3 import model_registry

    from kernels.dense_attention import DenseMaskAttention

    if family == "llama3":
        cfg = model_registry(
            "debugmodel", attn_backend="varlen" if backend == "varlen" else "flex"
        ).model
    else:
        from core.models import model_config

        cfg = model_config("debugmodel", family)
        cfg.layers = cfg.layers[:2]
    if backend == "dense":
        for _, _c, parent, attr in cfg.traverse(FlexAttention.Config):
            if isinstance(parent, list):
                parent[attr] = DenseMaskAttention.Config()
            else:
                setattr(parent, attr, DenseMaskAttention.Config())
    if tp:
        from torchtitan.models.llama3.sharding import set_llama3_sharding_config

        set_llama3_sharding_config(cfg, enable_sp=True)
    torch.manual_seed(seed)
    with torch.device(device):
        model = cfg.build()
        model.init_states()
    return model.eval()


def logits(model, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(x, pos, model.get_attention_masks(positions=pos))
    if hasattr(out, "full_tensor"):
        out = out.full_tensor()
    return out.float()


def contamination(model, x, pos, seed: int = 1) -> dict[str, float]:
    """Max logit change outside a perturbed document, and (control) inside it and with
    positions that do not reset (one document per row: plain causal attention)."""
    gen = torch.Generator().manual_seed(seed)
    base = logits(model, x, pos)
    dev = x.device
    causal_pos = torch.arange(x.shape[1], device=dev).expand_as(pos).contiguous()
    base_causal = logits(model, x, causal_pos)
    outside = inside = control = 0.0
    n = 0
    for b in range(x.shape[0]):
        for s, e in spans(pos[b].cpu()):
            x2 = x.clone()
            x2[b, s:e] = torch.randint(3, 2000, (e - s,), generator=gen).to(dev)
            out = logits(model, x2, pos)
            keep = torch.ones(x.shape[:2], dtype=torch.bool, device=dev)
            keep[b, s:e] = False
            outside = max(outside, (out - base)[keep].abs().max().item())
            inside = max(inside, (out - base)[~keep].abs().max().item())
            if e < x.shape[1] and control == 0.0:  # one control suffices; it costs a forward
                out_c = logits(model, x2, causal_pos)
                later = torch.zeros_like(keep)
                later[b, e:] = True
                control = max(control, (out_c - base_causal)[later].abs().max().item())
            n += 1
    return {"outside": outside, "inside": inside, "causal_control": control, "documents": n}
