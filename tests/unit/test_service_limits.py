"""Issue #41 in-process: body decoding bounded before allocation, per-request and per-tenant
limits named in their refusal, admission before registration (a create refused with 429 is
accepted when retried), every seq_id resolved whatever the validation raises, and a
non-finite optimizer step undone. A `Service` over a fake backend whose ops block on an
event: no HTTP, no model, no sleeps."""

from __future__ import annotations

import asyncio
import threading
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch

from service import proto, wire
from service import tinker_proto as pb
from service.backend import BaseModelInfo
from service.core import Service
from service.errors import ServiceError
from service.limits import Limits, parse_limit
from service.storage import Storage
from tests.unit.test_service_units import _wait  # polls a future's outcome (no sleep asserts)

VOCAB, CONTEXT = 64, 32


class GatedBackend:
    """Every op waits for `gate`; records what ran."""

    devices = 1
    max_lora_rank = 8

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.ran: list[str] = []

    def base_model(self) -> BaseModelInfo:
        return BaseModelInfo("fake/base", CONTEXT, VOCAB, "fake")

    def create_adapter(self, adapter, spec) -> None:
        self.gate.wait(10)
        self.ran.append(f"create {adapter}")

    def drop_adapter(self, adapter) -> None:
        pass

    def adapter_bytes(self, spec) -> int:
        return 1000 * spec.rank

    def optim_step(self, adapter, params):
        self.gate.wait(10)
        self.ran.append(f"optim {adapter}")
        return {}


@pytest.fixture
def svc(tmp_path):
    loop = asyncio.new_event_loop()
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()
    backend = GatedBackend()
    limits = Limits(max_queued_per_tenant=2, max_sessions_per_tenant=2, max_models_per_tenant=4)
    s = Service(backend, Storage(str(tmp_path / "st")), loop, limits=limits)
    yield s, backend
    backend.gate.set()
    s.scheduler.drain(5)
    loop.call_soon_threadsafe(loop.stop)


def _session(s: Service, tenant="t", meta=None) -> str:
    return s.create_session(tenant, wire.CreateSessionBody(user_metadata=meta))


def _create(s: Service, sid: str, seq: int, tenant="t"):
    body = wire.CreateModelBody.model_validate(
        {"session_id": sid, "model_seq_id": seq, "base_model": "fake/base",
         "lora_config": {"rank": 2}}
    )  # fmt: skip
    return s.create_model(tenant, body)


def test_create_refused_with_429_is_accepted_when_retried(svc):
    s, backend = svc
    sid = _session(s)
    first = [_create(s, sid, 0)]
    while s.scheduler._running is None:  # the worker holds the first; two more queue
        time.sleep(0.01)
    first += [_create(s, sid, i) for i in (1, 2)]  # the tenant's queue cap: 2
    with pytest.raises(ServiceError) as e:
        _create(s, sid, 3)
    assert e.value.status == 429
    assert f"{sid}:train:3" not in s.registry.models  # refused: nothing registered
    backend.gate.set()
    assert all(_wait(f).error is None for f in first)
    again = _create(s, sid, 3)  # the SDK's retry of the same create
    assert _wait(again).error is None
    assert f"create {sid}:train:3" in backend.ran


def test_a_validation_crash_still_resolves_its_seq_id(svc, monkeypatch):
    s, backend = svc
    backend.gate.set()
    sid = _session(s)
    mid = f"{sid}:train:0"
    assert _wait(_create(s, sid, 0)).error is None

    def damaged(*a, **k):  # a meta.json nested past the recursion limit
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(wire, "adam_params", damaged)
    body = wire.OptimStepBody.model_validate(
        {"model_id": mid, "seq_id": 1, "adam_params": {"learning_rate": 1e-3}}
    )
    with pytest.raises(ServiceError) as e:
        s.optim_step("t", body)
    assert e.value.status == 500 and "RecursionError" in e.value.message
    monkeypatch.undo()
    nxt = s.optim_step("t", body.model_copy(update={"seq_id": 2}))
    assert _wait(nxt).error is None  # seq 2 ran: seq 1's place was resolved
    assert backend.ran[-1] == f"optim {mid}"


