"""Two tenants on one `tools.serve`: every route refuses one tenant's ids to the other with the
404 a missing id gets, and nothing of the victim changes; the REST routes the cookbook calls
on resume (tinker.RestClient) under the same rules; a refused training request keeps its
seq_id place; revoking a key by editing the key file (or SIGHUP); `tools.usage` figures
against the per-operation log.

One server for the module: tenant "key-<fingerprint of KEY>" (the victim) and tenant "bob"
(KEY_B, KEY_B2: two keys, one tenant), admission budget 1 GiB per request.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402
from tinker.proto.request_conv import forward_backward_request_to_proto  # noqa: E402

from tests.helpers.service_server import (  # noqa: E402
    BASE_MODEL,
    KEY,
    KEY_B,
    KEY_B2,
    ROOT,
    SEQ,
    TWO_TENANTS,
    start_server,
)
from tests.helpers.service_server import sft_datum as datum  # noqa: E402


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(
        tmp_path_factory.mktemp("tenants"), "--max-request-gib", "1", keys=TWO_TENANTS
    )
    yield srv
    assert srv.stop() == 0, srv.log_text()[-3000:]


def call(server, key, method, path, body=None, content=None, headers=None):
    h = {"X-API-Key": key, **(headers or {})}
    return httpx.request(
        method, f"{server.url}{path}", json=body, content=content, headers=h, timeout=60
    )


def fwdbwd_raw(model_id: str, seq_id: int, data=None, loss="cross_entropy") -> bytes:
    req = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data or [datum()], loss_fn=loss),
        model_id=model_id,
        seq_id=seq_id,
    )
    return forward_backward_request_to_proto(req).SerializeToString()


def tree_digest(folder) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def fake_session() -> str:
    return f"s-{secrets.token_hex(16)}"


@pytest.fixture(scope="module")
def victim(server):
    """The victim's session, model (one step trained), checkpoints, sampler and a future."""
    sc = tinker.ServiceClient(base_url=server.url, api_key=KEY)
    tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=0).result()
    tc.forward_backward([datum()], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    path_w = tc.save_state("v-ckpt").result().path
    path_s = tc.save_weights_for_sampler("v-samp").result().path
    smp = sc.create_sampling_client(model_path=path_s).result()
    greedy = types.SamplingParams(max_tokens=6, temperature=0.0, seed=0)
    sample0 = smp.sample(types.ModelInput.from_ints(SEQ[:4]), 1, greedy).result()
    r = call(
        server,
        KEY,
        "POST",
        "/api/v1/asample",
        {
            "sampling_session_id": smp._sampling_session_id,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": SEQ[:4]}]},
            "sampling_params": {"max_tokens": 2, "temperature": 0.0},
        },
    )
    assert r.status_code == 200, r.text
    yield {
        "sc": sc,
        "tc": tc,
        "session": sc.holder.get_session_id(),
        "model": tc.model_id,
        "path_w": path_w,
        "path_s": path_s,
        "sampler": smp._sampling_session_id,
        "smp": smp,
        "sample0": sample0.sequences[0].tokens,
        "future": r.json()["request_id"],
        "greedy": greedy,
    }
    sc.close("success").result()


@pytest.fixture(scope="module")
def attacker(server):
    sc = tinker.ServiceClient(base_url=server.url, api_key=KEY_B)
    tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=1).result()
    yield {"sc": sc, "session": sc.holder.get_session_id(), "model": tc.model_id, "tc": tc}
    sc.close("success").result()


