"""tools.preflight under torchrun (4 gloo processes): every collective checked per mesh group."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.helpers.runs import ROOT, free_port, python


@pytest.mark.multiproc
def test_preflight_under_torchrun(tmp_path):
    """4 CPU processes, pp2 x tp2: every axis's collective runs and checks out."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHON_EXEC=python())
    cmd = [
        python(), "-m", "torch.distributed.run", "--nproc-per-node=4",
        f"--master-port={free_port()}", "--module", "tools.preflight",
        "--recipe", str(ROOT / "recipes" / "debug.toml"),
        "--set", "parallel.tp=2", "--set", "parallel.pp=2",
        "--cluster", "local_cpu", "--out", str(tmp_path), "--size-mb", "0.25",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "pre-flight: OK" in proc.stdout
    rep = json.loads((tmp_path / "preflight.json").read_text())
    ran = {(r["axis"], r["op"]) for r in rep["results"]}
    # dp_shard is 1 here; the Slurm test runs dp_shard 8 (all-gather, reduce-scatter).
    assert ran == {("tp", "all_reduce"), ("pp", "send_recv")}
    assert all(r["ok"] and r["max_error"] == 0 and r["busbw_gbs"] > 0 for r in rep["results"])
    assert all(r["predicted_busbw_gbs"] == pytest.approx(10.0) for r in rep["results"])
    placement = json.loads((tmp_path / "placement.json").read_text())
    assert [r["rank"] for r in placement["ranks"]] == [0, 1, 2, 3]
    assert placement["layout"] == {"pp": 2, "dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 2}
