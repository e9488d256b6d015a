"""MFU conventions and the peak table against the vendors' datasheet figures.

mfu_pct is against the dense BF16 peak for every precision (torchtitan's get_peak_flops and
Megatron quote it so); mfu_at_precision_peak_pct against the linears' precision. Reference
numbers are the datasheets' "with sparsity" figures halved, typed here from the sources cited
in parallel/hardware.py, not read from the table under test.
"""

from __future__ import annotations

import pytest

from core.hardware import gpu_kind, mfu_pair, peak_flops

# name torch reports -> (dense BF16, dense FP8) TFLOP/s, from the datasheets' sparse figures
DATASHEET = {
    "NVIDIA H100 80GB HBM3": (1979 / 2, 3958 / 2),
    "NVIDIA H200": (1979 / 2, 3958 / 2),
    "NVIDIA H200 NVL": (1671 / 2, 3341 / 2),
    "NVIDIA H800": (1979 / 2, 3958 / 2),
    "NVIDIA B200": (4500 / 2, 9000 / 2),
    "NVIDIA B300 SXM6 AC": (36000 / 8 / 2, 72000 / 8 / 2),  # HGX B300: 8-GPU totals
    "NVIDIA GB300": (360_000 / 2 / 72, 360_000 / 72),  # NVL72: 360 PF FP8 dense per rack
}


@pytest.mark.parametrize("name", sorted(DATASHEET))
def test_peaks_match_datasheets(name):
    bf16, fp8 = DATASHEET[name]
    assert peak_flops(name, "bf16") == pytest.approx(bf16 * 1e12, rel=1e-3)
    assert peak_flops(name, "fp8_rowwise") == pytest.approx(fp8 * 1e12, rel=1e-3)


def test_kinds_do_not_shadow_each_other():
    assert gpu_kind("NVIDIA H200 NVL") == "H200_NVL"
    assert gpu_kind("NVIDIA H200") == "H200"
    assert gpu_kind("NVIDIA GB300") == "GB300"
    assert gpu_kind("NVIDIA B300 SXM6 AC") == "B300"
    assert gpu_kind("NVIDIA GB200") == "GB200"
    assert peak_flops("NVIDIA B300 SXM6 AC", "mxfp8") == 4500e12  # SM100: block-scaled FP8
    assert peak_flops("NVIDIA H800", "mxfp8") is None  # Hopper has no MXFP8 tensor cores


def test_fp8_run_as_fast_as_bf16_shows_the_same_mfu():
    flops = 400e12  # 400 TFLOP/s of model FLOPs on one H100
    bf16 = mfu_pair(flops, "NVIDIA H100 80GB HBM3", "bf16")
    fp8 = mfu_pair(flops, "NVIDIA H100 80GB HBM3", "fp8_rowwise")
    assert bf16[0] == bf16[1] == pytest.approx(100 * 400 / 989)
    assert fp8[0] == pytest.approx(100 * 400 / 989)  # same speed, same MFU
    assert fp8[1] == pytest.approx(100 * 400 / 1979)  # about half, against the FP8 peak
    assert mfu_pair(flops, "cpu", "fp8") == (None, None)