def _cases(v, a):
    """(method, path template) -> list of (request, id it targets) by the attacker.
    Each request is (method, path, json body | None, raw proto | None)."""
    sv, mv, nxt = v["session"], v["model"], 1000  # seq ids the victim has not used yet
    prompt = {"chunks": [{"type": "encoded_text", "tokens": SEQ[:4]}]}
    samp = {"max_tokens": 2, "temperature": 0.0}
    lora = {"rank": 4}
    P = "/api/v1"
    return {
        ("POST", f"{P}/session_heartbeat"): [(f"{P}/session_heartbeat", {"session_id": sv}, sv)],
        ("POST", f"{P}/sessions/{{session_id}}/finish"): [
            (f"{P}/sessions/{sv}/finish", {"reason": {"type": "x"}}, sv)
        ],
        ("GET", f"{P}/sessions/{{session_id}}/usage"): [(f"{P}/sessions/{sv}/usage", None, sv)],
        ("GET", f"{P}/sessions/{{session_id}}"): [(f"{P}/sessions/{sv}", None, sv)],
        ("POST", f"{P}/create_model"): [
            (  # squat the victim's next model id in its session
                f"{P}/create_model",
                {
                    "session_id": sv,
                    "model_seq_id": 1,
                    "base_model": BASE_MODEL,
                    "lora_config": lora,
                },
                sv,
            )
        ],
        ("POST", f"{P}/get_info"): [(f"{P}/get_info", {"model_id": mv}, mv)],
        ("POST", f"{P}/forward_backward"): [(f"{P}/forward_backward", fwdbwd_raw(mv, nxt), mv)],
        ("POST", f"{P}/optim_step"): [
            (
                f"{P}/optim_step",
                {"model_id": mv, "seq_id": nxt, "adam_params": {"learning_rate": 1.0}},
                mv,
            )
        ],
        ("POST", f"{P}/save_weights"): [
            (
                f"{P}/save_weights",
                {"model_id": mv, "seq_id": nxt, "path": "v-ckpt", "overwrite": True},
                mv,
            )
        ],
        ("POST", f"{P}/save_weights_for_sampler"): [
            (
                f"{P}/save_weights_for_sampler",
                {"model_id": mv, "seq_id": nxt, "path": "v-samp"},
                mv,
            ),
            (
                f"{P}/save_weights_for_sampler",
                {"model_id": mv, "seq_id": nxt, "sampling_session_seq_id": 0},
                mv,
            ),
        ],
        ("POST", f"{P}/load_weights"): [
            (  # into the victim's model
                f"{P}/load_weights",
                {"model_id": mv, "seq_id": nxt, "path": v["path_w"], "optimizer": False},
                mv,
            ),
            (  # the victim's checkpoint into the attacker's own model
                f"{P}/load_weights",
                {"model_id": a["model"], "seq_id": nxt, "path": v["path_w"], "optimizer": True},
                v["path_w"].split("/")[2],
            ),
            (  # a new model of the attacker's from the victim's checkpoint
                f"{P}/load_weights",
                {
                    "session_id": a["session"],
                    "model_seq_id": 77,
                    "path": v["path_w"],
                    "optimizer": True,
                },
                v["path_w"].split("/")[2],
            ),
        ],
        ("GET", f"{P}/training_runs/{{model_id}}"): [(f"{P}/training_runs/{mv}", None, mv)],
        ("GET", f"{P}/training_runs/{{model_id}}/checkpoints"): [
            (f"{P}/training_runs/{mv}/checkpoints", None, mv)
        ],
        ("DELETE", f"{P}/training_runs/{{model_id}}/checkpoints/{{kind}}/{{name}}"): [
            (f"{P}/training_runs/{mv}/checkpoints/weights/v-ckpt", None, mv)
        ],
        ("PUT", f"{P}/training_runs/{{model_id}}/checkpoints/{{kind}}/{{name}}/ttl"): [
            (f"{P}/training_runs/{mv}/checkpoints/weights/v-ckpt/ttl", {"ttl_seconds": 1}, mv)
        ],
        ("POST", f"{P}/weights_info"): [
            (f"{P}/weights_info", {"tinker_path": v["path_w"]}, v["path_w"].split("/")[2])
        ],
        ("POST", f"{P}/create_sampling_session"): [
            (  # the victim's sampler weights in the attacker's session
                f"{P}/create_sampling_session",
                {
                    "session_id": a["session"],
                    "sampling_session_seq_id": 50,
                    "model_path": v["path_s"],
                },
                v["path_s"].split("/")[2],
            ),
            (  # swap the victim's sampler: register the base model under its id
                f"{P}/create_sampling_session",
                {"session_id": sv, "sampling_session_seq_id": 0, "base_model": BASE_MODEL},
                sv,
            ),
        ],
        ("POST", f"{P}/join_sampling_session"): [
            (f"{P}/join_sampling_session", {"sampling_session_id": v["sampler"]}, v["sampler"])
        ],
        ("GET", f"{P}/samplers/{{sampler_id}}"): [
            (f"{P}/samplers/{v['sampler']}", None, v["sampler"])
        ],
        ("POST", f"{P}/asample"): [
            (
                f"{P}/asample",
                {"sampling_session_id": v["sampler"], "prompt": prompt, "sampling_params": samp},
                v["sampler"],
            )
        ],
        ("POST", f"{P}/retrieve_future"): [
            (f"{P}/retrieve_future", {"request_id": v["future"]}, v["future"])
        ],
        ("POST", f"{P}/cancel_future"): [
            (f"{P}/cancel_future", {"request_id": v["future"]}, v["future"])
        ],
        # the rest of the SDK's surface (service/surface.py)
        ("POST", f"{P}/copy_weights"): [
            (f"{P}/copy_weights", {"source_path": v["path_w"]}, v["path_w"].split("/")[2])
        ],
        ("POST", f"{P}/training_runs/{{model_id}}/checkpoints/{{kind}}/{{name}}/publish"): [
            (f"{P}/training_runs/{mv}/checkpoints/weights/v-ckpt/publish", None, mv)
        ],
        ("DELETE", f"{P}/training_runs/{{model_id}}/checkpoints/{{kind}}/{{name}}/publish"): [
            (f"{P}/training_runs/{mv}/checkpoints/weights/v-ckpt/publish", None, mv)
        ],
        ("GET", f"{P}/sessions/{{session_id}}/trace_export"): [
            (f"{P}/sessions/{sv}/trace_export", None, sv)
        ],
        ("PUT", f"{P}/sessions/{{session_id}}/project"): [
            (f"{P}/sessions/{sv}/project", {"project_id": "x"}, sv)
        ],
    }


