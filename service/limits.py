"""The service's per-request and per-tenant limits: what one body may hold and what one tenant
may keep, each documented (docs/service.md "Limits"), configurable (`tools.serve --limit
NAME=VALUE`) and refused naming the limit: 413 for a request larger than a limit allows
(it will never fit: the SDK does not retry it), 429 for a tenant holding too much (it fits
once the tenant frees something).

Why each exists (the hostile probe of round III, issue #41): a stop string is matched against
the decoded text of every sample at every token, so 200,000 of them held the one worker for
633 s; user metadata is kept in memory with its session and written to `run.json`; sessions
and models per tenant were unbounded. Checks here run on a parsed body and touch nothing.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from service.errors import ServiceError


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 64 << 20
    max_data: int = 1024  # datums per forward_backward request
    max_samples: int = 64  # num_samples per sample request
    retrieve_wait_s: float = 20.0  # long-poll time of retrieve_future
    # Memory one request may use beyond the resident model (admission); None: not priced.
    max_request_bytes: float | None = None
    max_queued_per_session: int = 64  # ops queued or held, not yet running (429 beyond)
    max_queued_per_tenant: int = 256
    max_stop: int = 64  # stop strings or stop token ids per sample request (413)
    max_stop_chars: int = 4096  # characters of all stop strings of one request (413)
    max_metadata_bytes: int = 16 << 10  # user_metadata as JSON, per object (413)
    max_sessions_per_tenant: int = 64  # live (unfinished) sessions (429)
    max_models_per_tenant: int = 64  # live models (adapters) over the tenant's sessions (429)
    max_finished_sessions_per_tenant: int = 256  # finished sessions remembered (oldest go)
    # An op's deadline: `op_deadline_factor` x its priced seconds, at least
    # `op_deadline_min_s` (service/deadline.py); past it the op fails, the service goes on.
    op_deadline_factor: float = 20.0
    op_deadline_min_s: float = 120.0
    # Adapters and sampler snapshots held between requests (service/resident.py); None: not
    # admitted (tools.serve sets it: --max-resident-gib).
    max_resident_bytes: float | None = None
    # Fair sharing (service/scheduler.py): a forward_backward runs in pieces of at most this
    # many tokens, other tenants' ops between them (0: one piece); a tenant's token rate
    # (tokens/s, None: unlimited) and burst; bytes of checkpoints a tenant may keep.
    piece_tokens: int = 8192
    token_rate: float | None = None
    token_burst: float = 65536.0
    storage_quota_bytes: int | None = None


# The limits `tools.serve --limit NAME=VALUE` may set (the others have their own flags).
SETTABLE = (
    "max_data",
    "max_samples",
    "max_stop",
    "max_stop_chars",
    "max_metadata_bytes",
    "max_sessions_per_tenant",
    "max_models_per_tenant",
    "max_finished_sessions_per_tenant",
    "op_deadline_factor",
    "op_deadline_min_s",
)


def parse_limit(text: str) -> tuple[str, float]:
    """`NAME=VALUE` of a `--limit` option; ValueError with one line otherwise."""
    name, sep, raw = text.partition("=")
    if not sep or name not in SETTABLE:
        raise ValueError(
            f"expected NAME=VALUE with NAME one of {', '.join(SETTABLE)}; got {text!r}"
        )
    kind = type(getattr(Limits(), name))
    try:
        value = kind(raw)
    except ValueError:
        raise ValueError(f"{name}: expected a {kind.__name__}, got {raw!r}") from None
    if not value > 0 or value > 1 << 30:  # also refuses NaN
        raise ValueError(f"{name}: expected a positive number up to 2^30, got {raw!r}")
    return name, value


def with_settings(limits: Limits, settings: list[str]) -> Limits:
    changes: dict[str, Any] = dict(parse_limit(s) for s in settings)
    return dataclasses.replace(limits, **changes)


def too_large(field: str, what: str, limit: str) -> ServiceError:
    return ServiceError(413, f"{what} (limit {limit})", field=field)


def check_stop(stop: Any, limits: Limits) -> None:
    """At most `max_stop` stop strings or ids, at most `max_stop_chars` characters in all."""
    if stop is None or isinstance(stop, str):
        items = [] if stop is None else [stop]
    else:
        items = list(stop)
    if len(items) > limits.max_stop:
        raise too_large(
            "sampling_params.stop",
            f"{len(items)} stop sequences, at most {limits.max_stop}",
            "max_stop",
        )
    chars = sum(len(x) for x in items if isinstance(x, str))
    if chars > limits.max_stop_chars:
        raise too_large(
            "sampling_params.stop",
            f"{chars} characters of stop strings, at most {limits.max_stop_chars}",
            "max_stop_chars",
        )


def check_metadata(meta: Any, field: str, limits: Limits) -> None:
    """user_metadata of at most `max_metadata_bytes` as JSON (it is kept in memory with its
    session and written to run.json)."""
    if meta is None:
        return
    size = len(json.dumps(meta, ensure_ascii=False).encode())
    if size > limits.max_metadata_bytes:
        raise too_large(
            field,
            f"{size} bytes of metadata, at most {limits.max_metadata_bytes}",
            "max_metadata_bytes",
        )


def check_count(field: str, what: str, have: int, limit: int, name: str) -> None:
    """429 when a tenant already holds `limit` of something (it fits once one is freed)."""
    if have >= limit:
        raise ServiceError(
            429,
            f"this tenant has {have} {what} (limit {name} = {limit}); finish one first",
            field=field,
            retry_after=30,
        )
