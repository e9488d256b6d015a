"""One home for each on-disk mechanism and shared constant (issue #39).

- Renames that publish a file or folder (`os.replace`, `os.rename`) happen in core/atomic.py
  only: every other module commits through it (one manifest, one fsync order).
- One file checksum (`core.atomic.crc32_file`): no other module defines a CRC32-of-a-file.
- One `IGNORE_INDEX` of our own (data/packing.py), equal to torchtitan's.
- core.atomic's manifest catches what it claims to: a flipped byte, a truncated file, a
  missing file (checked against zlib and the file system, not against itself).
"""

from __future__ import annotations

import ast
import functools
import os
import zlib

from core import atomic
from tests.unit.test_layers import project_modules


@functools.cache
def _facts() -> dict[str, list[str]]:
    """One walk over every project module: renames outside core/atomic.py, functions named
    *crc32*, module-level IGNORE_INDEX assignments (one parse each: the unit tier's budget)."""
    out: dict[str, list[str]] = {"renames": [], "crc32": [], "ignore_index": []}
    for path, _ in project_modules():
        where = f"{path.parent.name}/{path.name}"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                f = node.func
                if (isinstance(f.value, ast.Name) and f.value.id == "os"
                        and f.attr in ("replace", "rename", "renames")
                        and where != "core/atomic.py"):  # fmt: skip
                    out["renames"].append(f"{where}:{node.lineno}")
            elif isinstance(node, ast.FunctionDef) and "crc32" in node.name:
                out["crc32"].append(f"{where}:{node.name}")
            elif isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "IGNORE_INDEX" for t in node.targets
            ):
                out["ignore_index"].append(where)
    return out


def test_only_core_atomic_renames_into_place():
    found = _facts()["renames"]
    assert found == [], "commit through core.atomic instead: " + ", ".join(found)


def test_one_file_checksum_and_one_ignore_index():
    assert _facts()["crc32"] == ["core/atomic.py:crc32_file"], _facts()["crc32"]
    assert _facts()["ignore_index"] == ["data/packing.py"], _facts()["ignore_index"]
    from torchtitan.components.loss import IGNORE_INDEX as TITAN

    from data.packing import IGNORE_INDEX

    assert IGNORE_INDEX == TITAN


def test_manifest_detects_damage(tmp_path):
    d = tmp_path / "c"
    d.mkdir()
    (d / "a.bin").write_bytes(bytes(range(256)) * 40)
    (d / "b.json").write_text("{}")
    (d / "meta.json").write_text("{}")
    atomic.write_manifest(d, atomic.folder_crcs(d, skip=["meta.json"]), skip=["meta.json"])
    assert atomic.check_folder(d) == []
    assert atomic.crc32_file(d / "a.bin") == zlib.crc32(bytes(range(256)) * 40)
    (d / "meta.json").write_text('{"rewritten": 1}')  # not covered: may change
    assert atomic.check_folder(d) == []
    raw = bytearray((d / "a.bin").read_bytes())
    raw[100] ^= 1
    (d / "a.bin").write_bytes(bytes(raw))
    assert atomic.check_folder(d) == [
        f"a.bin is corrupted (CRC32 {zlib.crc32(bytes(raw)):08x}, "
        f"expected {zlib.crc32(bytes(range(256)) * 40):08x})"
    ]
    (d / "a.bin").write_bytes(bytes(raw[:10]))
    assert atomic.check_folder(d) == ["a.bin has 10 bytes, the manifest says 10240"]
    os.unlink(d / "b.json")
    assert "b.json is missing" in atomic.check_folder(d)
    os.unlink(d / atomic.MANIFEST)
    assert atomic.check_folder(d) == ["manifest.json is missing"]


def test_publish_folder_replaces_only_once_complete(tmp_path):
    final, tmp = tmp_path / "x", tmp_path / "x.tmp"
    final.mkdir()
    (final / "old").write_text("1")
    tmp.mkdir()
    (tmp / "new").write_text("2")
    try:
        atomic.publish_folder(tmp, final, replace=False)
    except FileExistsError:
        pass
    else:
        raise AssertionError("replace=False published over an existing folder")
    assert sorted(os.listdir(final)) == ["old"]
    atomic.publish_folder(tmp, final)
    assert sorted(os.listdir(tmp_path)) == ["x"] and sorted(os.listdir(final)) == ["new"]