# Routes that take no object id: what they answer is the caller's own (checked below) or
# nothing tenant-specific.
NO_OBJECT = {
    ("GET", "/api/v1/healthz"),
    ("POST", "/api/v1/client/config"),
    ("POST", "/api/v1/client/dynamic_config"),
    ("GET", "/api/v1/get_server_capabilities"),
    ("POST", "/api/v1/create_session"),
    ("POST", "/api/v1/telemetry"),
    ("GET", "/api/v1/tokenizer"),  # the base's tokenizer, the same for every tenant
    # the caller's own, by query or body (tests/integration/test_service_surface.py)
    ("GET", "/api/v1/billing/usage/events"),
    ("POST", "/api/v1/sessions/search"),
    # every route not served: 400 naming the SDK method
    *{(m, "/api/v1/{rest:path}") for m in ("GET", "POST", "PUT", "DELETE", "PATCH")},
}
LISTINGS = {
    ("GET", "/api/v1/sessions"),
    ("GET", "/api/v1/training_runs"),
    ("GET", "/api/v1/checkpoints"),
    ("GET", "/api/v1/usage"),
    ("GET", "/api/v1/audit"),
    ("GET", "/api/v1/billing/usage/checkpoints/current"),
}


def app_routes() -> set[tuple[str, str]]:
    """Every (method, path) the FastAPI app serves, read from the app itself."""
    from types import SimpleNamespace

    from fastapi.routing import APIRoute

    from service.app import create_app
    from service.core import Limits

    stub = SimpleNamespace(max_chunk_len=lambda: 1, limits=Limits())
    app = create_app(stub, None)  # type: ignore[arg-type]
    return {(m, r.path) for r in app.routes if isinstance(r, APIRoute) for m in r.methods}


def _send(server, key, method, path, body):
    if isinstance(body, bytes):
        return call(
            server,
            key,
            method,
            path,
            content=body,
            headers={"Content-Type": "application/x-protobuf"},
        )
    return call(server, key, method, path, body)


def _fresh(target: str) -> str:
    """A random id of the same shape as `target`, owned by nobody."""
    return re.sub(r"[0-9a-f]{32}", lambda m: secrets.token_hex(16), target)


