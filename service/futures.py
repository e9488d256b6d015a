"""Results of queued operations, retrieved by the SDK's `/api/v1/retrieve_future` polls.

A future is completed once, from the scheduler's worker thread, with a JSON body, a
protobuf body, or an error (message + category "user" | "server"). Pollers wait on an
asyncio event (long poll, `wait` seconds at most) so a client does not spin. Finished
results are kept `keep_s` seconds after their last retrieval (a client retrying a lost
response gets the same answer), then dropped; `sweep` returns what it dropped so the
scheduler can forget the retry entries that point at them.

Each future belongs to the tenant whose request created it: `get(request_id, tenant)` finds
another tenant's future exactly as it finds a missing one (None). Request ids are 128 random
bits (`secrets`), not a counter: one tenant cannot name another's requests.
"""

from __future__ import annotations

import asyncio
import secrets
import threading
import time
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
    tenant: str
    session_id: str
    kind: str
    created: float = field(default_factory=time.time)
    outcome: Outcome | None = None
    retrieved_at: float | None = None
    event: asyncio.Event = field(default_factory=asyncio.Event)
    lane: str | None = None  # the model whose seq_id order it took part in
    seq_id: int | None = None


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(16)}"


class FutureStore:
    def __init__(self, loop: asyncio.AbstractEventLoop, *, keep_s: float = 600.0):
        self._loop = loop
        self._lock = threading.Lock()
        self._futures: dict[str, Future] = {}
        self._keep_s = keep_s

    def create(self, tenant: str, session_id: str, kind: str) -> Future:
        fut = Future(new_id("r"), tenant, session_id, kind)
        with self._lock:
            self._futures[fut.request_id] = fut
        return fut

    def get(self, request_id: str, tenant: str) -> Future | None:
        """The tenant's future, or None (missing, swept, or another tenant's)."""
        with self._lock:
            f = self._futures.get(request_id)
        return f if f is not None and f.tenant == tenant else None

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

    def sweep(self, now: float | None = None) -> list[Future]:
        """Drop results retrieved more than keep_s ago (and unretrieved ones after 24 h);
        returns the dropped futures."""
        now = time.time() if now is None else now
        with self._lock:
            old = [
                f
                for f in self._futures.values()
                if f.outcome is not None
                and (
                    (f.retrieved_at is not None and now - f.retrieved_at > self._keep_s)
                    or now - f.created > 86400
                )
            ]
            for f in old:
                del self._futures[f.request_id]
        return old

    def all(self) -> list[Future]:
        with self._lock:
            return list(self._futures.values())