def test_tenant_limits_are_named(svc):
    s, backend = svc
    backend.gate.set()
    a, b = _session(s), _session(s)
    with pytest.raises(ServiceError) as e:
        _session(s)
    assert e.value.status == 429 and "max_sessions_per_tenant" in e.value.message
    _session(s, tenant="other")  # another tenant is not counted
    for i in range(4):
        assert _wait(_create(s, a if i < 2 else b, i)).error is None
    with pytest.raises(ServiceError) as e:
        _create(s, b, 9)
    assert e.value.status == 429 and "max_models_per_tenant" in e.value.message
    s.finish_session("t", a, "done")  # its models and the session slot are freed
    _session(s)
    assert _wait(_create(s, b, 10)).error is None
    with pytest.raises(ServiceError) as e:
        _session(s, tenant="other", meta={"k": "x" * 20_000})
    assert e.value.status == 413 and "max_metadata_bytes" in e.value.message


def test_finished_sessions_kept_per_tenant_are_bounded(svc):
    s, backend = svc
    backend.gate.set()
    keep = 3
    for _ in range(5):
        s.finish_session("t", _session(s), "done")
    forgotten = s.registry.forget_finished(keep)
    assert len(forgotten) == 2 and len(s.registry.tenant_sessions("t")) == keep


def _csr_request(rows: int, cols: int, model="s-x:train:0", seq=1, nnz=1_000_000) -> bytes:
    msg = pb.ForwardBackwardRequest(model_id=model, seq_id=seq, loss_fn="cross_entropy")
    d = msg.data.add()
    d.model_input.add().encoded_text.tokens = np.int32([1, 2]).tobytes()
    t = d.loss_fn_inputs["weights"]
    t.dtype, t.shape[:] = pb.DTYPE_FLOAT32, [rows, cols]
    t.sparse_csr.values = np.ones(nnz, np.float32).tobytes()
    t.sparse_csr.col_indices = np.zeros(nnz, np.int64).tobytes()
    crow = np.zeros(rows + 1, np.int64)
    crow[1:] = nnz
    t.sparse_csr.crow_indices = crow.tobytes()
    return msg.SerializeToString()


def test_a_csr_tensor_is_bounded_before_it_is_expanded():
    raw = _csr_request(500_000, 1024, nnz=100_000)
    assert len(raw) > 4 << 20
    tracemalloc.start()
    req = proto.decode_forward_backward_request(raw, proto.Bounds(max_data=8, max_len=CONTEXT))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    # Refused naming the tensor; header kept (the refusal takes the seq_id place); nothing
    # near the declared 500000 x 1024 x 4 bytes (2 GiB) was allocated.
    assert req.error is not None and req.error.status == 413
    assert "data[0].loss_fn_inputs.weights.shape" in req.error.message
    assert (req.model_id, req.seq_id) == ("s-x:train:0", 1)
    assert peak < 3 * len(raw)


def test_datum_and_token_counts_are_bounded_before_decoding():
    msg = pb.ForwardBackwardRequest(model_id="m", seq_id=1, loss_fn="cross_entropy")
    for _ in range(9):
        msg.data.add().model_input.add().encoded_text.tokens = np.int32([1]).tobytes()
    req = proto.decode_forward_backward_request(msg.SerializeToString(), proto.Bounds(8, 32))
    assert req.error is not None and req.error.status == 413 and req.data == []
    msg = pb.ForwardBackwardRequest(model_id="m", seq_id=1, loss_fn="cross_entropy")
    msg.data.add().model_input.add().encoded_text.tokens = np.zeros(33, np.int32).tobytes()
    req = proto.decode_forward_backward_request(msg.SerializeToString(), proto.Bounds(8, 32))
    assert req.error is not None and "33 tokens exceed the model's 32" in req.error.message


