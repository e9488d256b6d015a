"""Sequence packers: documents in, fixed-length rows out (pure, streaming, deterministic).

A document of n tokens (BOS ... EOS) gives n - 1 next-token *pairs* (input t[k], label
t[k+1]); packers place pairs, never raw tokens, so a document's last token never predicts
the next document's first token (torchtitan's shift-within-document convention). A
`Piece` is a run of pairs [start, end) of one document; a `Row` is up to seq_len pairs.

Packers decide on lengths only; `materialize` turns a row into tensors given the tokens.
Rows carry positions 0.. restarting at every piece, which is what torchtitan's flex
BlockMask, varlen cu_seqlens and our dense CPU mask all derive document boundaries from.
Padding (labels = IGNORE_INDEX) is one trailing pseudo-document with its own positions
0..p-1, so no real token ever attends to padding and varlen gets one extra segment, not p.

- concat: concatenate and split every seq_len pairs (torchtitan's baseline); no padding
  except the final flush; documents straddling a row boundary are split.
- bfd: best-fit-decreasing over a bounded window of documents; a document is split only
  when it is longer than seq_len (full seq_len chunks become rows, the remainder is packed).
- none: one document per row, padded (long documents are chunked, the last chunk padded).

Packer state is a list of pending pieces (plus an age for bfd); it is what a checkpoint
stores (as document ids and offsets, never tokens) and what `restore` takes back.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

# The one IGNORE_INDEX of the project's own code: torchtitan.components.loss.IGNORE_INDEX's value
# (not imported: keep this module pure); tests/unit/test_layers.py holds the two equal.
IGNORE_INDEX = -100
PACKINGS = ("concat", "bfd", "none")


@dataclass(frozen=True, slots=True)
class Piece:
    """Pairs [start, end) of document `doc`, whose full length is `length` pairs."""

    doc: int
    start: int
    end: int
    length: int

    @property
    def size(self) -> int:
        return self.end - self.start

    @property
    def is_whole(self) -> bool:
        return self.start == 0 and self.end == self.length


@dataclass(frozen=True, slots=True)
class Row:
    pieces: tuple[Piece, ...]
    seq_len: int

    @property
    def used(self) -> int:
        return sum(p.size for p in self.pieces)

    @property
    def padding(self) -> int:
        return self.seq_len - self.used


@dataclass
class PackerStats:
    """Cumulative counts over everything a packer has emitted (per rank)."""

    documents: int = 0  # documents pushed
    rows: int = 0
    useful_tokens: int = 0  # pairs placed (labels != IGNORE_INDEX)
    padding_tokens: int = 0
    split_documents: int = 0  # documents spread over more than one row

    @property
    def all_tokens(self) -> int:
        return self.useful_tokens + self.padding_tokens

    @property
    def padding_fraction(self) -> float:
        return self.padding_tokens / self.all_tokens if self.all_tokens else 0.0

    @property
    def efficiency(self) -> float:
        """Useful tokens / all tokens emitted (1 - padding fraction)."""
        return 1.0 - self.padding_fraction if self.all_tokens else 0.0

    @property
    def split_documents_fraction(self) -> float:
        return self.split_documents / self.documents if self.documents else 0.0

    def as_dict(self) -> dict[str, float]:
        return {
            "documents": self.documents,
            "rows": self.rows,
            "useful_tokens": self.useful_tokens,
            "padding_tokens": self.padding_tokens,
            "all_tokens": self.all_tokens,
            "split_documents": self.split_documents,
            "padding_fraction": self.padding_fraction,
            "packing_efficiency": self.efficiency,
            "split_documents_fraction": self.split_documents_fraction,
        }


class Packer:
    """Base: `push(doc, n_pairs) -> rows completed`, `flush() -> the rest`, state/restore."""

    name = ""

    def __init__(self, seq_len: int):
        if seq_len < 1:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        self.seq_len = seq_len
        self.stats = PackerStats()

    # -- subclass API -------------------------------------------------------------------
    def push(self, doc: int, n_pairs: int) -> list[Row]:
        raise NotImplementedError

    def flush(self) -> list[Row]:
        raise NotImplementedError

    def state(self) -> list[tuple[int, int, int, int]]:
        """Pending pieces as (doc, start, end, extra) in buffer order; extra is packer data."""
        raise NotImplementedError

    def restore(self, state: Sequence[Sequence[int]], lengths: Mapping[int, int]) -> None:
        """Rebuild the buffer from `state()`; `lengths[doc]` = the document's pair count."""
        raise NotImplementedError

    # -- shared ---------------------------------------------------------------------------
    def padding_row(self) -> Row:
        """A row of padding only (counted), to even out the last group of a finite stream."""
        return self._emit(())

    def pending_docs(self) -> list[int]:
        return [s[0] for s in self.state()]

    def _emit(self, pieces: Sequence[Piece]) -> Row:
        row = Row(tuple(pieces), self.seq_len)
        st = self.stats
        st.rows += 1
        used = row.used
        st.useful_tokens += used
        st.padding_tokens += self.seq_len - used
        for p in pieces:
            # A split document is counted once: when its first piece leaves the packer.
            if p.start == 0 and p.end < p.length:
                st.split_documents += 1
        return row

    def _check_push(self, doc: int, n_pairs: int) -> None:
        if n_pairs < 1:
            raise ValueError(f"document {doc} has no pairs (needs at least 2 tokens)")
        self.stats.documents += 1