def test_every_route_refuses_the_other_tenants_ids(server, victim, attacker):
    routes = app_routes()
    cases = _cases(victim, attacker)
    unclassified = routes - set(cases) - NO_OBJECT - LISTINGS
    assert not unclassified, f"routes without an ownership case: {sorted(unclassified)}"
    assert set(cases) <= routes, sorted(set(cases) - routes)

    v = victim
    vdir = server.tenant_dir(KEY)
    before_files = tree_digest(vdir)
    before_usage = call(server, KEY, "GET", f"/api/v1/sessions/{v['session']}/usage").json()
    before_loss = v["tc"].forward([datum()], "cross_entropy").result().metrics["loss:sum"]

    for (method, _), reqs in cases.items():
        for path, body, target in reqs:
            r = _send(server, KEY_B, method, path, body)
            assert r.status_code == 404, (method, path, r.status_code, r.text)
            # ... with the answer an id that never existed gets
            other = _fresh(target)
            if isinstance(body, bytes):
                body2 = body.replace(target.encode(), other.encode())
            else:
                body2 = json.loads(json.dumps(body).replace(target, other)) if body else None
            r2 = _send(server, KEY_B, method, path.replace(target, other), body2)
            assert r2.status_code == 404, (path, r2.text)
            assert r.json()["detail"].replace(target, "X") == r2.json()["detail"].replace(
                other, "X"
            ), (path, r.text, r2.text)
            assert str(server.storage) not in r.text

    # Listings show the attacker only its own.
    for _, path in LISTINGS:
        r = call(server, KEY_B, "GET", path)
        assert r.status_code == 200, (path, r.text)
        assert v["session"] not in r.text and v["model"] not in r.text, (path, r.text)
    runs = call(server, KEY_B, "GET", "/api/v1/training_runs").json()["training_runs"]
    assert [x["training_run_id"] for x in runs] == [attacker["model"]]
    assert call(server, KEY_B, "GET", "/api/v1/usage").json()["tenant"] == "bob"

    # Nothing of the victim changed: files, op counts, weights, sampler, session.
    assert tree_digest(vdir) == before_files
    after_usage = call(server, KEY, "GET", f"/api/v1/sessions/{v['session']}/usage").json()
    forwards = before_usage["ops"].get("forward", 0) + 1  # the one for before_loss
    assert after_usage["ops"] == {**before_usage["ops"], "forward": forwards}
    assert after_usage["failed_ops"] == before_usage["failed_ops"]
    assert v["tc"].forward([datum()], "cross_entropy").result().metrics["loss:sum"] == before_loss
    again = v["smp"].sample(types.ModelInput.from_ints(SEQ[:4]), 1, v["greedy"]).result()
    assert again.sequences[0].tokens == v["sample0"]
    proto = {"Accept": "application/x-protobuf"}
    r = call(
        server, KEY, "POST", "/api/v1/retrieve_future", {"request_id": v["future"]}, headers=proto
    )
    assert r.status_code == 200, r.text  # the victim still reads its own result
    # ... and its training client goes on in order (no seq_id was taken by the attacker)
    fb = v["tc"].forward_backward([datum()], "cross_entropy")
    v["tc"].optim_step(types.AdamParams(learning_rate=1e-2)).result()
    assert fb.result().metrics["loss:sum"] == pytest.approx(before_loss, rel=1e-6)
    assert not any(v["model"] in p.name for p in server.tenant_dir(name="bob").rglob("*"))


def test_a_tenants_keys_share_its_objects(server, attacker):
    r = call(server, KEY_B2, "GET", f"/api/v1/sessions/{attacker['session']}")
    assert r.status_code == 200 and attacker["model"] in r.json()["training_run_ids"]
    assert call(server, KEY, "GET", f"/api/v1/sessions/{attacker['session']}").status_code == 404


