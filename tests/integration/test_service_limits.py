"""Issue #41 against `tools.serve` (debug base, CPU, two tenants): a 10 MB sparse body
declaring 2 GiB is refused without the memory while health checks keep answering; one
tenant's largest sampling request does not starve another's 5-token sample; a learning rate
of 1e30 is refused and the adapter's next forward gives the loss it gave before."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from service import tinker_proto as pb  # noqa: E402
from tests.helpers.service_server import (  # noqa: E402
    BASE_MODEL,
    KEY,
    KEY_B,
    TWO_TENANTS,
    start_server,
)
from tools.reliability_report import record_case  # noqa: E402

MiB = 1 << 20
PROMPT = [5, 17, 33, 2]
# docs/service.md "Limits": an op waits behind at most one op of each other session, and
# every op is stopped at its deadline: max(op_deadline_min_s, 20 x its priced seconds).
DEADLINE_MIN_S = 120.0


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("svc-limits"), keys=TWO_TENANTS, real_process=True)
    yield srv
    assert srv.stop() == 0, srv.log_text()[-3000:]


def _status(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        k, _, v = line.partition(":")
        if k in ("VmRSS", "VmHWM"):
            out[k] = int(v.split()[0]) * 1024
    return out


def _csr_body(rows: int, cols: int) -> bytes:
    """One datum whose `weights` is a CSR tensor of `rows` x `cols` with one value per row:
    expanded, every 4 KiB row is a touched page (2 GiB resident at [500000, 1024])."""
    msg = pb.ForwardBackwardRequest(model_id="s-0:train:0", seq_id=1, loss_fn="cross_entropy")
    d = msg.data.add()
    d.model_input.add().encoded_text.tokens = np.int32([1, 2]).tobytes()
    d.loss_fn_inputs["target_tokens"].dense = np.int64([2, 3]).tobytes()
    d.loss_fn_inputs["target_tokens"].dtype = pb.DTYPE_INT64
    d.loss_fn_inputs["target_tokens"].shape[:] = [2]
    t = d.loss_fn_inputs["weights"]
    t.dtype, t.shape[:] = pb.DTYPE_FLOAT32, [rows, cols]
    t.sparse_csr.values = np.ones(rows, np.float32).tobytes()
    t.sparse_csr.col_indices = np.zeros(rows, np.int64).tobytes()
    t.sparse_csr.crow_indices = np.arange(rows + 1, dtype=np.int64).tobytes()
    return msg.SerializeToString()


def test_a_sparse_body_is_refused_before_it_is_expanded(server):
    body = _csr_body(500_000, 1024)
    assert len(body) >= 10 * 10**6
    pid = server.proc.pid
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM := VmRSS
    base = _status(pid)["VmRSS"]
    health: list[int] = []
    stop = threading.Event()

    def probe() -> None:  # the event loop answers while the body is decoded
        while not stop.is_set():
            health.append(httpx.get(f"{server.url}/api/v1/healthz", timeout=1.0).status_code)

    t = threading.Thread(target=probe)
    t.start()
    try:
        r = httpx.post(
            f"{server.url}/api/v1/forward_backward",
            content=body,
            headers={"X-API-Key": KEY, "Content-Type": "application/x-protobuf"},
            timeout=60,
        )
    finally:
        stop.set()
        t.join()
    assert 400 <= r.status_code < 500, r.text
    growth = _status(pid)["VmHWM"] - base
    print(f"peak RSS growth {growth / MiB:.1f} MiB; {len(health)} health checks")
    assert growth < 100 * MiB
    assert health and all(s == 200 for s in health)
    record_case("service", "sparse body declaring 2 GiB")


def test_largest_sampling_request_does_not_starve_another_tenant(server):
    a = tinker.ServiceClient(base_url=server.url, api_key=KEY)
    b = tinker.ServiceClient(base_url=server.url, api_key=KEY_B)
    try:
        sa = a.create_sampling_client(base_model=BASE_MODEL).result()
        sb = b.create_sampling_client(base_model=BASE_MODEL).result()
        prompt = types.ModelInput.from_ints(PROMPT)
        huge = types.SamplingParams(max_tokens=50, stop=[f"#{i}#" for i in range(200_000)])
        with pytest.raises(tinker.APIStatusError) as e:  # 413: not retried
            sa.sample(prompt, 64, huge).result()
        assert e.value.status_code == 413 and "max_stop" in str(e.value)
        # The largest the limits allow: 64 stop strings of 64 characters (max_stop_chars).
        largest = types.SamplingParams(
            max_tokens=50, stop=[f"{i:02d}" + "~" * 62 for i in range(64)], seed=1
        )
        fa = sa.sample(prompt, 64, largest)
        t0 = time.monotonic()
        small = sb.sample(prompt, 1, types.SamplingParams(max_tokens=5, stop=[], seed=2))
        seq = small.result().sequences[0]
        waited = time.monotonic() - t0
        assert len(seq.tokens) == 5
        print(f"B's 5-token sample answered in {waited:.2f} s behind A's 64 x 50 tokens")
        assert waited < DEADLINE_MIN_S  # behind at most one op of A, itself bounded
        assert len(fa.result().sequences) == 64
        record_case("service", "stop strings (count, starvation)", n=2)
    finally:
        a.close("success").result()
        b.close("success").result()


def test_a_step_to_non_finite_weights_is_refused_and_undone(server):
    sc = tinker.ServiceClient(base_url=server.url, api_key=KEY_B)
    try:
        tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=3).result()
        toks = PROMPT + [9, 11, 40]
        d = types.Datum(
            model_input=types.ModelInput.from_ints(toks[:-1]),
            loss_fn_inputs={"target_tokens": toks[1:], "weights": [1.0] * (len(toks) - 1)},
        )
        tc.forward_backward([d], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()  # optimizer state
        before = tc.forward([d], "cross_entropy").result().metrics["loss:sum"]
        tc.forward_backward([d], "cross_entropy").result()
        with pytest.raises(Exception) as e:
            tc.optim_step(types.AdamParams(learning_rate=1e30)).result()
        assert "the step was undone" in str(e.value), e.value
        after = tc.forward([d], "cross_entropy").result().metrics["loss:sum"]
        assert after == before
        tc.forward_backward([d], "cross_entropy").result()  # and it trains on
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        # A saved state without its manifest cannot be verified: refused, not loaded.
        path = tc.save_state("no-manifest").result().path
        run_id = path.split("/")[2]
        folder = server.tenant_dir(name="bob") / run_id / "weights" / "no-manifest"
        (folder / "manifest.json").unlink()
        # (422 naming the checkpoint, as every damaged checkpoint: runtime.checkpoint's check)
        with pytest.raises(tinker.UnprocessableEntityError, match="manifest.json is missing"):
            sc.create_training_client_from_state(path).result()
        record_case("service", "learning rate 1e30")
        record_case("service", "load_state without manifest.json")
    finally:
        sc.close("success").result()
