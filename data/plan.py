"""Packing plans: which (document, pair range) pieces make global row k, from lengths only.

A plan is the streaming packer's decision (data.packing) taken ahead of time over a prepared
store's document lengths. Every epoch is packed on its own (the packer is flushed at an
epoch's end, in the streaming loader too), so a plan is periodic: global row k is row
k mod R of epoch k div R, R = rows per epoch, and a rank seeks to any row without reading
the rows before it:

- concat: closed form over cumulative pair counts (a binary search per row; nothing stored).
- none: closed form over cumulative chunk counts (a binary search per row).
- bfd: the BestFitDecreasingPacker itself runs once over the lengths (O(documents), about
  50k documents/s in Python, benchmarks/packing.md); its rows are kept as arrays, cached in
  the store under plans/ (memory-mapped .npy files, published by rename), so later ranks and
  runs open them in O(1).

Document d of epoch e is piece doc id e x D + d: the streaming path's document sequence
numbers, so rows compare equal piece for piece.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from core.atomic import publish_folder
from data.packing import PACKINGS, BestFitDecreasingPacker, Piece, Row

Pieces = list[tuple[int, int, int]]  # (doc, start pair, end pair) within one epoch


@dataclass
class EpochStats:
    """Counts over the first j rows of one epoch (PackerStats' names)."""

    rows: int = 0
    useful_tokens: int = 0
    padding_tokens: int = 0
    documents: int = 0
    split_documents: int = 0

    def plus(self, other: EpochStats, times: int = 1) -> EpochStats:
        return EpochStats(
            *(a + times * b for a, b in zip(self.astuple(), other.astuple(), strict=True))
        )

    def astuple(self) -> tuple[int, ...]:
        return (
            self.rows,
            self.useful_tokens,
            self.padding_tokens,
            self.documents,
            self.split_documents,
        )


class Plan:
    """Rows of one epoch over documents with `pairs[d]` next-token pairs each."""

    packing = ""

    def __init__(self, pairs: np.ndarray, seq_len: int) -> None:
        self.pairs = np.asarray(pairs, dtype=np.int64)
        self.seq_len = seq_len
        self.n_docs = len(self.pairs)
        self.rows_per_epoch = 0

    def epoch_row(self, j: int) -> Pieces:
        raise NotImplementedError

    def epoch_stats(self, j: int) -> EpochStats:
        raise NotImplementedError

    def row(self, k: int) -> Row:
        """Global row k (any epoch) as a data.packing.Row over epoch-numbered documents."""
        e, j = divmod(k, self.rows_per_epoch)
        base = e * self.n_docs
        return Row(
            tuple(Piece(base + d, s, t, int(self.pairs[d])) for d, s, t in self.epoch_row(j)),
            self.seq_len,
        )

    def stats(self, k: int) -> EpochStats:
        """Counts over global rows [0, k)."""
        e, j = divmod(k, self.rows_per_epoch)
        part = self.epoch_stats(j)
        return part.plus(self.epoch_stats(self.rows_per_epoch), e) if e else part


class ConcatPlan(Plan):
    packing = "concat"

    def __init__(self, pairs: np.ndarray, seq_len: int) -> None:
        super().__init__(pairs, seq_len)
        self.cum = np.zeros(self.n_docs + 1, dtype=np.int64)
        np.cumsum(self.pairs, out=self.cum[1:])
        self.total = int(self.cum[-1])
        self.rows_per_epoch = -(-self.total // seq_len)
        self._split_cum: np.ndarray | None = None

    def epoch_row(self, j: int) -> Pieces:
        L = self.seq_len
        p = j * L
        end = min(p + L, self.total)
        d = int(np.searchsorted(self.cum, p, side="right")) - 1
        out = []
        while p < end:
            s = p - int(self.cum[d])
            take = min(int(self.pairs[d]) - s, end - p)
            out.append((d, s, s + take))
            p += take
            d += 1
        return out

    def epoch_stats(self, j: int) -> EpochStats:
        L = self.seq_len
        useful = min(j * L, self.total)
        docs = int(np.searchsorted(self.cum[:-1], useful, side="left"))
        if self._split_cum is None:
            # A document is split when its first and last pair fall in different rows.
            split = (self.cum[:-1] // L) != ((self.cum[1:] - 1) // L)
            self._split_cum = np.concatenate([[0], np.cumsum(split)])
        return EpochStats(j, useful, j * L - useful, docs, int(self._split_cum[docs]))


class NonePlan(Plan):
    packing = "none"

    def __init__(self, pairs: np.ndarray, seq_len: int) -> None:
        super().__init__(pairs, seq_len)
        L = seq_len
        self.chunks = np.zeros(self.n_docs + 1, dtype=np.int64)
        np.cumsum(-(-self.pairs // L), out=self.chunks[1:])
        self.cum = np.zeros(self.n_docs + 1, dtype=np.int64)
        np.cumsum(self.pairs, out=self.cum[1:])
        self.long_cum = np.concatenate([[0], np.cumsum(self.pairs > L)])
        self.rows_per_epoch = int(self.chunks[-1])

    def epoch_row(self, j: int) -> Pieces:
        d = int(np.searchsorted(self.chunks, j, side="right")) - 1
        s = (j - int(self.chunks[d])) * self.seq_len
        return [(d, s, min(s + self.seq_len, int(self.pairs[d])))]

    def epoch_stats(self, j: int) -> EpochStats:
        d = int(np.searchsorted(self.chunks, j, side="right")) - 1
        if d >= self.n_docs:
            useful, docs = int(self.cum[-1]), self.n_docs
        else:
            done = j - int(self.chunks[d])
            useful = int(self.cum[d]) + min(int(self.pairs[d]), done * self.seq_len)
            docs = d + (1 if done else 0)
        return EpochStats(j, useful, j * self.seq_len - useful, docs, int(self.long_cum[docs]))


BFD_FILES = ("row_ptr", "doc", "start", "end")


class BfdPlan(Plan):
    packing = "bfd"

    def __init__(
        self, pairs: np.ndarray, seq_len: int, window: int, cache: Path | None = None
    ) -> None:
        super().__init__(pairs, seq_len)
        self.window = window
        arrays = _load_bfd(cache) if cache is not None else None
        if arrays is None:
            arrays = bfd_arrays(self.pairs, seq_len, window)
            if cache is not None:
                _save_bfd(cache, arrays)
        self.row_ptr, self.doc, self.start, self.end = arrays
        self.rows_per_epoch = len(self.row_ptr) - 1
        self._prefix: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    def epoch_row(self, j: int) -> Pieces:
        a, b = int(self.row_ptr[j]), int(self.row_ptr[j + 1])
        return [
            (int(d), int(s), int(t))
            for d, s, t in zip(self.doc[a:b], self.start[a:b], self.end[a:b], strict=True)
        ]

    def epoch_stats(self, j: int) -> EpochStats:
        if self._prefix is None:
            size = np.asarray(self.end) - np.asarray(self.start)
            first = np.asarray(self.start) == 0
            split = first & (np.asarray(self.end) < self.pairs[np.asarray(self.doc)])
            z = np.zeros(1, dtype=np.int64)
            self._prefix = tuple(np.concatenate([z, np.cumsum(x)]) for x in (size, first, split))  # type: ignore[assignment]
        size_c, first_c, split_c = self._prefix  # type: ignore[misc]
        n = int(self.row_ptr[j])
        useful = int(size_c[n])
        return EpochStats(j, useful, j * self.seq_len - useful, int(first_c[n]), int(split_c[n]))


def bfd_arrays(
    pairs: np.ndarray, seq_len: int, window: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Run the streaming path's BestFitDecreasingPacker over one epoch (then flush)."""
    packer = BestFitDecreasingPacker(seq_len, window=window)
    row_ptr = [0]
    doc: list[int] = []
    start: list[int] = []
    end: list[int] = []

    def take(rows: list[Row]) -> None:
        for r in rows:
            for p in r.pieces:
                doc.append(p.doc)
                start.append(p.start)
                end.append(p.end)
            row_ptr.append(len(doc))

    for d, n in enumerate(pairs.tolist()):
        take(packer.push(d, n))
    take(packer.flush())
    return (
        np.asarray(row_ptr, dtype=np.int64),
        np.asarray(doc, dtype=np.int64),
        np.asarray(start, dtype=np.int64),
        np.asarray(end, dtype=np.int64),
    )


def _load_bfd(folder: Path) -> tuple[np.ndarray, ...] | None:
    if not all((folder / f"{n}.npy").exists() for n in BFD_FILES):
        return None
    return tuple(np.load(folder / f"{n}.npy", mmap_mode="r") for n in BFD_FILES)


def _save_bfd(folder: Path, arrays: tuple[np.ndarray, ...]) -> None:
    """Best effort (a read-only store just recomputes): write beside, rename into place."""
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        for n, a in zip(BFD_FILES, arrays, strict=True):
            with open(tmp / f"{n}.npy", "wb") as f:
                np.save(f, a)
                f.flush()
                os.fsync(f.fileno())
        publish_folder(tmp, folder, replace=False)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)  # another rank won the race, or read-only


def plan_cache_dir(store_path: Path, seq_len: int, window: int) -> Path:
    return store_path / "plans" / f"bfd-L{seq_len}-W{window}"


def make_plan(
    packing: str, pairs: np.ndarray, seq_len: int, *, window: int = 256, cache: Path | None = None
) -> Plan:
    if packing == "concat":
        return ConcatPlan(pairs, seq_len)
    if packing == "none":
        return NonePlan(pairs, seq_len)
    if packing == "bfd":
        return BfdPlan(pairs, seq_len, window, cache)
    raise ValueError(f"unknown packing {packing!r}; expected one of {', '.join(PACKINGS)}")
