"""30 training steps of torchtitan's debug Llama with each linear backend (emulated on CPU)
track the BF16 backend's loss curve.

A direct single-process loop (model on CPU, dense attention, AdamW with the debug recipe's
lr / warmup / weight decay / clipping, byte tokens of fixed standard-library sources, seq 128,
batch 2), built through the same `select_kernels` + `apply_kernels` the runtime uses. The
BF16 backend runs in fp32 on CPU (the debug recipe's dtype), so the curves differ only by the
quantization. Stated distance: |loss - loss_bf16| <= 0.05 at every step and <= 0.02 at the
last (measured here: at most 0.006 and 0.001), while the loss falls from ~8.1 to < 3.
"""

from __future__ import annotations

import inspect
import json.decoder
import json.encoder
from functools import cache

import pytest
import torch
from torchtitan.models.llama3 import llama3_configs

from kernels.caps import DeviceCaps
from kernels.registry import apply_kernels, select_kernels
from recipe.schema import KernelsSection

STEPS, BATCH, SEQ = 30, 2, 128
LR, WARMUP, WEIGHT_DECAY, MAX_NORM = 8e-4, 2, 0.1, 1.0


def batches() -> torch.Tensor:
    """(STEPS, BATCH, SEQ + 1) byte tokens of fixed source text (vocab 2048 > 256)."""
    text = "".join(inspect.getsource(m) for m in (json.decoder, json.encoder, inspect))
    tokens = torch.tensor(list(text.encode()), dtype=torch.long)
    return tokens[: STEPS * BATCH * (SEQ + 1)].view(STEPS, BATCH, SEQ + 1)


@cache
def loss_curve(linear: str) -> tuple[float, ...]:
    # One thread: the emulated MX casts are many small ops, which two threads on two shared
    # cores slow down by an order of magnitude (measured 535 s vs 23 s for mxfp8).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _loss_curve(linear)
    finally:
        torch.set_num_threads(threads)


def _loss_curve(linear: str) -> tuple[float, ...]:
    choice = select_kernels(
        KernelsSection(attention="dense", linear=linear), DeviceCaps.cpu(), seq_len=SEQ
    )
    report = apply_kernels(llama3_configs["debugmodel"](attn_backend="flex"), choice)
    torch.manual_seed(0)
    model = report.model_config.build()
    model.init_states(buffer_device=None)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / WARMUP))
    positions = torch.arange(SEQ).repeat(BATCH, 1)
    masks = model.get_attention_masks(positions)
    data = batches()
    losses = []
    for step in range(STEPS):
        inputs, labels = data[step, :, :-1], data[step, :, 1:]
        logits = model(inputs, positions=positions, attention_masks=masks)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        sched.step()
        losses.append(loss.item())
    return tuple(losses)


@pytest.mark.parametrize("linear", ["fp8_rowwise", "fp8_rowwise_gw_hp", "mxfp8"])
def test_loss_curve_tracks_bf16(linear):
    ref = loss_curve("bf16")
    got = loss_curve(linear)
    assert ref[0] > 7.5 and ref[-1] < 3.0  # the reference learns
    diffs = [abs(a - b) for a, b in zip(got, ref, strict=True)]
    assert max(diffs) <= 0.05, diffs
    assert diffs[-1] <= 0.02, diffs
    assert max(diffs) > 1e-5  # the backend changed the numerics: conversion happened
