"""The service's pure layers: the protobuf codec (the SDK's vendored schema) against the SDK's
own encoder and decoder, checkpoint names against path escapes, and the scheduler's ordering, de-duplication
and fairness (with a recording fake backend, no HTTP)."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from service import proto
from service.errors import ServiceError
from service.futures import FutureStore, Outcome
from service.scheduler import Op, Scheduler
from service.storage import CheckpointRef, CheckpointStore, check_name, parse_tinker_path

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402
from tinker.proto.request_conv import forward_backward_request_to_proto  # noqa: E402
from tinker.proto.response_conv import (  # noqa: E402
    deserialize_forward_backward_output,
    deserialize_sample_response,
)


def test_decode_matches_the_sdk_encoder():
    import torch

    d1 = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [0.0, 1.0, 0.5]},
    )
    # 2-D torch tensors are sent sparse (CSR) by the SDK
    w = torch.tensor([[0.0, 0.25, 0.0, 1.0]])
    d2 = types.Datum(
        model_input=types.ModelInput(
            chunks=[types.EncodedTextChunk(tokens=[5, 6]), types.EncodedTextChunk(tokens=[7, 8])]
        ),
        loss_fn_inputs={"target_tokens": torch.tensor([[6, 7, 8, 9]]), "weights": w},
    )
    req = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(
            data=[d1, d2], loss_fn="ppo", loss_fn_config={"clip_low_threshold": 0.8, "tag": "x"}
        ),
        model_id="s-1:train:0",
        seq_id=7,
    )
    msg = forward_backward_request_to_proto(req)
    msg.forward_only = True
    got = proto.decode_forward_backward_request(msg.SerializeToString())
    assert (got.model_id, got.seq_id, got.loss_fn, got.forward_only) == (
        "s-1:train:0",
        7,
        "ppo",
        True,
    )
    assert got.loss_fn_config == {"clip_low_threshold": 0.8, "tag": "x"}
    np.testing.assert_array_equal(got.data[0][0], [1, 2, 3])
    np.testing.assert_array_equal(got.data[0][1]["weights"], np.float32([0, 1, 0.5]))
    np.testing.assert_array_equal(got.data[1][0], [5, 6, 7, 8])
    np.testing.assert_array_equal(got.data[1][1]["weights"], w.numpy())
    np.testing.assert_array_equal(got.data[1][1]["target_tokens"], [[6, 7, 8, 9]])


def test_encode_is_read_back_by_the_sdk_decoder():
    outs = [{"logprobs": np.float32([-1, -2, -3])}, {"logprobs": np.float32([-4.5])}]
    fb = deserialize_forward_backward_output(
        proto.encode_forward_backward_output(outs, {"loss:sum": 10.5})
    )
    assert fb.metrics == {"loss:sum": 10.5}
    assert [o["logprobs"].data for o in fb.loss_fn_outputs] == [[-1, -2, -3], [-4.5]]
    sr = deserialize_sample_response(
        proto.encode_sample_response(
            [
                (np.int32([4, 5]), np.float32([-0.5, -0.25]), "stop"),
                (np.int32([9]), np.float32([-1]), "length"),
            ],
            np.float32([np.nan, -2.0]),
        )
    )
    assert [s.tokens for s in sr.sequences] == [[4, 5], [9]]
    assert [s.stop_reason for s in sr.sequences] == ["stop", "length"]
    assert sr.sequences[0].logprobs == [-0.5, -0.25] and sr.prompt_logprobs == [None, -2.0]


def test_vendored_descriptor_is_the_installed_sdks():
    """service/tinker_proto/tinker_public.desc must be the SDK's schema: an SDK upgrade that
    changes it fails here (re-vendor: service/tinker_proto/__init__.py says how)."""
    from tinker.proto import tinker_public_pb2

    from service import tinker_proto

    assert tinker_public_pb2.DESCRIPTOR.serialized_pb == tinker_proto.DESCRIPTOR_BYTES


def test_provenance_spans_and_topk_prompt_logprobs_round_trip_with_the_sdk():
    d = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3, 4]),
        loss_fn_inputs={"target_tokens": [2, 3, 4, 5], "advantages": [0.0, 0.0, 1.0, 1.0]},
    ).with_provenance(
        model_input=[
            types.PromptProvenanceSpan(sequence_id="s:a:0", length=3),
            types.SampledProvenanceSpan(sequence_id="s:a:0", length=1),
        ],
        loss_fn_inputs=[
            types.PromptProvenanceSpan(sequence_id="s:a:0", offset=1, length=2),
            types.SampledProvenanceSpan(sequence_id="s:a:0", length=2),
        ],
    )
    req = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=[d], loss_fn="stable_reinforce"),
        model_id="s-1:train:0",
        seq_id=1,
    )
    got = proto.decode_forward_backward_request(
        forward_backward_request_to_proto(req).SerializeToString()
    )
    assert got.spans == [
        [proto.Span("prompt", "s:a:0", 1, 2), proto.Span("sampled", "s:a:0", 0, 2)]
    ]
    ids = np.int32([[0, 0], [7, 3], [9, 1]])
    lps = np.float32([[proto.TOPK_EMPTY_LOGPROB] * 2, [-0.25, -2.5], [-0.5, -1.0]])
    sr = deserialize_sample_response(
        proto.encode_sample_response(
            [(np.int32([4]), np.float32([-0.5]), "stop")], None, (ids, lps)
        )
    )
    assert sr.topk_prompt_logprobs == [None, [(7, -0.25), (3, -2.5)], [(9, -0.5), (1, -1.0)]]
    assert sr.prompt_logprobs is None


@pytest.mark.parametrize("raw", [b"\xff\xff", b"\x1a\x05\x0a", b"\x0a\x80", b"\x0f"])
def test_garbage_protobuf_is_a_400(raw):
    with pytest.raises(ServiceError) as e:
        proto.decode_forward_backward_request(raw)
    assert e.value.status == 400


@pytest.mark.parametrize("name", ["..", "../x", "a/b", ".hidden", "", "x" * 129, "a\\b", "é"])
def test_bad_checkpoint_names(name):
    with pytest.raises(ServiceError):
        check_name(name)


@pytest.mark.parametrize(
    "path",
    [
        "tinker://../weights/x",
        "tinker://a/weights/..",
        "tinker://a/other/x",
        "s3://a/weights/x",
        "tinker://a/weights",
    ],
)
def test_bad_tinker_paths(path):
    with pytest.raises(ServiceError):
        parse_tinker_path(path)


def test_store_is_atomic_and_inside_its_root(tmp_path):
    store = CheckpointStore(tmp_path / "root")
    ref = parse_tinker_path("tinker://s-1:train:0/weights/ok")
    assert store.folder(ref).is_relative_to(tmp_path / "root")

    def boom(folder):
        (folder / "half").write_text("x")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        store.save(ref, boom, {})
    assert not store.exists(ref) and not list((tmp_path / "root").rglob("half"))
    store.save(ref, lambda f: (f / "w").write_text("1"), {"base_model": "b", "lora": {"rank": 1}})
    with pytest.raises(ServiceError) as e:  # no silent overwrite
        store.save(ref, lambda f: None, {})
    assert e.value.status == 409
    assert store.meta(ref)["tinker_path"] == ref.tinker_path
    assert isinstance(CheckpointRef("a", "weights", "b").tinker_path, str)


@pytest.fixture
def sched():
    loop = asyncio.new_event_loop()
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()
    store = FutureStore(loop)
    s = Scheduler(store, devices=2)
    yield s
    s.drain(5)
    loop.call_soon_threadsafe(loop.stop)


def _wait(fut, timeout=10):
    end = time.monotonic() + timeout
    while fut.outcome is None and time.monotonic() < end:
        time.sleep(0.01)
    return fut.outcome


def test_lane_runs_in_seq_order_and_dedupes(sched):
    ran: list[int] = []
    sched.open_lane("m", first_seq=1)

    def op(i):
        return Op("s", "step", lambda: (ran.append(i), Outcome(json={"i": i}))[1], "m", i)

    f3 = sched.submit(op(3))
    f2 = sched.submit(op(2))
    time.sleep(0.1)
    assert ran == []  # seq 1 has not arrived: nothing may run
    assert sched.submit(op(2)) is f2  # a retry gets the same future
    sched.submit(op(1))
    assert _wait(f3).json == {"i": 3} and _wait(f2) is not None
    assert ran == [1, 2, 3]
    with pytest.raises(ServiceError):  # already executed
        sched.submit(Op("s", "step", lambda: Outcome(json={}), "m", 0))


class _StepClock:
    """Stands in for the `time` module of service code: `perf_counter` advances exactly 1 s
    per call (so an op timed by two calls took 1 s), `time` reads `now`; the rest is real."""

    def __init__(self) -> None:
        self.t = 0.0
        self.now = 1e9

    def perf_counter(self) -> float:
        self.t += 1.0
        return self.t

    def time(self) -> float:
        return self.now

    def __getattr__(self, name: str):
        return getattr(time, name)


def test_round_robin_across_sessions_and_accounting(sched, monkeypatch):
    import service.scheduler

    # device-seconds = wall seconds x devices: with each op's wall time exactly 1 s, the
    # session totals are known numbers, not a timing (the scheduler alone reads perf_counter)
    monkeypatch.setattr(service.scheduler, "time", _StepClock())
    order: list[str] = []
    gate = threading.Event()
    blocker = sched.submit(Op("x", "block", lambda: (gate.wait(5), Outcome(json={}))[1]))
    futs = []
    for i in range(3):
        futs.append(
            sched.submit(Op("a", "op", lambda i=i: (order.append(f"a{i}"), Outcome(json={}))[1]))
        )
    for i in range(3):
        futs.append(
            sched.submit(Op("b", "op", lambda i=i: (order.append(f"b{i}"), Outcome(json={}))[1]))
        )
    gate.set()
    for f in [blocker, *futs]:
        _wait(f)
    assert order == ["a0", "b0", "a1", "b1", "a2", "b2"]
    u = sched.session_usage("a")
    assert u is not None and u.ops["op"] == 3
    assert u.device_seconds == 3 * 1.0 * 2  # 3 ops x 1 s x 2 devices
    assert sched.session_usage("x").device_seconds == 1.0 * 2


def test_failing_op_fails_only_its_future(sched, monkeypatch):
    """...and bills by fault: the service's own failure bills nothing (its time recorded as
    `unbilled_s`), a failure on the tenant's input bills what ran, as success does (#41)."""
    import service.scheduler

    monkeypatch.setattr(service.scheduler, "time", _StepClock())  # every op: exactly 1 s
    records: list[dict] = []
    sched.record = records.append
    bad = sched.submit(Op("a", "op", lambda: 1 / 0))
    user = sched.submit(
        Op("u", "op", lambda: (_ for _ in ()).throw(ServiceError(400, "no", field="f")))
    )
    good = sched.submit(Op("b", "op", lambda: Outcome(json={"ok": 1})))
    assert _wait(bad).category == "server" and "ZeroDivisionError" in _wait(bad).error
    assert _wait(user).category == "user" and _wait(user).error == "f: no"
    assert _wait(good).json == {"ok": 1}
    billed = {s: sched.session_usage(s).device_seconds for s in "aub"}
    assert billed == {"a": 0.0, "u": 2.0, "b": 2.0}  # 1 s x 2 devices, but not the fault's
    by = {r["session"]: (r["device_s"], r["unbilled_s"]) for r in records}
    assert by == {"a": (0.0, 2.0), "u": (2.0, 0.0), "b": (2.0, 0.0)}


