"""tools/gpu_check.sh --cpu-smoke end to end: probe, gpu-marked tests (skipping here), ours
and torchtitan's stock Trainer on the debug model with emulated FP8; the report lands in
$OUT as at most 6 files, run folders elsewhere, both MFU fields in metrics.jsonl and
summary.json. Trimmed to one backend and one test file to stay short (53 s on the 2-core
machine, 4.3 min under load average 9); the full GPU check runs the same code, every stage."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.helpers.runs import ROOT, child_env


@pytest.mark.slow
def test_cpu_smoke_end_to_end(tmp_path):
    out, work = tmp_path / "OUT", tmp_path / "work"
    env = child_env()
    env["OUT"] = str(out)
    env["TMPDIR"] = str(tmp_path)
    cmd = ["bash", str(ROOT / "tools" / "gpu_check.sh"), "--cpu-smoke", "--work", str(work),
           "--linears", "fp8_rowwise", "--tests", "tests/integration/test_doc_mask.py"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    files = sorted(p.name for p in out.iterdir())
    assert files == ["gpu_check.json", "gpu_check.log", "gpu_check.md"]  # <= 6, nothing else
    rep = json.loads((out / "gpu_check.json").read_text())
    assert rep["status"] == "complete"
    assert [s["name"] for s in rep["stages"]] == ["probe", "gpu tests"]
    assert rep["probe"]["torchtitan"] == "0.3.0" and "spmd_backend" in rep["probe"]
    assert "skipped" in rep["stages"][1]["note"]  # the gpu tests skip here, with reasons
    runs = {r["trainer"]: r for r in rep["runs"]}
    assert set(runs) == {"titanscale", "torchtitan-stock"}
    for r in runs.values():
        assert r["exit_code"] == 0 and r["steps_measured"] == 3  # 4 steps, 1 warmup
        assert r["median_tokens_per_sec_per_gpu"] > 0
        assert r["mfu_pct"] is None and "mfu_at_precision_peak_pct" in r  # CPU: no peak
    # same config, same data: the two trainers' losses agree (emulated FP8 both)
    assert abs(runs["titanscale"]["final_loss"] - runs["torchtitan-stock"]["final_loss"]) < 1e-4
    assert "ours_over_stock_fp8_rowwise" in rep["derived"]
    md = (out / "gpu_check.md").read_text()
    assert "MFU % (BF16 peak)" in md and "MFU % (precision peak)" in md
    # run folders under --work, not $OUT; ours writes both MFU fields
    ours = work / "titanscale-fp8_rowwise"
    rec = [json.loads(x) for x in (ours / "metrics.jsonl").read_text().splitlines()]
    steps = [x for x in rec if "event" not in x]
    assert steps and all("mfu_pct" in x and "mfu_at_precision_peak_pct" in x for x in steps)
    summary = json.loads((ours / "summary.json").read_text())
    assert "median_mfu_pct" in summary and "median_mfu_at_precision_peak_pct" in summary
    assert summary["precision"] == "fp8"
