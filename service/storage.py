"""Checkpoint folders, one tree per tenant, addressed by the SDK's tinker:// paths.

    tinker://<model_id>/weights/<name>          training state (adapter + optimizer)
    tinker://<model_id>/sampler_weights/<name>  adapter weights for sampling

on disk:

    <storage>/usage.jsonl                                   accounting (service/accounting.py)
    <storage>/tenants/<tenant>/<model_id>/run.json          the training run (base, LoRA, metadata)
    <storage>/tenants/<tenant>/<model_id>/<weights|sampler_weights>/<name>/meta.json + files

A tinker:// path is resolved inside the caller's tenant folder only, so another tenant's
path is "not found" exactly like a path that never existed. Names and model ids come from
clients, so each is checked against a strict pattern (no `/`, no `..`, no leading dot) and the
resolved folder must lie under the tenant's root. A save writes into a hidden temporary
folder, writes a manifest (size and CRC32 of every file but meta.json), fsyncs, then renames it
into place (core.atomic), so a crash or SIGTERM mid-save leaves either the old checkpoint or
the new one, never half of one; every load verifies the files against the manifest
(`meta(ref, verify=True)`), sampler weights included. The weights are a PEFT LoRA folder
(`adapter_model.safetensors` + `adapter_config.json`, posttrain/lora.py's format). A checkpoint whose `meta.json` is damaged
is reported as damaged (listing shows it apart, loading it fails naming it) and hides nothing
else. Client-facing messages name tinker:// paths, never server folders.
"""

from __future__ import annotations

import json
import re
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core import jsonio
from core.atomic import (
    check_folder,
    folder_crcs,
    fsync_files,
    move_aside,
    publish_folder,
    write_json_atomic,
    write_manifest,
)
from posttrain.lora import PEFT_CONFIG, PEFT_WEIGHTS, ROUTED_EXPERTS_WEIGHTS
from service.errors import ServiceError, bad_request, not_found

KINDS = {"weights": "training", "sampler_weights": "sampler"}
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}\Z")
_MODEL_ID = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.:\-]{0,127}\Z")
RUN_FILE = "run.json"
_ATTN = {"q_proj", "k_proj", "v_proj", "o_proj"}
_MLP = {"gate_proj", "up_proj", "down_proj"}
META = "meta.json"


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

    @property
    def checkpoint_id(self) -> str:
        return f"{self.kind}/{self.name}"


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


def checkpoint_ref(
    model_id: str, checkpoint_id: str, field: str = "checkpoint_id"
) -> CheckpointRef:
    """(run id, "weights/<name>") as the SDK's REST routes send them."""
    kind, _, name = checkpoint_id.partition("/")
    if kind not in KINDS:
        raise bad_request(
            field, f"expected weights/<name> or sampler_weights/<name>, got {checkpoint_id!r}"
        )
    return CheckpointRef(check_model_id(model_id), kind, check_name(name, field))


def check_meta(meta: Any) -> dict[str, Any]:
    """meta.json as written by `save`, or ValueError saying what is wrong."""
    if not isinstance(meta, dict):
        raise ValueError("not a JSON object")
    for k in ("base_model", "lora", "created_at", "tinker_path"):
        if k not in meta:
            raise ValueError(f"no {k!r}")
    lora = meta["lora"]
    if not isinstance(lora, dict) or not isinstance(lora.get("rank"), int):
        raise ValueError("'lora' has no integer rank")
    if not isinstance(meta["created_at"], int | float):
        raise ValueError("'created_at' is not a number")
    return meta


def _read_json(path: Path) -> Any:
    return jsonio.loads(path.read_bytes())  # a nesting bomb: ValueError, not RecursionError


class Storage:
    """The storage root: one `CheckpointStore` per tenant, and the accounting log's folder."""

    def __init__(self, root: str | Path):
        self.root = Path(root).resolve()
        (self.root / "tenants").mkdir(parents=True, exist_ok=True)

    def tenant(self, name: str) -> CheckpointStore:
        return CheckpointStore(self.root / "tenants" / name, create=False)