def test_rest_routes_of_a_resume(server):
    """What the cookbook's resume and rolling-save code calls, through tinker.RestClient."""
    sc = tinker.ServiceClient(base_url=server.url, api_key=KEY_B)
    tc = sc.create_lora_training_client(
        base_model=BASE_MODEL, rank=4, seed=3, user_metadata={"run": "resume"}
    ).result()
    tc.forward_backward([datum()], "cross_entropy").result()
    p1 = tc.save_state("step-1", ttl_seconds=3600).result().path
    p2 = tc.save_state("step-2").result().path
    ps = tc.save_weights_for_sampler("samp-2").result().path
    rc = tinker.RestClient(base_url=server.url, api_key=KEY_B)

    run = rc.get_training_run(tc.model_id).result()
    assert (run.training_run_id, run.base_model, run.lora_rank, run.is_lora) == (
        tc.model_id,
        BASE_MODEL,
        4,
        True,
    )
    assert run.model_owner == "bob" and run.user_metadata == {"run": "resume"}
    assert run.last_checkpoint.tinker_path == p2 and run.last_sampler_checkpoint.tinker_path == ps
    assert rc.get_training_run_by_tinker_path(p1).result().training_run_id == tc.model_id
    info = rc.get_weights_info_by_tinker_path(p1).result()
    assert (info.base_model, info.lora_rank, info.train_mlp) == (BASE_MODEL, 4, True)

    runs = rc.list_training_runs(limit=100).result()
    assert tc.model_id in [r.training_run_id for r in runs.training_runs]
    assert runs.cursor.total_count == len(runs.training_runs)
    mine = rc.list_user_checkpoints(limit=2).result()
    assert [c.tinker_path for c in mine.checkpoints] == [ps, p2]  # newest first
    assert mine.cursor.total_count >= 3
    assert sc.holder.get_session_id() in rc.list_sessions(limit=100).result().sessions

    rc.set_checkpoint_ttl_from_tinker_path(p2, 3600).result()
    listed = {c.tinker_path: c for c in rc.list_checkpoints(tc.model_id).result().checkpoints}
    assert listed[p2].expires_at is not None
    rc.set_checkpoint_ttl_from_tinker_path(p2, None).result()
    rc.delete_checkpoint_from_tinker_path(p1).result()
    listed = {c.tinker_path for c in rc.list_checkpoints(tc.model_id).result().checkpoints}
    assert listed == {p2, ps}
    with pytest.raises(tinker.NotFoundError):
        rc.delete_checkpoint_from_tinker_path(p1).result()
    # The resume: a new client from the run's last checkpoint, after the session ended.
    sc.close("success").result()
    sc2 = tinker.ServiceClient(base_url=server.url, api_key=KEY_B)
    last = rc.get_training_run_by_tinker_path(p2).result().last_checkpoint.tinker_path
    t2 = sc2.create_training_client_from_state_with_optimizer(last).result()
    assert t2.forward([datum()], "cross_entropy").result().metrics["loss:sum"] > 0
    # Another tenant sees none of it through the same client API.
    other = tinker.RestClient(base_url=server.url, api_key=KEY)
    with pytest.raises(tinker.NotFoundError):
        other.get_training_run(tc.model_id).result()
    with pytest.raises(tinker.NotFoundError):
        other.get_weights_info_by_tinker_path(p2).result()
    assert p2 not in [c.tinker_path for c in other.list_user_checkpoints().result().checkpoints]
    sc2.close("success").result()


def test_a_damaged_meta_json_hides_only_its_own_checkpoint(server):
    sc = tinker.ServiceClient(base_url=server.url, api_key=KEY_B)
    tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=4).result()
    good = tc.save_state("good").result().path
    bad = tc.save_state("bad").result().path
    (server.tenant_dir(name="bob") / tc.model_id / "weights" / "bad" / "meta.json").write_text("{")
    r = call(server, KEY_B, "GET", f"/api/v1/training_runs/{tc.model_id}/checkpoints")
    assert r.status_code == 200, r.text
    assert [c["tinker_path"] for c in r.json()["checkpoints"]] == [good]
    assert [d["tinker_path"] for d in r.json()["damaged"]] == [bad]
    with pytest.raises(tinker.APIStatusError, match="damaged"):
        sc.create_training_client_from_state(bad).result()
    assert sc.create_training_client_from_state(good).result().model_id
    sc.close("success").result()


