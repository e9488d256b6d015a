"""Atomic commits on disk: the one module that renames a file or folder into place.

Every writer of durable state (DCP checkpoints and HF exports in runtime/checkpoint.py, the
service's checkpoint storage, prepared token stores and their packing plans, tokenizers,
metrics' run ids, tool reports) writes beside its destination and publishes here, so there is
one implementation of each step to get right:

- `write_bytes_atomic` / `write_text_atomic` / `write_json_atomic`: a file written to
  `<name>.tmp<pid>`, flushed, fsynced and renamed over `<name>` (a reader sees the old file
  or the new one, never a torn one).
- `publish_file(tmp, path)`: the same for a file a library streamed into `tmp`.
- `publish_folder(tmp, final)`: fsync the folder's files, one rename(2) of `tmp` to `final`
  (atomic on a POSIX file system), fsync of the parent. `replace=True` moves an existing
  `final` aside first and deletes it only once the new one is in place; `replace=False`
  fails if `final` exists (a concurrent writer won the race).
- `move_aside(path, dest)`: rename for deletion or for keeping a damaged folder apart.
- The manifest (`manifest.json`): size and CRC32 of every file of a folder
  (`write_manifest`), checked by `verify_manifest` (missing, wrong size, wrong CRC32).
  `crc32_file` is the one file checksum (zlib's CRC32, about 1 GB/s per core).

Local (POSIX) paths only; remote folders keep torchtitan's behaviour (runtime/checkpoint.py).
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from core import jsonio

MANIFEST = "manifest.json"
_CHUNK = 8 * 2**20
PathLike = str | os.PathLike[str]


def crc32_file(path: PathLike) -> int:
    """CRC32 (zlib) of the file's bytes."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def fsync_path(path: PathLike) -> None:
    """fsync a file or a folder (a folder's fsync makes the renames inside it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _tmp_name(path: Path) -> Path:
    return path.with_name(f"{path.name}.tmp{os.getpid()}")


def write_bytes_atomic(path: PathLike, data: bytes) -> None:
    """Write `data` to `path` atomically (tmp file, fsync, rename)."""
    p = Path(path)
    tmp = _tmp_name(p)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text_atomic(path: PathLike, text: str) -> None:
    write_bytes_atomic(path, text.encode())


def write_json_atomic(path: PathLike, obj: Any, *, indent: int | None = 1) -> None:
    write_bytes_atomic(path, json.dumps(obj, indent=indent).encode())


def publish_file(tmp: PathLike, path: PathLike) -> None:
    """fsync `tmp` (written by a library that streams into it) and rename it over `path`."""
    fsync_path(tmp)
    os.replace(tmp, path)


def fsync_files(folder: PathLike) -> None:
    """fsync every plain file directly inside `folder`, then the folder itself."""
    for f in Path(folder).iterdir():
        if f.is_file():
            fsync_path(f)
    fsync_path(folder)


def publish_folder(tmp: PathLike, final: PathLike, *, replace: bool = True) -> None:
    """Rename the finished folder `tmp` to `final` (one rename(2)), then fsync the parent.

    `replace=True`: an existing `final` is renamed to a hidden sibling first and removed only
    after the new one is in place (a crash in between leaves the new one or the old one).
    `replace=False`: OSError if `final` exists (a writer that lost a race keeps its tmp for
    the caller to remove)."""
    tmp, final = Path(tmp), Path(final)
    old = None
    if final.exists():
        if not replace:
            raise FileExistsError(17, "destination exists", str(final))
        old = final.with_name(f".replaced-{final.name}-{uuid.uuid4().hex[:8]}")
        os.replace(final, old)
    os.replace(tmp, final)  # POSIX: fails if `final` reappeared as a non-empty folder
    fsync_path(final.parent if str(final.parent) else Path("."))
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def move_aside(path: PathLike, dest: PathLike) -> None:
    """Rename `path` to `dest` (a damaged checkpoint kept apart, a folder about to be deleted)."""
    os.replace(path, dest)


def _manifest_files(folder: Path, skip: Iterable[str]) -> list[str]:
    skipped = {MANIFEST, *skip}
    return sorted(n.name for n in folder.iterdir() if n.is_file() and n.name not in skipped)


def folder_crcs(folder: PathLike, *, skip: Iterable[str] = ()) -> dict[str, int]:
    """CRC32 of every plain file directly inside `folder` except the manifest and `skip`."""
    return {n: crc32_file(Path(folder) / n) for n in _manifest_files(Path(folder), skip)}


def write_manifest(
    folder: PathLike, crcs: dict[str, int], *, skip: Iterable[str] = (), **fields: Any
) -> None:
    """Write `manifest.json` in `folder`: every plain file's size and (where `crcs` has it)
    CRC32, plus `fields` (e.g. the step). Files named in `skip` are left out (a file the
    owner rewrites in place, such as the service's meta.json)."""
    f = Path(folder)
    files = {
        n: {"size": (f / n).stat().st_size, "crc32": crcs.get(n)} for n in _manifest_files(f, skip)
    }
    write_json_atomic(f / MANIFEST, {**fields, "written": time.time(), "files": files})


def read_manifest(folder: PathLike) -> dict[str, Any] | None:
    """The manifest's `files` record (None when the folder has none); ValueError when it
    exists but cannot be read."""
    p = Path(folder) / MANIFEST
    if not p.exists():
        return None
    try:
        files = jsonio.loads(p.read_bytes())["files"]
        if not isinstance(files, dict):
            raise TypeError("'files' is not an object")
        return files
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{MANIFEST} is unreadable: {e}") from None


def verify_manifest(
    folder: PathLike,
    files: dict[str, Any],
    *,
    checksums: bool = True,
    share: tuple[int, int] = (0, 1),
    reported: Iterable[str] = (),
) -> list[str]:
    """Problems of `folder` against its manifest's `files` (see `read_manifest`): each
    listed file present, of the recorded size and (with `checksums`) CRC32. `share=(i, n)`
    checksums only every n-th file from i (n ranks split the reading); files in `reported`
    already have a problem and are skipped. Names in the problems are relative."""
    problems: list[str] = []
    skip = set(reported)
    for i, (rel, rec) in enumerate(sorted(files.items())):
        if rel in skip:
            continue
        fp = Path(folder) / rel
        if not fp.is_file():
            problems.append(f"{rel} is missing")
            continue
        size = fp.stat().st_size
        want = rec.get("size") if isinstance(rec, dict) else None
        if size != want:
            problems.append(f"{rel} has {size} bytes, the manifest says {want}")
            continue
        crc = rec.get("crc32")
        if checksums and crc is not None and i % share[1] == share[0]:
            got = crc32_file(fp)
            if got != crc:
                problems.append(f"{rel} is corrupted (CRC32 {got:08x}, expected {crc:08x})")
    return problems


def check_folder(folder: PathLike, *, checksums: bool = True) -> list[str]:
    """Problems of a folder committed with a manifest ([] = intact); a missing manifest is
    a problem here (use `read_manifest` + `verify_manifest` where it is optional)."""
    try:
        files = read_manifest(folder)
    except ValueError as e:
        return [str(e)]
    if files is None:
        return [f"{MANIFEST} is missing"]
    return verify_manifest(folder, files, checksums=checksums)
