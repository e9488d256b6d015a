"""Several bases in one `Service` (tools.serve --recipe A --recipe B), in-process over fake
backends: requests are routed by base name, a model's requests reach its own base's backend
and are checked against its own context, an unknown base is a 400 naming every served base,
the tokenizer route needs the base's name, usage is billed by base, and one base's checkpoint
never loads onto the other (the HTTP path through the SDK: tests/integration/test_service_moe.py)."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from service import tinker_proto as pb
from service import wire
from service.accounting import AccountingLog
from service.backend import BaseModelInfo
from service.core import Service
from service.errors import ServiceError
from service.storage import Storage
from service.types import FwdBwdResult
from tests.unit.test_service_units import _wait


class NamedBackend:
    devices = 1
    max_lora_rank = 8

    def __init__(self, name: str, context: int) -> None:
        self.name, self.context = name, context
        self.ran: list[str] = []

    def base_model(self) -> BaseModelInfo:
        return BaseModelInfo(self.name, self.context, 64, "fake")

    def create_adapter(self, adapter, spec) -> None:
        self.ran.append(f"create {adapter}")

    def drop_adapter(self, adapter) -> None:
        self.ran.append(f"drop {adapter}")

    def save_state(self, adapter, folder) -> None:
        (folder / "state.bin").write_bytes(b"x")
        self.ran.append(f"save {adapter}")

    def load_state(self, adapter, folder, *, optimizer) -> None:
        self.ran.append(f"load {adapter}")

    def forward_backward(self, adapter, data, loss_fn, loss_config, *, forward_only):
        self.ran.append(f"fwdbwd {adapter}")
        out = [{"logprobs": np.zeros(d.tokens.size, np.float32)} for d in data]
        return FwdBwdResult(out, {"loss:sum": 0.0})


@pytest.fixture
def two(tmp_path):
    loop = asyncio.new_event_loop()
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()
    a, b = NamedBackend("org/long", 64), NamedBackend("org/short", 16)
    storage = Storage(str(tmp_path / "st"))
    s = Service([a, b], storage, loop, accounting=AccountingLog(storage.root))
    yield s, a, b
    s.scheduler.drain(5)
    s.accounting.close()
    loop.call_soon_threadsafe(loop.stop)


def _model(s: Service, base: str, seq: int = 0) -> str:
    sid = s.create_session("t", wire.CreateSessionBody())
    body = wire.CreateModelBody.model_validate(
        {"session_id": sid, "model_seq_id": seq, "base_model": base, "lora_config": {"rank": 2}}
    )
    assert _wait(s.create_model("t", body)).error is None
    return f"{sid}:train:{seq}"


def _fwdbwd(model: str, n: int) -> bytes:
    msg = pb.ForwardBackwardRequest(model_id=model, seq_id=1, loss_fn="cross_entropy")
    d = msg.data.add()
    d.model_input.add().encoded_text.tokens = np.ones(n, np.int32).tobytes()
    t = d.loss_fn_inputs["target_tokens"]
    t.dtype, t.shape[:] = pb.DTYPE_INT64, [n]
    t.dense = np.ones(n, np.int64).tobytes()
    return msg.SerializeToString()


def test_requests_are_routed_by_base(two):
    s, a, b = two
    caps = s.capabilities()["supported_models"]
    assert [(m["model_name"], m["max_context_length"]) for m in caps] == [
        ("org/long", 64),
        ("org/short", 16),
    ]
    with pytest.raises(ServiceError) as e:
        _model(s, "org/nope")
    assert e.value.status == 400 and "'org/long', 'org/short'" in e.value.message
    ma, mb = _model(s, "org/long"), _model(s, "org/short")
    assert a.ran == [f"create {ma}"] and b.ran == [f"create {mb}"]
    assert s.get_info("t", mb)["model_name"] == "org/short"
    # 40 tokens: within the long base's context, over the short one's (each model's own)
    assert s.decode_forward_backward(_fwdbwd(ma, 40), "t").error is None
    refused = s.decode_forward_backward(_fwdbwd(mb, 40), "t").error
    assert refused is not None and "40 tokens exceed the model's 16" in refused.message
    with pytest.raises(ServiceError, match="base_model: required: this service serves"):
        s.tokenizer_files("t", None)


def test_a_checkpoint_loads_only_onto_its_own_base(two):
    s, a, b = two
    ma, mb = _model(s, "org/long"), _model(s, "org/short")
    save = wire.SaveWeightsBody.model_validate({"model_id": ma, "seq_id": 1, "path": "c"})
    path = _wait(s.save_weights("t", save)).json["path"]
    assert s.weights_info("t", path)["base_model"] == "org/long"
    load = wire.LoadWeightsBody.model_validate(
        {"model_id": mb, "seq_id": 1, "path": path, "optimizer": False}
    )
    with pytest.raises(ServiceError) as e:
        s.load_weights("t", load)
    assert e.value.status == 400 and "belongs to base model 'org/long', not 'org/short'" in str(
        e.value.message
    )
    assert f"load {mb}" not in b.ran
    # the refusal took seq_id 1: the short model's next request (seq 2) runs
    nxt = wire.SaveWeightsBody.model_validate({"model_id": mb, "seq_id": 2, "path": "d"})
    assert _wait(s.save_weights("t", nxt)).error is None
    sid = s.create_session("t", wire.CreateSessionBody())
    new = wire.LoadWeightsBody.model_validate(
        {
            "session_id": sid,
            "model_seq_id": 0,
            "path": path,
            "base_model": "org/short",
            "optimizer": False,
        }
    )
    with pytest.raises(ServiceError, match="belongs to base model"):
        s.load_weights("t", new)
    own = wire.LoadWeightsBody.model_validate(
        {"session_id": sid, "model_seq_id": 1, "path": path, "optimizer": False}
    )
    assert _wait(s.load_weights("t", own)).error is None
    assert a.ran[-1] == f"load {sid}:train:1"


def test_usage_is_billed_by_base(two):
    """Each base's trained tokens are its own billing events (the usage log records the base
    each op ran on)."""
    s, a, b = two
    ma, mb = _model(s, "org/long"), _model(s, "org/short")
    assert _wait(s.forward_backward("t", _fwdbwd(ma, 40))).error is None
    assert _wait(s.forward_backward("t", _fwdbwd(mb, 10))).error is None
    assert a.ran[-1] == f"fwdbwd {ma}" and b.ran[-1] == f"fwdbwd {mb}"
    events = s.billing_usage("t", 0.0, 4e9)["data"]
    trained = {e["base_model"]: e["event_info"]["token_count"] for e in events}
    assert trained == {"org/long": 40, "org/short": 10}
