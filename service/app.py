"""The FastAPI application: the `/api/v1/...` routes the `tinker` SDK calls.

Every route but `healthz` runs for one tenant: the middleware maps the `X-API-Key` header to
its tenant (service/tenants.py; 401 when missing, unknown or revoked: the key file is re-read
when it changes) and every route hands that tenant to `Service`, which resolves every id
through it. Bodies are read by the route itself (bounded by `Limits.max_body_bytes`, 413
beyond), and any `ServiceError` becomes `{"detail": "<field>: <what>"}` with its 4xx status
(and Retry-After on 429). Unexpected exceptions become a 500 with the exception's type only,
logged server-side; the service keeps serving. No key, path or traceback reaches a client.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from service import surface, wire
from service.accounting import parse_since
from service.core import Service, outcome_json
from service.errors import ServiceError, bad_request
from service.futures import Future
from service.tenants import LOCAL, KeyFile, fingerprint

log = logging.getLogger("service")
PROTO = "application/x-protobuf"
OFFLOAD_PARALLEL = 2  # bodies decoded at once, off the event loop
INLINE_PARSE_BYTES = 64 << 10  # JSON bodies up to this are parsed on the loop (< 1 ms)

# What this server supports, as the SDK's startup config call reads it
# (tinker.types.ClientConfigResponse): plain API keys, httpx transport, uncompressed
# protobuf forward_backward, per-request retrieve_future polling, client-side custom losses.
# `fwdbwd_max_chunk_len` is set per service: the datums of full context one request may
# carry within the admission budget, so the SDK splits larger batches into admitted chunks.
CLIENT_CONFIG = {
    "pjwt_auth_enabled": False,
    "credential_default_source": "api_key",
    "use_pyqwest_transport": False,
    "parallel_fwdbwd_chunks": True,
    "proto_compress_fwdbwd": False,
    "sample_use_retrieve_futures": False,
    "custom_loss_server_side": False,
    "sample_join_sampling_session": True,
}


def _error(e: ServiceError) -> JSONResponse:
    headers = {"Retry-After": str(e.retry_after)} if e.retry_after is not None else None
    return JSONResponse({"detail": e.message}, status_code=e.status, headers=headers)


def future_json(fut: Future, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"request_id": fut.request_id, **(extra or {})}


def page(request: Request, default_limit: int) -> tuple[int, int]:
    """(limit, offset) of a listing, from its query string."""
    return (
        query_int(request, "limit", default_limit, 1, 10_000),
        query_int(request, "offset", 0, 0, 1 << 31),
    )


def query_int(request: Request, name: str, default: int, lo: int, hi: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        v = int(raw)
    except ValueError:
        raise bad_request(name, f"expected an integer, got {raw!r}") from None
    if not lo <= v <= hi:
        raise bad_request(name, f"expected {lo}..{hi}, got {v}")
    return v


def create_app(service: Service, keys: KeyFile | None) -> FastAPI:
    app = FastAPI(title="titanscale Tinker-compatible service", docs_url=None, redoc_url=None)
    client_config = {**CLIENT_CONFIG, "fwdbwd_max_chunk_len": service.max_chunk_len()}

    def tenant_of(request: Request) -> str | None:
        if keys is None:
            return LOCAL
        key = request.headers.get("x-api-key", "")
        t = keys.tenant(key)
        if t is None:
            return None
        service.audit.key_used(t.name, fingerprint(key))  # once per key and process
        return t.name

    @app.middleware("http")
    async def guard(request: Request, call_next: Callable[[Request], Awaitable[Response]]):
        service.last_request = time.monotonic()
        if request.url.path != "/api/v1/healthz":
            tenant = tenant_of(request)
            if tenant is None:
                return JSONResponse({"detail": "missing or invalid API key (X-API-Key)"}, 401)
            request.state.tenant = tenant
        enc = request.headers.get("content-encoding", "identity").lower()
        if enc not in ("identity", ""):
            return JSONResponse({"detail": "content-encoding: only identity is accepted"}, 415)
        try:
            length = int(request.headers.get("content-length", "0") or 0)
        except ValueError:
            return JSONResponse({"detail": "content-length: not an integer"}, 400)
        if length > service.limits.max_body_bytes:
            return JSONResponse(
                {
                    "detail": f"body: {length} bytes exceed the limit of "
                    f"{service.limits.max_body_bytes}"
                },
                413,
            )
        return await call_next(request)

    # Decoding runs off the event loop (a 64 MB body parsed on it blocked every client,
    # health checks included, for seconds), at most OFFLOAD_PARALLEL bodies at a time: the
    # memory of bodies being decoded stays a small multiple of the body limit.
    offload = asyncio.Semaphore(OFFLOAD_PARALLEL)

    async def off_loop(fn: Callable[..., Any], *args: Any) -> Any:
        async with offload:
            return await asyncio.to_thread(fn, *args)

    async def parsed(request: Request, model: type[BaseModel], raw: bytes | None = None) -> Any:
        """The JSON body as `model`; a large one parsed off the event loop."""
        raw = await body(request) if raw is None else raw
        if len(raw) <= INLINE_PARSE_BYTES:
            return wire.parse(model, raw)
        return await off_loop(wire.parse, model, raw)

    async def body(request: Request) -> bytes:
        """The body, streamed with the size limit enforced (Content-Length may be absent)."""
        chunks, n = [], 0
        async for c in request.stream():
            n += len(c)
            if n > service.limits.max_body_bytes:
                raise ServiceError(
                    413, f"body exceeds the limit of {service.limits.max_body_bytes} bytes"
                )
            chunks.append(c)
        return b"".join(chunks)

    def route(method: str, path: str):
        """Register `fn(request, tenant, **path_params)`; errors become their 4xx/500."""

        def deco(fn: Callable[..., Awaitable[Any]]):
            async def handler(request: Request) -> Response:
                try:
                    tenant = getattr(request.state, "tenant", LOCAL)
                    out = await fn(request, tenant, **request.path_params)
                except ServiceError as e:
                    return _error(e)
                except Exception as e:
                    log.exception("service: %s %s failed", method, path)
                    return JSONResponse({"detail": f"internal error ({type(e).__name__})"}, 500)
                if isinstance(out, Response):
                    return out
                return JSONResponse(out)

            app.add_api_route(path, handler, methods=[method])
            return fn

        return deco

    async def training(
        request: Request, tenant: str, model: type[BaseModel], kind: str, call: Callable
    ) -> Any:
        """A JSON training request: a body refused before its seq_id is known still keeps
        its place in the model's order (Service.refuse_request)."""
        raw = await body(request)
        try:
            b = await parsed(request, model, raw)
        except ServiceError as e:
            service.refuse_request(tenant, raw, kind, e)
            raise
        return future_json(call(tenant, b))

    # --- service / session ----------------------------------------------------------------

    @route("GET", "/api/v1/healthz")
    async def healthz(request: Request, tenant: str):
        return {"status": "ok"}

    @route("POST", "/api/v1/client/config")
    async def config(request: Request, tenant: str):
        return client_config

    @route("POST", "/api/v1/client/dynamic_config")
    async def dynamic_config(request: Request, tenant: str):
        return {"refresh_interval_sec": 300, "sample_cancel_enabled": False}

    @route("GET", "/api/v1/get_server_capabilities")
    async def capabilities(request: Request, tenant: str):
        return service.capabilities()

    @route("POST", "/api/v1/create_session")
    async def create_session(request: Request, tenant: str):
        b = await parsed(request, wire.CreateSessionBody)
        return {"type": "create_session", "session_id": service.create_session(tenant, b)}

    @route("POST", "/api/v1/session_heartbeat")
    async def heartbeat(request: Request, tenant: str):
        b = await parsed(request, wire.SessionIdBody)
        service.heartbeat(tenant, b.session_id)
        return {"type": "session_heartbeat"}

    @route("POST", "/api/v1/sessions/{session_id}/finish")
    async def finish(request: Request, tenant: str, session_id: str):
        b = await parsed(request, wire.FinishBody)
        service.finish_session(tenant, session_id, str((b.reason or {}).get("type", "success")))
        return None

    @route("GET", "/api/v1/sessions/{session_id}/usage")
    async def session_usage(request: Request, tenant: str, session_id: str):
        return service.usage(tenant, session_id)

    @route("GET", "/api/v1/sessions/{session_id}")
    async def get_session(request: Request, tenant: str, session_id: str):
        return service.session_info(tenant, session_id)

    @route("GET", "/api/v1/sessions")
    async def list_sessions(request: Request, tenant: str):
        return service.sessions(tenant, *page(request, 20))

    @route("GET", "/api/v1/usage")
    async def tenant_usage(request: Request, tenant: str):
        raw = request.query_params.get("since")
        try:
            since = parse_since(raw) if raw else None
        except ValueError as e:
            raise bad_request("since", str(e)) from None
        return await asyncio.to_thread(service.tenant_usage, tenant, since)

    @route("POST", "/api/v1/telemetry")
    async def telemetry(request: Request, tenant: str):
        await body(request)  # accepted and dropped: this service keeps no client telemetry
        return {"status": "accepted"}

    # --- training ---------------------------------------------------------------------------

    @route("POST", "/api/v1/create_model")
    async def create_model(request: Request, tenant: str):
        b = await parsed(request, wire.CreateModelBody)
        return future_json(service.create_model(tenant, b))

    @route("GET", "/api/v1/tokenizer")
    async def tokenizer(request: Request, tenant: str):
        # Not a Tinker route: tools.tokenizer fetches the served tokenizer into the folder
        # its tokenizer_id names, where the SDK's get_tokenizer() loads it (docs/from_tinker.md).
        base = request.query_params.get("base_model")
        return await asyncio.to_thread(service.tokenizer_files, tenant, base)

    @route("POST", "/api/v1/get_info")
    async def get_info(request: Request, tenant: str):
        b = await parsed(request, wire.GetInfoBody)
        return service.get_info(tenant, b.model_id)

    @route("POST", "/api/v1/forward_backward")
    async def forward_backward(request: Request, tenant: str):
        ctype = request.headers.get("content-type", "")
        if PROTO not in ctype:
            raise ServiceError(415, f"content-type: expected {PROTO}")
        decoded = await off_loop(service.decode_forward_backward, await body(request), tenant)
        return future_json(service.forward_backward(tenant, decoded))

    @route("POST", "/api/v1/optim_step")
    async def optim_step(request: Request, tenant: str):
        return await training(request, tenant, wire.OptimStepBody, "optim_step", service.optim_step)

    @route("POST", "/api/v1/save_weights")
    async def save_weights(request: Request, tenant: str):
        return await training(
            request, tenant, wire.SaveWeightsBody, "save_state", service.save_weights
        )

    @route("POST", "/api/v1/save_weights_for_sampler")
    async def save_for_sampler(request: Request, tenant: str):
        return await training(
            request, tenant, wire.SaveForSamplerBody, "save_for_sampler", service.save_for_sampler
        )

    @route("POST", "/api/v1/load_weights")
    async def load_weights(request: Request, tenant: str):
        return await training(
            request, tenant, wire.LoadWeightsBody, "load_state", service.load_weights
        )

    # --- training runs and checkpoints (tinker.RestClient) ------------------------------------

    @route("GET", "/api/v1/training_runs")
    async def list_training_runs(request: Request, tenant: str):
        return await asyncio.to_thread(service.training_runs, tenant, *page(request, 20))

    @route("GET", "/api/v1/training_runs/{model_id}")
    async def get_training_run(request: Request, tenant: str, model_id: str):
        return await asyncio.to_thread(service.training_run, tenant, model_id)

    @route("GET", "/api/v1/training_runs/{model_id}/checkpoints")
    async def list_checkpoints(request: Request, tenant: str, model_id: str):
        return await asyncio.to_thread(service.checkpoints, tenant, model_id)

    @route("DELETE", "/api/v1/training_runs/{model_id}/checkpoints/{kind}/{name}")
    async def delete_checkpoint(request: Request, tenant: str, model_id: str, kind: str, name: str):
        await asyncio.to_thread(service.delete_checkpoint, tenant, model_id, f"{kind}/{name}")
        return None

    @route("PUT", "/api/v1/training_runs/{model_id}/checkpoints/{kind}/{name}/ttl")
    async def set_ttl(request: Request, tenant: str, model_id: str, kind: str, name: str):
        b = await parsed(request, wire.TtlBody)
        service.set_checkpoint_ttl(tenant, model_id, f"{kind}/{name}", b.ttl_seconds)
        return None

    @route("GET", "/api/v1/checkpoints")
    async def list_user_checkpoints(request: Request, tenant: str):
        return await asyncio.to_thread(service.user_checkpoints, tenant, *page(request, 100))

    @route("POST", "/api/v1/weights_info")
    async def weights_info(request: Request, tenant: str):
        b = await parsed(request, wire.WeightsInfoBody)
        return service.weights_info(tenant, b.tinker_path)

    # --- sampling ---------------------------------------------------------------------------

    @route("POST", "/api/v1/create_sampling_session")
    async def create_sampling_session(request: Request, tenant: str):
        b = await parsed(request, wire.CreateSamplingSessionBody)
        sid = service.create_sampling_session(tenant, b)
        return {"type": "create_sampling_session", "sampling_session_id": sid}

    @route("POST", "/api/v1/join_sampling_session")
    async def join(request: Request, tenant: str):
        b = await parsed(request, wire.JoinSamplingSessionBody)
        n = service.join_sampler(tenant, b.sampling_session_id)
        return {"type": "join_sampling_session", "client_counter": n}

    @route("GET", "/api/v1/samplers/{sampler_id}")
    async def get_sampler(request: Request, tenant: str, sampler_id: str):
        return service.sampler_info(tenant, sampler_id)

    @route("POST", "/api/v1/asample")
    async def asample(request: Request, tenant: str):
        fut, ids = service.sample(tenant, await parsed(request, wire.SampleBody))
        return future_json(fut, {"sample_sequence_ids": ids})

    # --- futures ----------------------------------------------------------------------------

    @route("POST", "/api/v1/cancel_future")
    async def cancel(request: Request, tenant: str):
        b = await parsed(request, wire.RetrieveFutureBody)
        service.future(tenant, b.request_id)  # 404 unless the caller's; cancelling is a no-op
        return None

    @route("POST", "/api/v1/retrieve_future")
    async def retrieve(request: Request, tenant: str):
        b = await parsed(request, wire.RetrieveFutureBody)
        fut = service.future(tenant, b.request_id)
        outcome = await service.futures.wait(fut, service.limits.retrieve_wait_s)
        if outcome is None:
            return {"type": "try_again", "request_id": fut.request_id, "queue_state": "active"}
        if outcome.proto is not None and PROTO in request.headers.get("accept", ""):
            return Response(outcome.proto, media_type=PROTO)
        if outcome.proto is not None:
            raise ServiceError(
                406, "this result is served as protobuf only (Accept: " + PROTO + ")"
            )
        return outcome_json(outcome)

    # --- the rest of the SDK's surface (service/surface.py) ----------------------------------

    @route("POST", "/api/v1/copy_weights")
    async def copy_weights(request: Request, tenant: str):
        b = wire.parse(surface.CopyWeightsBody, await body(request))
        return await asyncio.to_thread(service.copy_weights, tenant, b)

    @route("POST", "/api/v1/training_runs/{model_id}/checkpoints/{kind}/{name}/publish")
    async def publish(request: Request, tenant: str, model_id: str, kind: str, name: str):
        await asyncio.to_thread(service.publish, tenant, model_id, f"{kind}/{name}", True)
        return None

    @route("DELETE", "/api/v1/training_runs/{model_id}/checkpoints/{kind}/{name}/publish")
    async def unpublish(request: Request, tenant: str, model_id: str, kind: str, name: str):
        await asyncio.to_thread(service.publish, tenant, model_id, f"{kind}/{name}", False)
        return None

    @route("GET", "/api/v1/audit")
    async def audit(request: Request, tenant: str):
        day = surface.check_day(request.query_params.get("day"))
        kind = request.query_params.get("event_type", "all")
        return {"entries": service.audit.entries(tenant, kind, day)}

    def when(request: Request, name: str) -> float:
        raw = request.query_params.get(name)
        if raw is None:
            raise bad_request(name, "required (an ISO date-time)")
        try:
            return parse_since(raw)
        except ValueError as e:
            raise bad_request(name, str(e)) from None

    @route("GET", "/api/v1/billing/usage/events")
    async def billing_usage(request: Request, tenant: str):
        start, end = when(request, "starting_on"), when(request, "ending_before")
        return await asyncio.to_thread(service.billing_usage, tenant, start, end)

    @route("GET", "/api/v1/billing/usage/checkpoints/current")
    async def storage_usage(request: Request, tenant: str):
        return await asyncio.to_thread(service.storage_usage, tenant)

    @route("GET", "/api/v1/sessions/{session_id}/trace_export")
    async def trace_export(request: Request, tenant: str, session_id: str):
        return service.session_trace(tenant, session_id)

    @route("PUT", "/api/v1/sessions/{session_id}/project")
    async def project(request: Request, tenant: str, session_id: str):
        b = wire.parse(surface.ProjectBody, await body(request))
        service.set_project(tenant, session_id, b.project_id)
        return None

    @route("POST", "/api/v1/sessions/search")
    async def search_sessions(request: Request, tenant: str):
        b = wire.parse(surface.SessionSearchBody, await body(request))
        return await asyncio.to_thread(service.search_sessions, tenant, b)

    async def unserved(request: Request) -> Response:
        """Every other /api/v1 route: 400 naming the SDK method, "not supported by this
        service"; a training request among them (model_id + seq_id) still takes its seq_id
        place, so the client's next request runs (Service.refuse_request)."""
        tenant = getattr(request.state, "tenant", LOCAL)
        err = surface.unserved(request.method, request.url.path)
        try:
            raw = await body(request)
        except ServiceError as e:
            return _error(e)
        kind = request.url.path.removeprefix("/api/v1/").split("/")[0][:64]
        service.refuse_request(tenant, raw, kind, err)
        return _error(err)

    # Registered last: only a path no route above matches (with any method) lands here.
    app.add_api_route(
        "/api/v1/{rest:path}", unserved, methods=["GET", "POST", "PUT", "DELETE", "PATCH"]
    )

    return app
