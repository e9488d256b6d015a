"""The whole tinker SDK surface against one `tools.serve` (two tenants): every public method
of ServiceClient, TrainingClient, SamplingClient and RestClient (sync and async) either works
or is refused with a 4xx naming the method and "not supported by this service", and the same
client's next call works; save_weights_external then forward on the same training client;
publish/unpublish across tenants; the audit log; billing tokens and `tools.usage`.

One server for the module (the debug model, two layers): tenant "key-<fingerprint of KEY>"
and tenant "bob" (KEY_B).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import inspect
import json
import subprocess
import sys
import urllib.request
import warnings
from collections.abc import Callable
from typing import Any

import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from tests.helpers.service_server import (  # noqa: E402
    BASE_MODEL,
    KEY,
    KEY_B,
    ROOT,
    SEQ,
    TWO_TENANTS,
    fetch_tokenizer,
    start_server,
)
from tests.helpers.service_server import sft_datum as datum  # noqa: E402

NOT_SERVED = "not supported by this service"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("surface"), keys=TWO_TENANTS)
    yield srv
    assert srv.stop() == 0, srv.log_text()[-3000:]


def run(x: Any) -> Any:
    """The result of a sync call (an APIFuture / concurrent future) or an async one (whose
    result may be a future again: the deprecated `*_async` forms)."""
    while True:
        if inspect.isawaitable(x):

            async def wait(aw: Any) -> Any:
                return await aw

            x = asyncio.run(wait(x))
        elif callable(getattr(x, "result", None)):
            x = x.result()
        else:
            return x


def refused(fn: Callable[[], Any], name: str) -> str:
    """Call `fn`; it must fail with a 4xx whose message names `name` and NOT_SERVED."""
    with pytest.raises(tinker.APIStatusError) as e:
        run(fn())
    assert 400 <= e.value.status_code < 500, e.value
    msg = str(e.value)
    assert name in msg and NOT_SERVED in msg, msg
    return msg


def test_save_weights_external_then_forward(server):
    sc = tinker.ServiceClient(base_url=server.url, api_key=KEY)
    tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=0).result()
    refused(lambda: tc.save_weights_external("ext"), "save_weights_external")
    out = tc.forward([datum()], "cross_entropy").result(timeout=120)  # not wedged
    assert len(out.loss_fn_outputs) == 1
    sc.close("success").result()


@pytest.mark.slow  # measured: 18-49 s on 2 loaded cores (101 SDK calls)
def test_every_sdk_method(server, tmp_path, monkeypatch):  # noqa: PLR0915
    warnings.simplefilter("ignore", FutureWarning)
    sc = tinker.ServiceClient(
        base_url=server.url, api_key=KEY, display_name="nightly-7", project_id="p1"
    )
    rc = sc.create_rest_client()
    tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=0).result()
    data = [datum()]
    state = tc.save_state("s0").result().path
    sampler_path = tc.save_weights_for_sampler("w0").result().path
    run_id = tc.model_id
    session_id = sc.holder.get_session_id()
    sampler = tc.save_weights_and_get_sampling_client().result()
    # get_tokenizer loads AutoTokenizer.from_pretrained(<base name>); for a titanscale base
    # the documented client setting: tools.tokenizer writes that name's folder where the
    # client runs (docs/from_tinker.md).
    monkeypatch.chdir(fetch_tokenizer(server.url, tmp_path))
    prompt = types.ModelInput.from_ints(SEQ[:5])
    params = types.SamplingParams(max_tokens=3, temperature=1.0, seed=1)
    now = dt.datetime.now(dt.UTC)
    day = (now - dt.timedelta(days=1), now + dt.timedelta(days=1))
    search = types.SessionSearchRequest(display_name="nightly")

    def fb(x):
        return run(x).loss_fn_outputs

    def neg_ll(logprobs, weights):
        loss = -(logprobs * weights).sum()
        return loss, {"custom/neg_ll:sum": loss}

    def custom(data, logprobs):
        loss = sum((-lp).sum() for lp in logprobs)
        return loss, {"nll:sum": float(loss)}

    # name -> (call, check of its result); a None check: any answer.
    ok: dict[str, Callable[[], Any]] = {
        # ServiceClient
        "ServiceClient.create_lora_training_client": lambda: sc.create_lora_training_client(
            base_model=BASE_MODEL, rank=4
        ).result(),
        "ServiceClient.create_lora_training_client_async": lambda: run(
            sc.create_lora_training_client_async(base_model=BASE_MODEL, rank=4)
        ),
        "ServiceClient.create_rest_client": sc.create_rest_client,
        "ServiceClient.create_sampling_client": lambda: sc.create_sampling_client(
            model_path=sampler_path
        ).result(),
        "ServiceClient.create_sampling_client_async": lambda: run(
            sc.create_sampling_client_async(base_model=BASE_MODEL)
        ),
        "ServiceClient.create_training_client_from_state": lambda: (
            sc.create_training_client_from_state(state).result()
        ),
        "ServiceClient.create_training_client_from_state_async": lambda: run(
            sc.create_training_client_from_state_async(state)
        ),
        "ServiceClient.create_training_client_from_state_with_optimizer": lambda: (
            sc.create_training_client_from_state_with_optimizer(state).result()
        ),
        "ServiceClient.create_training_client_from_state_with_optimizer_async": lambda: run(
            sc.create_training_client_from_state_with_optimizer_async(state)
        ),
        "ServiceClient.get_console_url": sc.get_console_url,
        "ServiceClient.get_server_capabilities": sc.get_server_capabilities,
        "ServiceClient.get_server_capabilities_async": lambda: run(
            sc.get_server_capabilities_async()
        ),
        "ServiceClient.get_telemetry": sc.get_telemetry,
        "ServiceClient.copy_weights": lambda: run(sc.copy_weights(sampler_path)),
        # traced here; this service runs custom losses client-side (no upload)
        "ServiceClient.create_custom_loss": lambda: run(
            sc.create_custom_loss(neg_ll, {"logprobs": 1, "weights": 1})
        ),
        # TrainingClient
        "TrainingClient.forward": lambda: fb(tc.forward(data, "cross_entropy")),
        "TrainingClient.forward_async": lambda: fb(tc.forward_async(data, "cross_entropy")),
        "TrainingClient.forward_backward": lambda: fb(tc.forward_backward(data, "cross_entropy")),
        "TrainingClient.forward_backward_async": lambda: fb(
            tc.forward_backward_async(data, "cross_entropy")
        ),
        "TrainingClient.forward_backward_custom": lambda: fb(
            tc.forward_backward_custom(data, custom)
        ),
        "TrainingClient.forward_backward_custom_async": lambda: fb(
            tc.forward_backward_custom_async(data, custom)
        ),
        "TrainingClient.optim_step": lambda: run(tc.optim_step(types.AdamParams())),
        "TrainingClient.optim_step_async": lambda: run(tc.optim_step_async(types.AdamParams())),
        "TrainingClient.get_console_url": tc.get_console_url,
        "TrainingClient.get_info": tc.get_info,
        "TrainingClient.get_info_async": lambda: run(tc.get_info_async()),
        "TrainingClient.get_telemetry": tc.get_telemetry,
        "TrainingClient.get_tokenizer": tc.get_tokenizer,
        "TrainingClient.load_state": lambda: run(tc.load_state(state)),
        "TrainingClient.load_state_async": lambda: run(tc.load_state_async(state)),
        "TrainingClient.load_state_with_optimizer": lambda: run(
            tc.load_state_with_optimizer(state)
        ),
        "TrainingClient.load_state_with_optimizer_async": lambda: run(
            tc.load_state_with_optimizer_async(state)
        ),
        "TrainingClient.save_state": lambda: run(tc.save_state("s1")),
        "TrainingClient.save_state_async": lambda: run(tc.save_state_async("s2")),
        "TrainingClient.save_weights_for_sampler": lambda: run(tc.save_weights_for_sampler("w1")),
        "TrainingClient.save_weights_for_sampler_async": lambda: run(
            tc.save_weights_for_sampler_async("w2")
        ),
        "TrainingClient.save_weights_and_get_sampling_client": lambda: (
            tc.save_weights_and_get_sampling_client().result()
        ),
        "TrainingClient.save_weights_and_get_sampling_client_async": lambda: run(
            tc.save_weights_and_get_sampling_client_async()
        ),
        "TrainingClient.create_sampling_client": lambda: tc.create_sampling_client(sampler_path),
        "TrainingClient.create_sampling_client_async": lambda: run(
            tc.create_sampling_client_async(sampler_path)
        ),
        # SamplingClient
        "SamplingClient.sample": lambda: run(sampler.sample(prompt, 1, params)).sequences,
        "SamplingClient.sample_async": lambda: run(sampler.sample_async(prompt, 1, params)),
        "SamplingClient.compute_logprobs": lambda: run(sampler.compute_logprobs(prompt)),
        "SamplingClient.compute_logprobs_async": lambda: run(
            sampler.compute_logprobs_async(prompt)
        ),
        "SamplingClient.get_base_model": sampler.get_base_model,
        "SamplingClient.get_base_model_async": lambda: run(sampler.get_base_model_async()),
        "SamplingClient.get_sampler_handle": sampler.get_sampler_handle,
        "SamplingClient.from_sampler_handle": lambda: tinker.SamplingClient.from_sampler_handle(
            sampler.get_sampler_handle(), api_key=KEY
        ),
        "SamplingClient.create": lambda: run(
            tinker.SamplingClient.create(sampler.holder, base_model=BASE_MODEL)
        ),
        "SamplingClient.get_telemetry": sampler.get_telemetry,
        "SamplingClient.get_tokenizer": sampler.get_tokenizer,
        "SamplingClient.on_queue_state_change": lambda: sampler.on_queue_state_change(
            "active", None
        ),
        # RestClient
        "RestClient.get_server_capabilities": lambda: run(rc.get_server_capabilities()),
        "RestClient.get_telemetry": rc.get_telemetry,
        "RestClient.get_sampler": lambda: run(rc.get_sampler(sampler._sampling_session_id)),
        "RestClient.get_sampler_async": lambda: run(
            rc.get_sampler_async(sampler._sampling_session_id)
        ),
        "RestClient.get_session": lambda: run(rc.get_session(session_id)),
        "RestClient.get_session_async": lambda: run(rc.get_session_async(session_id)),
        "RestClient.list_sessions": lambda: run(rc.list_sessions()),
        "RestClient.list_sessions_async": lambda: run(rc.list_sessions_async()),
        "RestClient.search_sessions": lambda: run(rc.search_sessions(search)),
        "RestClient.assign_session_project": lambda: run(
            rc.assign_session_project(session_id, "p2")
        ),
        "RestClient.assign_session_project_async": lambda: run(
            rc.assign_session_project_async(session_id, "p3")
        ),
        "RestClient.export_session_trace": lambda: run(rc.export_session_trace(session_id)),
        "RestClient.export_session_trace_async": lambda: run(
            rc.export_session_trace_async(session_id)
        ),
        "RestClient.get_training_run": lambda: run(rc.get_training_run(run_id)),
        "RestClient.get_training_run_async": lambda: run(rc.get_training_run_async(run_id)),
        "RestClient.get_training_run_by_tinker_path": lambda: run(
            rc.get_training_run_by_tinker_path(state)
        ),
        "RestClient.get_training_run_by_tinker_path_async": lambda: run(
            rc.get_training_run_by_tinker_path_async(state)
        ),
        "RestClient.get_weights_info_by_tinker_path": lambda: run(
            rc.get_weights_info_by_tinker_path(state)
        ),
        "RestClient.list_training_runs": lambda: run(rc.list_training_runs()),
        "RestClient.list_training_runs_async": lambda: run(rc.list_training_runs_async()),
        "RestClient.list_checkpoints": lambda: run(rc.list_checkpoints(run_id)),
        "RestClient.list_checkpoints_async": lambda: run(rc.list_checkpoints_async(run_id)),
        "RestClient.list_user_checkpoints": lambda: run(rc.list_user_checkpoints()),
        "RestClient.list_user_checkpoints_async": lambda: run(rc.list_user_checkpoints_async()),
        "RestClient.set_checkpoint_ttl_from_tinker_path": lambda: run(
            rc.set_checkpoint_ttl_from_tinker_path(state, 86400)
        ),
        "RestClient.set_checkpoint_ttl_from_tinker_path_async": lambda: run(
            rc.set_checkpoint_ttl_from_tinker_path_async(state, 86400)
        ),
        "RestClient.publish_checkpoint_from_tinker_path": lambda: run(
            rc.publish_checkpoint_from_tinker_path(sampler_path)
        ),
        "RestClient.publish_checkpoint_from_tinker_path_async": lambda: run(
            rc.publish_checkpoint_from_tinker_path_async(sampler_path)
        ),
        "RestClient.unpublish_checkpoint_from_tinker_path": lambda: run(
            rc.unpublish_checkpoint_from_tinker_path(sampler_path)
        ),
        "RestClient.unpublish_checkpoint_from_tinker_path_async": lambda: run(
            rc.unpublish_checkpoint_from_tinker_path_async(sampler_path)
        ),
        "RestClient.copy_weights": lambda: run(rc.copy_weights(state, "archive")),
        "RestClient.copy_weights_async": lambda: run(rc.copy_weights_async(state, "archive")),
        "RestClient.get_audit_log": lambda: run(rc.get_audit_log()),
        "RestClient.get_audit_log_async": lambda: run(rc.get_audit_log_async()),
        "RestClient.get_billing_usage": lambda: run(rc.get_billing_usage(*day)),
        "RestClient.get_billing_usage_async": lambda: run(rc.get_billing_usage_async(*day)),
        "RestClient.get_current_checkpoint_storage_usage": lambda: run(
            rc.get_current_checkpoint_storage_usage()
        ),
        "RestClient.get_current_checkpoint_storage_usage_async": lambda: run(
            rc.get_current_checkpoint_storage_usage_async()
        ),
    }
    # Refused: (call, the name the message carries), then the delete calls last.
    no: dict[str, tuple[Callable[[], Any], str]] = {
        "TrainingClient.save_weights_external": (
            lambda: tc.save_weights_external("ext"),
            "save_weights_external",
        ),
        "TrainingClient.save_weights_external_async": (
            lambda: tc.save_weights_external_async("ext"),
            "save_weights_external",
        ),
        "RestClient.get_external_weights_urls": (
            lambda: rc.get_external_weights_urls(f"tinker://{run_id}/external_weights/x"),
            "get_external_weights_urls",
        ),
        "RestClient.get_external_weights_urls_async": (
            lambda: rc.get_external_weights_urls_async(f"tinker://{run_id}/external_weights/x"),
            "get_external_weights_urls",
        ),
    }
    last: dict[str, Callable[[], Any]] = {
        "RestClient.delete_checkpoint": lambda: run(rc.delete_checkpoint(run_id, "weights/s1")),
        "RestClient.delete_checkpoint_async": lambda: run(
            rc.delete_checkpoint_async(run_id, "weights/s2")
        ),
        "RestClient.delete_checkpoint_from_tinker_path": lambda: run(
            rc.delete_checkpoint_from_tinker_path(sampler_path.replace("w0", "w1"))
        ),
        "RestClient.delete_checkpoint_from_tinker_path_async": lambda: run(
            rc.delete_checkpoint_from_tinker_path_async(sampler_path.replace("w0", "w2"))
        ),
    }
    close = {"ServiceClient.close": lambda: sc.close("success").result()}  # the very last
    # whoami reads the identity from a JWT; with plain API keys the SDK refuses it itself,
    # before any request (this service's client config: pjwt_auth_enabled=false).
    client_side = {"RestClient.whoami": lambda: run(rc.whoami())}
    sdk = {
        f"{c.__name__}.{n}"
        for c in (tinker.ServiceClient, tinker.TrainingClient, tinker.SamplingClient)
        + (tinker.RestClient,)
        for n, _ in inspect.getmembers(c, callable)
        if not n.startswith("_")
    }
    covered = set(ok) | set(no) | set(last) | set(close) | set(client_side)
    assert sdk == covered, (sorted(sdk - covered), sorted(covered - sdk))

    def next_call_works() -> None:
        assert fb(tc.forward(data, "cross_entropy"))
        assert run(rc.get_training_run(run_id)).training_run_id == run_id

    results: dict[str, Any] = {}
    for name, call in ok.items():
        try:
            results[name] = call()
        except Exception as e:
            raise AssertionError(f"{name}: {type(e).__name__}: {e}") from e
    next_call_works()
    for call, named in no.values():
        refused(call, named)
        next_call_works()
    with pytest.raises(RuntimeError, match="JWT"):
        client_side["RestClient.whoami"]()
    # Answers that must carry what the client sent or what ran.
    assert results["RestClient.get_session"].display_name == "nightly-7"
    found = results["RestClient.search_sessions"].sessions
    assert [s.session_id for s in found] == [session_id]
    assert run(rc.get_session(session_id)).training_run_ids  # still served after the project
    trace_url = results["RestClient.export_session_trace"]
    with urllib.request.urlopen(trace_url) as f:  # a data: URL, no auth needed
        trace = json.loads(f.read())
    kinds = {e["name"] for e in trace["traceEvents"]}
    assert {"create_model", "forward_backward", "optim_step", "save_state"} <= kinds
    copied = results["RestClient.copy_weights"]
    assert copied.startswith("tinker://c-") and copied.endswith("/weights/s0")
    assert run(rc.get_weights_info_by_tinker_path(copied)).lora_rank == 4
    usage = results["RestClient.get_current_checkpoint_storage_usage"].data[0]
    assert usage.checkpoint_count >= 4 and usage.size_bytes > 0
    events = {e.event for e in results["RestClient.get_audit_log"].entries}
    assert {"api_key_used", "checkpoint_published", "checkpoint_unpublished"} <= events
    for call in last.values():
        call()
    entries = {(e.event, e.tinker_path) for e in run(rc.get_audit_log()).entries}
    assert ("checkpoint_deleted", f"tinker://{run_id}/weights/s1") in entries
    close["ServiceClient.close"]()


def test_publish_is_read_only_for_others_and_revocable(server):
    a = tinker.ServiceClient(base_url=server.url, api_key=KEY)
    b = tinker.ServiceClient(base_url=server.url, api_key=KEY_B)
    ra, rb = a.create_rest_client(), b.create_rest_client()
    ta = a.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=0).result()
    path = ta.save_weights_for_sampler("pub").result().path
    with pytest.raises(tinker.NotFoundError):  # not published: bob cannot see it
        rb.get_weights_info_by_tinker_path(path).result()
    ra.publish_checkpoint_from_tinker_path(path).result()
    assert rb.get_weights_info_by_tinker_path(path).result().lora_rank == 4
    s = b.create_sampling_client(model_path=path)
    params = types.SamplingParams(max_tokens=2, seed=0)
    assert s.sample(types.ModelInput.from_ints(SEQ[:4]), 1, params).result().sequences
    rid, _, cid = path.removeprefix("tinker://").partition("/")
    with pytest.raises(tinker.NotFoundError):  # readable, not writable
        rb.delete_checkpoint(rid, cid).result()
    with pytest.raises(tinker.NotFoundError):
        rb.publish_checkpoint_from_tinker_path(path).result()
    assert [c.public for c in ra.list_checkpoints(rid).result().checkpoints] == [True]
    reads = [e for e in ra.get_audit_log().result().entries if e.event == "checkpoint_read"]
    assert reads and reads[-1].event_details["reader"] == "bob"
    ra.unpublish_checkpoint_from_tinker_path(path).result()
    with pytest.raises(tinker.NotFoundError):  # revoked at once
        rb.get_weights_info_by_tinker_path(path).result()
    a.close("success").result()
    b.close("success").result()


def test_billing_tokens_and_usage_tool(server, tmp_path):
    b = tinker.ServiceClient(base_url=server.url, api_key=KEY_B)
    rb = b.create_rest_client()
    tc = b.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=0).result()
    tc.forward_backward([datum(), datum(SEQ[:6])], "cross_entropy").result()
    s = tc.save_weights_and_get_sampling_client()
    seqs = s.sample(types.ModelInput.from_ints(SEQ[:5]), 2, types.SamplingParams(max_tokens=3))
    sampled = sum(len(q.tokens) for q in seqs.result().sequences)
    now = dt.datetime.now(dt.UTC)
    got = rb.get_billing_usage(now - dt.timedelta(hours=1), now + dt.timedelta(hours=1))
    tokens: dict[str, int] = {}
    for e in got.result().data:
        if e.session_id != b.holder.get_session_id():
            continue  # bob's other sessions (the publish test)
        tokens[e.event_info.type] = tokens.get(e.event_info.type, 0) + e.event_info.token_count
    # trained: the two datums' input tokens; prefill: the prompt per sample
    assert tokens == {"training": 11 + 5, "sampling_prefill": 5 * 2, "sampling_sample": sampled}
    b.close("success").result()
    prices = tmp_path / "prices.json"
    prices.write_text(json.dumps({"usd_per_gpu_hour": 3600.0, "usd_per_million_tokens": {}}))
    out = subprocess.run(
        [sys.executable, "-m", "tools.usage", "--storage", str(server.storage), "--json"]
        + ["--prices", str(prices)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    bob = json.loads(out.stdout)["bob"]
    assert bob["tokens"]["trained"] >= 16 and bob["tokens"]["sampled"] >= sampled
    assert bob["cost_usd"] == pytest.approx(bob["device_seconds"])  # $1 per device-second
    table = subprocess.run(
        [sys.executable, "-m", "tools.usage", "--storage", str(server.storage)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "GPU-minutes" in table and "trained" in table and "bob" in table