class ConcatPacker(Packer):
    """Concatenate everything and cut every seq_len pairs (torchtitan's HuggingFaceTextDataset)."""

    name = "concat"

    def __init__(self, seq_len: int):
        super().__init__(seq_len)
        self._buf: deque[Piece] = deque()
        self._n = 0

    def push(self, doc: int, n_pairs: int) -> list[Row]:
        self._check_push(doc, n_pairs)
        self._buf.append(Piece(doc, 0, n_pairs, n_pairs))
        self._n += n_pairs
        rows = []
        while self._n >= self.seq_len:
            rows.append(self._emit(self._take(self.seq_len)))
        return rows

    def _take(self, n: int) -> list[Piece]:
        out = []
        while n:
            p = self._buf[0]
            if p.size <= n:
                out.append(self._buf.popleft())
                n -= p.size
                self._n -= p.size
            else:
                out.append(Piece(p.doc, p.start, p.start + n, p.length))
                self._buf[0] = Piece(p.doc, p.start + n, p.end, p.length)
                self._n -= n
                n = 0
        return out

    def flush(self) -> list[Row]:
        if not self._buf:
            return []
        return [self._emit(self._take(self._n))]

    def state(self) -> list[tuple[int, int, int, int]]:
        return [(p.doc, p.start, p.end, 0) for p in self._buf]

    def restore(self, state, lengths) -> None:
        self._buf = deque(Piece(d, s, e, lengths[d]) for d, s, e, _ in state)
        self._n = sum(p.size for p in self._buf)


class NonePacker(Packer):
    """One document per row, padded; documents longer than seq_len are chunked."""

    name = "none"

    def push(self, doc: int, n_pairs: int) -> list[Row]:
        self._check_push(doc, n_pairs)
        L = self.seq_len
        return [
            self._emit([Piece(doc, s, min(s + L, n_pairs), n_pairs)]) for s in range(0, n_pairs, L)
        ]

    def flush(self) -> list[Row]:
        return []

    def state(self) -> list[tuple[int, int, int, int]]:
        return []

    def restore(self, state, lengths) -> None:
        if state:
            raise ValueError("the 'none' packer keeps no buffer; the state is not from it")


@dataclass
class _Item:
    piece: Piece
    age: int = 0  # packing rounds this item was held back for


@dataclass
class _Bin:
    items: list[_Item] = field(default_factory=list)
    used: int = 0


