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


def test_step_record_follows_the_definitions():
    """One logged interval of TitanscaleMetrics.log, recomputed from the metric definitions:
    tokens/s per GPU = tokens / (seconds x GPUs that share one batch: tp x cp x pp), per node
    = per GPU x processes per node, TFLOP/s = torchtitan's FLOPs per token x tokens/s, MFU =
    that over the dense BF16 peak of the GPU."""
    import time
    from types import SimpleNamespace

    from core.models import model_shape
    from runtime.metrics import TitanscaleMetrics

    shape = model_shape("8B")
    flops_per_token = shape.flops_per_token(8192)
    tokens = 4 * 8192
    ns = SimpleNamespace(
        time_last_log=time.perf_counter() - 2.0,
        last_logged_step=0,
        parallel_dims=SimpleNamespace(non_data_parallel_size=4),  # e.g. tp 2 x pp 2
        ntokens_since_last_log=tokens,
        useful_ntokens_since_last_log=tokens - 1000,
        doc_attn_pairs_since_last_log=4 * 8192 * 8193 // 2,
        num_flops_per_token=flops_per_token,
        peak=peak_flops("H100", "bf16"),
        precision_peak=peak_flops("H100", "fp8"),  # an FP8 run: MFU still against BF16's peak
        shape=shape,
        device_memory_monitor=SimpleNamespace(
            get_peak_stats=lambda: SimpleNamespace(max_reserved_gib=1.5),
            reset_peak_stats=lambda: None,
        ),
        data_loading_times=[],
        procs_per_node=8,
        records=[],
        _jsonl=None,
        logger=SimpleNamespace(log=lambda *a, **k: None),
        is_metrics_rank=False,
    )
    TitanscaleMetrics.log(ns, 1, 2.0, 2.5, 1.0)  # type: ignore[arg-type]
    rec = ns.records[0]
    dt = rec["step_time_s"]  # one step in the interval
    assert 2.0 <= dt < 60
    tps = tokens / (dt * 4)
    assert rec["tokens_per_sec_per_gpu"] == pytest.approx(tps, rel=1e-12)
    assert rec["useful_tokens_per_sec_per_gpu"] == pytest.approx((tokens - 1000) / (dt * 4))
    assert rec["tokens_per_sec_per_node"] == pytest.approx(8 * tps)
    assert rec["tflops_per_gpu"] == pytest.approx(flops_per_token * tps / 1e12)
    assert rec["mfu_pct"] == pytest.approx(100 * flops_per_token * tps / 989e12)
    assert rec["mfu_at_precision_peak_pct"] == pytest.approx(100 * flops_per_token * tps / 1979e12)
    assert rec["padding_pct"] == pytest.approx(100 * 1000 / tokens)
    # Causal pairs only: the document-masked count charges half the L x L attention scores.
    assert rec["tflops_doc_masked_per_gpu"] < rec["tflops_per_gpu"]
    assert rec["memory_gib"] == 1.5