def test_drain_finishes_queued_work_and_refuses_new(sched):
    done = [
        sched.submit(Op("a", "op", lambda: (time.sleep(0.05), Outcome(json={}))[1]))
        for _ in range(3)
    ]
    sched.open_lane("m", first_seq=1)
    held = sched.submit(Op("a", "op", lambda: Outcome(json={}), "m", 5))  # waits for seq 1..4
    finished, refused = sched.drain(10)
    assert finished == 3 and refused == 1
    assert all(_wait(f).error is None for f in done)
    assert "shut down" in _wait(held).error
    with pytest.raises(ServiceError) as e:
        sched.submit(Op("a", "op", lambda: Outcome(json={})))
    assert e.value.status == 410


def test_sessions_expire_and_free_their_models(monkeypatch):
    import service.sessions
    from service.sessions import Model, Registry
    from service.types import LoraSpec

    clock = _StepClock()  # the registry's clock, moved by hand: no sleep, no timing
    monkeypatch.setattr(service.sessions, "time", clock)
    reg = Registry(ttl_s=60)
    s = reg.new_session(None)
    reg.add_model(Model(f"{s.session_id}:train:0", s.session_id, "b", LoraSpec(rank=1)))
    clock.now += 59
    assert reg.expired() == []
    reg.session(s.session_id)  # a request: its TTL starts again
    clock.now += 59
    assert reg.expired() == []
    clock.now += 2
    assert reg.expired() == [(s.session_id, "")]
    models, _ = reg.finish(s.session_id, "expired")
    assert [m.model_id for m in models] == [f"{s.session_id}:train:0"]
    with pytest.raises(ServiceError) as e:  # a finished session answers 410
        reg.session(s.session_id)
    assert e.value.status == 410
    assert reg.finish(s.session_id, "again") == ([], [])  # first reason wins
