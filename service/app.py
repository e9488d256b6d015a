"""The FastAPI application: the `/api/v1/...` routes the `tinker` SDK calls.

Every route reads its body itself (bounded by `Limits.max_body_bytes`, 413 beyond), checks
the API key (`X-API-Key`, 401 when missing or wrong; keys compared in constant time and
never logged), and turns any `ServiceError` into `{"detail": "<field>: <what>"}` with its
4xx status. Unexpected exceptions become a 500 with the exception's type only, logged
server-side; the service keeps serving.
"""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from service import wire
from service.core import Service, outcome_json
from service.errors import ServiceError
from service.futures import Future
from service.storage import check_model_id

log = logging.getLogger("service")
PROTO = "application/x-protobuf"

# What this server supports, as the SDK's startup config call reads it
# (tinker.types.ClientConfigResponse): plain API keys, httpx transport, uncompressed
# protobuf forward_backward, per-request retrieve_future polling, client-side custom losses.
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
    return JSONResponse({"detail": e.message}, status_code=e.status)


def future_json(fut: Future, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"request_id": fut.request_id, **(extra or {})}


def create_app(service: Service, api_keys: list[str] | None) -> FastAPI:
    app = FastAPI(title="titanscale Tinker-compatible service", docs_url=None, redoc_url=None)
    keys = [k.encode() for k in api_keys] if api_keys else None

    def authorized(request: Request) -> bool:
        if keys is None:
            return True
        got = request.headers.get("x-api-key", "").encode()
        ok = False
        for k in keys:  # compare with every key: timing reveals nothing about which matched
            ok |= hmac.compare_digest(got, k)
        return ok

    @app.middleware("http")
    async def guard(request: Request, call_next: Callable[[Request], Awaitable[Response]]):
        service.last_request = time.monotonic()
        if request.url.path != "/api/v1/healthz" and not authorized(request):
            return JSONResponse({"detail": "missing or invalid API key (X-API-Key)"}, 401)
        enc = request.headers.get("content-encoding", "identity").lower()
        if enc not in ("identity", ""):
            return JSONResponse(
                {"detail": f"content-encoding: {enc!r} is not accepted (send identity)"}, 415
            )
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
        try:
            return await call_next(request)
        except ServiceError as e:
            return _error(e)

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
        def deco(fn: Callable[..., Awaitable[Any]]):
            async def handler(request: Request) -> Response:
                try:
                    out = await fn(request)
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

    # --- service / session ----------------------------------------------------------------

    @route("GET", "/api/v1/healthz")
    async def healthz(request: Request):
        return {"status": "ok"}

    @route("POST", "/api/v1/client/config")
    async def client_config(request: Request):
        return CLIENT_CONFIG

    @route("POST", "/api/v1/client/dynamic_config")
    async def dynamic_config(request: Request):
        return {"refresh_interval_sec": 300, "sample_cancel_enabled": False}

    @route("GET", "/api/v1/get_server_capabilities")
    async def capabilities(request: Request):
        return service.capabilities()

    @route("POST", "/api/v1/create_session")
    async def create_session(request: Request):
        b = wire.parse(wire.CreateSessionBody, await body(request))
        return {"type": "create_session", "session_id": service.create_session(b)}

    @route("POST", "/api/v1/session_heartbeat")
    async def heartbeat(request: Request):
        b = wire.parse(wire.SessionIdBody, await body(request))
        service.registry.session(b.session_id)
        return {"type": "session_heartbeat"}

    @app.post("/api/v1/sessions/{session_id}/finish")
    async def finish(session_id: str, request: Request):
        try:
            b = wire.parse(wire.FinishBody, await body(request))
            reason = str((b.reason or {}).get("type", "success"))
            service.finish_session(session_id, reason)
        except ServiceError as e:
            return _error(e)
        return JSONResponse(None)

    @app.get("/api/v1/sessions/{session_id}/usage")
    async def usage(session_id: str):
        try:
            return JSONResponse(service.usage(session_id))
        except ServiceError as e:
            return _error(e)

    @route("POST", "/api/v1/telemetry")
    async def telemetry(request: Request):
        await body(request)  # accepted and dropped: this service keeps no client telemetry
        return {"status": "accepted"}

    # --- training ---------------------------------------------------------------------------

    @route("POST", "/api/v1/create_model")
    async def create_model(request: Request):
        fut = service.create_model(wire.parse(wire.CreateModelBody, await body(request)))
        return future_json(fut)

    @route("POST", "/api/v1/get_info")
    async def get_info(request: Request):
        return service.get_info(wire.parse(wire.GetInfoBody, await body(request)).model_id)

    @route("POST", "/api/v1/forward_backward")
    async def forward_backward(request: Request):
        ctype = request.headers.get("content-type", "")
        if PROTO not in ctype:
            raise ServiceError(415, f"content-type: expected {PROTO}, got {ctype!r}")
        return future_json(service.forward_backward(await body(request)))

    @route("POST", "/api/v1/optim_step")
    async def optim_step(request: Request):
        return future_json(service.optim_step(wire.parse(wire.OptimStepBody, await body(request))))

    @route("POST", "/api/v1/save_weights")
    async def save_weights(request: Request):
        b = wire.parse(wire.SaveWeightsBody, await body(request))
        return future_json(service.save_weights(b))

    @route("POST", "/api/v1/save_weights_for_sampler")
    async def save_for_sampler(request: Request):
        b = wire.parse(wire.SaveForSamplerBody, await body(request))
        return future_json(service.save_for_sampler(b))

    @route("POST", "/api/v1/load_weights")
    async def load_weights(request: Request):
        b = wire.parse(wire.LoadWeightsBody, await body(request))
        return future_json(service.load_weights(b))

    @app.get("/api/v1/training_runs/{model_id}/checkpoints")
    async def checkpoints(model_id: str, request: Request):
        try:
            items = service.storage.list(check_model_id(model_id))
        except ServiceError as e:
            return _error(e)
        return JSONResponse({"checkpoints": items, "cursor": None})

    # --- sampling ---------------------------------------------------------------------------

    @route("POST", "/api/v1/create_sampling_session")
    async def create_sampling_session(request: Request):
        b = wire.parse(wire.CreateSamplingSessionBody, await body(request))
        sid = service.create_sampling_session(b)
        return {"type": "create_sampling_session", "sampling_session_id": sid}

    @route("POST", "/api/v1/join_sampling_session")
    async def join(request: Request):
        b = wire.parse(wire.JoinSamplingSessionBody, await body(request))
        s = service.registry.sampler(b.sampling_session_id)
        with service.registry.lock:
            n = s.clients
            s.clients += 1
        return {"type": "join_sampling_session", "client_counter": n}

    @app.get("/api/v1/samplers/{sampler_id}")
    async def get_sampler(sampler_id: str):
        try:
            s = service.registry.sampler(sampler_id)
        except ServiceError as e:
            return _error(e)
        return JSONResponse(
            {"sampler_id": s.sampler_id, "base_model": s.base_model, "model_path": s.model_path}
        )

    @route("POST", "/api/v1/asample")
    async def asample(request: Request):
        fut, ids = service.sample(wire.parse(wire.SampleBody, await body(request)))
        return future_json(fut, {"sample_sequence_ids": ids})

    @route("POST", "/api/v1/cancel_future")
    async def cancel(request: Request):
        await body(request)
        return None

    # --- futures ----------------------------------------------------------------------------

    @route("POST", "/api/v1/retrieve_future")
    async def retrieve(request: Request):
        b = wire.parse(wire.RetrieveFutureBody, await body(request))
        fut = service.futures.get(b.request_id)
        if fut is None:
            raise ServiceError(404, f"request {b.request_id!r} not found", field="request_id")
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

    return app