def test_refused_requests_keep_their_seq_place(server):
    """#25: every kind of training request the service refuses, through the SDK; the client's
    next request runs (the refusal took its seq_id place)."""
    sc = tinker.ServiceClient(base_url=server.url, api_key=KEY_B)
    tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=5).result()
    bad_vocab = types.Datum(
        model_input=types.ModelInput.from_ints([1, 99999]),
        loss_fn_inputs={"target_tokens": [1, 2]},
    )
    too_long = datum(list(range(1, 100)))  # the served context is 64
    refused = {
        "bad loss name": lambda: tc.forward_backward([datum()], "dpo"),
        "token outside the vocabulary": lambda: tc.forward_backward([bad_vocab], "cross_entropy"),
        "sequence over the context": lambda: tc.forward([too_long], "cross_entropy"),
        "bad loss config": lambda: tc.forward_backward([datum()], "cross_entropy", {"x": 1.0}),
        "negative learning rate": lambda: tc.optim_step(types.AdamParams(learning_rate=-1.0)),
        "eps 0": lambda: tc.optim_step(types.AdamParams(learning_rate=1e-3, eps=0.0)),
        "bad checkpoint name": lambda: tc.save_state("../escape"),
        "bad sampler name": lambda: tc.save_weights_for_sampler("a/b"),
        "missing checkpoint": lambda: tc.load_state(f"tinker://{tc.model_id}/weights/none"),
    }
    for what, send in refused.items():
        # a refusal (4xx: the client's error), not a crash (5xx) or a timeout
        with pytest.raises((tinker.APIStatusError, tinker.RequestFailedError)) as e:
            send().result(timeout=60)
        err = e.value
        if isinstance(err, tinker.APIStatusError):
            assert 400 <= err.status_code < 500, (what, err)
        else:
            assert err.category == types.RequestErrorCategory.User, (what, err)
        # ... and the next request runs
        fb = tc.forward_backward([datum()], "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=60)
        assert fb.result(timeout=60).metrics["loss:sum"] > 0, what
    sc.close("success").result()


def test_admission_refusal_keeps_its_seq_place(server):
    """The SDK splits a batch into admitted chunks (the service's fwdbwd_max_chunk_len); a
    client that sends one over the budget gets 413 naming the limit, and its next seq_id runs."""
    sc = tinker.ServiceClient(base_url=server.url, api_key=KEY_B)
    tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=8).result()
    big = [datum(list(range(1, 65)))] * 300  # 300 x 63 tokens: about 2.7 GiB priced
    r = call(
        server,
        KEY_B,
        "POST",
        "/api/v1/forward_backward",
        content=fwdbwd_raw(tc.model_id, 1, big),
        headers={"Content-Type": "application/x-protobuf"},
    )
    assert r.status_code == 413, r.text
    assert r.json()["detail"].startswith("data:") and "admits 1.00 GiB" in r.text
    body = {"model_id": tc.model_id, "seq_id": 2, "adam_params": {"learning_rate": 1e-3}}
    rid = call(server, KEY_B, "POST", "/api/v1/optim_step", body).json()["request_id"]
    out = call(server, KEY_B, "POST", "/api/v1/retrieve_future", {"request_id": rid}).json()
    assert "metrics" in out, out  # ran, not held for seq 1
    sc.close("success").result()


