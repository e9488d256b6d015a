"""tools.gpu_check's pieces that must hold on a lent GPU: a stage past its timeout is killed
with its whole process group (compile workers too), the report is complete after each write,
and the derived ratios use the right runs."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from tools.gpu_check import OURS, STOCK, Report, derived, parse, run_stage


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for its reaper counts as dead)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def test_timeout_kills_the_process_group(tmp_path):
    pidfile = tmp_path / "grandchild.pid"
    # a background grandchild (as compile workers are), its output detached so that a
    # survivor would not hold the pipe: it is found alive below instead of hanging the test
    cmd = ["bash", "-c", f"sleep 300 >/dev/null 2>&1 & echo $! > {pidfile}; sleep 300"]
    res = run_stage(cmd, 2.0, {"PATH": "/usr/bin:/bin"})
    assert res["timed_out"]
    pid = int(pidfile.read_text())
    try:
        end = time.monotonic() + 10  # SIGKILL is delivered at once; the reaper may lag
        while _alive(pid) and time.monotonic() < end:
            time.sleep(0.05)
        assert not _alive(pid), "the stage's grandchild survived the timeout"
    finally:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_report_rewritten_whole(tmp_path):
    rep = Report(tmp_path, "cmd", "recipes/x.toml")
    rep.data["runs"].append({"trainer": "titanscale", "linear": "bf16",
                             "median_tokens_per_sec_per_gpu": 100.0})  # fmt: skip
    rep.write()
    first = json.loads((tmp_path / "gpu_check.json").read_text())
    rep.data["runs"].append({"trainer": "torchtitan-stock", "linear": "bf16",
                             "median_tokens_per_sec_per_gpu": 98.0})  # fmt: skip
    rep.write()
    second = json.loads((tmp_path / "gpu_check.json").read_text())
    assert len(first["runs"]) == 1 and len(second["runs"]) == 2
    assert second["derived"] == {"ours_over_stock_bf16": round(100 / 98, 4)}
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "gpu_check.json", "gpu_check.log", "gpu_check.md"]  # fmt: skip


def test_derived_and_parsers():
    runs = [{"trainer": "titanscale", "linear": "bf16", "median_tokens_per_sec_per_gpu": 100.0},
            {"trainer": "titanscale", "linear": "fp8_rowwise",
             "median_tokens_per_sec_per_gpu": 140.0}]  # fmt: skip
    assert derived(runs) == {"fp8_rowwise_over_bf16": 1.4}
    ours = "step    1  loss  9.10000  tok/s/gpu 1,000 (useful 990)\nstep    2  loss  8.50000  tok/s/gpu 2,000 (u)"
    assert parse(ours, OURS, 1) == ([2000.0], 8.5)
    stock = "step:  1  loss:  9.1000  grad_norm: 1.0  memory: 1GiB(1%)  tps: 1,200  tflops: 1\n"
    stock += "step:  2  loss:  8.4000  grad_norm: 1.0  memory: 1GiB(1%)  tps: 2,400  tflops: 1\n"
    assert parse(stock, STOCK, 1) == ([2400.0], 8.4)
