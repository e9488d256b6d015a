"""train.py with rl.generator = "vllm": the engine's absence refused in one line; a run whose
every update has a real train/inference mismatch; a killed engine ending the run in one line
and the rerun resuming from the last checkpoint."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.runs import RL_TINY, ROOT, child_env, run_train, train_main_error

RECIPE = "recipes/rl_debug.toml"
TINY = [*RL_TINY, "rl.generator=vllm", "checkpoint.interval=1"]


def test_without_the_engine_environment_one_line_naming_the_setup_command(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("TITANSCALE_VLLM_PYTHON", str(tmp_path / "no-such-python"))
    argv = ["--recipe", RECIPE]
    for o in [*TINY, f"job.output_dir={tmp_path / 'out'}"]:
        argv += ["--set", o]
    code, errors = train_main_error(argv, capsys)
    assert code == 2
    assert len(errors) == 1 and "rl.generator" in errors[0], errors
    assert "bash scripts/setup.sh --vllm" in errors[0]


def _records(out: Path) -> list[dict]:
    p = out / "metrics.jsonl"
    if not p.is_file():
        return []
    recs = []
    for line in p.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):  # a line being written
            recs.append(json.loads(line))
    return [r for r in recs if "event" not in r and "loss" in r]


def _engine_pid(pid: int) -> int | None:
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            cmd = Path(f"/proc/{child}/cmdline").read_bytes()
            if b"vllm_server.py" in cmd:
                return int(child)
    return None


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_run_mismatch_every_update_killed_engine_then_resume(tmp_path):
    out = tmp_path / "run"
    args = [sys.executable, str(ROOT / "train.py"), "--recipe", RECIPE]
    run = [*TINY, "training.steps=8", "rl.tis_cap=2.0", "rl.generator_dtype=bfloat16"]
    for o in [*run, f"job.output_dir={out}"]:
        args += ["--set", o]
    proc = subprocess.Popen(
        args, cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 480
        while len(_records(out)) < 2 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        engine = _engine_pid(proc.pid)
        assert engine is not None
        os.kill(engine, signal.SIGKILL)  # the engine this test's train.py started
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 2, err[-3000:]
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "vLLM engine" in errors[0], err[-3000:]
    done = max(r["step"] for r in _records(out))
    assert done < 8
    # The rerun resumes after the last checkpointed update and finishes.
    run_train(out, run, recipe=RECIPE, timeout=600)
    recs = _records(out)
    assert max(r["step"] for r in recs) == 8
    steps_after = [r["step"] for r in recs if r["step"] > done]
    assert steps_after == list(range(done + 1, 9)), [r["step"] for r in recs]
    for r in recs:  # vLLM vs the trainer on the same weights: a real, finite gap
        assert math.isfinite(r["train_infer_kl"]) and r["train_infer_kl"] > 0, r
        assert math.isfinite(r["behaviour_kl"])
