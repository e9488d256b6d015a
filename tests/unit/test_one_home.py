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
import os
import zlib

from core import atomic
from tests.unit.test_layers import project_modules


def _calls(tree: ast.AST, names: set[str]) -> list[int]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            f = node.func
            if isinstance(f.value, ast.Name) and f.value.id == "os" and f.attr in names:
                out.append(node.lineno)
    return out


def test_only_core_atomic_renames_into_place():
    found = []
    for path, _ in project_modules():
        if path.name == "atomic.py" and path.parent.name == "core":
            continue
        tree = ast.parse(path.read_text(), str(path))
        found += [f"{path}:{n}" for n in _calls(tree, {"replace", "rename", "renames"})]
    assert found == [], "commit through core.atomic instead: " + ", ".join(found)


def test_one_file_checksum_and_one_ignore_index():
    crc_defs, ignore_defs = [], []
    for path, _ in project_modules():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and "crc32" in node.name:
                crc_defs.append(f"{path.parent.name}/{path.name}:{node.name}")
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "IGNORE_INDEX" for t in node.targets
            ):
                ignore_defs.append(f"{path.parent.name}/{path.name}")
    assert crc_defs == ["core/atomic.py:crc32_file"], crc_defs
    assert ignore_defs == ["data/packing.py"], ignore_defs
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
