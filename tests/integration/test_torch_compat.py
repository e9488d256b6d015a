"""The torch-version bridges (runtime.platform, items 6-9): a torch without the symbols
torchtitan 0.3.0 needs beyond torch 2.11 still trains the debug recipe with the same losses,
and a pipeline run on a torch whose schedules lack step(arg_mbs=...) stops with one line.

Reference: the same recipe on the unmodified torch 2.14 (spmd_types backend); the bridged run
uses partial_dtensor, a different torchtitan code path, so equal losses are not a tautology.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers.runs import ROOT, child_env, free_port, read_losses, run_train

WORKER = ROOT / "tests" / "integration" / "_old_torch_worker.py"
FAST = ["training.seq_len=128", "training.steps=3", "metrics.tensorboard=false"]


def _old(args: list[str], *, pipeline: bool = False, env=None) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        str(WORKER),
        *(["--no-pipeline-kwargs"] if pipeline else []),
        "--",
        *args,
    ]
    return subprocess.run(cmd, cwd=ROOT, env=env or child_env(), capture_output=True, text=True,
                          timeout=600)  # fmt: skip


def test_old_torch_trains_debug_recipe_like_new(tmp_path):
    ref_out, old_out = tmp_path / "ref", tmp_path / "old"
    run_train(ref_out, FAST)
    args = ["--set", f"job.output_dir={old_out}"]
    for o in FAST:
        args += ["--set", o]
    proc = _old(args)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert (
        "bridged DataParallelMeshDims, set_timeout (runtime.platform); "
        "spmd backend partial_dtensor" in log
    )
    ref, old = read_losses(ref_out), read_losses(old_out)
    assert sorted(old) == sorted(ref) == [1, 2, 3]
    for s in ref:
        assert abs(old[s] - ref[s]) <= 2e-4, (s, old[s], ref[s])


def test_old_torch_pipeline_stops_with_one_line(tmp_path):
    env = child_env()
    env.update(WORLD_SIZE="2", RANK="0", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2")
    args = ["--set", f"job.output_dir={tmp_path}", "--set", "parallel.pp=2",
            "--set", "parallel.dp_shard=1", *[x for o in FAST for x in ("--set", o)]]  # fmt: skip
    proc = _old(args, pipeline=True, env=env)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    line = lines[0]
    import torch

    assert f"torch {torch.__version__}" in line and "arg_mbs" in line and "loss_kwargs" in line
    assert "parallel.pp = 1" in line
    assert not (tmp_path / "metrics.jsonl").exists()  # stopped before training


@pytest.mark.multiproc
@pytest.mark.slow  # measured: over 60 s on 2 loaded cores (#31)
def test_old_torch_tensor_parallel_matches_new(tmp_path):
    """2 ranks, TP 2: the bridged set_timeout and the partial_dtensor backend under torchrun
    (measured here: losses equal to 5 decimals, 7.93755 / 8.00565 / 7.96750)."""
    tp2 = [*FAST, "parallel.tp=2", "parallel.dp_shard=1"]
    ref_out, old_out = tmp_path / "ref", tmp_path / "old"
    run_train(ref_out, tp2, nproc=2)
    args = ["--set", f"job.output_dir={old_out}", *[x for o in tp2 for x in ("--set", o)]]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{free_port()}", str(WORKER),
           "--", *args]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "spmd backend partial_dtensor" in proc.stdout + proc.stderr
    ref, old = read_losses(ref_out), read_losses(old_out)
    assert sorted(old) == sorted(ref) == [1, 2, 3]
    for s in ref:
        assert abs(old[s] - ref[s]) <= 2e-4, (s, old[s], ref[s])
