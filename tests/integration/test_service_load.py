"""Load: 4 SDK client processes x 50 steps at once against one service, each session's
losses equal to the same client running alone, every step run exactly once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import pytest

pytest.importorskip("tinker")

from tests._service_helpers import KEY, ROOT, start_server  # noqa: E402

CLIENTS, STEPS = 4, 50


def _run(server, tmp, seeds, tag):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    procs = []
    for s in seeds:
        out = tmp / f"{tag}-{s}.json"
        cmd = [sys.executable, str(ROOT / "tests" / "_service_load_client.py"), server.url, KEY,
               str(s), str(STEPS), str(out)]
        procs.append((s, out, subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                               stderr=subprocess.STDOUT, text=True)))
    results = {}
    for s, out, p in procs:
        log, _ = p.communicate(timeout=600)
        assert p.returncode == 0, log[-3000:]
        results[s] = json.loads(out.read_text())
    return results


@pytest.mark.slow
def test_four_clients_fifty_steps_each(tmp_path):
    server = start_server(tmp_path)
    try:
        alone = {}
        for s in range(CLIENTS):  # each client alone, one after another
            alone.update(_run(server, tmp_path, [s], "alone"))
        t0 = time.monotonic()
        together = _run(server, tmp_path, range(CLIENTS), "together")
        wall = time.monotonic() - t0
        for s in range(CLIENTS):
            a, b = alone[s]["losses"], together[s]["losses"]
            assert len(b) == STEPS
            assert max(abs(x - y) for x, y in zip(a, b, strict=True)) <= 1e-5, (s, a, b)
            assert b[-1] < b[0]  # it trained
            u = httpx.get(f"{server.url}/api/v1/sessions/{together[s]['session_id']}/usage",
                          headers={"X-API-Key": KEY}).json()
            # every step ran exactly once: no lost and no duplicated operation
            assert u["ops"] == {"create_model": 1, "forward_backward": STEPS, "optim_step": STEPS,
                                "free": 1}, u
            assert u["failed_ops"] == {}
        print(f"4 clients x {STEPS} steps together: {wall:.1f} s")
    finally:
        assert server.stop() == 0
