"""Run the service: uvicorn on one event loop, the scheduler's worker thread beside it, and a
drain on SIGTERM / SIGINT.

Shutdown: the first signal stops new work (410: the SDK would retry a 503 for minutes), lets the worker finish what is queued
for up to `drain_s` seconds, fails the rest with "the service shut down before this request
ran", keeps answering `retrieve_future` until every finished result was fetched (or
`fetch_grace_s` passed) and no request came for 2 s, then stops uvicorn and exits 0. Checkpoint saves are atomic
(`service.storage`), so no reported save is lost and no partial one is left. A second
signal exits at once.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import uvicorn

from core.errors import ConfigError
from service.app import create_app
from service.backend import Backend
from service.core import INTERNAL_OPS, Limits, Service
from service.storage import CheckpointStore

log = logging.getLogger("service")
QUIET_S = 2.0  # no request for this long after a drain: the clients have stopped


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


def read_api_keys(path: str) -> list[str]:
    """One key per line; blank lines and '#' comments ignored. Never logged."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise ConfigError(
            f"cannot read API key file ({e.strerror})", key="--api-key-file"
        ) from None
    keys = [s.strip() for s in lines if s.strip() and not s.strip().startswith("#")]
    if not keys:
        raise ConfigError(f"{path} holds no keys (one per line)", key="--api-key-file")
    bad = [i for i, k in enumerate(keys) if not k.startswith("tml-")]
    if bad:
        # The SDK itself refuses keys without this prefix (tinker.lib._auth_token_provider).
        raise ConfigError(
            f"{path}: key on non-comment line {bad[0] + 1} does not start with 'tml-' "
            "(the tinker SDK only sends keys that do)",
            key="--api-key-file",
        )
    return keys


def check_exposure(opts: ServeOptions) -> None:
    try:
        loopback = ipaddress.ip_address(opts.host).is_loopback
    except ValueError:
        loopback = opts.host == "localhost"
    if not loopback and opts.api_key_file is None:
        raise ConfigError(
            f"serving on {opts.host} (not loopback) needs --api-key-file", key="--host"
        )


class _DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, service: Service, opts: ServeOptions):
        super().__init__(config)
        self.service = service
        self.opts = opts
        self._draining = False

    def handle_exit(self, sig: int, frame) -> None:  # runs on the event-loop thread
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
        threading.Thread(target=self._drain, name="service-drain", daemon=True).start()

    def _drain(self) -> None:
        finished, refused = self.service.scheduler.drain(self.opts.drain_s)
        log.info("service: drained: %d ops finished, %d refused", finished, refused)
        # Stay up (refusing new work) until every finished result was fetched and clients have
        # gone quiet: the SDK sends one training client's requests one after another, and a
        # request that finds the port closed is retried for minutes instead of failing now.
        end = time.monotonic() + self.opts.fetch_grace_s
        while time.monotonic() < end:
            unfetched = [
                f
                for f in self.service.futures.all()
                if f.outcome is not None and f.retrieved_at is None and f.kind not in INTERNAL_OPS
            ]
            quiet = time.monotonic() - self.service.last_request > QUIET_S
            if not unfetched and quiet:
                break
            time.sleep(0.1)
        for sid, u in sorted(self.service.scheduler.usage.items()):
            log.info(
                "service.usage session=%s device_s=%.3f ops=%s", sid, u.device_seconds, dict(u.ops)
            )
        self.should_exit = True


async def serve(backend: Backend, opts: ServeOptions) -> None:
    check_exposure(opts)
    keys = read_api_keys(opts.api_key_file) if opts.api_key_file else None
    loop = asyncio.get_running_loop()
    service = Service(
        backend,
        CheckpointStore(opts.storage),
        loop,
        limits=opts.limits,
        session_ttl_s=opts.session_ttl_s,
    )
    app = create_app(service, keys)
    config = uvicorn.Config(
        app,
        host=opts.host,
        port=opts.port,
        access_log=False,
        log_level="warning",
        timeout_graceful_shutdown=5,
    )
    server = _DrainingServer(config, service, opts)

    async def sweep() -> None:
        while True:
            await asyncio.sleep(30)
            service.futures.sweep()
            service.expire_sessions()

    sweeper = asyncio.create_task(sweep())
    info = backend.base_model()
    log.info(
        "service: serving %s (max context %d, vocab %d) on http://%s:%d, storage %s, auth %s",
        info.name,
        info.max_context,
        info.vocab_size,
        opts.host,
        opts.port,
        Path(opts.storage).resolve(),
        f"{len(keys)} key(s)" if keys else "off (loopback only)",
    )
    try:
        await server.serve()
    finally:
        sweeper.cancel()
