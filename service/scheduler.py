"""One worker thread runs every operation on the backend, in order per model, fairly across
sessions, and accounts device-seconds per session.

Ordering: the SDK numbers each training client's requests (`seq_id`, from 1; a model created
by loading a checkpoint runs that load as seq 0) and expects them executed in that order,
even though its chunks and retries may arrive out of order. Each model is a *lane*: an op
waits until every lower seq_id of its lane has been queued, and a second op with a seq_id
already seen (an SDK retry after a lost response) returns the first one's future. So a step
is never lost or run twice.

Fairness: ops ready to run sit in one FIFO per session; the worker takes one op from each
session with work in turn (round robin), so a session with a long backlog delays another
session's op by at most one op per other active session.

Accounting: each op's wall time x the backend's device count is added to its session's
device-seconds, logged per op (`service.op ... device_s=... session_device_s=...`) and
served by `/api/v1/sessions/{id}/usage`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from service.errors import ServiceError
from service.futures import Future, FutureStore, Outcome

log = logging.getLogger("service")


@dataclass
class Op:
    session_id: str
    kind: str
    run: Callable[[], Outcome]
    lane: str | None = None
    seq_id: int | None = None
    future: Future | None = None
    on_error: Callable[[], None] | None = None


@dataclass
class Lane:
    next_seq: int
    held: dict[int, Op] = field(default_factory=dict)
    seen: dict[int, Future] = field(default_factory=dict)


@dataclass
class Usage:
    device_seconds: float = 0.0
    ops: Counter = field(default_factory=Counter)
    failed: Counter = field(default_factory=Counter)


class Scheduler:
    def __init__(self, futures: FutureStore, *, devices: int):
        self.futures = futures
        self.devices = devices
        self._cond = threading.Condition()
        self._ready: OrderedDict[str, deque[Op]] = OrderedDict()  # session -> FIFO
        self._lanes: dict[str, Lane] = {}
        self.usage: dict[str, Usage] = {}
        self._accepting = True
        self._stop = False
        self._running: Op | None = None
        self._thread = threading.Thread(target=self._work, name="service-worker", daemon=True)
        self._thread.start()

    # --- submission (event-loop thread) -----------------------------------------------------

    def open_lane(self, lane: str, first_seq: int) -> None:
        with self._cond:
            self._lanes.setdefault(lane, Lane(next_seq=first_seq))

    def close_lane(self, lane: str) -> None:
        with self._cond:
            self._lanes.pop(lane, None)

    def submit(self, op: Op) -> Future:
        with self._cond:
            if not self._accepting:
                # 410, not 503: the SDK retries 5xx for five minutes, but the adapters live in
                # this process and will not come back; 410 fails the call at once, with this.
                raise ServiceError(410, "the service is shutting down; this request was not run")
            lane = self._lanes.get(op.lane) if op.lane is not None else None
            if op.lane is not None and op.seq_id is not None:
                if lane is None:
                    raise ServiceError(404, f"model {op.lane} not found")
                if op.seq_id in lane.seen:  # a retry of a request already queued
                    return lane.seen[op.seq_id]
                if op.seq_id < lane.next_seq:
                    raise ServiceError(
                        409, f"seq_id {op.seq_id} of model {op.lane} was already executed"
                    )
            op.future = self.futures.create(op.session_id, op.kind)
            self.usage.setdefault(op.session_id, Usage())
            if lane is not None and op.seq_id is not None:
                lane.seen[op.seq_id] = op.future
                lane.held[op.seq_id] = op
                while lane.next_seq in lane.held:  # release the contiguous prefix
                    self._enqueue(lane.held.pop(lane.next_seq))
                    lane.next_seq += 1
            else:
                self._enqueue(op)
            self._cond.notify()
            return op.future

    def _enqueue(self, op: Op) -> None:
        q = self._ready.get(op.session_id)
        if q is None:
            q = self._ready[op.session_id] = deque()
        q.append(op)

    # --- the worker --------------------------------------------------------------------------

    def _next(self) -> Op | None:
        with self._cond:
            while not self._ready and not self._stop:
                self._cond.wait()
            if self._stop and not self._ready:
                return None
            session, q = self._ready.popitem(last=False)  # the session waiting longest
            op = q.popleft()
            if q:
                self._ready[session] = q  # back of the line
            self._running = op
            return op

    def _work(self) -> None:
        while (op := self._next()) is not None:
            t0 = time.perf_counter()
            try:
                outcome = op.run()
            except ServiceError as e:
                outcome = Outcome(error=e.message, category="user")
            except Exception as e:  # a failing step fails its future; the service goes on
                log.exception("service.op failed: session=%s kind=%s", op.session_id, op.kind)
                outcome = Outcome(error=f"{type(e).__name__}: {e}", category="server")
            wall = time.perf_counter() - t0
            with self._cond:
                self._running = None
                u = self.usage.setdefault(op.session_id, Usage())
                u.device_seconds += wall * self.devices
                u.ops[op.kind] += 1
                if outcome.error is not None:
                    u.failed[op.kind] += 1
                total = u.device_seconds
                self._cond.notify_all()
            if outcome.error is not None and op.on_error is not None:
                op.on_error()
            log.info(
                "service.op session=%s lane=%s kind=%s seq=%s wall_s=%.4f device_s=%.4f "
                "session_device_s=%.3f%s",
                op.session_id,
                op.lane,
                op.kind,
                op.seq_id,
                wall,
                wall * self.devices,
                total,
                f" error={outcome.error!r}" if outcome.error else "",
            )
            assert op.future is not None
            self.futures.complete(op.future, outcome)

    # --- shutdown ----------------------------------------------------------------------------

    def stop_accepting(self) -> None:
        with self._cond:
            self._accepting = False

    def drain(self, deadline_s: float) -> tuple[int, int]:
        """Finish queued work until the deadline, then fail what is left (including ops held
        for a missing earlier seq_id) with a clear error. Returns (finished, refused)."""
        self.stop_accepting()
        end = time.monotonic() + deadline_s
        with self._cond:
            start_count = sum(sum(u.ops.values()) for u in self.usage.values())
            while (self._ready or self._running) and time.monotonic() < end:
                self._cond.wait(timeout=max(0.0, min(0.5, end - time.monotonic())))
            refused = [op for q in self._ready.values() for op in q]
            refused += [op for lane in self._lanes.values() for op in lane.held.values()]
            self._ready.clear()
            for lane in self._lanes.values():
                lane.held.clear()
            finished = sum(sum(u.ops.values()) for u in self.usage.values()) - start_count
            running = self._running
            self._stop = True
            self._cond.notify_all()
        for op in refused:
            assert op.future is not None
            self.futures.complete(
                op.future,
                Outcome(error="the service shut down before this request ran", category="server"),
            )
        if running is not None:  # past the deadline: let the current op finish (atomic saves)
            self._thread.join()
        return finished, len(refused)

    def session_usage(self, session_id: str) -> Usage | None:
        with self._cond:
            return self.usage.get(session_id)
