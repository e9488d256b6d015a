"""Rows from prepared stores: one store (`StoreStream`) or a weighted mix (`MixedStream`).

Same sharding invariant as the streaming loader (data/loader.py): one global row sequence,
data-parallel rank r takes rows r, r + dp, ...; but here rank r computes only its own rows
(data.plan maps a global row index to document pieces) and reads only their tokens from
the memory-mapped store, so a rank's cost does not grow with dp. The position is one
integer, the next global row, plus a fingerprint: a checkpoint is a few hundred bytes
whatever the dataset size, and resumes at any dp.

Mixing: every source is packed on its own (its own plan), and the global sequence
interleaves whole rows: within each window of `window` rows, source i gives exactly c_i
rows (c_i from the weights by largest remainder), spread evenly (a deterministic smooth
weighted round-robin). Global row k -> (window k div W, slot k mod W) -> (source, its row):
O(1), no state beyond k. Megatron's BlendedDataset mixes the same way, at sample level.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset

from data.packing import Row, materialize
from data.plan import Plan, make_plan, plan_cache_dir

STORE_STATE_VERSION = 1


class MemoryStore:
    """A small unprepared source tokenized in memory (every rank: for small data only);
    the same interface as data.store.TokenStore."""

    def __init__(self, source: Any, tokenizer: Any, *, bad_records: str = "skip") -> None:
        from data.loader import BadRecordError, encode_documents

        self.description = source.description
        docs: list[np.ndarray] = []
        bad = 0
        recs = list(source.records(0))
        good = [t for _, t, _ in recs if t is not None]
        encoded = iter(encode_documents(tokenizer, good)) if good else iter(())
        for idx, text, reason in recs:
            ids = next(encoded) if text is not None else None
            if ids is not None and len(ids) < 2:
                reason = "empty"
            if reason is not None:
                if bad_records == "fail":
                    raise BadRecordError(
                        f"record {idx} of {self.description} is bad ({reason})",
                        key="data.bad_records",
                    )
                bad += 1
                continue
            assert ids is not None
            docs.append(ids)
        self.docs = docs
        self.n_docs = len(docs)
        self.bad_records_total = bad
        self.path: Path | None = None
        self.identity = {"source": self.description, "documents": self.n_docs}

    def doc_tokens(self, d: int) -> np.ndarray:
        return self.docs[d]

    def token_counts(self) -> np.ndarray:
        return np.asarray([len(x) for x in self.docs], dtype=np.int64)


def store_identity(store: Any) -> dict[str, Any]:
    if hasattr(store, "manifest"):
        m = store.manifest
        return {
            "source": m["source"]["fingerprint"],
            "tokenizer": m["tokenizer"]["hash"],
            "documents": m["documents"],
            "tokens": m["tokens"],
        }
    return dict(store.identity)


class PlannedRows:
    """One store + one plan: global row k as (input, labels, positions) numpy arrays."""

    def __init__(self, store: Any, *, packing: str, seq_len: int, window: int, pad_id: int) -> None:
        self.store = store
        pairs = store.token_counts() - 1
        cache = plan_cache_dir(store.path, seq_len, window) if store.path is not None else None
        self.plan: Plan = make_plan(packing, pairs, seq_len, window=window, cache=cache)
        self.pad_id = pad_id
        self.seq_len = seq_len
        self.identity = {
            **store_identity(store),
            "packing": packing,
            "seq_len": seq_len,
            "window": window if packing == "bfd" else None,
        }

    def materialize(self, row: Row) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        D = self.plan.n_docs
        tokens = {p.doc: self.store.doc_tokens(p.doc % D) for p in row.pieces}
        return materialize(row, tokens, self.pad_id)

    def row(self, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self.materialize(self.plan.row(k))

    def stats(self, k: int) -> dict[str, Any]:
        st = self.plan.stats(k)
        all_tokens = st.useful_tokens + st.padding_tokens
        return {
            "documents": st.documents,
            "rows": st.rows,
            "useful_tokens": st.useful_tokens,
            "padding_tokens": st.padding_tokens,
            "all_tokens": all_tokens,
            "split_documents": st.split_documents,
            "padding_fraction": st.padding_tokens / all_tokens if all_tokens else 0.0,
            "packing_efficiency": st.useful_tokens / all_tokens if all_tokens else 0.0,
            "split_documents_fraction": st.split_documents / st.documents if st.documents else 0.0,
            "epoch": k // self.plan.rows_per_epoch,
        }


def mix_counts(weights: Sequence[float], window: int) -> list[int]:
    """Rows per window for each source: largest remainder of weight share x window, each
    at least 1 (raises ValueError when a window is too small for that)."""
    total = float(sum(weights))
    raw = [w / total * window for w in weights]
    counts = [int(np.floor(x)) for x in raw]
    order = sorted(range(len(raw)), key=lambda i: (-(raw[i] - counts[i]), i))
    for i in order[: window - sum(counts)]:
        counts[i] += 1
    if min(counts) < 1:
        raise ValueError(
            f"a mixing window of {window} rows gives a source no row (weights {list(weights)})"
        )
    return counts


def mix_pattern(counts: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """(source of each slot, that source's index among its slots) over one window: smooth
    weighted round-robin, ties to the lower source index; deterministic."""
    window = sum(counts)
    taken = [0] * len(counts)
    src = np.empty(window, dtype=np.int64)
    nth = np.empty(window, dtype=np.int64)
    for j in range(window):
        # Most behind its exact share (c_i x (j + 1) / W) among sources with rows left.
        best = max(
            (i for i in range(len(counts)) if taken[i] < counts[i]),
            key=lambda i: (counts[i] * (j + 1) / window - taken[i], -i),
        )
        src[j], nth[j] = best, taken[best]
        taken[best] += 1
    return src, nth


@dataclass
class MixSource:
    name: str
    weight: float
    rows: PlannedRows


class _RowStream(IterableDataset, Stateful):
    """Global rows by index; this rank yields rows r, r + dp, ... from `next_row` on."""

    kind = ""

    def __init__(self, *, dp_rank: int, dp_world_size: int, seq_len: int) -> None:
        if not 0 <= dp_rank < dp_world_size:
            raise ValueError(f"dp_rank {dp_rank} outside 0..{dp_world_size - 1}")
        self.dp_rank = dp_rank
        self.dp_world_size = dp_world_size
        self.seq_len = seq_len
        self.next_row = 0  # the first global row of the next group of dp rows
        self.fingerprint: dict[str, Any] = {}

    def total_rows(self) -> int | None:
        """Rows of a finite stream, padded to a multiple of dp; None = infinite."""
        return None

    def global_row(self, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        raise NotImplementedError

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        total = self.total_rows()
        while total is None or self.next_row < total:
            k = self.next_row + self.dp_rank
            self.next_row += self.dp_world_size
            inp, lab, pos = self.global_row(k)
            yield (
                {"input": torch.from_numpy(inp), "positions": torch.from_numpy(pos)},
                torch.from_numpy(lab),
            )

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": STORE_STATE_VERSION,
            "kind": self.kind,
            "fingerprint": self.fingerprint,
            "next_row": self.next_row,
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if sd.get("version") != STORE_STATE_VERSION or sd.get("kind") != self.kind:
            raise ValueError(
                f"the checkpoint's data position is of another kind ({sd.get('kind')!r} "
                f"version {sd.get('version')}), expected {self.kind!r} {STORE_STATE_VERSION}"
            )
        old = sd.get("fingerprint", {})
        if old != self.fingerprint:
            keys = sorted(set(old) | set(self.fingerprint))
            diff = [f"{k}: checkpoint {old.get(k)!r}, now {self.fingerprint.get(k)!r}"
                    for k in keys if old.get(k) != self.fingerprint.get(k)]  # fmt: skip
            raise ValueError(
                "the checkpoint's data position belongs to another data setup ("
                + "; ".join(diff)
                + "); resume with the same data settings, or exclude the dataloader"
            )
        self.next_row = int(sd["next_row"])


class StoreStream(_RowStream):
    """One prepared (or in-memory) store, packed by a plan."""

    kind = "store"

    def __init__(
        self,
        store: Any,
        *,
        seq_len: int,
        dp_rank: int,
        dp_world_size: int,
        packing: str = "concat",
        window: int = 256,
        infinite: bool = True,
        pad_id: int = 0,
        vocab_size: int | None = None,
    ) -> None:
        super().__init__(dp_rank=dp_rank, dp_world_size=dp_world_size, seq_len=seq_len)
        self.rows = PlannedRows(
            store, packing=packing, seq_len=seq_len, window=window, pad_id=pad_id
        )
        self.infinite = infinite
        self.fingerprint = {**self.rows.identity, "infinite": infinite, "vocab_size": vocab_size}
        self.description = getattr(store, "description", "store")

    def total_rows(self) -> int | None:
        if self.infinite:
            return None
        n, dp = self.rows.plan.rows_per_epoch, self.dp_world_size
        return -(-n // dp) * dp

    def global_row(self, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if not self.infinite and k >= self.rows.plan.rows_per_epoch:
            return self.rows.materialize(Row((), self.seq_len))  # dp padding, labels -100
        return self.rows.row(k)

    def packing_stats(self) -> dict[str, Any]:
        consumed = self.next_row
        if not self.infinite:
            consumed = min(consumed, self.rows.plan.rows_per_epoch)
        out = self.rows.stats(consumed)
        pad_rows = self.next_row - consumed
        out["rows"] += pad_rows
        out["padding_tokens"] += pad_rows * self.seq_len
        out["all_tokens"] += pad_rows * self.seq_len
        out["rows_consumed"] = self.next_row
        bad = getattr(self.rows.store, "manifest", {}).get("bad_records")
        out["bad_records_at_prepare"] = bad
        return out


class MixedStream(_RowStream):
    """Several stores, interleaved by weight (module docstring). Always infinite: each
    source loops over its own epochs."""

    kind = "mix"

    def __init__(
        self,
        sources: Sequence[MixSource],
        *,
        seq_len: int,
        dp_rank: int,
        dp_world_size: int,
        window: int = 1000,
        vocab_size: int | None = None,
    ) -> None:
        super().__init__(dp_rank=dp_rank, dp_world_size=dp_world_size, seq_len=seq_len)
        self.sources = list(sources)
        self.window = window
        self.counts = mix_counts([s.weight for s in self.sources], window)
        self.slot_source, self.slot_nth = mix_pattern(self.counts)
        # before[i][j] = slots of source i among slots 0..j-1 of a window
        self._before = np.zeros((len(self.sources), window + 1), dtype=np.int64)
        for i in range(len(self.sources)):
            self._before[i, 1:] = np.cumsum(self.slot_source == i)
        self.fingerprint = {
            "window": window,
            "weights": [s.weight for s in self.sources],
            "sources": [s.rows.identity for s in self.sources],
            "vocab_size": vocab_size,
        }

    def locate(self, k: int) -> tuple[int, int]:
        """(source, that source's row) of global row k."""
        w, j = divmod(k, self.window)
        i = int(self.slot_source[j])
        return i, w * self.counts[i] + int(self.slot_nth[j])

    def rows_per_source(self, k: int) -> list[int]:
        """Rows each source gave to global rows [0, k)."""
        w, j = divmod(k, self.window)
        return [w * c + int(self._before[i, j]) for i, c in enumerate(self.counts)]

    def global_row(self, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        i, r = self.locate(k)
        return self.sources[i].rows.row(r)

    def packing_stats(self) -> dict[str, Any]:
        per = []
        tot: dict[str, float] = {}
        for s, n in zip(self.sources, self.rows_per_source(self.next_row), strict=True):
            st = s.rows.stats(n)
            per.append({"source": s.name, "weight": s.weight, **st})
            for key in ("documents", "rows", "useful_tokens", "padding_tokens", "all_tokens",
                        "split_documents"):  # fmt: skip
                tot[key] = tot.get(key, 0) + st[key]
        all_tokens = tot["all_tokens"]
        return {
            **tot,
            "padding_fraction": tot["padding_tokens"] / all_tokens if all_tokens else 0.0,
            "packing_efficiency": tot["useful_tokens"] / all_tokens if all_tokens else 0.0,
            "split_documents_fraction": tot["split_documents"] / tot["documents"]
            if tot["documents"]
            else 0.0,
            "rows_consumed": self.next_row,
            "mix_window": self.window,
            "sources": per,
        }
