"""tools.bench: a real (tiny) run measured into JSON + PNG; bad input exits 2."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.helpers.runs import ROOT, child_env, python


def test_bench_rejects_warmup_not_below_steps():
    proc = subprocess.run(
        [python(), "-m", "tools.bench", "--steps", "3", "--warmup", "3"],
        cwd=ROOT, env=child_env(), capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 2 and "--warmup" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_bench_measures_a_run(tmp_path):
    proc = subprocess.run(
        [python(), "-m", "tools.bench", "--steps", "4", "--warmup", "1",
         "--out", str(tmp_path), "--set", "training.seq_len=128"],
        cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "bench.json").read_text())
    m = result["measured"]
    assert m["steps_in_summary"] == 3
    assert m["p10_tokens_per_sec_per_gpu"] <= m["median_tokens_per_sec_per_gpu"]
    assert m["median_tokens_per_sec_per_gpu"] <= m["p90_tokens_per_sec_per_gpu"]
    assert result["environment"]["torchtitan"] == "0.3.0"
    assert (tmp_path / "bench.png").stat().st_size > 1000
