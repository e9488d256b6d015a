"""A real one-process train.py run writes the metrics report."""

from __future__ import annotations

import json

import pytest

from core.models import model_shape
from tests.helpers.runs import run_train

REQUIRED = (
    "step",
    "loss",
    "tokens_per_sec_per_gpu",
    "useful_tokens_per_sec_per_gpu",
    "tokens_per_sec_per_node",
    "tflops_per_gpu",
    "mfu_pct",
    "mfu_at_precision_peak_pct",
    "memory_gib",
)


@pytest.mark.slow
def test_single_process_run_writes_report(tmp_path):
    proc = run_train(tmp_path, ["training.steps=4", "training.seq_len=128",
                                "metrics.summary_skip_steps=1"])  # fmt: skip
    flops = model_shape("debugmodel").flops_per_token(128)
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    starts = [x for x in lines if x.get("event") == "start"]
    steps = [x for x in lines if "event" not in x]
    assert len(starts) == 1 and starts[0]["resumed_from_step"] == 0
    assert [x["step"] for x in steps] == [1, 2, 3, 4]
    for x in steps:
        for k in REQUIRED:
            assert k in x, k
        # From the definitions: one process, one step per record, local batch 2 x seq 128
        # tokens; FLOPs per token as torchtitan counts them for the debug model.
        tps = 2 * 128 / x["step_time_s"]
        assert x["tokens_per_sec_per_gpu"] == pytest.approx(tps, rel=1e-9)
        assert x["tokens_per_sec_per_node"] == pytest.approx(tps, rel=1e-9)  # 1 process/node
        assert x["tflops_per_gpu"] == pytest.approx(flops * tps / 1e12, rel=1e-9)
        assert x["useful_tokens_per_sec_per_gpu"] <= x["tokens_per_sec_per_gpu"]
        assert x["mfu_pct"] is None  # CPU: no peak to compare with
        assert x["mfu_doc_masked_pct"] is None
        # the document mask keeps at most the causal half of the L x L scores
        assert 0 < x["tflops_doc_masked_per_gpu"] < x["tflops_per_gpu"]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps_in_summary"] == 3
    assert summary["median_tokens_per_sec_per_gpu"] > 0
    assert summary["median_mfu_pct"] is None and summary["median_mfu_at_precision_peak_pct"] is None
    assert summary["data"]["rows_consumed"] >= 4 * 2  # 4 steps x local batch 2
    assert any((tmp_path / "tb").rglob("events.out.tfevents*"))
    out = proc.stdout + proc.stderr
    assert "mfu n/a" in out and "summary (steady state" in out
