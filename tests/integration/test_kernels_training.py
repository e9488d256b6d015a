"""The debug recipe trained 30 steps through train.py with each linear backend (emulated on
CPU) tracks the BF16 backend's loss curve, and reports the backend in its first lines.

One process, seq 128, local batch 2, 30 steps, dense attention; every run starts from the same
seeded weights and reads the same data, and the BF16 backend runs in fp32 (the debug
recipe's CPU dtype), so the curves differ only by the quantization. Stated distance:
|loss - loss_bf16| <= 0.05 at every step and <= 0.02 at step 30 (measured here: see
docs/kernels.md), while the loss falls by more than 1 nat.
"""

from __future__ import annotations

import pytest

from tests.helpers.runs import read_losses, run_train

STEPS = 30
COMMON = [
    f"training.steps={STEPS}",
    "training.seq_len=128",
    "training.local_batch_size=2",
    "metrics.tensorboard=false",
]


def train(tmp_path_factory, linear: str):
    out = tmp_path_factory.mktemp(f"train_{linear}")
    proc = run_train(out, [f"kernels.linear={linear}", *COMMON])
    return read_losses(out), proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def bf16_curve(tmp_path_factory):
    losses, _log = train(tmp_path_factory, "bf16")
    return losses


@pytest.mark.slow
@pytest.mark.parametrize("linear", ["fp8_rowwise", "fp8_rowwise_gw_hp", "mxfp8", "fp8_tensorwise"])
def test_loss_curve_tracks_bf16(tmp_path_factory, bf16_curve, linear):
    losses, log = train(tmp_path_factory, linear)
    # The backend is reported before training starts, with the emulation notice.
    head = log[: log.index("Training starts")]
    assert f"kernels: attention=dense linear={linear} (emulated) on cpu" in head
    assert f"kernels.linear={linear}: no " in head and "emulated" in head
    assert f"linear {linear} (emulated): converted 30 of 31 linears" in head
    assert "skipped lm_head" in head

    ref = bf16_curve
    assert sorted(losses) == sorted(ref) == list(range(1, STEPS + 1))
    assert ref[1] > 7.5 and ref[STEPS] < ref[1] - 1.0  # the reference learns
    diffs = [abs(losses[s] - ref[s]) for s in ref]
    assert max(diffs) <= 0.05, diffs
    assert diffs[-1] <= 0.02, diffs
    assert max(diffs) > 1e-6  # the backend changed the numerics: conversion happened
    print(f"{linear}: max |dloss| {max(diffs):.2e}, step {STEPS} |dloss| {diffs[-1]:.2e}")


# Layouts of the same job differ only by float reduction order (the layout tests' bound).
TP_TOL = 2e-4


@pytest.mark.multiproc
def test_emulated_mxfp8_under_tensor_parallel(tmp_path, seed_checkpoint):
    """torchtitan's TP plan over the converted (emulated MX) linears: 2 processes, gloo, match
    the 1-process MX run from the same seed checkpoint on the same tokens. TP splits every
    GEMM's K at multiples of 32, so the MX scaling blocks are the same blocks."""
    run = [
        "kernels.linear=mxfp8",
        "training.steps=3",
        f"checkpoint.load_from={seed_checkpoint}",
        *COMMON[1:],
    ]
    run_train(tmp_path / "one", run)
    proc = run_train(tmp_path / "tp2", [*run, "parallel.tp=2"], nproc=2)
    log = proc.stdout + proc.stderr
    assert "linear mxfp8 (emulated): converted 30 of 31 linears" in log
    ref = read_losses(tmp_path / "one")
    losses = read_losses(tmp_path / "tp2")
    assert sorted(losses) == sorted(ref) == [1, 2, 3]
    diffs = {s: abs(losses[s] - ref[s]) for s in ref}
    print(f"mxfp8 tp2 vs 1 process: {diffs}")
    assert max(diffs.values()) <= TP_TOL, (losses, ref)
