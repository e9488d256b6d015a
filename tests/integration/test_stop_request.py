"""Checkpoint-and-stop on the launcher's request, in the real Trainer (one process)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from launch.stop_request import StopRequest
from tests.helpers.runs import ROOT, python

SETS = ["training.seq_len=64", "training.steps=3", "training.warmup_steps=1",
        "checkpoint.interval=2", "metrics.tensorboard=false"]  # fmt: skip


def _train(out: Path, stop_file: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", TITANSCALE_STOP_FILE=stop_file)
    cmd = [python(), str(ROOT / "train.py"), "--set", f"job.output_dir={out}"]
    for s in SETS:
        cmd += ["--set", s]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_stop_request_without_process_group(tmp_path):
    assert not StopRequest("").enabled and not StopRequest("").requested()
    req = StopRequest(str(tmp_path / "stop"))
    assert req.enabled and not req.requested()
    (tmp_path / "stop").touch()
    assert req.requested()
    req.acknowledge(7)
    assert (tmp_path / "stop.saved").read_text() == "7\n"


def test_trainer_saves_and_stops_on_request(tmp_path):
    out = tmp_path / "run"
    stop = tmp_path / "stop-request"
    stop.touch()  # asked before the first step: save the start state, train nothing
    p = _train(out, str(stop))
    assert p.returncode == 0, p.stderr[-3000:]
    assert (stop.parent / "stop-request.saved").read_text() == "0\n"
    assert (out / "checkpoint" / "step-0" / ".metadata").exists()
    recs = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert not [r for r in recs if "loss" in r]
    # Resuming from it (and stopping mid-run on SIGUSR1) runs in tests/integration/test_slurm.py.