def test_a_refused_decode_takes_its_seq_place(svc):
    s, backend = svc
    backend.gate.set()
    sid = _session(s)
    mid = f"{sid}:train:0"
    assert _wait(_create(s, sid, 0)).error is None
    with pytest.raises(ServiceError) as e:
        s.forward_backward("t", s.decode_forward_backward(_csr_request(500, 1024, mid, 1, 10)))
    assert e.value.status == 413
    body = wire.OptimStepBody.model_validate(
        {"model_id": mid, "seq_id": 2, "adam_params": {"learning_rate": 1e-3}}
    )
    assert _wait(s.optim_step("t", body)).error is None


@pytest.mark.parametrize(
    "stop, limit",
    [(["x"] * 65, "max_stop"), (["y" * 4097], "max_stop_chars"), (list(range(65)), "max_stop")],
)
def test_stop_sequences_are_bounded(stop, limit):
    from service.limits import check_stop

    with pytest.raises(ServiceError) as e:
        check_stop(stop, Limits())
    assert e.value.status == 413 and f"(limit {limit})" in e.value.message
    check_stop(stop[:64] if limit == "max_stop" else ["y" * 4096], Limits())


def test_negative_stop_token_is_one_clear_error():
    from service.sampling import sample_request

    body = wire.SampleBody.model_validate(
        {"prompt": {"chunks": [{"tokens": [1, 2]}]}, "sampling_params": {"stop": [3, -1]}}
    )
    with pytest.raises(ServiceError) as e:
        sample_request(body, vocab=VOCAB, max_context=CONTEXT, max_samples=4)
    assert e.value.message == "sampling_params.stop: token id -1 outside the vocabulary [0, 64)"


@pytest.mark.parametrize(
    "text", ["max_stop", "max_stop=0", "max_stop=nan", "nope=3", "max_stop=1.5"]
)
def test_limit_settings_are_checked(text):
    with pytest.raises(ValueError):
        parse_limit(text)
    assert parse_limit("op_deadline_min_s=2.5") == ("op_deadline_min_s", 2.5)


def test_a_step_to_non_finite_weights_is_undone():
    from torchtitan.components.optimizer import default_adamw

    from runtime.steps import NonFiniteError, StepEngine

    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4)
    opt = default_adamw(lr=1e-3, eps=1e-12, weight_decay=0.0).build(model_parts=[lin])
    eng = StepEngine(lin, opt, microbatch_tokens=8, max_norm=0, guard_weights=True)
    x = torch.randn(3, 4)
    lin(x).sum().backward()
    eng.optim_step()  # one good step: the optimizer has state
    before = {k: v.detach().clone() for k, v in lin.state_dict().items()}
    state = {k: v.clone() for k, v in opt.optimizers[0].state[lin.weight].items()}
    loss_before = float(lin(x).detach().square().sum())
    for g in opt.optimizers[0].param_groups:
        g["lr"] = 1e30  # finite weights of ~1e30: their squares overflow float32
    lin(x).sum().backward()
    with pytest.raises(NonFiniteError, match="the step was undone"):
        eng.optim_step()
    for k, v in lin.state_dict().items():
        assert torch.equal(v, before[k])
    for k, v in opt.optimizers[0].state[lin.weight].items():
        assert torch.equal(v, state[k])
    assert lin.weight.grad is None or not lin.weight.grad.any()
    assert float(lin(x).detach().square().sum()) == loss_before


def test_deadline_with_an_injected_clock():
    from service.deadline import Deadline, op_deadline

    now = [100.0]
    d = Deadline(op_deadline(2.0, factor=20, min_s=10), 2.0, clock=lambda: now[0])
    assert d.seconds == 40
    now[0] += 40
    d.check()  # at the deadline: still running
    now[0] += 0.5
    with pytest.raises(ServiceError) as e:
        d.check()
    assert e.value.status == 413 and "deadline of 40 s (priced at 2.0 s)" in e.value.message
    assert op_deadline(0.01, factor=20, min_s=10) == 10


