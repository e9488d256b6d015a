"""Sessions (one per SDK `ServiceClient`), their training models and their samplers.

Ids follow the SDK's own scheme, which it also computes client-side:
    session   s-<hex>
    model     <session>:train:<model_seq_id>      (the adapter, and the checkpoints' run id)
    sampler   <session>:sample:<sampling_session_seq_id>
A session lives while its client heartbeats (every 10 s) and for `ttl_s` after the last
request or heartbeat; a client that disconnects therefore keeps its adapters until then.
Expiry or `finish` frees the adapters and samplers; checkpoints on disk stay.
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from service.errors import ServiceError
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


@dataclass
class Sampler:
    sampler_id: str
    session_id: str
    base_model: str
    model_path: str | None
    handle: str | None = None  # the backend's sampler handle (None: the base model)
    clients: int = 1


@dataclass
class Session:
    session_id: str
    created: float
    last_seen: float
    user_metadata: dict[str, Any] | None = None
    finished: str | None = None  # finish reason, once finished or expired
    models: set[str] = field(default_factory=set)
    samplers: set[str] = field(default_factory=set)


class Registry:
    def __init__(self, ttl_s: float):
        self.ttl_s = ttl_s
        self.lock = threading.Lock()
        self.sessions: dict[str, Session] = {}
        self.models: dict[str, Model] = {}
        self.samplers: dict[str, Sampler] = {}

    def new_session(self, user_metadata: dict[str, Any] | None) -> Session:
        now = time.time()
        s = Session(f"s-{uuid.uuid4().hex[:16]}", now, now, user_metadata)
        with self.lock:
            self.sessions[s.session_id] = s
        return s

    def session(self, session_id: str, *, field_name: str = "session_id") -> Session:
        """A live session (touching it), or 404 / 410."""
        with self.lock:
            s = self.sessions.get(session_id)
            if s is None:
                raise ServiceError(404, f"session {session_id!r} not found", field=field_name)
            if s.finished:
                raise ServiceError(410, f"session {session_id} has finished ({s.finished})")
            s.last_seen = time.time()
            return s

    def model(self, model_id: str) -> Model:
        with self.lock:
            m = self.models.get(model_id)
        if m is None:
            raise ServiceError(404, f"model {model_id!r} not found", field="model_id")
        self.session(m.session_id)
        return m

    def sampler(self, sampler_id: str) -> Sampler:
        with self.lock:
            s = self.samplers.get(sampler_id)
        if s is None:
            raise ServiceError(
                404, f"sampling session {sampler_id!r} not found", field="sampling_session_id"
            )
        self.session(s.session_id)
        return s

    def add_model(self, m: Model) -> None:
        with self.lock:
            if m.model_id in self.models:
                raise ServiceError(409, f"model {m.model_id} exists", field="model_seq_id")
            self.models[m.model_id] = m
            self.sessions[m.session_id].models.add(m.model_id)

    def remove_model(self, model_id: str) -> None:
        with self.lock:
            m = self.models.pop(model_id, None)
            if m is not None and m.session_id in self.sessions:
                self.sessions[m.session_id].models.discard(model_id)

    def add_sampler(self, s: Sampler) -> None:
        with self.lock:
            self.samplers[s.sampler_id] = s
            self.sessions[s.session_id].samplers.add(s.sampler_id)

    def finish(self, session_id: str, reason: str) -> tuple[list[Model], list[Sampler]]:
        """Mark finished (first reason wins); returns what to free."""
        with self.lock:
            s = self.sessions.get(session_id)
            if s is None:
                raise ServiceError(404, f"session {session_id!r} not found")
            if s.finished:
                return [], []
            s.finished = reason
            models = [self.models.pop(m) for m in s.models if m in self.models]
            samplers = [self.samplers.pop(x) for x in s.samplers if x in self.samplers]
            return models, samplers

    def expired(self) -> list[str]:
        now = time.time()
        with self.lock:
            return [
                s.session_id
                for s in self.sessions.values()
                if not s.finished and now - s.last_seen > self.ttl_s
            ]
