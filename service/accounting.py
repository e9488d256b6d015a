"""Usage accounting: one JSON line per operation run on the devices, in `<storage>/usage.jsonl`.

Each record is what billing needs and nothing a client could forge:

    {"v": 1, "ts": <unix end time>, "tenant": "alice", "session": "s-...", "model": "..."|null,
     "base": "org/name"|null, "kind": "forward_backward", "ok": true, "wall_s": 0.21, "devices": 1, "device_s": 0.21,
     "unbilled_s": 0.0, "pieces": 1, "tokens": {"trained": 1024}}

`device_s` = billed wall seconds x devices held (GPU-seconds). `tokens`: what a successful op
processed, by kind: `prefill` (prompt tokens of a sample x samples, and forward-only
tokens), `sampled` (tokens generated), `trained` (forward_backward tokens). An op refused
on the tenant's input while it ran bills its device-seconds and no tokens; an op that failed
through the service's own fault bills nothing (its time is `unbilled_s`, the operator's).
Only ops that ran are recorded. The tenant is its key-file name or
the key's fingerprint, never the key. A record is appended with one `write(2)` of a whole
line to a file opened O_APPEND (mode 0600), so concurrent writers never interleave and a
reader sees whole lines; a line cut short by a crash (power loss mid-write) is skipped and
counted by the reader, never misread. Records are not fsynced one by one: a power loss can
drop the last moments of usage, never invent any.

`summarize` is the one aggregation: `GET /api/v1/usage` and `python -m tools.usage` both call
it, so the endpoint and the table cannot disagree. The service does not re-read the log per
request: `UsageIndex` reads it once at start and then appends each record as it is written,
keeping each tenant's records in time order (a `since` query is a bisection); it costs about
one small dict per operation in memory.

`Prices` is the operator's price table (`tools.serve --prices FILE`, `tools.usage --prices`):
a JSON object {"usd_per_gpu_hour": 2.5, "usd_per_million_tokens": {"prefill": 0.1,
"sampled": 0.4, "trained": 0.3}}; a missing entry costs nothing.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import threading
from bisect import bisect_left
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.jsonio import loads_line

log = logging.getLogger("service")
FILE_NAME = "usage.jsonl"
VERSION = 1
TOKEN_KINDS = ("prefill", "sampled", "trained")


@dataclass(frozen=True)
class Prices:
    usd_per_gpu_hour: float = 0.0
    usd_per_million_tokens: dict[str, float] = field(default_factory=dict)

    @staticmethod
    def load(path: str | Path) -> Prices:
        """The price table, or ValueError naming the bad entry."""
        try:
            raw = json.loads(Path(path).read_bytes())
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot read {path} as JSON ({type(e).__name__})") from None
        if not isinstance(raw, dict) or set(raw) - {"usd_per_gpu_hour", "usd_per_million_tokens"}:
            raise ValueError("expected {usd_per_gpu_hour, usd_per_million_tokens} only")
        gpu = raw.get("usd_per_gpu_hour", 0.0)
        toks = raw.get("usd_per_million_tokens", {})
        if not isinstance(toks, dict) or set(toks) - set(TOKEN_KINDS):
            raise ValueError(f"usd_per_million_tokens: keys among {', '.join(TOKEN_KINDS)}")
        for k, v in [("usd_per_gpu_hour", gpu), *toks.items()]:
            if not isinstance(v, int | float) or not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{k}: expected a finite price >= 0, got {v!r}")
        return Prices(float(gpu), {k: float(v) for k, v in toks.items()})

    def cost(self, device_seconds: float, tokens: dict[str, int]) -> float:
        return self.usd_per_gpu_hour * device_seconds / 3600.0 + sum(
            self.usd_per_million_tokens.get(k, 0.0) * n / 1e6 for k, n in tokens.items()
        )


class AccountingLog:
    """Appends records to `<folder>/usage.jsonl` (or `<folder>/<name>`)."""

    def __init__(self, folder: str | Path, name: str = FILE_NAME):
        self.path = Path(folder) / name
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
                r = loads_line(raw)
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
    tokens: Counter = field(default_factory=Counter)

    def add(self, r: dict) -> None:
        self.device_seconds += float(r["device_s"])
        self.ops += 1
        self.failed += 0 if r.get("ok", True) else 1
        if r.get("session"):
            self.sessions.add(str(r["session"]))
        toks = r.get("tokens")
        if isinstance(toks, dict):
            for k in TOKEN_KINDS:
                v = toks.get(k)
                if type(v) is int and v > 0:
                    self.tokens[k] += v

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
            "tokens": {k: self.tokens[k] for k in TOKEN_KINDS},
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


def table(summary: Summary, by: str = "tenant", prices: Prices | None = None) -> Iterator[str]:
    """Plain-text rows: one per tenant (or per tenant and session / kind) and a total, with a
    cost column when `prices` is given."""
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
    cols: tuple[str, ...] = ("sessions", "ops", "failed", "device_s", "GPU-minutes", *TOKEN_KINDS)
    cols += ("cost_usd",) if prices is not None else ()
    fmt_keys = "  ".join(f"{{:<{w}}}" for w in width)
    yield fmt_keys.format(*heads) + "  " + "  ".join(f"{c:>12}" for c in cols)
    total = Totals()
    for k, v in rows:
        total.device_seconds += v.device_seconds
        total.ops += v.ops
        total.failed += v.failed
        total.tokens += v.tokens
        total.sessions |= {f"{k[0]}/{s}" for s in v.sessions}
        yield fmt_keys.format(*k) + "  " + _cells(v, prices)
    yield fmt_keys.format("total", *[""] * (len(heads) - 1)) + "  " + _cells(total, prices)


def _cells(v: Totals, prices: Prices | None = None) -> str:
    cost = f"  {prices.cost(v.device_seconds, dict(v.tokens)):>12.6f}" if prices else ""
    toks = "  ".join(f"{v.tokens[k]:>12}" for k in TOKEN_KINDS)
    return (
        f"{len(v.sessions):>12}  {v.ops:>12}  {v.failed:>12}  "
        f"{v.device_seconds:>12.3f}  {v.gpu_minutes:>12.4f}  {toks}{cost}"
    )


class UsageIndex:
    """Each tenant's usage records in time order, read once from the log and then kept up
    to date by `add` (the scheduler calls it with every record it writes)."""

    def __init__(self, path: str | Path | None = None):
        self._lock = threading.Lock()
        self._ts: defaultdict[str, list[float]] = defaultdict(list)
        self._records: defaultdict[str, list[dict]] = defaultdict(list)
        self.damaged = 0
        if path is not None and Path(path).is_file():
            records, self.damaged = read_records(path)
            for r in sorted(records, key=lambda r: float(r["ts"])):
                self.add(r)

    def add(self, r: dict) -> None:
        ts = float(r["ts"])
        with self._lock:
            tss, recs = self._ts[r["tenant"]], self._records[r["tenant"]]
            i = len(tss) if not tss or tss[-1] <= ts else bisect_left(tss, ts)
            tss.insert(i, ts)
            recs.insert(i, r)

    def records(
        self, tenant: str, since: float | None = None, until: float | None = None
    ) -> list[dict]:
        with self._lock:
            tss, recs = self._ts.get(tenant, []), self._records.get(tenant, [])
            lo = bisect_left(tss, since) if since is not None else 0
            hi = bisect_left(tss, until) if until is not None else len(tss)
            return recs[lo:hi]


def billing_events(
    records: list[dict], prices: Prices, base_model: str
) -> dict[str, Any]:  # fmt: skip
    """`get_billing_usage`'s answer: one event per UTC day, session and token kind (the
    SDK's event types), priced from `prices`, and the GPU-seconds of the same records."""
    import datetime as dt

    kinds = {"trained": "training", "prefill": "sampling_prefill", "sampled": "sampling_sample"}
    buckets: defaultdict[tuple[str, str, str], Totals] = defaultdict(Totals)
    for r in records:  # records before bases were recorded ("base" absent): `base_model`
        day = dt.datetime.fromtimestamp(float(r["ts"]), dt.UTC).date().isoformat()
        buckets[(day, str(r.get("session")), str(r.get("base") or base_model))].add(r)
    data, gpu = [], Totals()
    for (day, session, base), t in sorted(buckets.items()):
        gpu.device_seconds += t.device_seconds
        start = dt.datetime.fromisoformat(day).replace(tzinfo=dt.UTC)
        for k, n in t.tokens.items():
            info: dict[str, Any] = {"type": kinds[k], "token_count": n}
            if k == "prefill":
                info["cached"] = False
            rate = prices.usd_per_million_tokens.get(k)
            data.append(
                {
                    "bucket_start": start.isoformat(),
                    "bucket_end": (start + dt.timedelta(days=1)).isoformat(),
                    "base_model": base,
                    "session_id": session,
                    "estimated_cost_usd": rate * n / 1e6 if rate is not None else None,
                    "effective_rate_usd_per_million_tokens": rate,
                    "event_info": info,
                }
            )
    return {
        "data": data,
        "device_seconds": gpu.device_seconds,
        "gpu_minutes": gpu.gpu_minutes,
        "gpu_estimated_cost_usd": prices.usd_per_gpu_hour * gpu.device_seconds / 3600.0,
    }
