"""checkpoint.async_mode = "async" (torchtitan's dcp.async_save) keeps the atomic, verified
commit; [profiling] trace writes torch.profiler traces.

Run A: 4 steps, async save at step 2 (the last step's save is synchronous), traces every 2
steps. Then step-4 is removed and the job restarted: it must resume from the async step-2
checkpoint and reproduce steps 3-4 exactly. Two 1-process runs, seq 64: ~40-60 s."""

from __future__ import annotations

import gzip
import json
import shutil

import pytest

from runtime.checkpoint import verify_checkpoint
from runtime.metrics import read_starts
from tests.helpers.runs import read_losses, run_train

pytestmark = pytest.mark.slow  # training runs: ~30-120 s on 2 shared cores

RUN = [
    "training.seq_len=64",
    "training.warmup_steps=1",
    "training.steps=4",
    "checkpoint.interval=2",
    "checkpoint.keep_latest=0",
    "checkpoint.async_mode=async",
    "metrics.tensorboard=false",
]


def test_async_checkpoint_commits_verified_and_resumes(tmp_path):
    out = tmp_path / "job"
    proc = run_train(out, [*RUN, "profiling.trace=true", "profiling.every=2", "profiling.warmup=1"])
    log = proc.stdout + proc.stderr
    assert "Staging the checkpoint" in log  # torchtitan's async path ran (step 2)
    ckpt = out / "checkpoint"
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-2", "step-4"]  # no .partial
    for step in (2, 4):
        assert (ckpt / f"step-{step}" / "manifest.json").exists()
        assert verify_checkpoint(str(ckpt / f"step-{step}"), checksums=True) == []
    manifest = json.loads((ckpt / "step-2" / "manifest.json").read_text())
    assert manifest["step"] == 2 and all(r["crc32"] is not None for r in manifest["files"].values())
    first = read_losses(out)

    # Traces: torchtitan's profiler wrote a chrome trace for the traced steps.
    traces = sorted(out.glob("profiling/traces/iteration_*/rank0_trace.json.gz"))
    assert [t.parent.name for t in traces] == ["iteration_2", "iteration_4"]
    with gzip.open(traces[0]) as f:
        assert json.load(f)["traceEvents"]

    shutil.rmtree(ckpt / "step-4")
    run_train(out, RUN)  # resumes from the async checkpoint
    assert read_starts(out / "metrics.jsonl")[-1]["resumed_from_step"] == 2
    again = read_losses(out)
    assert again[3] == pytest.approx(first[3], abs=1e-6)
    assert again[4] == pytest.approx(first[4], abs=1e-6)
