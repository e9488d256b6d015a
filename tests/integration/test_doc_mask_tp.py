"""Document masks under tensor parallelism: 2 processes (torchrun, gloo), dense and flex."""

from __future__ import annotations

import json
import os
import socket
import subprocess

import pytest

from tests.helpers.runs import ROOT, python

pytestmark = pytest.mark.multiproc


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_tp2_keeps_documents_apart():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), PYTHON_EXEC=python())
    cmd = [
        python(), "-m", "torch.distributed.run", "--nproc_per_node=2",
        "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{_port()}",
        str(ROOT / "tests" / "helpers" / "doc_mask_tp_worker.py"), "dense", "flex",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    per_rank = json.loads(line[len("RESULT ") :])
    assert len(per_rank) == 2
    for rank, results in enumerate(per_rank):
        for backend in ("dense", "flex"):
            r = results[backend]
            assert r["tp_vs_single"] < 1e-4, (rank, backend, r)
            assert r["outside"] == 0.0, (rank, backend, r)  # exactly, as docs/packing.md says
            assert r["inside"] > 1e-3 and r["causal_control"] > 1e-3, (rank, backend, r)