class BestFitDecreasingPacker(Packer):
    """Best-fit-decreasing over a bounded window of documents.

    Documents longer than seq_len give full seq_len chunks at once (rows with no padding);
    their remainder joins the window like a short document. When the window holds `window`
    pieces, they are packed largest first, each into the fullest row it fits. Rows that are
    full, or nearly (within `slack` pairs), leave; the least-filled rows' pieces go back
    into the window for the next round (at most half a window, each piece at most
    `max_age` times) so that a few late, awkward pieces do not each cost a padded row.
    Memory: the tokens of up to `window` documents. Latency: a piece leaves within
    `max_age` + 1 rounds.
    """

    name = "bfd"

    def __init__(self, seq_len: int, window: int = 256, slack: int | None = None, max_age: int = 4):
        super().__init__(seq_len)
        if window < 1:
            raise ValueError(f"window must be positive, got {window}")
        self.window = window
        # Default slack: 1/512 of a row; the < 1% padding target leaves room for it.
        self.slack = seq_len // 512 if slack is None else slack
        self.max_age = max_age
        self._items: list[_Item] = []

    def push(self, doc: int, n_pairs: int) -> list[Row]:
        self._check_push(doc, n_pairs)
        L = self.seq_len
        rows = []
        full = n_pairs // L
        for k in range(full):
            rows.append(self._emit([Piece(doc, k * L, (k + 1) * L, n_pairs)]))
        if n_pairs % L:
            self._items.append(_Item(Piece(doc, full * L, n_pairs, n_pairs)))
        if len(self._items) >= self.window:
            rows.extend(self._round(final=False))
        return rows

    def flush(self) -> list[Row]:
        return self._round(final=True) if self._items else []

    def _pack(self, items: list[_Item]) -> list[_Bin]:
        # Largest first; ties broken by arrival order (stable sort), so the result is a
        # pure function of the window's contents.
        order = sorted(items, key=lambda it: -it.piece.size)
        bins: list[_Bin] = []
        # Sorted (remaining capacity, bin index): best fit = smallest remaining >= size.
        free: list[tuple[int, int]] = []
        for it in order:
            size = it.piece.size
            k = bisect.bisect_left(free, (size, -1))
            if k < len(free):
                rem, b = free.pop(k)
            else:
                bins.append(_Bin())
                rem, b = self.seq_len, len(bins) - 1
            bins[b].items.append(it)
            bins[b].used += size
            if rem - size > 0:
                bisect.insort(free, (rem - size, b))
        return bins

    def _round(self, *, final: bool) -> list[Row]:
        bins = self._pack(self._items)
        keep: list[_Item] = []
        if not final:
            budget = self.window // 2
            # Least-filled first; ties by first arrival (bins are created in a fixed order).
            for b in sorted(bins, key=lambda b: b.used):
                if self.seq_len - b.used <= self.slack:
                    break
                if len(keep) + len(b.items) > budget:
                    break
                if any(it.age >= self.max_age for it in b.items):
                    continue
                keep.extend(b.items)
        kept = {id(it) for it in keep}
        out = [b for b in bins if not any(id(it) in kept for it in b.items)]
        # Emit in data order (by the earliest document in each row) for readability of
        # the stream; the choice does not affect padding.
        out.sort(key=lambda b: min(it.piece.doc for it in b.items))
        rows = [self._emit(sorted((it.piece for it in b.items), key=lambda p: p.doc)) for b in out]
        # Held-back items keep arrival order so that a restored buffer is identical.
        order = {id(it): i for i, it in enumerate(self._items)}
        keep.sort(key=lambda it: order[id(it)])
        for it in keep:
            it.age += 1
        self._items = keep
        return rows

    def state(self) -> list[tuple[int, int, int, int]]:
        return [(it.piece.doc, it.piece.start, it.piece.end, it.age) for it in self._items]

    def restore(self, state, lengths) -> None:
        self._items = [_Item(Piece(d, s, e, lengths[d]), age) for d, s, e, age in state]


def make_packer(packing: str, seq_len: int, *, window: int = 256) -> Packer:
    if packing == "concat":
        return ConcatPacker(seq_len)
    if packing == "bfd":
        return BestFitDecreasingPacker(seq_len, window=window)
    if packing == "none":
        return NonePacker(seq_len)
    raise ValueError(f"unknown packing {packing!r}; expected one of {', '.join(PACKINGS)}")


