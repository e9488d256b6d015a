"""The tinker SDK's surface beyond training and sampling: publishing, copies, audit, storage
usage and quota, session search/projects/trace export, and the one answer for everything
this service does not serve.

Semantics (docs/service.md, "The whole SDK surface"):
- publish / unpublish: only the owner; a published checkpoint is *readable* by every tenant
  of this service by its `tinker://` path (load it, sample it, read its weights info, copy
  it), never writable (delete, TTL, publish stay the owner's). Unpublishing revokes at once.
  The index is `<storage>/published.json` (tinker path -> owner), rewritten atomically.
- copy_weights: a new run `c-<32 hex>` of the caller holding a byte copy of the checkpoint
  (the caller's own, or a published one); it cannot be trained on. Counts against the
  caller's storage quota.
- audit log: per tenant, the security-relevant actions: each key's first use per process
  (by fingerprint, never the key), checkpoints of the tenant read by another tenant,
  publish/unpublish, deletions, copies. `<storage>/audit.jsonl` (mode 0600), one record a
  line, written like the accounting log; the whole file is read once at start.
- storage usage: the bytes and checkpoints under the tenant's folder, against
  `Limits.storage_quota_bytes` (a save or copy beyond it is refused with 413 naming the
  quota before it runs).
- Unserved requests (`unserved`): a 400 naming the SDK method and "not supported by this
  service". A training request among them (save_weights_external) still takes its seq_id
  place, through the same path as any other refused training request.
"""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import json
import os
import secrets
import shutil
import threading
import time
from collections import defaultdict, deque
from pathlib import Path
from typing import Any

from pydantic import Field

from core.jsonio import loads_line
from data.store import write_json_atomic
from service import wire
from service.accounting import AccountingLog
from service.errors import ServiceError, bad_request
from service.storage import CheckpointRef, CheckpointStore

AUDIT_FILE = "audit.jsonl"
PUBLISHED_FILE = "published.json"
AUDIT_KEEP = 10_000  # entries kept in memory per tenant (the file keeps all)

# The routes of SDK methods this service does not serve, and why (path prefix after /api/v1/).
UNSERVED: dict[str, tuple[str, str]] = {
    "save_weights_external": (
        "TrainingClient.save_weights_external",
        "no external-weights bucket; save_weights_for_sampler writes the adapter",
    ),
    "create_custom_loss": (
        "TrainingClient.forward_backward_custom (server-side)",
        "custom losses run client-side here (client config custom_loss_server_side=false)",
    ),
    "auth/": ("auth", "this service authenticates plain API keys only (X-API-Key)"),
    "retrieve_futures": ("retrieve_futures", "poll futures one by one (retrieve_future)"),
}
EXTERNAL_URLS = (
    "RestClient.get_external_weights_urls",
    "no object store behind this service: read checkpoints through the SDK",
)


def unserved(method: str, path: str) -> ServiceError:
    """The refusal of a route this service does not serve: 400 naming the SDK method (4xx,
    so the SDK fails the call at once instead of retrying as it does 5xx)."""
    rest = path.removeprefix("/api/v1/")
    name, why = f"{method} {path}", "no such route"
    if rest.endswith("/external_weights_urls"):
        name, why = EXTERNAL_URLS
    for prefix, (n, w) in UNSERVED.items():
        if rest == prefix or (prefix.endswith("/") and rest.startswith(prefix)):
            name, why = n, w
    return ServiceError(400, f"{name}: not supported by this service ({why})")


def folder_usage(folder: Path) -> tuple[int, int]:
    """(checkpoints, bytes) under a tenant's folder (checkpoint = a folder with meta.json)."""
    count = size = 0
    if not folder.is_dir():
        return 0, 0
    for dirpath, _dirs, files in os.walk(folder):
        if "meta.json" in files and not os.path.basename(dirpath).startswith("."):
            count += 1
        for f in files:
            with contextlib.suppress(OSError):
                size += os.lstat(os.path.join(dirpath, f)).st_size
    return count, size


class Published:
    """tinker path -> owning tenant, for checkpoints their owners published."""

    def __init__(self, root: Path):
        self.path = root / PUBLISHED_FILE
        self._lock = threading.Lock()
        try:
            raw = json.loads(self.path.read_bytes())
            self._owner: dict[str, str] = {
                str(k): str(v) for k, v in raw.items() if isinstance(raw, dict)
            }
        except (OSError, ValueError, AttributeError):
            self._owner = {}

    def owner(self, tinker_path: str) -> str | None:
        with self._lock:
            return self._owner.get(tinker_path)

    def set(self, tinker_path: str, owner: str | None) -> bool:
        """Publish (owner) or revoke (None); True when that changed anything."""
        with self._lock:
            before = self._owner.get(tinker_path)
            if owner is None:
                self._owner.pop(tinker_path, None)
            else:
                self._owner[tinker_path] = owner
            if before != owner:
                write_json_atomic(self.path, dict(self._owner))
            return before != owner


