"""One worker thread runs every operation on the backend, in order per model, fairly across
sessions, within queue caps, and accounts device-seconds per tenant, session and kind.

Ordering: the SDK numbers each training client's requests (`seq_id`, from 1; a model created
by loading a checkpoint runs that load as seq 0) and expects them executed in that order,
even though its chunks and retries may arrive out of order. Each model is a *lane*: an op
waits until every lower seq_id of its lane has been queued, and a second op with a seq_id
already seen (an SDK retry after a lost response) returns the first one's future. So a step
is never lost or run twice. A request the service refuses (400, 404 of a checkpoint, 413 ...)
still takes its place: `refuse` files a placeholder that completes with the refusal when its
turn comes, so the client's next request runs instead of waiting forever for a seq_id that
will never arrive. (A 429 does not take a place: the SDK sends the same request again.)

Leaks closed: a lane's retry entries (`Lane.seen`) are forgotten with their futures when the
future store sweeps them; closing a lane (its session finished or expired) completes the ops
it still held for a missing seq_id with an error; `drain` has a deadline for the running op.

Fairness: ops ready to run sit in one FIFO per session, and sessions in one ring per
tenant; the worker takes one op from each *tenant* with work in turn, and within a tenant
from each session in turn (round robin at both levels). So a tenant with many sessions or a
long backlog delays another tenant's op by at most one op (or one *piece*) per other active
tenant. A large op runs in pieces: its `run` returns None while pieces remain (core splits
a forward_backward into pieces of at most `piece_tokens` tokens, at the step layer's
microbatch boundary: gradients accumulate over pieces exactly as over microbatches), and
between two pieces the worker serves the other tenants. The op keeps its place at the head
of its session's FIFO, so the model's order is unchanged.

Detached ops (`Op.detached`: samples when the backend samples through a vLLM engine,
`tools.serve --sampler vllm`): taken in the same fair order, then run on a thread of their
own while the worker goes on, so concurrent samples of several tenants meet in one engine
batch (service/vllm_sampler.py); each is billed its own wall time, and `drain` waits for
them as for the running op.

Token rate: with `token_rate` set, each tenant has a bucket of `token_burst` tokens refilled
at `token_rate` tokens/s (clock injectable for tests). A request is admitted while the
bucket is not negative and then takes its tokens (it may go into debt: a request larger than
the burst still runs once, then the tenant waits); otherwise 429 with Retry-After = the
seconds until the bucket is back at zero.

Queue caps: a session may have `max_per_session` and a tenant `max_per_tenant` ops queued or
held (not yet running); beyond that a request gets 429 with Retry-After = the priced seconds
of that tenant's queued work (rounded up, 1..600). The service's own ops (free, load_sampler)
are not capped.

Accounting: each op's wall time (all its pieces) x the backend's device count is added to
its session's device-seconds, logged per op (`service.op ... device_s=... session_device_s=...`)
and handed to `record` (the JSONL accounting log, service/accounting.py) as one record, with
the tokens the op processed (`Op.tokens`: prefill, sampled, trained) when it succeeded. Only
ops that ran are recorded: a refusal placeholder never runs and is never billed. An op that
failed through the service's own fault (category "server") bills nothing: its time is the
record's `unbilled_s`. The last
`TRACE_KEEP` ops of each session (start, wait, wall) feed `export_session_trace`.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter, OrderedDict, defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from service import deadline
from service.admission import Price, Throughput
from service.deadline import Deadline
from service.errors import ServiceError, log_safe, scrub_paths
from service.futures import Future, FutureStore, Outcome

log = logging.getLogger("service")
SHUTDOWN_ERROR = "the service shut down before this request ran"
TRACE_KEEP = 2_000  # ops kept per session for export_session_trace


@dataclass
class Op:
    session_id: str
    kind: str
    run: Callable[[], Outcome | None]  # None: another piece remains (see Fairness)
    lane: str | None = None
    seq_id: int | None = None
    future: Future | None = None
    base: str | None = None  # the served base it runs on (billing by base), when one
    on_error: Callable[[], None] | None = None
    tenant: str = ""
    price: Price | None = None
    internal: bool = False  # queued by the service itself: not capped
    refusal: Outcome | None = None  # a refused request's placeholder in its lane
    est_s: float = 0.0  # priced seconds (Retry-After hints)
    rate_tokens: int = 0  # tokens charged to the tenant's rate bucket at admission
    tokens: dict[str, int] = field(default_factory=dict)  # billed tokens by kind (set by run)
    submitted: float = 0.0  # unix time queued
    started: float | None = None  # unix time its first piece started
    wall_s: float = 0.0  # over all its pieces
    pieces: int = 0
    # Runs on a thread of its own, the worker going on at once: an op whose backend call
    # does not use the worker's model (a sample through a vLLM engine, which batches the
    # concurrent ones itself; service/vllm_sampler.py). Never split into pieces.
    detached: bool = False


@dataclass
class Lane:
    next_seq: int
    held: dict[int, Op] = field(default_factory=dict)
    seen: dict[int, Future] = field(default_factory=dict)


@dataclass
class Usage:
    tenant: str = ""
    device_seconds: float = 0.0
    ops: Counter = field(default_factory=Counter)
    failed: Counter = field(default_factory=Counter)
    trace: deque = field(default_factory=lambda: deque(maxlen=TRACE_KEEP))


class TokenBucket:
    """Per-tenant token rate (see the module docstring); `clock` returns seconds."""

    def __init__(self, rate: float, burst: float, clock: Callable[[], float] = time.monotonic):
        self.rate, self.burst, self.clock = rate, burst, clock
        self._level: dict[str, tuple[float, float]] = {}  # tenant -> (tokens, at)

    def _now(self, tenant: str) -> float:
        now = self.clock()
        level, at = self._level.get(tenant, (self.burst, now))
        return min(self.burst, level + (now - at) * self.rate)

    def wait_s(self, tenant: str) -> float:
        """0 when the tenant may send now, else seconds until its bucket is back at zero."""
        level = self._now(tenant)
        return 0.0 if level >= 0 else -level / self.rate

    def take(self, tenant: str, tokens: int) -> None:
        self._level[tenant] = (self._now(tenant) - tokens, self.clock())


class Scheduler:
    def __init__(
        self,
        futures: FutureStore,
        *,
        devices: int,
        max_per_session: int = 1 << 30,
        max_per_tenant: int = 1 << 30,
        record: Callable[[dict[str, Any]], None] | None = None,
        throughput: Throughput | None = None,
        roots: tuple[str, ...] = (),
        deadline_s: Callable[[float], float] | None = None,
        tokens: TokenBucket | None = None,
    ):
        self.futures = futures
        # priced seconds -> the op's deadline (service/deadline.py); None: no deadline
        self.deadline_s = deadline_s
        self.devices = devices
        self.max_per_session = max_per_session
        self.max_per_tenant = max_per_tenant
        self.record = record
        self.throughput = throughput or Throughput()
        self.roots = roots  # server folders to scrub from error messages (the storage root)
        self._cond = threading.Condition()
        self.tokens = tokens
        # tenant -> (session -> FIFO): both levels served round robin
        self._ready: OrderedDict[str, OrderedDict[str, deque[Op]]] = OrderedDict()
        self._lanes: dict[str, Lane] = {}
        self.usage: dict[str, Usage] = {}
        self._pending_session: Counter = Counter()
        self._pending_tenant: Counter = Counter()
        self._pending_tenant_s: defaultdict[str, float] = defaultdict(float)
        self._kind_s: dict[str, float] = {}  # measured wall seconds per kind (EWMA)
        self._accepting = True
        self._refusal = "the service is shutting down; this request was not run"
        self._stop = False
        self._running: Op | None = None
        self._detached: set[threading.Thread] = set()  # detached ops' threads still running
        self._thread = threading.Thread(target=self._work, name="service-worker", daemon=True)
        self._thread.start()

    # --- submission (event-loop thread) -----------------------------------------------------

    def open_lane(self, lane: str, first_seq: int) -> None:
        with self._cond:
            self._lanes.setdefault(lane, Lane(next_seq=first_seq))

    def close_lane(self, lane: str) -> None:
        """Forget the lane; ops it held for a missing seq_id can never run: fail them."""
        with self._cond:
            ln = self._lanes.pop(lane, None)
            held = list(ln.held.values()) if ln is not None else []
            for op in held:
                self._unpend(op)
        for op in held:
            assert op.future is not None
            self.futures.complete(
                op.future,
                Outcome(
                    error=op.refusal.error
                    if op.refusal is not None
                    else "the model was released (its session finished) before this request ran",
                    category=op.refusal.category if op.refusal is not None else "user",
                ),
            )

    def _estimate(self, op: Op) -> float:
        if op.price is not None:
            return self.throughput.seconds(op.price.flops)
        return self._kind_s.get(op.kind, 0.05)

    def _check_caps(self, op: Op) -> None:
        if op.internal:
            return
        if self.tokens is not None and op.rate_tokens:
            wait_s = self.tokens.wait_s(op.tenant)
            if wait_s > 0:
                wait = min(600, max(1, math.ceil(wait_s)))
                raise ServiceError(
                    429,
                    f"this tenant is over its token rate ({self.tokens.rate:g} tokens/s); "
                    f"retry in about {wait} s",
                    retry_after=wait,
                )
        s, t = self._pending_session[op.session_id], self._pending_tenant[op.tenant]
        if s < self.max_per_session and t < self.max_per_tenant:
            return
        wait = math.ceil(self._pending_tenant_s[op.tenant] + self._estimate(op))
        wait = min(600, max(1, wait))
        which = (
            f"session {op.session_id} has {s} requests queued (limit {self.max_per_session})"
            if s >= self.max_per_session
            else f"this tenant has {t} requests queued (limit {self.max_per_tenant})"
        )
        raise ServiceError(429, f"{which}; retry in about {wait} s", retry_after=wait)

    def submit(self, op: Op) -> Future:
        with self._cond:
            if not self._accepting:
                # 410, not 503: the SDK retries 5xx for five minutes, but the adapters live in
                # this process and will not come back; 410 fails the call at once, with this.
                raise ServiceError(410, self._refusal)
            lane = self._lanes.get(op.lane) if op.lane is not None else None
            if op.lane is not None and op.seq_id is not None:
                if lane is None:
                    raise ServiceError(404, "model not found", field="model_id")
                if op.seq_id in lane.seen:  # a retry of a request already queued
                    return lane.seen[op.seq_id]
                if op.seq_id < lane.next_seq:
                    raise ServiceError(
                        400, f"seq_id {op.seq_id} of this model was already executed"
                    )
            if op.refusal is None:
                self._check_caps(op)
                if self.tokens is not None and op.rate_tokens and not op.internal:
                    self.tokens.take(op.tenant, op.rate_tokens)
            op.est_s = self._estimate(op)
            op.submitted = time.time()
            op.future = self.futures.create(op.tenant, op.session_id, op.kind)
            op.future.lane, op.future.seq_id = op.lane, op.seq_id
            self.usage.setdefault(op.session_id, Usage(tenant=op.tenant))
            if op.refusal is None:
                self._pend(op)
            if lane is not None and op.seq_id is not None:
                lane.seen[op.seq_id] = op.future
                lane.held[op.seq_id] = op
                done = self._release(lane)
            else:
                done = []
                self._enqueue(op)
            self._cond.notify()
        for o in done:
            assert o.future is not None and o.refusal is not None
            self.futures.complete(o.future, o.refusal)
        return op.future

    def refuse(
        self,
        lane: str,
        seq_id: int,
        *,
        tenant: str,
        session_id: str,
        kind: str,
        error: ServiceError,
    ) -> None:
        """A refused request keeps its seq_id place: a placeholder completing with `error`
        when its turn comes (nothing if the lane is gone or the seq_id was already seen)."""
        with self._cond:
            ln = self._lanes.get(lane)
            if ln is None or seq_id in ln.seen or seq_id < ln.next_seq:
                return
        category = "user" if error.status < 500 else "server"
        op = Op(session_id, kind, _never, lane, seq_id, tenant=tenant)
        op.refusal = Outcome(error=error.message, category=category)
        try:
            fut = self.submit(op)
        except ServiceError:
            return  # shutting down: the lane is about to go
        # Nobody polls a placeholder (the client got its 4xx); it is kept for an SDK retry of
        # the same seq_id and swept like a fetched result.
        fut.retrieved_at = time.time()
        with self._cond:
            u = self.usage.get(session_id)
            if u is not None:
                u.failed[kind] += 1

    def _release(self, lane: Lane) -> list[Op]:
        """Queue the lane's contiguous prefix; returns refusal placeholders to complete."""
        done = []
        while lane.next_seq in lane.held:
            op = lane.held.pop(lane.next_seq)
            lane.next_seq += 1
            if op.refusal is not None:
                done.append(op)
            else:
                self._enqueue(op)
        return done

    def _pend(self, op: Op) -> None:
        if op.internal:
            return
        self._pending_session[op.session_id] += 1
        self._pending_tenant[op.tenant] += 1
        self._pending_tenant_s[op.tenant] += op.est_s

    def _unpend(self, op: Op) -> None:
        if op.internal or op.refusal is not None:
            return
        self._pending_session[op.session_id] -= 1
        self._pending_tenant[op.tenant] -= 1
        self._pending_tenant_s[op.tenant] = max(0.0, self._pending_tenant_s[op.tenant] - op.est_s)
        if self._pending_session[op.session_id] <= 0:
            del self._pending_session[op.session_id]

    def _enqueue(self, op: Op, front: bool = False) -> None:
        sessions = self._ready.get(op.tenant)
        if sessions is None:
            sessions = self._ready[op.tenant] = OrderedDict()
        q = sessions.get(op.session_id)
        if q is None:
            q = sessions[op.session_id] = deque()
        if front:
            q.appendleft(op)
        else:
            q.append(op)

    def _ready_ops(self) -> list[Op]:
        return [op for sessions in self._ready.values() for q in sessions.values() for op in q]

    def forget(self, futures: list[Future]) -> None:
        """Drop the lanes' retry entries of swept futures (`FutureStore.sweep`)."""
        with self._cond:
            for f in futures:
                ln = self._lanes.get(f.lane) if f.lane is not None else None
                if ln is not None and f.seq_id is not None and ln.seen.get(f.seq_id) is f:
                    del ln.seen[f.seq_id]

    def forget_sessions(self, session_ids: list[str]) -> None:
        """Drop the in-memory usage of sessions the registry forgot (the accounting log
        keeps their records)."""
        with self._cond:
            for sid in session_ids:
                self.usage.pop(sid, None)

    def lane_sizes(self, lane: str) -> tuple[int, int] | None:
        """(retry entries, held ops) of a lane, or None."""
        with self._cond:
            ln = self._lanes.get(lane)
            return None if ln is None else (len(ln.seen), len(ln.held))

    # --- the worker --------------------------------------------------------------------------

    def _next(self) -> Op | None:
        with self._cond:
            while not self._ready and not self._stop:
                self._cond.wait()
            if self._stop and not self._ready:
                return None
            tenant, sessions = self._ready.popitem(last=False)  # the tenant waiting longest
            session, q = sessions.popitem(last=False)  # its session waiting longest
            op = q.popleft()
            if q:
                sessions[session] = q  # back of the tenant's line
            if sessions:
                self._ready[tenant] = sessions  # back of the line
            if op.pieces == 0:
                self._unpend(op)
            self._running = op
            return op

    def _work(self) -> None:
        while (op := self._next()) is not None:
            if op.detached:
                th = threading.Thread(target=self._run_op, args=(op,), daemon=True,
                                      name=f"service-{op.kind}")  # fmt: skip
                with self._cond:
                    self._detached.add(th)
                    if self._running is op:
                        self._running = None
                th.start()
                continue
            self._run_op(op)

    def _run_op(self, op: Op) -> None:
        """One piece of `op` (the worker's thread, or its own when detached); once the op is
        done, its accounting and its future."""
        try:
            self._run_piece(op)
        finally:
            with self._cond:
                self._detached.discard(threading.current_thread())
                self._cond.notify_all()

    def _run_piece(self, op: Op) -> None:
        t0 = time.perf_counter()
        limit = None if self.deadline_s is None else self.deadline_s(op.est_s)
        if op.started is None:
            op.started = time.time()
        outcome: Outcome | None
        try:
            with deadline.running(None if limit is None else Deadline(limit, op.est_s)):
                outcome = op.run()
        except ServiceError as e:
            if e.status >= 500 and not getattr(e, "logged", False):
                log.exception("service.op failed: session=%s kind=%s", op.session_id, op.kind)
            outcome = Outcome(error=e.message, category="user" if e.status < 500 else "server")
        except Exception as e:  # a failing step fails its future; the service goes on
            log.exception("service.op failed: session=%s kind=%s", op.session_id, op.kind)
            # the client gets the error's type and text, never a server path
            outcome = Outcome(
                error=scrub_paths(f"{type(e).__name__}: {e}", self.roots), category="server"
            )
        op.wall_s += time.perf_counter() - t0
        op.pieces += 1
        if outcome is None:  # more pieces: the other tenants' ops go first
            with self._cond:
                self._enqueue(op, front=True)
                if self._running is op:
                    self._running = None
            return
        wall = op.wall_s
        # Billed: ops that succeeded or failed on the tenant's input ("user"). A failure
        # of the service itself ("server": a bug, a device fault, shutdown) is the
        # operator's cost: recorded as `unbilled_s`, never charged to the tenant (#41).
        spent_s = wall * self.devices
        server_fault = outcome.error is not None and outcome.category == "server"
        device_s = 0.0 if server_fault else spent_s
        with self._cond:
            if self._running is op:
                self._running = None
            u = self.usage.setdefault(op.session_id, Usage(tenant=op.tenant))
            u.device_seconds += device_s
            u.ops[op.kind] += 1
            if outcome.error is not None:
                u.failed[op.kind] += 1
            u.trace.append(
                {
                    "kind": op.kind,
                    "ok": outcome.error is None,
                    "start": op.started,
                    "wait_s": op.started - op.submitted,
                    "wall_s": wall,
                    "pieces": op.pieces,
                    "seq_id": op.seq_id,
                    "model": op.lane,
                }
            )
            total = u.device_seconds
            prev = self._kind_s.get(op.kind, wall)
            self._kind_s[op.kind] = 0.8 * prev + 0.2 * wall
            self._cond.notify_all()
        if op.price is not None and outcome.error is None:
            self.throughput.observe(op.price.flops, wall)
        if outcome.error is not None and op.on_error is not None:
            op.on_error()
        if self.record is not None:
            self.record(
                {
                    "ts": time.time(),
                    "tenant": op.tenant,
                    "session": op.session_id,
                    "model": op.lane,
                    "base": op.base,
                    "kind": op.kind,
                    "ok": outcome.error is None,
                    "wall_s": wall,
                    "devices": self.devices,
                    "device_s": device_s,
                    "unbilled_s": spent_s - device_s,
                    "pieces": op.pieces,
                    "tokens": dict(op.tokens) if outcome.error is None else {},
                }
            )
        log.info(
            "service.op tenant=%s session=%s lane=%s kind=%s seq=%s wall_s=%.4f "
            "device_s=%.4f session_device_s=%.3f%s",
            log_safe(op.tenant),
            op.session_id,
            op.lane,
            op.kind,
            op.seq_id,
            wall,
            device_s,
            total,
            f" error={log_safe(outcome.error)!r}" if outcome.error else "",
        )
        assert op.future is not None
        self.futures.complete(op.future, outcome)

    # --- shutdown ----------------------------------------------------------------------------

    def stop_accepting(self, reason: str | None = None) -> None:
        """Refuse new work (410); `reason` replaces the shutdown sentence (a broken model
        resource says what it lost)."""
        with self._cond:
            self._accepting = False
            if reason is not None:
                self._refusal = reason

    def drain(self, deadline_s: float, running_grace_s: float = 30.0) -> tuple[int, int]:
        """Finish queued work until the deadline, then fail what is left (including ops held
        for a missing earlier seq_id) with a clear error. The op running at the deadline gets
        `running_grace_s` more (a save in progress finishes: saves are atomic either way);
        after that its future fails too and drain returns. Returns (finished, refused)."""
        self.stop_accepting()
        end = time.monotonic() + deadline_s
        with self._cond:
            start_count = sum(sum(u.ops.values()) for u in self.usage.values())
            while (self._ready or self._running or self._detached) and time.monotonic() < end:
                self._cond.wait(timeout=max(0.0, min(0.5, end - time.monotonic())))
            refused = self._ready_ops()
            refused += [op for lane in self._lanes.values() for op in lane.held.values()]
            self._ready.clear()
            for lane in self._lanes.values():
                lane.held.clear()
            for op in refused:
                if op.pieces == 0:
                    self._unpend(op)
            finished = sum(sum(u.ops.values()) for u in self.usage.values()) - start_count
            running = self._running
            detached = list(self._detached)
            self._stop = True
            self._cond.notify_all()
        for op in refused:
            assert op.future is not None
            self.futures.complete(
                op.future, op.refusal or Outcome(error=SHUTDOWN_ERROR, category="server")
            )
        for th in detached:  # detached ops (samples) get the same grace
            th.join(timeout=running_grace_s)
        if running is not None:
            self._thread.join(timeout=running_grace_s)
            if self._thread.is_alive():
                log.error(
                    "service: %s op of session %s still running %.0f s after the drain "
                    "deadline; giving up on it",
                    running.kind,
                    running.session_id,
                    running_grace_s,
                )
                assert running.future is not None
                self.futures.complete(
                    running.future,
                    Outcome(
                        error="the service shut down while this request ran", category="server"
                    ),
                )
        return finished, len([op for op in refused if op.refusal is None])

    def session_usage(self, session_id: str) -> Usage | None:
        with self._cond:
            return self.usage.get(session_id)


