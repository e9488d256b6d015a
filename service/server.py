"""Run the service: uvicorn on one event loop, the scheduler's worker thread beside it, and a
drain on SIGTERM / SIGINT; SIGHUP re-reads the API key file.

Start-up: `tools.serve` binds the listening socket (`bind`) before it builds the model, so a
port in use is one line and exit 2, and the "serving ..." line is logged only once the socket
is ours. Shutdown: the first signal stops new work (410: the SDK would retry a 503 for
minutes), lets the worker finish what is queued for up to `drain_s` seconds, fails the rest
with "the service shut down before this request ran", keeps answering `retrieve_future` until
every finished result was fetched (or `fetch_grace_s` passed) and no request came for 2 s,
then stops uvicorn and exits 0. Checkpoint saves are atomic (`service.storage`), so no
reported save is lost and no partial one is left. A second signal exits at once.

A model resource (several processes, service/distributed.py): on a signal, rank 0 first
pings every rank (torchrun signals every rank when one of them dies); a resource that lost a
rank, at any time, stops with `fail`: new requests get 410 naming what was lost, queued ones
fail with it, finished results stay fetchable for `fetch_grace_s`, then uvicorn stops and
`tools.serve` exits non-zero.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ipaddress
import logging
import signal
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import uvicorn

from core.errors import ConfigError
from service.accounting import AccountingLog, Prices
from service.admission import CostModel
from service.app import create_app
from service.backend import Backend
from service.core import INTERNAL_OPS, Limits, Service
from service.errors import log_safe
from service.storage import Storage
from service.tenants import KeyFile

log = logging.getLogger("service")
QUIET_S = 2.0  # no request for this long after a drain: the clients have stopped
# A broken resource: queued requests fail at once (the backend refuses them); this bounds it.
FAIL_DRAIN_S = 5.0
# On a signal, how long rank 0 waits for every rank of a resource to answer a ping.
PROBE_S = 10.0


@dataclass(frozen=True)
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key_file: str | None = None
    storage: str = "outputs/service"
    session_ttl_s: float = 1800.0
    drain_s: float = 60.0
    fetch_grace_s: float = 10.0
    limits: Limits = Limits()
    prices: Prices = Prices()  # the operator's price table (tools.serve --prices)


def check_exposure(opts: ServeOptions) -> None:
    try:
        loopback = ipaddress.ip_address(opts.host).is_loopback
    except ValueError:
        loopback = opts.host == "localhost"
    if not loopback and opts.api_key_file is None:
        raise ConfigError(
            f"serving on {opts.host} (not loopback) needs --api-key-file", key="--host"
        )


# glibc's mmap threshold for the service process (bound_host_memory). Measured 2026-12-03 on
# the debug model (benchmarks/peers.md finding 7): 128 KiB mapped every tensor of 128 KiB or
# more on its own, ~166,000 page faults and 0.70 CPU s per LoRA forward_backward + optim_step
# (8 x 96 tokens) against 0.37-0.41 s without a fixed threshold; 4 MiB: ~18,000-30,000
# faults, 0.41 s. Peak RSS over 16 admitted chunks of the admission test: +117 MiB at 128 KiB,
# +126 at 2 MiB, +162-169 at 4 MiB, +270 without a fixed threshold (budget 256 MiB).
MMAP_THRESHOLD_BYTES = 4 << 20


def bound_host_memory(threshold: int = MMAP_THRESHOLD_BYTES) -> None:
    """Make the process's resident memory follow its live tensors (what admission prices).

    glibc's malloc raises its mmap threshold each time a large block is freed (up to 32 MiB),
    after which blocks of that size come from the heap and their pages stay resident when
    freed: the RSS then grows towards the sum of every request's peak, not the largest one.
    A fixed threshold (mallopt M_MMAP_THRESHOLD, which also disables the adjustment) maps
    every block of `threshold` bytes or more on its own and returns it at free. The cost is
    a fresh mapping and its page faults for each such tensor, so the threshold is not set
    lower than needed: smaller tensors reuse the heap's pages (figures at
    MMAP_THRESHOLD_BYTES). A no-op where mallopt does not exist (not glibc)."""
    m_mmap_threshold = -3
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).mallopt(m_mmap_threshold, threshold)


def warm_up(backend: Backend) -> None:
    """One forward_backward of one token on a scratch adapter before serving: the runtime's
    one-time allocations (autograd, kernel workspaces) become part of the resident model
    instead of the first client's request."""
    import numpy as np

    from service.types import Datum, LoraSpec

    name = "service-warm-up"
    backend.create_adapter(name, LoraSpec(rank=1, seed=0))
    try:
        one = np.zeros(1, dtype=np.int64)
        backend.forward_backward(
            name, [Datum(one, {"target_tokens": one})], "cross_entropy", {}, forward_only=False
        )
    finally:
        backend.drop_adapter(name)