class AuditLog:
    """The tenants' security-relevant actions: appended to `<storage>/audit.jsonl`, and the
    last `AUDIT_KEEP` per tenant kept in memory for `GET /api/v1/audit`."""

    def __init__(self, root: Path):
        self._lock = threading.Lock()
        self._by_tenant: defaultdict[str, deque[dict[str, Any]]] = defaultdict(
            lambda: deque(maxlen=AUDIT_KEEP)
        )
        path = root / AUDIT_FILE
        if path.is_file():
            with open(path, "rb") as f:
                for raw in f:
                    with contextlib.suppress(ValueError, KeyError, TypeError):
                        r = loads_line(raw)
                        self._by_tenant[str(r["tenant"])].append(r)
        self._log = AccountingLog(root, AUDIT_FILE)
        self._keys_seen: set[tuple[str, str]] = set()

    def add(self, tenant: str, event: str, **details: Any) -> None:
        r = {"ts": time.time(), "tenant": tenant, "event": event, "details": details}
        with self._lock:
            self._by_tenant[tenant].append(r)
        self._log.write(r)

    def key_used(self, tenant: str, fingerprint: str) -> None:
        """A key's first request since the service started (by fingerprint only)."""
        with self._lock:
            if (tenant, fingerprint) in self._keys_seen:
                return
            self._keys_seen.add((tenant, fingerprint))
        self.add(tenant, "api_key_used", key_fingerprint=fingerprint)

    def entries(self, tenant: str, event_type: str, day: str | None) -> list[dict[str, Any]]:
        if event_type not in ("all", "checkpoints"):
            return []  # no projects, teams or organizations here: nothing of theirs to log
        with self._lock:
            records = list(self._by_tenant.get(tenant, ()))
        out = []
        for r in records:
            ts = dt.datetime.fromtimestamp(float(r["ts"]), dt.UTC)
            if day is not None and ts.date().isoformat() != day:
                continue
            if event_type == "checkpoints" and not str(r["event"]).startswith("checkpoint"):
                continue
            details = r.get("details") or {}
            out.append(
                {
                    "timestamp": ts.isoformat(),
                    "event": r["event"],
                    "event_details": details,
                    "tinker_path": details.get("tinker_path"),
                }
            )
        return out

    def close(self) -> None:
        self._log.close()


def copy_checkpoint(
    src: CheckpointStore, ref: CheckpointRef, dst: CheckpointStore, meta: dict[str, Any],
    ttl_seconds: int | None,
) -> str:  # fmt: skip
    """Copy `ref` from `src` into a new run of `dst` (atomically, like any save); returns the
    copy's tinker path."""
    run = f"c-{secrets.token_hex(16)}"
    new = CheckpointRef(run, ref.kind, ref.name)
    folder = src.folder(ref)

    def write(tmp: Path) -> None:
        for f in folder.iterdir():
            if f.is_file() and f.name != "meta.json":
                shutil.copyfile(f, tmp / f.name)

    keep = {k: v for k, v in meta.items() if k not in ("tinker_path", "created_at", "expires_at")}
    path = dst.save(new, write, {**keep, "copied_from": ref.tinker_path}, ttl_seconds=ttl_seconds)
    dst.write_run(
        run,
        {
            "training_run_id": run,
            "base_model": meta["base_model"],
            "lora": meta["lora"],
            "user_metadata": meta.get("user_metadata"),
            "created_at": time.time(),
            "copied_from": ref.tinker_path,
            "trainable": False,
        },
    )
    return path


def trace_url(session_id: str, ops: list[dict[str, Any]]) -> str:
    """The session's ops as a Chrome trace-event JSON (Perfetto opens it), in a `data:` URL:
    the SDK hands back a URL to download without auth headers, and urllib reads data: URLs."""
    events = [
        {
            "name": o["kind"],
            "cat": "ok" if o["ok"] else "failed",
            "ph": "X",
            "ts": o["start"] * 1e6,
            "dur": o["wall_s"] * 1e6,
            "pid": 1,
            "tid": 1,
            "args": {k: o[k] for k in ("seq_id", "model", "wait_s") if k in o},
        }
        for o in ops
    ]
    doc = {"traceEvents": events, "otherData": {"session_id": session_id}}
    return "data:application/json;base64," + base64.b64encode(json.dumps(doc).encode()).decode()


def check_day(day: str | None) -> str | None:
    if day is None:
        return None
    try:
        return dt.date.fromisoformat(day).isoformat()
    except ValueError:
        raise bad_request("day", f"expected an ISO date (2025-01-31), got {day!r}") from None


def micros(ts: float) -> int:
    """Unix microseconds: what an ISO time in a search cursor keeps of a session's start."""
    return round(ts * 1e6)


def iso(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.UTC).isoformat()


# --- request bodies of these routes (SDK field names; unknown fields ignored like wire's) ---


class CopyWeightsBody(wire._Body):
    source_path: str = Field(max_length=512)
    destination_project_id: str | None = Field(default=None, max_length=128)
    ttl_seconds: int | None = Field(default=None, ge=1, lt=2**40)


class ProjectBody(wire._Body):
    project_id: str = Field(max_length=128)


class Cursor(wire._Body):
    last_created_at: dt.datetime
    last_session_id: str = Field(max_length=128)


class SessionSearchBody(wire._Body):
    session_id: str | None = Field(default=None, max_length=128)
    project_ids: list[str] | None = Field(default=None, max_length=100)
    user_metadata: dict[str, str] = Field(default_factory=dict, max_length=64)
    display_name: str | None = Field(default=None, min_length=1, max_length=256)
    statuses: list[dict[str, Any]] | None = Field(default=None, min_length=1, max_length=8)
    limit: int = Field(default=50, ge=1, le=200)
    cursor: Cursor | None = None

    def cursor_key(self) -> tuple[int, str] | None:
        c = self.cursor
        if c is None:
            return None
        at = c.last_created_at
        if at.tzinfo is None:
            at = at.replace(tzinfo=dt.UTC)
        return micros(at.timestamp()), c.last_session_id

    def status_types(self) -> set[str] | None:
        return None if self.statuses is None else {str(q.get("type")) for q in self.statuses}