def _never() -> Outcome:  # a refusal placeholder is completed, never run
    raise AssertionError("a refused request was run")


def split_pieces(lengths: list[int], piece_tokens: int) -> list[tuple[int, int]]:
    """Consecutive [lo, hi) datum ranges of at most `piece_tokens` tokens each (a datum
    longer than that is a piece of its own); one piece when `piece_tokens` <= 0."""
    if piece_tokens <= 0 or sum(lengths) <= piece_tokens:
        return [(0, len(lengths))]
    out, lo, n = [], 0, 0
    for i, t in enumerate(lengths):
        if i > lo and n + t > piece_tokens:
            out.append((lo, i))
            lo, n = i, 0
        n += t
    out.append((lo, len(lengths)))
    return out


def merge_metrics(parts: list[tuple[dict[str, float], int]]) -> dict[str, float]:
    """The metrics of one request from its pieces' (`name:reduction` metrics, datums): sums
    add, max/min take the extreme, means weigh by datums; any other reduction keeps the
    last piece's value (none of the built-in losses reports one)."""
    out: dict[str, float] = {}
    total = sum(n for _, n in parts) or 1
    for metrics, n in parts:
        for k, v in metrics.items():
            red = k.rpartition(":")[2]
            if k not in out:
                out[k] = v * n / total if red == "mean" else v
            elif red == "sum":
                out[k] += v
            elif red == "max":
                out[k] = max(out[k], v)
            elif red == "min":
                out[k] = min(out[k], v)
            elif red == "mean":
                out[k] += v * n / total
            else:
                out[k] = v
    return out