class CheckpointStore:
    """One tenant's checkpoints (or, in tests, any folder)."""

    def __init__(self, root: str | Path, *, create: bool = True):
        self.root = Path(root).resolve()
        if create:
            self.root.mkdir(parents=True, exist_ok=True)

    def folder(self, ref: CheckpointRef) -> Path:
        p = (self.root / ref.model_id / ref.kind / ref.name).resolve()
        # Belt and braces: the patterns above already exclude separators and '..'.
        if not p.is_relative_to(self.root):
            raise bad_request("path", "checkpoint path escapes the storage folder")
        return p

    def run_folder(self, model_id: str) -> Path:
        p = (self.root / check_model_id(model_id)).resolve()
        if not p.is_relative_to(self.root):
            raise bad_request("model_id", "run path escapes the storage folder")
        return p

    def exists(self, ref: CheckpointRef) -> bool:
        return (self.folder(ref) / "meta.json").is_file()

    def meta(self, ref: CheckpointRef, *, verify: bool = False) -> dict[str, Any]:
        """The checkpoint's meta.json: 404 if missing (or expired), 422 if damaged. With
        `verify` (every load: training state and sampler weights alike) its files are also
        checked against the manifest (sizes, CRC32s): a damaged one is a 422 naming it,
        never loaded (and never replaced by the base model)."""
        f = self.folder(ref) / "meta.json"
        if not f.is_file():
            raise not_found(f"checkpoint {ref.tinker_path}")
        try:
            meta = check_meta(_read_json(f))
        except (ValueError, OSError) as e:
            raise ServiceError(
                422,
                f"checkpoint {ref.tinker_path} is damaged (meta.json: {_why(e)}); "
                "delete it or save it again",
            ) from None
        expires = meta.get("expires_at")
        if isinstance(expires, int | float) and expires < time.time():
            raise not_found(f"checkpoint {ref.tinker_path} (it has expired)")
        if verify:
            problems = check_folder(self.folder(ref))
            if problems:  # names files inside the checkpoint only, never the server's path
                raise ServiceError(
                    422,
                    f"checkpoint {ref.tinker_path} is damaged ({'; '.join(problems)}); "
                    "delete it or save it again",
                )
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
            (tmp / META).write_text(json.dumps(meta, indent=1))
            # One manifest (size, CRC32) over every file but meta.json (set_ttl rewrites
            # it): `verify` refuses a checkpoint whose weights no longer match it.
            write_manifest(tmp, folder_crcs(tmp, skip=[META]), skip=[META])
            fsync_files(tmp)
            publish_folder(tmp, final)  # an existing one (overwrite) goes only once replaced
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        return ref.tinker_path

    def import_peft(
        self, ref: CheckpointRef, source: str | Path, *, base_model: str, seed: int | None = None
    ) -> str:
        """Copy a PEFT LoRA folder (an [[adapters]] job's export, a folder from peft) into
        this tenant's tree as training checkpoint `ref` (weights/<name>, no optimizer state),
        committed like a save; the SDK's `create_training_client_from_state` then starts from
        it. The adapter's shape comes from its adapter_config.json (r; target modules by their
        HF names: q/k/v/o_proj train attention, gate/up/down_proj the MLP, lm_head the
        unembedding). Whether the tensors fit the served model is checked when it loads."""
        src = Path(source)
        try:
            cfg = _read_json(src / PEFT_CONFIG)
            targets = set(cfg.get("target_modules") or [])
            rank = cfg["r"]
            if not isinstance(rank, int) or not (src / PEFT_WEIGHTS).is_file():
                raise ValueError(f"needs an integer 'r' and {PEFT_WEIGHTS}")
        except (OSError, ValueError, KeyError, AttributeError) as e:
            raise bad_request("path", f"not a PEFT LoRA folder ({_why(e)})") from None
        lora = {"rank": rank, "seed": seed, "train_attn": bool(targets & _ATTN),
                "train_mlp": bool(targets & _MLP), "train_unembed": "lm_head" in targets}  # fmt: skip

        def write(tmp: Path) -> None:
            for n in (PEFT_WEIGHTS, PEFT_CONFIG):
                shutil.copyfile(src / n, tmp / n)
            if (src / ROUTED_EXPERTS_WEIGHTS).is_file():  # an MoE export's routed-expert pairs
                shutil.copyfile(src / ROUTED_EXPERTS_WEIGHTS, tmp / ROUTED_EXPERTS_WEIGHTS)

        meta = {"base_model": base_model, "lora": lora, "imported": True}
        return self.save(ref, write, meta)

    def delete(self, ref: CheckpointRef) -> None:
        """Remove a checkpoint (moved aside atomically, then deleted); 404 if missing."""
        final = self.folder(ref)
        if not final.is_dir():
            raise not_found(f"checkpoint {ref.tinker_path}")
        gone = final.parent / f".del-{ref.name}-{uuid.uuid4().hex[:8]}"
        move_aside(final, gone)
        shutil.rmtree(gone, ignore_errors=True)

    def set_ttl(self, ref: CheckpointRef, ttl_seconds: int | None) -> None:
        """Expire the checkpoint `ttl_seconds` from now (None: never); meta.json rewritten
        atomically."""
        meta = self.meta(ref)
        meta["expires_at"] = time.time() + ttl_seconds if ttl_seconds else None
        write_json_atomic(self.folder(ref) / "meta.json", meta)

    # --- training runs ----------------------------------------------------------------------

    def write_run(self, model_id: str, info: dict[str, Any]) -> None:
        d = self.run_folder(model_id)
        d.mkdir(parents=True, exist_ok=True)
        write_json_atomic(d / RUN_FILE, info)

    def run(self, model_id: str) -> dict[str, Any] | None:
        """run.json of a stored run ({} when the folder exists without a readable one);
        None when this tenant has no such run."""
        d = self.run_folder(model_id)
        if not d.is_dir():
            return None
        try:
            info = _read_json(d / RUN_FILE)
            return info if isinstance(info, dict) else {}
        except (ValueError, OSError):
            return {}

    def run_ids(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.iterdir() if p.is_dir() and _MODEL_ID.match(p.name))

    def list(self, model_id: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """(checkpoints, damaged) of one run, oldest first. A checkpoint whose meta.json
        cannot be read is listed in `damaged` (checkpoint_id, tinker_path, problem) only."""
        out, damaged = [], []
        base = self.run_folder(model_id)
        for kind in KINDS:
            d = base / kind
            if not d.is_dir():
                continue
            for c in sorted(d.iterdir()):
                if c.name.startswith(".") or not c.is_dir():
                    continue
                ref = CheckpointRef(model_id, kind, c.name)
                try:
                    meta = check_meta(_read_json(c / "meta.json"))
                except (ValueError, OSError) as e:
                    damaged.append(
                        {
                            "checkpoint_id": ref.checkpoint_id,
                            "tinker_path": ref.tinker_path,
                            "problem": f"meta.json: {_why(e)}",
                        }
                    )
                    continue
                size = sum(f.stat().st_size for f in c.iterdir() if f.is_file())
                expires = meta.get("expires_at")
                if isinstance(expires, int | float) and expires < time.time():
                    continue
                out.append(
                    {
                        "checkpoint_id": ref.checkpoint_id,
                        "checkpoint_type": KINDS[kind],
                        "time": meta["created_at"],
                        "tinker_path": ref.tinker_path,
                        "size_bytes": size,
                        "public": False,
                        "user_metadata": meta.get("user_metadata"),
                        "expires_at": expires,
                        "training_run_id": model_id,
                    }
                )
        out.sort(key=lambda c: c["time"])
        return out, damaged


def _why(e: Exception) -> str:
    if isinstance(e, OSError):
        return e.strerror or type(e).__name__
    if isinstance(e, json.JSONDecodeError):
        return f"not JSON ({e.msg} at byte {e.pos})"
    return str(e)
