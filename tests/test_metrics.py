"""Throughput report: the summary math (unit) and what a real run writes (1 process)."""

from __future__ import annotations

import json

import pytest

from core.hardware import gpu_kind, peak_flops
from runtime.metrics import percentile, summarize
from tests.conftest import run_train

REQUIRED = (
    "step",
    "loss",
    "tokens_per_sec_per_gpu",
    "useful_tokens_per_sec_per_gpu",
    "tokens_per_sec_per_node",
    "tflops_per_gpu",
    "mfu_pct",
    "memory_gib",
)


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


def test_single_process_run_writes_report(tmp_path):
    proc = run_train(tmp_path, ["training.steps=4", "training.seq_len=128",
                                "metrics.summary_skip_steps=1"])  # fmt: skip
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    starts = [x for x in lines if x.get("event") == "start"]
    steps = [x for x in lines if "event" not in x]
    assert len(starts) == 1 and starts[0]["resumed_from_step"] == 0
    assert [x["step"] for x in steps] == [1, 2, 3, 4]
    for x in steps:
        for k in REQUIRED:
            assert k in x, k
        assert x["tokens_per_sec_per_gpu"] > 0
        assert x["useful_tokens_per_sec_per_gpu"] <= x["tokens_per_sec_per_gpu"]
        assert x["mfu_pct"] is None  # CPU: no peak to compare with
        assert x["mfu_doc_masked_pct"] is None
        # the document mask keeps at most the causal half of the L x L scores
        assert 0 < x["tflops_doc_masked_per_gpu"] < x["tflops_per_gpu"]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps_in_summary"] == 3
    assert summary["median_tokens_per_sec_per_gpu"] > 0
    assert summary["data"]["rows_consumed"] >= 4 * 2  # 4 steps x local batch 2
    assert any((tmp_path / "tb").rglob("events.out.tfevents*"))
    out = proc.stdout + proc.stderr
    assert "mfu n/a" in out and "summary (steady state" in out