def test_usage_tool_sums_the_operations(server, victim, attacker):
    """Two tenants, several sessions: tools.usage equals the sum of each operation's
    device-seconds (wall x devices) as the per-operation log lines state them."""
    extra = tinker.ServiceClient(base_url=server.url, api_key=KEY)
    t = extra.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=9).result()
    t.forward_backward([datum()], "cross_entropy").result()
    extra.close("success").result()
    records = server.storage / "usage.jsonl"
    op_line = re.compile(r"service\.op tenant=(\S+) session=(\S+) .* device_s=([0-9.]+)")
    for _ in range(100):  # the worker writes the record, then the log line
        logged = [op_line.search(x) for x in server.log_text().splitlines()]
        logged = [m for m in logged if m]
        if len(logged) == len(records.read_text().splitlines()):
            break
        time.sleep(0.1)
    expect: dict[str, float] = {}
    sessions: dict[str, set] = {}
    for m in logged:
        expect[m[1]] = expect.get(m[1], 0.0) + float(m[3])
        sessions.setdefault(m[1], set()).add(m[2])
    from service.tenants import fingerprint

    assert set(expect) == {"bob", fingerprint(KEY)} and len(sessions[fingerprint(KEY)]) >= 2
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run(
        [sys.executable, "-m", "tools.usage", "--storage", str(server.storage), "--json"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    for tenant, dev_s in expect.items():
        n = len([m for m in logged if m[1] == tenant])
        assert got[tenant]["device_seconds"] == pytest.approx(dev_s, abs=1e-4 * n), tenant
        assert got[tenant]["gpu_minutes"] == pytest.approx(dev_s / 60, abs=1e-5 * n)
        assert got[tenant]["ops"] == n and got[tenant]["sessions"] == len(sessions[tenant])
    table = subprocess.run(
        [sys.executable, "-m", "tools.usage", "--storage", str(server.storage)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    rows = {line.split()[0]: line.split() for line in table.splitlines()[1:]}
    assert set(rows) == {"bob", fingerprint(KEY), "total"}
    # GPU-minutes, before the three token columns (prefill, sampled, trained)
    assert float(rows["bob"][-4]) == pytest.approx(expect["bob"] / 60, abs=1e-4)
    for k in (KEY, KEY_B, KEY_B2):
        assert k not in table and k not in records.read_text() and k not in server.log_text()
    # the endpoint is the same aggregation, the caller's only
    mine = call(server, KEY_B, "GET", "/api/v1/usage").json()
    assert mine["device_seconds"] == pytest.approx(got["bob"]["device_seconds"], rel=1e-9)


def test_log_lines_escape_client_strings(server):
    sc = tinker.ServiceClient(base_url=server.url, api_key=KEY_B)
    sid = sc.holder.get_session_id()
    forged = "x\nservice.op tenant=bob session=s-0 lane=None kind=forward_backward device_s=99"
    r = call(server, KEY_B, "POST", f"/api/v1/sessions/{sid}/finish", {"reason": {"type": forged}})
    assert r.status_code == 200, r.text
    lines = server.log_text().splitlines()
    assert not any(x.startswith("service.op") for x in lines)
    assert any("reason=x\\nservice.op" in x for x in lines)


def test_revoking_a_key_by_editing_the_key_file(server, attacker):
    keyfile = server.storage.parent / "keys.txt"
    original = keyfile.read_text()
    sid = attacker["session"]

    def status(key):
        return call(
            server, key, "POST", "/api/v1/session_heartbeat", {"session_id": sid}
        ).status_code

    try:
        keyfile.write_text(original.replace(f"bob {KEY_B2}\n", ""))
        assert status(KEY_B2) == 401 and status(KEY_B) == 200  # no restart
        # SIGHUP: an edit the change check cannot see (same size, inode and mtime)
        keyfile.write_text(original)
        assert status(KEY_B2) == 200
        st = keyfile.stat()
        new_key = "tml-bob-third-key-" + KEY_B2[len("tml-bob-third-key-") :]
        assert len(new_key) == len(KEY_B2)
        with open(keyfile, "r+") as f:
            f.write(original.replace(KEY_B2, new_key))
        os.utime(keyfile, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert status(KEY_B2) == 200  # not re-read yet
        server.proc.send_signal(signal.SIGHUP)
        end = time.monotonic() + 10
        while status(KEY_B2) != 401 and time.monotonic() < end:
            time.sleep(0.1)
        assert status(KEY_B2) == 401 and status(new_key) == 200
        # a reload that fails (others may read the file) keeps the previous keys
        keyfile.chmod(0o644)
        keyfile.write_text(original)
        assert status(new_key) == 200 and status(KEY_B2) == 401
        assert "key file not reloaded" in server.log_text()
    finally:
        keyfile.write_text(original)
        keyfile.chmod(0o600)
    assert status(KEY_B2) == 200


def test_damaged_sampler_weights_are_refused_naming_the_checkpoint(server):
    """Sampler weights are verified like every checkpoint (core.atomic's manifest): a
    truncated file or one flipped byte makes create_sampling_client a 422 naming the
    checkpoint and the file, never a sampler of the base model."""
    sc = tinker.ServiceClient(base_url=server.url, api_key=KEY_B)
    tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=6).result()
    tc.forward_backward([datum()], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    folder = server.tenant_dir(name="bob") / tc.model_id / "sampler_weights"
    truncated = tc.save_weights_for_sampler("truncated").result().path
    f = folder / "truncated" / "adapter_model.safetensors"
    size = f.stat().st_size
    f.write_bytes(f.read_bytes()[: size // 2])
    flipped = tc.save_weights_for_sampler("flipped").result().path
    g = folder / "flipped" / "adapter_model.safetensors"
    raw = bytearray(g.read_bytes())
    raw[-1] ^= 0x40  # inside the last tensor's data: the file still parses
    g.write_bytes(bytes(raw))
    why = {truncated: f"has {size // 2} bytes, the manifest says {size}", flipped: "is corrupted"}
    for path, because in why.items():
        with pytest.raises(tinker.APIStatusError) as e:
            sc.create_sampling_client(model_path=path).result()
        msg = str(e.value)
        assert e.value.status_code == 422, msg
        assert f"checkpoint {path} is damaged (adapter_model.safetensors {because}" in msg, msg
        assert str(server.storage) not in msg
    sc.close("success").result()


def test_client_errors_carry_no_server_paths(server):
    sc = tinker.ServiceClient(base_url=server.url, api_key=KEY_B)
    tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=7).result()
    path = tc.save_state("gone").result().path
    os.remove(
        server.tenant_dir(name="bob")
        / tc.model_id
        / "weights"
        / "gone"
        / "adapter_model.safetensors"
    )
    with pytest.raises(tinker.APIStatusError) as e:  # verified at the route: a 422
        sc.create_training_client_from_state(path).result()
    msg = str(e.value)
    assert e.value.status_code == 422, msg
    # Names the file it lacks, never where the server keeps it.
    assert "adapter_model.safetensors" in msg, msg
    assert str(server.storage) not in msg and "/tmp" not in msg, msg
    sc.close("success").result()


@pytest.mark.parametrize(
    "body, field",
    [
        ({"seq_id": 1.0}, "seq_id"),  # an integer field refuses a float
        ({"seq_id": "1"}, "seq_id"),
        ({"seq_id": 10**30}, "seq_id"),
        ({"adam_params": {"learning_rate": float("nan")}}, "adam_params.learning_rate"),
        ({"adam_params": {"beta2": 1.0}}, "adam_params.beta2"),
        ({"adam_params": {"eps": 0.0}}, "adam_params.eps"),
    ],
)
def test_optim_step_fields_are_strict(server, attacker, body, field):
    full = {"model_id": attacker["model"], "seq_id": 10_000, "adam_params": {}}
    for k, v in body.items():
        full[k] = {**full[k], **v} if isinstance(v, dict) else v
    raw = json.dumps(full, allow_nan=True)
    r = call(
        server,
        KEY_B,
        "POST",
        "/api/v1/optim_step",
        content=raw,
        headers={"Content-Type": "application/json"},
    )
    assert r.status_code == 400 and r.json()["detail"].startswith(field), r.text


def test_decoding_never_answers_500(server, attacker):
    sid = attacker["session"]
    r = call(
        server,
        KEY_B,
        "POST",
        "/api/v1/create_sampling_session",
        {"session_id": sid, "sampling_session_seq_id": 900, "base_model": BASE_MODEL},
    )
    sampler = r.json()["sampling_session_id"]
    bodies = [
        (
            "/api/v1/asample",
            {
                "sampling_session_id": sampler,
                "prompt": {"chunks": [{"tokens": [10**30]}]},
                "sampling_params": {},
            },
        ),
        (
            "/api/v1/create_model",
            {
                "session_id": sid,
                "model_seq_id": 3,
                "base_model": BASE_MODEL,
                "lora_config": {"rank": 4, "seed": 2**70},
            },
        ),
        (
            "/api/v1/create_sampling_session",
            {"session_id": sid, "sampling_session_seq_id": 2**80, "base_model": BASE_MODEL},
        ),
        ("/api/v1/retrieve_future", [1, 2]),
        ("/api/v1/session_heartbeat", "null"),
    ]
    for path, body in bodies:
        r = call(server, KEY_B, "POST", path, body)
        assert 400 <= r.status_code < 500, (path, r.status_code, r.text)
    rng = np.random.default_rng(0)
    good = fwdbwd_raw(attacker["model"], 10_000)
    for _ in range(200):  # mutated protobuf bodies
        b = bytearray(good)
        for j in rng.integers(0, len(b), 3):
            b[j] = int(rng.integers(0, 256))
        r = call(
            server,
            KEY_B,
            "POST",
            "/api/v1/forward_backward",
            content=bytes(b),
            headers={"Content-Type": "application/x-protobuf"},
        )
        assert r.status_code < 500, r.text


def test_importance_weights_and_target_tokens_are_checked(server, attacker):
    toks = SEQ
    n = len(toks) - 1
    cases = [
        (  # a finite log-probability no sampler produces: exp(logp - q) would overflow
            types.Datum(
                model_input=types.ModelInput.from_ints(toks[:-1]),
                loss_fn_inputs={
                    "target_tokens": toks[1:],
                    "logprobs": [-1e4] * n,
                    "advantages": [1.0] * n,
                },
            ),
            "importance_sampling",
            "data[0].loss_fn_inputs.logprobs",
        ),
        (  # token ids as floats: refused, not truncated
            types.Datum(
                model_input=types.ModelInput.from_ints(toks[:-1]),
                loss_fn_inputs={
                    "target_tokens": types.TensorData(
                        data=[float(t) + 0.5 for t in toks[1:]], dtype="float32", shape=[n]
                    )
                },
            ),
            "cross_entropy",
            "data[0].loss_fn_inputs.target_tokens",
        ),
    ]
    for d, loss, field in cases:
        r = call(
            server,
            KEY_B,
            "POST",
            "/api/v1/forward_backward",
            content=fwdbwd_raw(attacker["model"], 10_000, [d], loss),
            headers={"Content-Type": "application/x-protobuf"},
        )
        assert r.status_code == 400 and r.json()["detail"].startswith(field), r.text
