"""A straggler injected in a 2-process run (rank 1 sleeps 2 s after fetching every step's
batches) is named in metrics.jsonl and the log."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.helpers.runs import ROOT, child_env, free_port, python


@pytest.mark.slow
def test_sleeping_rank_is_named(tmp_path):
    env = child_env()
    env["TITANSCALE_FAULT"] = "slow:rank=1:step=1:at=batch:seconds=2.0"
    cmd = [python(), "-m", "torch.distributed.run", "--nproc_per_node=2",
           "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{free_port()}",
           str(ROOT / "train.py"), "--set", f"job.output_dir={tmp_path}",
           "--set", "training.steps=5", "--set", "training.seq_len=64",
           "--set", "metrics.straggler_steps=2", "--set", "metrics.tensorboard=false"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    recs = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "event" not in r]
    shown = [{k: r.get(k) for k in ("step", "step_time_s", "slowest_rank", "slowest_rank_ratio",
              "slowest_rank_lateness_s", "straggler_rank")} for r in steps]  # fmt: skip
    shown = json.dumps(shown)  # whole, in the failure message
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5], shown
    # Step 1 starts unaligned (each rank's own set-up); from step 2 on rank 1 is late by
    # its 2 s sleep, and named once that has lasted 2 logged steps. No other rank is named.
    assert all(r["slowest_rank"] == 1 for r in steps[1:]), shown
    assert all(r["slowest_rank_lateness_s"] >= 1.5 for r in steps[1:]), shown
    named = [r["straggler_rank"] for r in steps]
    assert set(named) <= {-1, 1} and named[0] == -1 and named[-2:] == [1, 1], shown
    assert "straggler: rank 1" in proc.stdout + proc.stderr