def test_an_op_past_its_deadline_fails_alone():
    from service import deadline
    from service.futures import FutureStore, Outcome
    from service.scheduler import Op, Scheduler

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    sched = Scheduler(FutureStore(loop), devices=1, deadline_s=lambda priced: -1.0)
    steps = []

    def endless() -> Outcome:  # a decode loop that never ends on its own
        while True:
            steps.append(1)
            deadline.check()

    def small() -> Outcome:
        return Outcome(json={"ok": True})

    a = sched.submit(Op("s-a", "sample", endless, tenant="a"))
    b = sched.submit(Op("s-b", "sample", small, tenant="b"))
    assert "past its deadline" in _wait(a).error and _wait(a).category == "user"
    assert _wait(b).json == {"ok": True} and len(steps) == 1
    sched.drain(5)
    loop.call_soon_threadsafe(loop.stop)


@pytest.mark.parametrize("name", ["ckpt\n", "ckpt\n\n"])
def test_names_with_a_trailing_newline_are_refused(name):
    from service import tenants
    from service.served_base import HF_NAME
    from service.storage import check_model_id, check_name

    with pytest.raises(ServiceError):
        check_name(name, "path")
    with pytest.raises(ServiceError):
        check_model_id("s-1:train:0" + name[4:], "model_id")
    assert tenants._NAME.match(name) is None and tenants._KEY.match("tml-" + name) is None
    assert HF_NAME.match("org/" + name) is None


def test_a_deleted_key_file_is_logged_once(tmp_path, caplog):
    from service.tenants import KeyFile

    f = tmp_path / "keys.txt"
    f.write_text("tml-0123456789abcdef0123456789\n")
    f.chmod(0o600)
    ring = KeyFile(str(f))
    f.unlink()
    with caplog.at_level("ERROR", logger="service"):
        for _ in range(5):
            assert ring.tenant("tml-0123456789abcdef0123456789") is not None  # keys stay
    assert len([r for r in caplog.records if r.levelname == "ERROR"]) == 1


def test_empty_recipe_is_an_error():
    from core.errors import ConfigError
    from tools.cli import ArgumentParser, add_recipe_arg

    p = ArgumentParser()
    add_recipe_arg(p)
    with pytest.raises(ConfigError, match="--recipe: expected a recipe TOML"):
        p.parse_args(["--recipe="])
    assert p.parse_args([]).recipe is None  # absent: the default, as before


def test_json_readers_bound_nesting_depth(tmp_path):
    from core import jsonio
    from service.storage import CheckpointRef, CheckpointStore

    bomb = b"[" * 100_000 + b"]" * 100_000
    with pytest.raises(ValueError, match="nested 100000 levels"):
        jsonio.loads(bomb)
    assert jsonio.loads(b'{"a": "[[[[", "b": [[1]]}') == {"a": "[[[[", "b": [[1]]}
    assert jsonio.nesting_depth(b'["\\"[", {"x": []}]') == 3
    store = CheckpointStore(tmp_path)
    ref = CheckpointRef("s-1:train:0", "weights", "w")
    store.folder(ref).mkdir(parents=True)
    (store.folder(ref) / "meta.json").write_bytes(b'{"lora": ' + bomb + b"}")
    with pytest.raises(ServiceError) as e:  # was a RecursionError: a hole in the seq order
        store.meta(ref)
    assert e.value.status == 422 and "nested" in e.value.message


