"""Throughput report: the summary math (unit) and what a real run writes (1 process)."""

from __future__ import annotations

import pytest

from core.hardware import gpu_kind, peak_flops
from runtime.metrics import percentile, summarize


def rec(step, tps, loss=1.0):
    return {"step": step, "first_step": step, "loss": loss, "tokens_per_sec_per_gpu": tps,
            "useful_tokens_per_sec_per_gpu": tps / 2, "tokens_per_sec_per_node": tps * 8,
            "tflops_per_gpu": tps / 1000, "step_time_s": 1 / tps, "mfu_pct": None,
            "memory_gib": step}  # fmt: skip


def test_percentile():
    assert percentile([5.0], 10) == 5.0
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 50) == 3.0
    assert percentile([1.0, 2.0], 10) == pytest.approx(1.1)


def test_summary_excludes_warmup_and_restarts():
    records = [rec(1, 10.0), rec(2, 20.0), rec(3, 100.0), rec(4, 110.0), rec(5, 120.0)]
    s = summarize(records, skip_steps=2)
    assert s["steps_in_summary"] == 3
    assert s["median_tokens_per_sec_per_gpu"] == 110.0
    assert s["median_useful_tokens_per_sec_per_gpu"] == 55.0
    assert s["p10_tokens_per_sec_per_gpu"] == pytest.approx(102.0)
    assert s["median_mfu_pct"] is None
    assert s["peak_memory_gib"] == 5
    # a process that resumed from step 2 warms up again: steps 3 and 4 are its warmup
    assert summarize(records, skip_steps=2, start_step=2)["steps_in_summary"] == 1
    assert "note" in summarize(records[:2], skip_steps=2)


def test_peak_table():
    assert gpu_kind("NVIDIA H100 80GB HBM3") == "H100"
    assert gpu_kind("NVIDIA GB200") == "GB200"
    assert peak_flops("NVIDIA H200", "bf16") == 989e12
    assert peak_flops("NVIDIA B200", "fp8") == 4500e12
    assert peak_flops("cpu") is None
    assert peak_flops("Some Future GPU") is None
