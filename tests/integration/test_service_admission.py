"""Admission control against the server's real memory: a forward_backward of the documented
maximum (Limits.max_data = 1024 datums of the served context) is refused with 413 before it
runs when its price exceeds the per-request budget, and the same batch through the SDK, split
into the chunks the service advertises, runs with the server's peak RSS within the budget.

Peak RSS is the server process's VmHWM, reset before each request (/proc/PID/clear_refs).
"""

from __future__ import annotations

import httpx
import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402
from tinker.proto.request_conv import forward_backward_request_to_proto  # noqa: E402

from tests.helpers.service_server import BASE_MODEL, KEY, start_server  # noqa: E402

BUDGET_GIB = 0.25
CONTEXT = 32
MAX_DATA = 1024  # service.core.Limits.max_data, the documented maximum
MIB = 1 << 20


def _rss(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                k, v, _ = line.split()
                out[k[:-1]] = int(v) * 1024
    return out


def _reset_peak(pid: int) -> int:
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    return _rss(pid)["VmRSS"]


def _batch(n: int) -> list[types.Datum]:
    out = []
    for i in range(n):
        toks = [(7 * i + 13 * t) % 2000 + 1 for t in range(CONTEXT + 1)]
        out.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(toks[:-1]),
                loss_fn_inputs={"target_tokens": toks[1:], "weights": [1.0] * CONTEXT},
            )
        )
    return out


def test_the_documented_maximum_is_refused_or_runs_within_its_budget(tmp_path):
    server = start_server(
        tmp_path,
        "--max-request-gib",
        str(BUDGET_GIB),
        sets=["model.layers=1", f"training.seq_len={CONTEXT}"],
        real_process=True,
    )
    pid = server.proc.pid
    budget = BUDGET_GIB * (1 << 30)
    try:
        sc = tinker.ServiceClient(base_url=server.url, api_key=KEY)
        tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=0).result()
        data = _batch(MAX_DATA)

        # One request of the documented maximum, as a client without the SDK's chunking
        # sends it: refused before it runs, naming the limit; the process does not grow.
        req = types.ForwardBackwardRequest(
            forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn="cross_entropy"),
            model_id=tc.model_id,
            seq_id=1,
        )
        raw = forward_backward_request_to_proto(req).SerializeToString()
        base = _reset_peak(pid)
        r = httpx.post(
            f"{server.url}/api/v1/forward_backward",
            content=raw,
            headers={"X-API-Key": KEY, "Content-Type": "application/x-protobuf"},
            timeout=60,
        )
        grown = _rss(pid)["VmHWM"] - base
        assert r.status_code == 413, r.text
        assert r.json()["detail"].startswith("data:") and "--max-request-gib" in r.text
        assert grown < 64 * MIB, f"refused request grew the server by {grown / MIB:.0f} MiB"
        sc.close("success").result()

        # The same batch through the SDK: split into chunks the service admits (the chunk
        # size it advertises), all of them run, and the peak stays within the budget.
        cfg = httpx.post(
            f"{server.url}/api/v1/client/config", json={}, headers={"X-API-Key": KEY}
        ).json()
        chunk = cfg["fwdbwd_max_chunk_len"]
        assert 1 <= chunk < MAX_DATA
        sc = tinker.ServiceClient(base_url=server.url, api_key=KEY)
        tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=0).result()
        base = _reset_peak(pid)
        out = tc.forward_backward(data, "cross_entropy").result(timeout=600)
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=60)
        peak = _rss(pid)["VmHWM"] - base
        assert len(out.loss_fn_outputs) == MAX_DATA
        print(
            f"admitted {MAX_DATA} datums x {CONTEXT} tokens in chunks of {chunk}: peak RSS "
            f"+{peak / MIB:.0f} MiB, budget {budget / MIB:.0f} MiB"
        )
        assert peak <= budget, f"peak +{peak / MIB:.0f} MiB over the {budget / MIB:.0f} MiB budget"
        sc.close("success").result()
    finally:
        assert server.stop() == 0, server.log_text()[-3000:]