def test_line_readers_take_a_deep_line_as_a_bad_line(tmp_path):
    """Each line-oriented reader of input it does not control: a line nested 100,000 deep
    is one bad line (skipped, counted or refused as invalid), never a RecursionError (a
    dataset scan, the usage index, a refused body's seq_id, a metrics resume)."""
    from data.sources import classify_jsonl_line
    from posttrain.evaluate import load_examples
    from runtime.metrics import read_starts, read_trajectory
    from service.accounting import read_records
    from service.wire import sequence_key

    deep = "[" * 100_000 + "]" * 100_000
    assert classify_jsonl_line(deep, "text") == (None, "invalid_json")
    good = '{"ts": 1.0, "device_s": 2.0, "tenant": "a"}'
    (tmp_path / "usage.jsonl").write_text(f"{deep}\n{good}\n")
    records, damaged = read_records(tmp_path / "usage.jsonl")
    assert damaged == 1 and [r["tenant"] for r in records] == ["a"]
    body = b'{"model_id": "m", "seq_id": 3, "x": ' + deep.encode() + b"}"
    assert sequence_key(body) is None and sequence_key(b'{"model_id": "m", "seq_id": 3}')
    chat = (
        '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}'
    )
    (tmp_path / "eval.jsonl").write_text(f"{deep}\n{chat}\n")
    assert len(load_examples(tmp_path / "eval.jsonl")) == 1
    (tmp_path / "metrics.jsonl").write_text(f'{deep}\n{{"step": 1, "loss": 2.0}}\n')
    assert [r["step"] for r in read_trajectory(tmp_path / "metrics.jsonl")] == [1]
    assert read_starts(tmp_path / "metrics.jsonl") == []


def test_an_adapter_export_refuses_another_runs_folder(tmp_path):
    """Round III: two runs given one finetune.export_dir silently replaced the first export."""
    from types import SimpleNamespace

    from core.errors import ConfigError
    from posttrain.lora import adapter_export_folder, check_adapter_export
    from runtime.hf import export_run_id, mark_export

    def recipe(run: str):
        return SimpleNamespace(
            finetune=SimpleNamespace(export_dir="{output_dir}/peft"), output_dir=str(tmp_path),
            checkpoint_dir=str(tmp_path / run), source="r.toml",
        )  # fmt: skip

    a, b = recipe("run-a"), recipe("run-b")
    check_adapter_export(a, "job")  # nothing there yet
    folder = Path(adapter_export_folder(a, "job"))
    folder.mkdir(parents=True)
    mark_export(str(folder), export_run_id(a.checkpoint_dir))
    check_adapter_export(a, "job")  # its own (a resume) may be written again
    with pytest.raises(ConfigError, match="another run's") as e:
        check_adapter_export(b, "job")
    assert e.value.key == "finetune.export_dir"
    (folder / "titanscale_export.json").unlink()  # a folder titanscale did not write
    with pytest.raises(ConfigError, match="not a titanscale export"):
        check_adapter_export(a, "job")


def test_resident_adapters_are_admitted_against_the_budget(tmp_path):
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    backend = GatedBackend()
    backend.gate.set()
    # rank 2: 2,000 bytes of weights, x4 resident (weights, grads, two moments) = 8,000
    s = Service(backend, Storage(str(tmp_path / "st")), loop,
                limits=Limits(max_resident_bytes=20_000))  # fmt: skip
    a, b = _session(s), _session(s, tenant="u")
    assert _wait(_create(s, a, 0)).error is None
    assert _wait(_create(s, b, 0, tenant="u")).error is None
    with pytest.raises(ServiceError) as e:  # a third: 24,000 > 20,000
        _create(s, a, 1)
    assert e.value.status == 429 and "--max-resident-gib" in e.value.message
    assert f"{a}:train:1" not in s.registry.models
    assert s.resident.total() == 16_000
    s.finish_session("u", b, "done")  # frees the other tenant's adapter
    assert s.resident.total() == 8_000
    assert _wait(_create(s, a, 1)).error is None
    big = wire.CreateModelBody.model_validate(
        {"session_id": a, "model_seq_id": 5, "base_model": "fake/base",
         "lora_config": {"rank": 8}}
    )  # fmt: skip
    with pytest.raises(ServiceError) as e:  # 32,000: more than the whole budget
        s.create_model("t", big)
    assert e.value.status == 413
    s.scheduler.drain(5)
    loop.call_soon_threadsafe(loop.stop)