def materialize(
    row: Row, tokens: Mapping[int, np.ndarray], pad_id: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(input ids, labels, positions), each int64 of length seq_len.

    Padding: input = pad_id, label = IGNORE_INDEX, positions 0..p-1 (one pseudo-document
    after all real tokens, so causal masking alone already hides it from them).
    """
    L = row.seq_len
    inp = np.empty(L, dtype=np.int64)
    lab = np.empty(L, dtype=np.int64)
    pos = np.empty(L, dtype=np.int64)
    o = 0
    for p in row.pieces:
        t = tokens[p.doc]
        n = p.size
        seg = t[p.start : p.end + 1]
        if seg.min() < 0:
            # SFT examples store prompt tokens as -1 - id (data.chat): input is the id, and a
            # pair whose next token is a prompt token is not trained.
            inp[o : o + n] = np.where(seg[:-1] < 0, -1 - seg[:-1], seg[:-1])
            lab[o : o + n] = np.where(seg[1:] < 0, IGNORE_INDEX, seg[1:])
        else:
            inp[o : o + n] = seg[:-1]
            lab[o : o + n] = seg[1:]
        pos[o : o + n] = np.arange(n)
        o += n
    if o < L:
        inp[o:] = pad_id
        lab[o:] = IGNORE_INDEX
        pos[o:] = np.arange(L - o)
    return inp, lab, pos


# -- per-example loss weights (SFT records' optional "weight", data.chat) -------------------
# The channel is sparse: a stream keeps `weights[doc]` only for documents whose weight is not
# 1, so rows of weight-1 documents never touch any of this (no cost, bit-identical rows).
LOSS_WEIGHTS = "loss_weights"  # batch key: float32 [L] per-token weights (weighted groups)
LOSS_WEIGHT_DELTA = "loss_weight_delta"  # batch key: float64 scalar, see group_weight_delta


def trained_pairs(tokens: np.ndarray, piece: Piece) -> int:
    """Pairs of `piece` whose label is trained (next token not a prompt token, data.chat)."""
    return int(np.count_nonzero(tokens[piece.start + 1 : piece.end + 1] >= 0))


def weigh_row(row: Row, labels: np.ndarray, weights: Mapping[int, float]) -> np.ndarray:
    """Apply per-document weights to one materialized row.

    Pieces of weight-0 documents get labels IGNORE_INDEX (in place): weight 0 is exactly a
    mask, so those tokens are neither trained nor counted as trained tokens. Returns the
    per-token weights (float32 [seq_len]): the document's weight (1 when absent from
    `weights`) at every trained pair, 0 at prompt pairs and padding.
    """
    per_piece = np.array([weights.get(p.doc, 1.0) for p in row.pieces], dtype=np.float32)
    w = np.zeros(row.seq_len, dtype=np.float32)
    used = row.used
    w[:used] = np.repeat(per_piece, [p.size for p in row.pieces])
    lab = labels[:used]
    lab[w[:used] == 0.0] = IGNORE_INDEX  # weight-0 pieces (a view: labels change in place)
    w[:used][lab == IGNORE_INDEX] = 0.0  # prompt pairs
    return w


def group_weight_delta(
    rows: Sequence[Row], tokens: Mapping[int, np.ndarray], weights: Mapping[int, float]
) -> float:
    """sum over the trained pairs t of `rows` of (w_t - 1), w_t as the float32 the loss uses.

    A step's weighted-loss normalizer is sum_t w_t = (trained pairs, the count torchtitan
    already all-reduces) + the deltas of the step's groups. `rows` is one whole group (the dp
    rows taken together, identical on every rank), so every rank knows the group's delta
    without a collective. Weight-0 pieces add nothing: their labels are masked (weigh_row),
    so they are not in the trained count either.
    """
    total = 0.0
    for r in rows:
        for p in r.pieces:
            w = weights.get(p.doc, 1.0)
            if w != 1.0 and w != 0.0:
                total += (float(np.float32(w)) - 1.0) * trained_pairs(tokens[p.doc], p)
    return total
