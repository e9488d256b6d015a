"""Fair sharing between tenants (service/scheduler.py): tenants served round robin, a large
op run in pieces that interleave with another tenant's small ops, the per-tenant token rate
with a hand-moved clock; billing tokens (service/accounting.py) and the unserved-route answer
(service/surface.py)."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from service.accounting import Prices, UsageIndex, billing_events, summarize, table
from service.errors import ServiceError
from service.futures import FutureStore, Outcome
from service.scheduler import Op, Scheduler, TokenBucket, merge_metrics, split_pieces
from service.surface import unserved
from tests.helpers.service_server import wait_outcome as _wait


@pytest.fixture
def make_sched():
    loop = asyncio.new_event_loop()
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()
    made: list[Scheduler] = []

    def make(**kw) -> Scheduler:
        s = Scheduler(FutureStore(loop), devices=1, **kw)
        made.append(s)
        return s

    yield make
    for s in made:
        s.drain(5)
    loop.call_soon_threadsafe(loop.stop)


def test_a_large_op_yields_to_another_tenant_between_pieces(make_sched):
    sched = make_sched()
    records: list[dict] = []
    sched.record = records.append
    order: list[str] = []
    gate = threading.Event()
    blocker = sched.submit(
        Op("x", "block", lambda: (gate.wait(5), Outcome(json={}))[1], tenant="x")
    )
    left = [5]

    def big() -> Outcome | None:  # five pieces: None while pieces remain
        left[0] -= 1
        order.append(f"A{5 - left[0]}")
        return None if left[0] else Outcome(json={"done": True})

    fa = sched.submit(Op("sa", "forward_backward", big, tenant="A"))
    fbs = [
        sched.submit(
            Op(
                "sb",
                "forward_backward",
                lambda i=i: (order.append(f"B{i}"), Outcome(json={}))[1],
                tenant="B",
            )
        )  # fmt: skip
        for i in range(2)
    ]
    gate.set()
    assert _wait(fa).json == {"done": True} and all(_wait(f) for f in fbs)
    _wait(blocker)
    # B's ops wait at most one piece of A's each, never A's whole request
    assert order == ["A1", "B0", "A2", "B1", "A3", "A4", "A5"]
    a = [r for r in records if r["tenant"] == "A"]
    assert len(a) == 1 and a[0]["pieces"] == 5  # one billing record for the whole op


def test_tenants_round_robin_over_their_sessions(make_sched):
    sched = make_sched()
    order: list[str] = []
    gate = threading.Event()
    sched.submit(Op("x", "block", lambda: (gate.wait(5), Outcome(json={}))[1], tenant="x"))
    futs = []
    # tenant A floods from three sessions, tenant B has one session
    for s in ("a1", "a2", "a3"):
        for i in range(2):
            futs.append(
                sched.submit(
                    Op(
                        s,
                        "op",
                        lambda s=s, i=i: (order.append(f"{s}.{i}"), Outcome(json={}))[1],
                        tenant="A",
                    )
                )  # fmt: skip
            )
    for i in range(3):
        futs.append(
            sched.submit(
                Op("b", "op", lambda i=i: (order.append(f"b.{i}"), Outcome(json={}))[1], tenant="B")
            )  # fmt: skip
        )
    gate.set()
    for f in futs:
        _wait(f)
    assert order[:6] == ["a1.0", "b.0", "a2.0", "b.1", "a3.0", "b.2"]
    assert order[6:] == ["a1.1", "a2.1", "a3.1"]


def test_token_rate_429_with_retry_after_on_a_moved_clock(make_sched):
    now = [0.0]
    bucket = TokenBucket(rate=100.0, burst=1000.0, clock=lambda: now[0])
    sched = make_sched(tokens=bucket)

    def op(tokens: int, tenant: str = "A") -> Op:
        o = Op("s" + tenant, "forward_backward", lambda: Outcome(json={}), tenant=tenant)
        o.rate_tokens = tokens
        return o

    _wait(sched.submit(op(1500)))  # the burst is 1000: admitted once, into debt (-500)
    with pytest.raises(ServiceError) as e:
        sched.submit(op(10))
    assert e.value.status == 429 and e.value.retry_after == 5  # 500 tokens at 100/s
    _wait(sched.submit(op(10, tenant="B")))  # another tenant is not held back
    now[0] = 4.9
    with pytest.raises(ServiceError):
        sched.submit(op(10))
    now[0] = 5.0
    _wait(sched.submit(op(10)))  # back at zero: admitted


def test_split_pieces_and_merge_metrics():
    assert split_pieces([256] * 1024, 8192) == [(i, i + 32) for i in range(0, 1024, 32)]
    assert split_pieces([5, 5, 5], 0) == [(0, 3)]
    assert split_pieces([10, 1, 1, 10], 5) == [(0, 1), (1, 3), (3, 4)]  # a long datum alone
    parts = [({"loss:sum": 2.0, "m:mean": 1.0, "x:max": 3.0}, 1),
             ({"loss:sum": 5.0, "m:mean": 4.0, "x:max": 1.0}, 3)]  # fmt: skip
    assert merge_metrics(parts) == {"loss:sum": 7.0, "m:mean": 3.25, "x:max": 3.0}


def _rec(tenant, ts, tokens, ok=True, device_s=1.0, session="s1"):
    return {"tenant": tenant, "ts": ts, "session": session, "kind": "k", "ok": ok,
            "device_s": device_s, "tokens": tokens}  # fmt: skip


def test_usage_index_tokens_and_prices(tmp_path):
    log = tmp_path / "usage.jsonl"
    lines = [_rec("a", 10.0, {"trained": 100}), _rec("b", 11.0, {"prefill": 7, "sampled": 3})]
    log.write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"cut')
    idx = UsageIndex(log)
    assert idx.damaged == 1
    idx.add(_rec("a", 5.0, {"trained": 1}))  # out of order: kept in time order
    idx.add(_rec("a", 20.0, {}, ok=False, device_s=2.0))
    assert [r["ts"] for r in idx.records("a")] == [5.0, 10.0, 20.0]
    assert [r["ts"] for r in idx.records("a", since=6.0, until=20.0)] == [10.0]
    t = summarize(idx.records("a")).tenants["a"]
    assert dict(t.tokens) == {"trained": 101} and t.device_seconds == 4.0
    prices = Prices(usd_per_gpu_hour=3600.0, usd_per_million_tokens={"trained": 1e6})
    assert prices.cost(t.device_seconds, dict(t.tokens)) == 4.0 + 101.0
    rows = list(table(summarize(idx.records("b")), prices=prices))
    assert rows[0].split()[-4:] == ["prefill", "sampled", "trained", "cost_usd"]
    assert rows[1].split()[-4:] == ["7", "3", "0", "1.000000"]
    ev = billing_events(idx.records("b"), prices, "base")
    got = sorted((e["event_info"]["type"], e["event_info"]["token_count"]) for e in ev["data"])
    assert got == [("sampling_prefill", 7), ("sampling_sample", 3)]
    assert ev["device_seconds"] == 1.0


def test_prices_file_is_checked(tmp_path):
    p = tmp_path / "p.json"
    p.write_text('{"usd_per_million_tokens": {"prefil": 1}}')
    with pytest.raises(ValueError, match="prefill"):
        Prices.load(p)
    p.write_text('{"usd_per_gpu_hour": -1}')
    with pytest.raises(ValueError, match="usd_per_gpu_hour"):
        Prices.load(p)


def test_unserved_names_the_sdk_method():
    e = unserved("POST", "/api/v1/save_weights_external")
    assert e.status == 400
    assert e.message.startswith("TrainingClient.save_weights_external: not supported by this")
    e = unserved("GET", "/api/v1/training_runs/r/checkpoints/weights/x/external_weights_urls")
    assert "RestClient.get_external_weights_urls: not supported" in e.message
    assert "GET /api/v1/nope: not supported" in unserved("GET", "/api/v1/nope").message


def test_published_index_audit_log_and_storage_usage_persist(tmp_path):
    from service.surface import AuditLog, Published, folder_usage

    pub = Published(tmp_path)
    assert pub.set("tinker://r/weights/a", "alice") and not pub.set("tinker://r/weights/a", "alice")
    assert Published(tmp_path).owner("tinker://r/weights/a") == "alice"  # survives a restart
    pub.set("tinker://r/weights/a", None)
    assert Published(tmp_path).owner("tinker://r/weights/a") is None  # revoked on disk too

    log = AuditLog(tmp_path)
    log.key_used("alice", "key-1")
    log.key_used("alice", "key-1")  # once per key and process
    log.add("alice", "checkpoint_read", tinker_path="tinker://r/weights/a", reader="bob")
    log.close()
    again = AuditLog(tmp_path)
    assert [e["event"] for e in again.entries("alice", "all", None)] == [
        "api_key_used",
        "checkpoint_read",
    ]
    assert [e["event"] for e in again.entries("alice", "checkpoints", None)] == ["checkpoint_read"]
    assert (
        again.entries("alice", "all", "1999-01-01") == []
        and again.entries("bob", "all", None) == []
    )
    again.close()

    ck = tmp_path / "t" / "run" / "weights" / "c1"
    ck.mkdir(parents=True)
    (ck / "meta.json").write_text("{}")
    (ck / "w.bin").write_bytes(b"x" * 100)
    assert folder_usage(tmp_path / "t") == (1, 102)


def test_storage_quota_refuses_a_save_once_full(tmp_path):
    from types import SimpleNamespace

    from service.core import Limits, Service
    from service.storage import CheckpointStore

    store = CheckpointStore(tmp_path / "t")
    svc = SimpleNamespace(limits=Limits(storage_quota_bytes=100), store=lambda tenant: store)
    Service.check_quota(svc, "t")  # type: ignore[arg-type]  # empty: a save may go ahead
    (store.root / "blob").write_bytes(b"x" * 100)
    with pytest.raises(ServiceError) as e:
        Service.check_quota(svc, "t")  # type: ignore[arg-type]
    assert e.value.status == 413 and "100 bytes of its 100-byte storage quota" in e.value.message


def test_detached_ops_run_beside_the_worker_and_are_billed(make_sched):
    """A detached op (a sample through the vLLM engine) runs on its own thread: two of them,
    from two tenants, run at the same time, and each is billed and recorded as one op."""
    sched = make_sched()
    records: list[dict] = []
    sched.record = records.append
    both = threading.Barrier(2, timeout=5)  # passes only if both run at once

    def run() -> Outcome:
        both.wait()
        return Outcome(json={"ok": True})

    futs = []
    for t in ("A", "B"):
        op = Op(f"s{t}", "sample", run, tenant=t)
        op.detached = True
        futs.append(sched.submit(op))
    assert all(_wait(f).json == {"ok": True} for f in futs)
    assert sorted(r["tenant"] for r in records if r["kind"] == "sample") == ["A", "B"]
    assert sched.drain(5) == (0, 0)
