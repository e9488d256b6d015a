"""Checkpoint folders under one storage root, addressed by the SDK's tinker:// paths.

    tinker://<model_id>/weights/<name>          training state (adapter + optimizer)
    tinker://<model_id>/sampler_weights/<name>  adapter weights for sampling

on disk `<root>/<model_id>/<weights|sampler_weights>/<name>/` with a `meta.json`. Names and
model ids come from clients, so each is checked against a strict pattern (no `/`, no `..`,
no leading dot) and the resolved folder must lie under the root: a name can never address
anything outside it. A save writes into a hidden temporary folder, fsyncs, then renames it
into place, so a crash or SIGTERM mid-save leaves either the old checkpoint or the new one,
never half of one; a checkpoint whose future reported success is on disk.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service.errors import ServiceError, bad_request

KINDS = {"weights": "training", "sampler_weights": "sampler"}
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}$")
_MODEL_ID = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.:\-]{0,127}$")


def check_name(name: str, field: str = "path") -> str:
    if not _NAME.match(name) or ".." in name:
        raise bad_request(
            field,
            f"invalid checkpoint name {name!r}: use 1-128 letters, digits, '_', '-', '.' "
            "(no '/', no '..', not starting with '.')",
        )
    return name


def check_model_id(model_id: str, field: str = "model_id") -> str:
    if not _MODEL_ID.match(model_id) or ".." in model_id:
        raise bad_request(field, f"invalid model id {model_id!r}")
    return model_id


@dataclass(frozen=True)
class CheckpointRef:
    model_id: str
    kind: str  # "weights" or "sampler_weights"
    name: str

    @property
    def tinker_path(self) -> str:
        return f"tinker://{self.model_id}/{self.kind}/{self.name}"


def parse_tinker_path(path: str, field: str = "path") -> CheckpointRef:
    if not path.startswith("tinker://"):
        raise bad_request(field, f"expected tinker://<model_id>/weights/<name>, got {path!r}")
    parts = path[len("tinker://") :].split("/")
    if len(parts) != 3 or parts[1] not in KINDS:
        raise bad_request(
            field, f"expected tinker://<model_id>/<weights|sampler_weights>/<name>, got {path!r}"
        )
    model_id, kind, name = parts
    return CheckpointRef(check_model_id(model_id, field), kind, check_name(name, field))


class CheckpointStore:
    def __init__(self, root: str | Path):
        self.root = Path(root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)

    def folder(self, ref: CheckpointRef) -> Path:
        p = (self.root / ref.model_id / ref.kind / ref.name).resolve()
        # Belt and braces: the patterns above already exclude separators and '..'.
        if not p.is_relative_to(self.root):
            raise bad_request("path", "checkpoint path escapes the storage folder")
        return p

    def exists(self, ref: CheckpointRef) -> bool:
        return (self.folder(ref) / "meta.json").is_file()

    def meta(self, ref: CheckpointRef) -> dict[str, Any]:
        f = self.folder(ref) / "meta.json"
        if not f.is_file():
            raise ServiceError(404, f"checkpoint {ref.tinker_path} not found")
        meta = json.loads(f.read_text())
        expires = meta.get("expires_at")
        if expires is not None and expires < time.time():
            raise ServiceError(404, f"checkpoint {ref.tinker_path} has expired")
        return meta

    def save(
        self,
        ref: CheckpointRef,
        write: Callable[[Path], None],
        meta: dict[str, Any],
        *,
        overwrite: bool = False,
        ttl_seconds: int | None = None,
    ) -> str:
        """Run `write(tmp_folder)`, add meta.json, fsync, and rename into place atomically."""
        final = self.folder(ref)
        if final.exists() and not overwrite:
            raise ServiceError(
                409, f"checkpoint {ref.tinker_path} exists (pass overwrite=True to replace it)"
            )
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.parent / f".tmp-{ref.name}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            write(tmp)
            now = time.time()
            meta = {
                **meta,
                "tinker_path": ref.tinker_path,
                "created_at": now,
                "expires_at": now + ttl_seconds if ttl_seconds else None,
            }
            (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
            for f in tmp.iterdir():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
            if final.exists():  # overwrite: move the old one aside first, then drop it
                old = final.parent / f".old-{ref.name}-{uuid.uuid4().hex[:8]}"
                os.replace(final, old)
                os.replace(tmp, final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, final)
            dfd = os.open(final.parent, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        return ref.tinker_path

    def list(self, model_id: str) -> list[dict[str, Any]]:
        out = []
        base = self.root / model_id
        for kind in KINDS:
            d = base / kind
            if not d.is_dir():
                continue
            for c in sorted(d.iterdir()):
                if c.name.startswith(".") or not (c / "meta.json").is_file():
                    continue
                meta = json.loads((c / "meta.json").read_text())
                size = sum(f.stat().st_size for f in c.iterdir() if f.is_file())
                out.append(
                    {
                        "checkpoint_id": f"{kind}/{c.name}",
                        "checkpoint_type": KINDS[kind],
                        "time": meta["created_at"],
                        "tinker_path": meta["tinker_path"],
                        "size_bytes": size,
                        "user_metadata": meta.get("user_metadata"),
                        "expires_at": meta.get("expires_at"),
                    }
                )
        return out
