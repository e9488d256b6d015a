"""Usage accounting: one JSON line per operation run on the devices, in `<storage>/usage.jsonl`.

Each record is what billing needs and nothing a client could forge:

    {"v": 1, "ts": <unix end time>, "tenant": "alice", "session": "s-...", "model": "..."|null,
     "kind": "forward_backward", "ok": true, "wall_s": 0.21, "devices": 1, "device_s": 0.21}

`device_s` = wall seconds x devices held (GPU-seconds). The tenant is its key-file name or
the key's fingerprint, never the key. A record is appended with one `write(2)` of a whole
line to a file opened O_APPEND (mode 0600), so concurrent writers never interleave and a
reader sees whole lines; a line cut short by a crash (power loss mid-write) is skipped and
counted by the reader, never misread. Records are not fsynced one by one: a power loss can
drop the last moments of usage, never invent any.

`summarize` is the one aggregation: `GET /api/v1/usage` and `python -m tools.usage` both call
it, so the endpoint and the table cannot disagree.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import threading
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("service")
FILE_NAME = "usage.jsonl"
VERSION = 1


class AccountingLog:
    """Appends records to `<folder>/usage.jsonl`."""

    def __init__(self, folder: str | Path):
        self.path = Path(folder) / FILE_NAME
        self._lock = threading.Lock()
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)

    def write(self, record: dict[str, Any]) -> None:
        line = (json.dumps({"v": VERSION, **record}, separators=(",", ":")) + "\n").encode()
        with self._lock:
            try:
                n = os.write(self._fd, line)
            except OSError as e:
                log.error("service: accounting record not written (%s)", e.strerror)
                return
        if n != len(line):  # disk full: the reader skips the partial line
            log.error("service: accounting record cut short (%d of %d bytes)", n, len(line))

    def close(self) -> None:
        with self._lock:
            with contextlib.suppress(OSError):
                os.fsync(self._fd)
            os.close(self._fd)


def parse_since(text: str) -> float:
    """`--since` / `?since=`: unix seconds, an ISO date or date-time (UTC unless it names a
    zone), or a duration back from now: 90s, 30m, 24h, 7d. ValueError otherwise."""
    import datetime as dt
    import time

    t = text.strip()
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    try:
        if t and t[-1] in units and t[:-1].replace(".", "", 1).isdigit():
            return time.time() - float(t[:-1]) * units[t[-1]]
        v = float(t)
        if math.isfinite(v):
            return v
    except ValueError:
        pass
    try:
        d = dt.datetime.fromisoformat(t)
    except ValueError:
        raise ValueError(
            f"expected unix seconds, an ISO date (2025-01-31), a date-time or 24h/7d, got {t!r}"
        ) from None
    if d.tzinfo is None:
        d = d.replace(tzinfo=dt.UTC)
    return d.timestamp()


def read_records(path: str | Path, since: float | None = None) -> tuple[list[dict], int]:
    """(records with ts >= since, number of damaged lines skipped)."""
    out: list[dict] = []
    damaged = 0
    with open(path, "rb") as f:
        for raw in f:
            try:
                r = json.loads(raw)
                ts, dev = float(r["ts"]), float(r["device_s"])
                if not (isinstance(r["tenant"], str) and math.isfinite(ts + dev)):
                    raise ValueError
            except (ValueError, KeyError, TypeError):
                damaged += 1
                continue
            if since is None or ts >= since:
                out.append(r)
    return out, damaged


@dataclass
class Totals:
    device_seconds: float = 0.0
    ops: int = 0
    failed: int = 0
    sessions: set[str] = field(default_factory=set)

    def add(self, r: dict) -> None:
        self.device_seconds += float(r["device_s"])
        self.ops += 1
        self.failed += 0 if r.get("ok", True) else 1
        if r.get("session"):
            self.sessions.add(str(r["session"]))

    @property
    def gpu_minutes(self) -> float:
        return self.device_seconds / 60.0

    def to_json(self) -> dict[str, Any]:
        return {
            "device_seconds": self.device_seconds,
            "gpu_minutes": self.gpu_minutes,
            "ops": self.ops,
            "failed_ops": self.failed,
            "sessions": len(self.sessions),
        }


@dataclass
class Summary:
    """Totals per tenant, and per (tenant, session) and (tenant, operation kind)."""

    tenants: dict[str, Totals]
    sessions: dict[tuple[str, str], Totals]
    kinds: dict[tuple[str, str], Totals]

    def tenant_json(self, tenant: str) -> dict[str, Any]:
        t = self.tenants.get(tenant, Totals())
        return {
            "tenant": tenant,
            **t.to_json(),
            "by_session": {s: v.to_json() for (tn, s), v in self.sessions.items() if tn == tenant},
            "by_kind": {k: v.to_json() for (tn, k), v in self.kinds.items() if tn == tenant},
        }


def summarize(records: Iterable[dict]) -> Summary:
    tenants: dict[str, Totals] = defaultdict(Totals)
    sessions: dict[tuple[str, str], Totals] = defaultdict(Totals)
    kinds: dict[tuple[str, str], Totals] = defaultdict(Totals)
    for r in records:
        t = r["tenant"]
        tenants[t].add(r)
        sessions[(t, str(r.get("session")))].add(r)
        kinds[(t, str(r.get("kind")))].add(r)
    return Summary(dict(tenants), dict(sessions), dict(kinds))


def table(summary: Summary, by: str = "tenant") -> Iterator[str]:
    """Plain-text rows: one per tenant (or per tenant and session / kind) and a total."""
    rows: list[tuple[tuple[str, ...], Totals]]
    heads: tuple[str, ...]
    if by == "tenant":
        rows = [((t,), v) for t, v in sorted(summary.tenants.items())]
        heads = ("tenant",)
    else:
        src = summary.sessions if by == "session" else summary.kinds
        rows = [(k, v) for k, v in sorted(src.items())]
        heads = ("tenant", by)
    width = [max([len(h)] + [len(k[i]) for k, _ in rows]) for i, h in enumerate(heads)]
    cols = ("sessions", "ops", "failed", "device_s", "GPU-minutes")
    fmt_keys = "  ".join(f"{{:<{w}}}" for w in width)
    yield fmt_keys.format(*heads) + "  " + "  ".join(f"{c:>12}" for c in cols)
    total = Totals()
    for k, v in rows:
        total.device_seconds += v.device_seconds
        total.ops += v.ops
        total.failed += v.failed
        total.sessions |= {f"{k[0]}/{s}" for s in v.sessions}
        yield fmt_keys.format(*k) + "  " + _cells(v)
    yield fmt_keys.format("total", *[""] * (len(heads) - 1)) + "  " + _cells(total)


def _cells(v: Totals) -> str:
    return (
        f"{len(v.sessions):>12}  {v.ops:>12}  {v.failed:>12}  "
        f"{v.device_seconds:>12.3f}  {v.gpu_minutes:>12.4f}"
    )
