"""The embedded corpus: this Python's standard-library sources, one document per file.

No network and no files shipped: the documents are read at run time from
`sysconfig.get_paths()["stdlib"]` (site-packages excluded), in sorted path order so every
rank and every run sees the same sequence. Files that are not valid UTF-8 are skipped and
counted, never silently mangled.
"""

from __future__ import annotations

import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files() -> list[Path]:
    root = stdlib_root()
    files = [
        p
        for p in root.rglob("*.py")
        if "site-packages" not in p.parts and "dist-packages" not in p.parts
    ]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


@dataclass
class CorpusStats:
    documents: int = 0
    skipped_undecodable: int = 0
    skipped_empty: int = 0
    skipped_paths: list[str] = field(default_factory=list)


def iter_stdlib_documents(
    stats: CorpusStats | None = None, start: int = 0
) -> Iterator[tuple[int, str]]:
    """Yield (file index, text) from file index `start` on; bad files are counted in stats."""
    stats = stats if stats is not None else CorpusStats()
    for i, path in enumerate(stdlib_files()):
        if i < start:
            continue
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            stats.skipped_undecodable += 1
            stats.skipped_paths.append(str(path))
            continue
        except OSError:
            stats.skipped_paths.append(str(path))
            continue
        if not text.strip():
            stats.skipped_empty += 1
            continue
        stats.documents += 1
        yield i, text
