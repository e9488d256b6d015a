"""The service's tenant, accounting, admission and scheduler pieces, pure (no HTTP, no model):
the key file's rules and reload, the accounting log's figures, the scheduler's leaks (retry
entries, held ops of a closed lane, the drain deadline), refusals keeping their seq_id place,
queue caps, strict request fields, damaged checkpoint metadata."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time

import numpy as np
import pytest

from core.errors import ConfigError
from service import wire
from service.accounting import AccountingLog, parse_since, read_records, summarize, table
from service.errors import ServiceError, log_safe, scrub_paths
from service.futures import FutureStore, Outcome
from service.scheduler import Op, Scheduler
from service.storage import CheckpointRef, CheckpointStore
from service.tenants import MIN_KEY_CHARS, KeyFile, fingerprint, read_key_file
from tests.helpers.guards import alarm_guard

KEY_A = "tml-" + "a" * MIN_KEY_CHARS
KEY_B = "tml-" + "b1" * MIN_KEY_CHARS


def keyfile(tmp_path, text: str, mode: int = 0o600):
    p = tmp_path / "keys.txt"
    p.write_text(text)
    p.chmod(mode)
    return p


# --- the key file -------------------------------------------------------------------------


def test_key_file_tenants_by_name_and_by_fingerprint(tmp_path):
    p = keyfile(tmp_path, f"# keys\n{KEY_A}\n\nalice {KEY_B}\nalice tml-{'c' * 20}\n")
    kf = KeyFile(str(p))
    assert (
        kf.tenant(KEY_A).name
        == fingerprint(KEY_A)
        == "key-" + __import__("hashlib").sha256(KEY_A.encode()).hexdigest()[:12]
    )
    assert kf.tenant(KEY_B).name == kf.tenant("tml-" + "c" * 20).name == "alice"
    assert kf.tenant("tml-unknown-key-000000000") is None and kf.tenant("") is None


@pytest.mark.parametrize(
    "text, why",
    [
        ("tml-short\n", "at least"),  # a 4-character key
        ("abc-" + "x" * 30 + "\n", "does not start with 'tml-'"),
        (f"{KEY_A}\n{KEY_A}\n", "already on line 1"),
        (f"a b {KEY_A}\n", "expected 'KEY' or 'TENANT KEY'"),
        (f"key-x {KEY_A}\n", "tenant name"),
        (f"../up {KEY_A}\n", "tenant name"),
        ("# nothing\n", "holds no keys"),
        ("tml-" + "é" * 20 + "\n", "may only hold"),
    ],
)
def test_bad_key_files_are_one_line_naming_the_line(tmp_path, text, why):
    with pytest.raises(ConfigError) as e:
        read_key_file(str(keyfile(tmp_path, text)))
    msg = str(e.value)
    assert why in msg and "\n" not in msg
    assert KEY_A not in msg  # never echo a key


def test_key_file_readable_by_others_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="chmod 600"):
        read_key_file(str(keyfile(tmp_path, KEY_A + "\n", 0o644)))


def test_key_file_not_utf8_or_a_fifo_is_one_line_not_a_hang(tmp_path):
    p = tmp_path / "bin"
    p.write_bytes(b"tml-\xff\xfe" + b"x" * 20)
    p.chmod(0o600)
    with pytest.raises(ConfigError, match="not UTF-8"):
        read_key_file(str(p))
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    with alarm_guard(60), pytest.raises(ConfigError, match="FIFO"):  # a hang fails, not waits
        read_key_file(str(fifo))


def test_keys_are_revoked_by_editing_the_file(tmp_path):
    p = keyfile(tmp_path, f"{KEY_A}\n{KEY_B}\n")
    kf = KeyFile(str(p))
    assert kf.tenant(KEY_B) is not None
    p.write_text(f"{KEY_A}\n# {KEY_B} revoked\n")
    assert kf.tenant(KEY_B) is None and kf.tenant(KEY_A) is not None
    # a broken edit keeps the previous keys (and is logged), a fixed one is read again
    p.write_text("tml-x\n")
    assert kf.tenant(KEY_A) is not None
    p.write_text(f"{KEY_B}\n")
    assert kf.tenant(KEY_A) is None and kf.tenant(KEY_B) is not None


# --- log lines and client errors ----------------------------------------------------------


def test_log_safe_and_scrub_paths():
    assert "\n" not in log_safe("a\nservice.op x\r\x1b[2J")
    assert log_safe("plain") == "plain"
    msg = "[Errno 2] No such file or directory: '/srv/my storage/t/x/adapter_model.safetensors'"
    out = scrub_paths(msg, ("/srv/my storage",))
    assert "/srv" not in out and "storage" not in out
    assert (
        scrub_paths("tinker://s-1:train:0/weights/a failed")
        == "tinker://s-1:train:0/weights/a failed"
    )


# --- accounting ---------------------------------------------------------------------------


def test_accounting_records_sum_per_tenant_session_and_kind(tmp_path):
    acc = AccountingLog(tmp_path)
    rng = np.random.default_rng(0)
    expect: dict[str, float] = {}
    recs = []
    for i in range(300):
        t = ["alice", "key-0123456789ab"][i % 2]
        r = {
            "ts": 1000.0 + i,
            "tenant": t,
            "session": f"s-{i % 5}",
            "model": None,
            "kind": ["forward_backward", "optim_step", "sample"][i % 3],
            "ok": i % 7 != 0,
            "wall_s": float(rng.uniform(0, 2)),
            "devices": 2,
        }
        r["device_s"] = r["wall_s"] * 2
        expect[t] = expect.get(t, 0.0) + r["device_s"]
        recs.append(r)
    threads = [
        threading.Thread(target=lambda part=recs[k::4]: [acc.write(r) for r in part])
        for k in range(4)
    ]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    acc.close()
    with open(tmp_path / "usage.jsonl", "ab") as f:
        f.write(b'{"v":1,"ts":5,"tenant":"alice","dev')  # a line cut short by a crash
    got, damaged = read_records(tmp_path / "usage.jsonl")
    assert damaged == 1 and len(got) == 300
    s = summarize(got)
    for t, dev in expect.items():
        assert s.tenants[t].device_seconds == pytest.approx(dev, rel=1e-12)
        assert s.tenants[t].gpu_minutes == pytest.approx(dev / 60, rel=1e-12)
    assert s.tenants["alice"].failed == sum(1 for i in range(0, 300, 2) if i % 7 == 0)
    by_kind = sum(v.device_seconds for (t, _), v in s.kinds.items() if t == "alice")
    assert by_kind == pytest.approx(expect["alice"])
    late, _ = read_records(tmp_path / "usage.jsonl", since=1200.0)
    assert len(late) == 100
    rows = list(table(s))
    assert rows[-1].split()[0] == "total" and len(rows) == 4
    assert (os.stat(tmp_path / "usage.jsonl").st_mode & 0o077) == 0


def test_parse_since():
    assert parse_since("1700000000") == 1700000000.0
    assert parse_since("2024-01-01") == 1704067200.0
    before = time.time()
    since = parse_since("2h")
    assert before - 7200 <= since <= time.time() - 7200
    with pytest.raises(ValueError):
        parse_since("yesterday")


# --- the scheduler --------------------------------------------------------------------------


@pytest.fixture
def loop():
    lp = asyncio.new_event_loop()
    t = threading.Thread(target=lp.run_forever, daemon=True)
    t.start()
    yield lp
    lp.call_soon_threadsafe(lp.stop)


def _wait(fut, timeout=10.0):
    end = time.monotonic() + timeout
    while fut.outcome is None and time.monotonic() < end:
        time.sleep(0.01)
    return fut.outcome


def _ok(i=0):
    return lambda: Outcome(json={"i": i})


def test_completed_futures_release_their_retry_entries(loop):
    store = FutureStore(loop, keep_s=0.0)
    s = Scheduler(store, devices=1)
    s.open_lane("m", first_seq=1)
    futs = [s.submit(Op("a", "step", _ok(i), "m", i, tenant="t")) for i in range(1, 51)]
    for f in futs:
        _wait(f)
        f.retrieved_at = time.time() - 1  # fetched by the client
    s.forget(store.sweep())
    assert s.lane_sizes("m") == (0, 0)  # Lane.seen no longer grows with every step
    assert store.all() == []
    s.drain(5)


def test_closing_a_lane_fails_the_ops_it_held(loop):
    s = Scheduler(FutureStore(loop), devices=1)
    s.open_lane("m", first_seq=1)
    held = s.submit(Op("a", "step", _ok(), "m", 3, tenant="t"))  # waits for seq 1, 2
    s.close_lane("m")
    out = _wait(held, 5)
    assert out is not None and "released" in out.error
    s.drain(5)


def test_drain_has_a_deadline_for_the_running_op(loop):
    s = Scheduler(FutureStore(loop), devices=1)
    stuck, running = threading.Event(), threading.Event()
    hang = lambda: (running.set(), stuck.wait(60), Outcome(json={}))[2]  # noqa: E731
    fut = s.submit(Op("a", "hang", hang, tenant="t"))
    assert running.wait(10)  # the op is running (not queued) when the drain starts
    done = []
    th = threading.Thread(target=lambda: done.append(s.drain(0.1, running_grace_s=0.3)))
    th.start()
    th.join(10)
    stuck.set()
    assert done, "drain did not return"
    assert "shut down" in _wait(fut).error


def test_a_refused_request_keeps_its_seq_place(loop):
    s = Scheduler(FutureStore(loop), devices=1)
    s.open_lane("m", first_seq=1)
    ran: list[int] = []

    def op(i):
        return Op("a", "step", lambda: (ran.append(i), Outcome(json={}))[1], "m", i, tenant="t")

    f1 = s.submit(op(1))
    s.refuse("m", 2, tenant="t", session_id="a", kind="step", error=ServiceError(400, "bad"))
    f3 = s.submit(op(3))
    assert _wait(f3) is not None and _wait(f1) is not None and ran == [1, 3]
    # a retry of the refused seq_id gets the refusal, not a second run
    again = s.submit(op(2))
    assert _wait(again).error == "bad" and ran == [1, 3]
    s.drain(5)


def test_queue_caps_answer_429_with_retry_after(loop):
    s = Scheduler(FutureStore(loop), devices=1, max_per_session=2, max_per_tenant=3)
    gate, running = threading.Event(), threading.Event()
    block = lambda: (running.set(), gate.wait(10), Outcome(json={}))[2]  # noqa: E731
    s.submit(Op("x", "block", block, tenant="t"))
    assert running.wait(10)  # running: no longer queued
    s.submit(Op("a", "op", _ok(), tenant="t"))
    s.submit(Op("a", "op", _ok(), tenant="t"))
    with pytest.raises(ServiceError) as e:
        s.submit(Op("a", "op", _ok(), tenant="t"))
    assert e.value.status == 429 and e.value.retry_after >= 1 and "session" in e.value.message
    s.submit(Op("b", "op", _ok(), tenant="t"))
    with pytest.raises(ServiceError) as e:
        s.submit(Op("c", "op", _ok(), tenant="t"))
    assert e.value.status == 429 and "tenant" in e.value.message
    s.submit(Op("d", "op", _ok(), tenant="u"))  # another tenant is not held up
    s.submit(Op("a", "free", _ok(), tenant="t", internal=True))  # the service's own ops
    gate.set()
    s.drain(10)


# --- request fields and checkpoints ------------------------------------------------------


@pytest.mark.parametrize(
    "params, field",
    [
        ({"eps": 0.0}, "adam_params.eps"),
        ({"eps": 1e-45}, "adam_params.eps"),  # rounds to 0 in float32
        ({"beta1": 1.0}, "adam_params.beta1"),
        ({"learning_rate": -1e-3}, "adam_params.learning_rate"),
    ],
)
def test_adam_params_that_would_make_the_adapter_nan_are_refused(params, field):
    body = wire.OptimStepBody(model_id="m", seq_id=1, adam_params=wire.AdamParamsBody(**params))
    with pytest.raises(ServiceError) as e:
        wire.adam_params(body)
    assert e.value.status == 400 and e.value.message.startswith(field)


@pytest.mark.parametrize(
    "raw, field",
    [
        (b'{"model_id": "m", "seq_id": 1.0}', "seq_id"),
        (b'{"model_id": "m", "seq_id": true}', "seq_id"),
        (b'{"model_id": "m", "seq_id": 1e400}', "seq_id"),
        (b'{"model_id": "m", "seq_id": 1, "adam_params": {"eps": NaN}}', "adam_params.eps"),
    ],
)
def test_integer_fields_refuse_floats_and_numbers_refuse_nan(raw, field):
    with pytest.raises(ServiceError) as e:
        wire.parse(wire.OptimStepBody, raw)
    assert e.value.message.startswith(field)


def test_target_tokens_refuse_floats_and_logprobs_have_a_floor():
    toks = np.arange(1, 5)
    ok = {"target_tokens": toks, "logprobs": np.full(4, -3.0, np.float32), "advantages": np.ones(4)}
    wire.fwdbwd_data([(toks, ok)], "importance_sampling", vocab=10, max_len=8, max_data=4)
    for key, value in (
        ("target_tokens", toks.astype(np.float32)),
        ("logprobs", np.full(4, -1e4, np.float32)),
    ):
        bad = {**ok, key: value}
        with pytest.raises(ServiceError) as e:
            wire.fwdbwd_data([(toks, bad)], "importance_sampling", vocab=10, max_len=8, max_data=4)
        assert e.value.message.startswith(f"data[0].loss_fn_inputs.{key}")


def test_a_damaged_meta_json_hides_only_its_checkpoint(tmp_path):
    store = CheckpointStore(tmp_path)
    meta = {"base_model": "b", "lora": {"rank": 2}}
    for name in ("a", "b", "c"):
        store.save(CheckpointRef("m", "weights", name), lambda f: None, meta)
    (tmp_path / "m" / "weights" / "b" / "meta.json").write_text('{"base_model": ')
    items, damaged = store.list("m")
    assert [c["checkpoint_id"] for c in items] == ["weights/a", "weights/c"]
    assert [d["checkpoint_id"] for d in damaged] == ["weights/b"] and "not JSON" in damaged[0][
        "problem"
    ]
    with pytest.raises(ServiceError) as e:
        store.meta(CheckpointRef("m", "weights", "b"))
    assert e.value.status == 422 and "damaged" in e.value.message
    assert str(tmp_path) not in e.value.message
    json.loads((tmp_path / "m" / "weights" / "a" / "meta.json").read_text())


def test_a_microbatched_backend_is_priced_per_microbatch():
    """The same price function: a backend declaring a token budget per microbatch is charged
    one microbatch's activations, so it admits more datums within the same budget."""
    from core.models import ModelShape
    from parallel.workload import Workload
    from service.admission import GIB, CostModel, max_rows, price_forward_backward

    # torchtitan's debug Llama with two layers, as tools.serve's tests serve it
    shape = ModelShape("debugmodel", 2, 256, 16, 16, 16, 768, 2048, False)
    cm = CostModel(Workload(shape, seq_len=64, local_batch_size=1, dtype="float32"), "dense")
    one = price_forward_backward(cm, [64] * 512, forward_only=False)
    mb = price_forward_backward(
        CostModel(cm.workload, "dense", microbatch_tokens=64 * 32), [64] * 512, forward_only=False
    )
    assert (mb.microbatches, mb.rows) == (16, 32)
    assert mb.bytes == pytest.approx(
        price_forward_backward(cm, [64] * 32, forward_only=False).bytes
    )
    assert one.bytes > 10 * mb.bytes
    assert (
        max_rows(cm, 64, 1 * GIB, 1024)
        < max_rows(CostModel(cm.workload, "dense", microbatch_tokens=64 * 32), 64, 1 * GIB, 1024)
        == 1024
    )
