"""Results of queued operations, retrieved by the SDK's `/api/v1/retrieve_future` polls.

A future is completed once, from the scheduler's worker thread, with a JSON body, a
protobuf body, or an error (message + category "user" | "server"). Pollers wait on an
asyncio event (long poll, `wait` seconds at most) so a client does not spin. Finished
results are kept `keep_s` seconds after their last retrieval (a client retrying a lost
response gets the same answer), then dropped.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Outcome:
    json: dict[str, Any] | None = None
    proto: bytes | None = None  # for results the SDK reads as protobuf
    error: str | None = None
    category: str = "server"


@dataclass
class Future:
    request_id: str
    session_id: str
    kind: str
    created: float = field(default_factory=time.time)
    outcome: Outcome | None = None
    retrieved_at: float | None = None
    event: asyncio.Event = field(default_factory=asyncio.Event)


class FutureStore:
    def __init__(self, loop: asyncio.AbstractEventLoop, *, keep_s: float = 600.0):
        self._loop = loop
        self._lock = threading.Lock()
        self._futures: dict[str, Future] = {}
        self._ids = itertools.count()
        self._keep_s = keep_s
        self._prefix = uuid.uuid4().hex[:8]

    def create(self, session_id: str, kind: str) -> Future:
        rid = f"{self._prefix}-{next(self._ids)}"
        fut = Future(rid, session_id, kind)
        with self._lock:
            self._futures[rid] = fut
        return fut

    def get(self, request_id: str) -> Future | None:
        with self._lock:
            return self._futures.get(request_id)

    def complete(self, fut: Future, outcome: Outcome) -> None:
        """Thread-safe; the first completion wins."""
        with self._lock:
            if fut.outcome is not None:
                return
            fut.outcome = outcome
        self._loop.call_soon_threadsafe(fut.event.set)

    async def wait(self, fut: Future, timeout: float) -> Outcome | None:
        if fut.outcome is None:
            try:
                await asyncio.wait_for(fut.event.wait(), timeout)
            except TimeoutError:
                return None
        fut.retrieved_at = time.time()
        return fut.outcome

    def sweep(self) -> int:
        """Drop results retrieved more than keep_s ago (and unretrieved ones after 24 h)."""
        now = time.time()
        with self._lock:
            old = [
                k
                for k, f in self._futures.items()
                if f.outcome is not None
                and (
                    (f.retrieved_at is not None and now - f.retrieved_at > self._keep_s)
                    or now - f.created > 86400
                )
            ]
            for k in old:
                del self._futures[k]
        return len(old)

    def all(self) -> list[Future]:
        with self._lock:
            return list(self._futures.values())
