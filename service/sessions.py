"""Sessions (one per SDK `ServiceClient`), their training models and their samplers, each
owned by the tenant whose key created the session.

Ids follow the SDK's own scheme, which it also computes client-side:
    session   s-<32 hex: 128 random bits from `secrets`>
    model     <session>:train:<model_seq_id>      (the adapter, and the checkpoints' run id)
    sampler   <session>:sample:<sampling_session_seq_id>
Every lookup takes the caller's tenant: another tenant's session, model or sampler is "not
found" with the same 404 message as one that never existed (and a finished session of
another tenant is 404, not 410), so ids are no capability and existence leaks nothing.

A session lives while its client heartbeats (every 10 s) and for `ttl_s` after the last
request or heartbeat; a client that disconnects therefore keeps its adapters until then.
Expiry or `finish` frees the adapters and samplers; checkpoints on disk stay. Finished
sessions are forgotten `keep_finished_s` after they finished.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from service.errors import ServiceError, not_found
from service.futures import new_id
from service.types import LoraSpec


@dataclass
class Model:
    model_id: str
    session_id: str
    base_model: str
    lora: LoraSpec
    user_metadata: dict[str, Any] | None = None
    ready: bool = False  # the adapter exists on the backend
    create_future: Any = None  # the creating op's future (an SDK retry gets the same one)
    tenant: str = ""
    created: float = field(default_factory=time.time)
    last_request: float = field(default_factory=time.time)


@dataclass
class Sampler:
    sampler_id: str
    session_id: str
    base_model: str
    model_path: str | None
    handle: str | None = None  # the backend's sampler handle (None: not loaded yet, or base)
    clients: int = 1
    tenant: str = ""
    # "ready" (handle set, or the base model), "loading" (its load op is queued), or the
    # load's error: a sampler whose weights failed to load never samples (no base fallback).
    state: str = "ready"
    error: str | None = None


@dataclass
class Session:
    session_id: str
    created: float
    last_seen: float
    user_metadata: dict[str, Any] | None = None
    finished: str | None = None  # finish reason, once finished or expired
    models: set[str] = field(default_factory=set)
    samplers: set[str] = field(default_factory=set)
    tenant: str = ""
    finished_at: float | None = None
    display_name: str | None = None  # as the client sent it (RestClient.get_session)
    project_id: str | None = None  # create_session's, or assign_session_project's


class Registry:
    def __init__(self, ttl_s: float, keep_finished_s: float = 86400.0):
        self.ttl_s = ttl_s
        self.keep_finished_s = keep_finished_s
        self.lock = threading.Lock()
        self.sessions: dict[str, Session] = {}
        self.models: dict[str, Model] = {}
        self.samplers: dict[str, Sampler] = {}

    def new_session(self, user_metadata: dict[str, Any] | None, tenant: str = "") -> Session:
        now = time.time()
        s = Session(new_id("s"), now, now, user_metadata, tenant=tenant)
        with self.lock:
            self.sessions[s.session_id] = s
        return s

    def _owned(self, session_id: str, tenant: str) -> Session | None:
        s = self.sessions.get(session_id)
        return s if s is not None and s.tenant == tenant else None

    def session(
        self, session_id: str, tenant: str = "", *, field_name: str = "session_id"
    ) -> Session:
        """The tenant's live session (touching it), or 404 / 410."""
        with self.lock:
            s = self._owned(session_id, tenant)
            if s is None:
                raise not_found(f"session {session_id!r}", field=field_name)
            if s.finished:
                raise ServiceError(410, f"session {session_id} has finished ({s.finished})")
            s.last_seen = time.time()
            return s

    def any_session(self, session_id: str, tenant: str = "") -> Session:
        """The tenant's session, finished or not (read-only routes), or 404."""
        with self.lock:
            s = self._owned(session_id, tenant)
        if s is None:
            raise not_found(f"session {session_id!r}", field="session_id")
        return s

    def model(self, model_id: str, tenant: str = "") -> Model:
        with self.lock:
            m = self.models.get(model_id)
        if m is None or m.tenant != tenant:
            raise not_found(f"model {model_id!r}", field="model_id")
        self.session(m.session_id, tenant)
        m.last_request = time.time()
        return m

    def find_model(self, model_id: str, tenant: str) -> Model | None:
        """The tenant's live model, without touching or raising."""
        with self.lock:
            m = self.models.get(model_id)
        return m if m is not None and m.tenant == tenant else None

    def sampler(self, sampler_id: str, tenant: str = "") -> Sampler:
        with self.lock:
            s = self.samplers.get(sampler_id)
        if s is None or s.tenant != tenant:
            raise not_found(f"sampling session {sampler_id!r}", field="sampling_session_id")
        self.session(s.session_id, tenant)
        return s

    def add_model(self, m: Model) -> None:
        with self.lock:
            if m.model_id in self.models:
                raise ServiceError(400, f"model {m.model_id} exists", field="model_seq_id")
            self.models[m.model_id] = m
            self.sessions[m.session_id].models.add(m.model_id)

    def remove_model(self, model_id: str) -> None:
        with self.lock:
            m = self.models.pop(model_id, None)
            if m is not None and m.session_id in self.sessions:
                self.sessions[m.session_id].models.discard(model_id)

    def add_sampler(self, s: Sampler) -> Sampler:
        """Register `s`; an id already registered (an SDK retry) returns the existing one:
        a sampler is never replaced, so no request can swap the weights a client samples."""
        with self.lock:
            old = self.samplers.get(s.sampler_id)
            if old is not None:
                return old
            self.samplers[s.sampler_id] = s
            self.sessions[s.session_id].samplers.add(s.sampler_id)
            return s

    def finish(
        self, session_id: str, reason: str, tenant: str = ""
    ) -> tuple[list[Model], list[Sampler]]:
        """Mark finished (first reason wins); returns what to free."""
        with self.lock:
            s = self._owned(session_id, tenant)
            if s is None:
                raise not_found(f"session {session_id!r}", field="session_id")
            if s.finished:
                return [], []
            s.finished = reason
            s.finished_at = time.time()
            models = [self.models.pop(m) for m in s.models if m in self.models]
            samplers = [self.samplers.pop(x) for x in s.samplers if x in self.samplers]
            return models, samplers

    def expired(self) -> list[tuple[str, str]]:
        """(session, tenant) of live sessions past their ttl."""
        now = time.time()
        with self.lock:
            return [
                (s.session_id, s.tenant)
                for s in self.sessions.values()
                if not s.finished and now - s.last_seen > self.ttl_s
            ]

    def forget_finished(self, keep_per_tenant: int | None = None) -> list[str]:
        """Drop sessions finished more than keep_finished_s ago, and beyond the newest
        `keep_per_tenant` finished sessions of each tenant (each keeps its user_metadata);
        returns their ids."""
        now = time.time()
        with self.lock:
            done = sorted(
                (s for s in self.sessions.values() if s.finished_at is not None),
                key=lambda s: s.finished_at or 0.0,
                reverse=True,
            )
            kept: dict[str, int] = {}
            old = []
            for s in done:
                kept[s.tenant] = kept.get(s.tenant, 0) + 1
                over = keep_per_tenant is not None and kept[s.tenant] > keep_per_tenant
                if over or now - (s.finished_at or now) > self.keep_finished_s:
                    old.append(s.session_id)
            for sid in old:
                del self.sessions[sid]
        return old

    def count_sessions(self, tenant: str) -> int:
        """The tenant's live (unfinished) sessions."""
        with self.lock:
            return sum(1 for s in self.sessions.values() if s.tenant == tenant and not s.finished)

    def count_models(self, tenant: str) -> int:
        """The tenant's live models (a finished session's are gone from `models`)."""
        with self.lock:
            return sum(1 for m in self.models.values() if m.tenant == tenant)

    def tenant_sessions(self, tenant: str) -> list[Session]:
        """The tenant's sessions, newest first."""
        with self.lock:
            out = [s for s in self.sessions.values() if s.tenant == tenant]
        return sorted(out, key=lambda s: s.created, reverse=True)