def bind(host: str, port: int) -> socket.socket:
    """The listening socket (port 0: any free port), or ConfigError naming the problem."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ConfigError(f"cannot resolve {host!r} ({e.strerror})", key="--host") from None
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port} ({e.strerror})", key="--port") from None
    sock.set_inheritable(True)
    return sock


class _DrainingServer(uvicorn.Server):
    def __init__(
        self, config: uvicorn.Config, service: Service, opts: ServeOptions, resource: Any = None
    ):
        super().__init__(config)
        self.service = service
        self.opts = opts
        self.resource = resource  # service.distributed.Dispatcher of a model resource
        self._draining = False
        self._drain_started = False
        self.failed: str | None = None

    def handle_exit(self, sig: int, frame) -> None:  # runs on the event-loop thread
        if self.failed is not None:  # torchrun stopping the ranks after one died: we are
            log.info("service: %s received; already stopping", signal.Signals(sig).name)
            return
        if self._draining:
            log.warning("service: second signal, exiting now")
            self.should_exit = self.force_exit = True
            return
        self._draining = True
        self.service.draining = True
        log.info(
            "service: %s received; draining (up to %.0f s)",
            signal.Signals(sig).name,
            self.opts.drain_s,
        )
        threading.Thread(target=self._stop, name="service-drain", daemon=True).start()

    def fail(self, reason: str) -> None:  # the event-loop thread (call_soon_threadsafe)
        """The resource lost a rank: refuse everything with `reason`, let clients fetch what
        finished, then stop (tools.serve exits non-zero)."""
        if self.failed is not None:
            return
        self.failed = reason
        self._draining = True
        self.service.draining = True
        self.service.scheduler.stop_accepting(f"{reason}; this request was not run")
        if not self._drain_started:
            threading.Thread(
                target=self._drain, args=(FAIL_DRAIN_S,), name="service-fail", daemon=True
            ).start()

    def _stop(self) -> None:
        # A signal from torchrun may mean a rank died: then `fail` (through the resource's
        # on_broken) stops the service, not the drain. A healthy resource drains as usual.
        probe = self.resource is None or self.resource.probe(PROBE_S)
        if not probe and self.resource.broken is not None:
            return
        if self.failed is None:
            self._drain(self.opts.drain_s)

    def _drain(self, deadline_s: float) -> None:
        self._drain_started = True
        finished, refused = self.service.scheduler.drain(deadline_s)
        log.info("service: drained: %d ops finished, %d refused", finished, refused)
        # Stay up (refusing new work) until every finished result was fetched and clients have
        # gone quiet: the SDK sends one training client's requests one after another, and a
        # request that finds the port closed is retried for minutes instead of failing now.
        # A broken resource stays the whole grace: a client's next request gets the reason
        # (410) instead of a refused connection, which the SDK would retry for minutes.
        end = time.monotonic() + self.opts.fetch_grace_s
        while time.monotonic() < end:
            unfetched = [
                f
                for f in self.service.futures.all()
                if f.outcome is not None and f.retrieved_at is None and f.kind not in INTERNAL_OPS
            ]
            quiet = time.monotonic() - self.service.last_request > QUIET_S
            if not unfetched and quiet and self.failed is None:
                break
            time.sleep(0.1)
        for sid, u in sorted(self.service.scheduler.usage.items()):
            log.info(
                "service.usage tenant=%s session=%s device_s=%.3f ops=%s",
                log_safe(u.tenant),
                sid,
                u.device_seconds,
                dict(u.ops),
            )
        self.should_exit = True


async def serve(
    backend: Backend | Sequence[Backend],
    opts: ServeOptions,
    *,
    sock: socket.socket,
    keys: KeyFile | None,
    cost: CostModel | Sequence[CostModel | None] | None = None,
    resource: Any = None,
) -> str | None:
    """Serve until stopped (`backend`: one, or one per base with `cost` in the same order);
    returns None, or why a model resource (`resource`: its service.distributed.Dispatcher)
    broke."""
    check_exposure(opts)
    backends = [backend] if not isinstance(backend, Sequence) else list(backend)
    for b in backends:
        warm_up(b)
    loop = asyncio.get_running_loop()
    storage = Storage(opts.storage)
    accounting = AccountingLog(storage.root)
    service = Service(
        backends,
        storage,
        loop,
        limits=opts.limits,
        session_ttl_s=opts.session_ttl_s,
        cost=cost,
        accounting=accounting,
    )
    service.prices = opts.prices
    app = create_app(service, keys)
    config = uvicorn.Config(app, access_log=False, log_level="warning", timeout_graceful_shutdown=5)
    server = _DrainingServer(config, service, opts, resource)
    if resource is not None:
        resource.on_broken = lambda reason: loop.call_soon_threadsafe(server.fail, reason)
    if keys is not None:
        loop.add_signal_handler(signal.SIGHUP, keys.reload)

    async def sweep() -> None:
        while True:
            await asyncio.sleep(30)
            service.sweep()

    sweeper = asyncio.create_task(sweep())
    host, port = sock.getsockname()[:2]
    budget = opts.limits.max_request_bytes
    log.info(
        "service: serving %s on http://%s:%d, storage %s, auth %s, admission %s per request",
        ", ".join(
            f"{b.info.name} (max context {b.info.max_context}, vocab {b.info.vocab_size})"
            for b in service.bases.values()
        ),
        host,
        port,
        storage.root,
        f"{len(keys)} key(s) of {len(keys.tenants())} tenant(s)" if keys else "off (loopback only)",
        f"{budget / (1 << 30):.2f} GiB" if budget is not None and cost is not None else "off",
    )
    try:
        await server.serve(sockets=[sock])
    finally:
        sweeper.cancel()
        accounting.close()
        service.audit.close()
    return server.failed
