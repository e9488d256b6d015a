"""Load: 4 SDK client processes x 20 steps at once against one service, each session's
losses equal to the same client running alone, every step run exactly once. The clients
start training together (a file barrier after each has created its model) and the service's
operation log shows their steps interleaved, so the concurrency is checked, not assumed.
(50 steps each before: the claims need overlap and every op counted, not length.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import pytest

pytest.importorskip("tinker")

from tests.helpers.service_server import KEY, ROOT, start_server  # noqa: E402

CLIENTS, STEPS = 4, 20


def _run(server, tmp, groups: list[str], tag):
    """One client process per group of comma-separated seeds (a group's seeds run in turn);
    several groups wait for each other before their first step."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    barrier = tmp / f"{tag}-barrier"
    barrier.mkdir()
    procs = []
    for i, seeds in enumerate(groups):
        out = tmp / f"{tag}-{i}.json"
        cmd = [
            sys.executable,
            str(ROOT / "tests" / "helpers" / "service_load_client.py"),
            server.url,
            KEY,
            seeds,
            str(STEPS),
            str(out),
            *([str(barrier), str(len(groups))] if len(groups) > 1 else []),
        ]
        procs.append(
            (
                out,
                subprocess.Popen(
                    cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
                ),
            )
        )
    results = {}
    for out, p in procs:
        log, _ = p.communicate(timeout=600)
        assert p.returncode == 0, log[-3000:]
        results.update({int(k): v for k, v in json.loads(out.read_text()).items()})
    return results


@pytest.mark.slow
def test_four_clients_twenty_steps_each(tmp_path):
    # One layer keeps the 160 steps of this test (4 x 20, alone then together) short.
    server = start_server(tmp_path, sets=["model.layers=1", "training.seq_len=64"])
    try:
        seeds = [str(s) for s in range(CLIENTS)]
        alone = _run(server, tmp_path, [",".join(seeds)], "alone")  # one after another
        t0 = time.monotonic()
        together = _run(server, tmp_path, seeds, "together")  # four processes at once
        wall = time.monotonic() - t0
        for s in range(CLIENTS):
            a, b = alone[s]["losses"], together[s]["losses"]
            assert len(b) == STEPS
            assert max(abs(x - y) for x, y in zip(a, b, strict=True)) <= 1e-5, (s, a, b)
            assert b[-1] < b[0]  # it trained
            u = httpx.get(
                f"{server.url}/api/v1/sessions/{together[s]['session_id']}/usage",
                headers={"X-API-Key": KEY},
            ).json()
            # every step ran exactly once: no lost and no duplicated operation
            assert u["ops"] == {
                "create_model": 1,
                "forward_backward": STEPS,
                "optim_step": STEPS,
                "free": 1,
            }, u
            assert u["failed_ops"] == {}
        # The together phase ran concurrently: in the service's operation order (one worker,
        # usage.jsonl) the sessions' steps alternate; run one after another they would switch
        # sessions CLIENTS - 1 times.
        ids = {together[s]["session_id"] for s in range(CLIENTS)}
        order = [
            r["session"]
            for r in map(json.loads, (server.storage / "usage.jsonl").read_text().splitlines())
            if r["session"] in ids and r["kind"] in ("forward_backward", "optim_step")
        ]
        assert len(order) == 2 * STEPS * CLIENTS
        switches = sum(a != b for a, b in zip(order, order[1:], strict=False))
        assert switches >= 4 * CLIENTS, switches
        print(f"4 clients x {STEPS} steps together: {wall:.1f} s, {switches} session switches")
    finally:
        assert server.stop() == 0
