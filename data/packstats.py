"""Measure packing on a source: one pass, one process, the loader's own code path.

`measure_packing` runs `PackedStream` (read + tokenize + pack + materialize rows) over the
whole source once and reports counts and speed; `measure_torchtitan` runs torchtitan's
HuggingFaceTextDataset over the same documents and tokenizer for comparison. Both are
used by `tools.packstats` and `benchmarks/bench_packing.py`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from data.loader import PackedStream
from data.sources import Record, Source, open_source


class LimitedSource(Source):
    """The first `limit` records of another source."""

    def __init__(self, inner: Source, limit: int) -> None:
        super().__init__(description=f"{inner.description}[:{limit}]")
        self.inner = inner
        self.limit = limit

    def __len__(self) -> int:
        n = self.inner.known_length
        return self.limit if n is None else min(n, self.limit)

    def records(self, start: int = 0) -> Iterator[Record]:
        for rec in self.inner.records(start):
            if rec[0] >= self.limit:
                return
            yield rec

    def resume_state(self, next_record: int) -> Any:
        return self.inner.resume_state(next_record)

    def restore(self, next_record: int, state: Any) -> None:
        self.inner.restore(next_record, state)


class TextListSource(Source):
    """Documents already in memory (all good): the benchmark's common ground with torchtitan."""

    def __init__(self, texts: list[str], description: str = "in-memory") -> None:
        super().__init__(description=description)
        self.texts = texts

    def __len__(self) -> int:
        return len(self.texts)

    def records(self, start: int = 0) -> Iterator[Record]:
        for i in range(start, len(self.texts)):
            yield i, self.texts[i], None


def measure_packing(
    source: str | Source,
    tokenizer,
    *,
    seq_len: int,
    packing: str,
    window: int = 256,
    text_field: str = "text",
    bad_records: str = "skip",
    streaming: str = "auto",
    max_records: int | None = None,
) -> dict[str, Any]:
    """One full pass; `tokens` = tokens placed in rows with a label (documents' tokens
    minus one per document: the shift within each document)."""
    src = (
        source
        if isinstance(source, Source)
        else open_source(source, text_field=text_field, streaming=streaming)
    )
    if max_records is not None:
        src = LimitedSource(src, max_records)
    stream = PackedStream(
        source=src,
        tokenizer=tokenizer,
        seq_len=seq_len,
        dp_rank=0,
        dp_world_size=1,
        packing=packing,
        text_field=text_field,
        window=window,
        bad_records=bad_records,
        infinite=False,
    )
    t0, c0 = time.perf_counter(), time.process_time()
    rows = 0
    for _ in stream:
        rows += 1
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    st = stream.packing_stats()
    return _report(src.description, packing, seq_len, window, st, rows, dt, cpu,
                   st["bad_records"])  # fmt: skip


def _report(source, packing, seq_len, window, st, rows, dt, cpu, bad) -> dict[str, Any]:
    """The packstats keys from a stream's packing_stats and one pass's timings."""
    return {
        "source": source,
        "packing": packing,
        "seq_len": seq_len,
        "window": window if packing == "bfd" else None,
        "documents": st["documents"],
        "tokens": st["useful_tokens"],
        "sequences": rows,
        "padding_fraction": st["padding_fraction"],
        "split_documents_fraction": st["split_documents_fraction"],
        "tokens_per_sec": st["useful_tokens"] / dt if dt > 0 else None,
        "seconds": dt,
        "tokens_per_cpu_sec": st["useful_tokens"] / cpu if cpu > 0 else None,
        "packing_efficiency": st["packing_efficiency"],
        "split_documents": st["split_documents"],
        "bad_records": bad,
    }


def measure_store(path: str, tokenizer, *, seq_len: int, packing: str, window: int = 256) -> dict:
    """One epoch of a prepared store (plan + materialized rows, this process): the same keys
    as `measure_packing`; tokens/s here is the read path's, tokenization was done before."""
    from data.store import TokenStore
    from data.store_stream import StoreStream

    t0, c0 = time.perf_counter(), time.process_time()
    store = TokenStore(path)
    tok_dir = getattr(tokenizer, "tokenizer_path", None)
    if tok_dir is not None:
        store.check_tokenizer(tok_dir)
    eos = getattr(tokenizer, "eos_id", None)
    stream = StoreStream(store, seq_len=seq_len, dp_rank=0, dp_world_size=1, packing=packing,
                         window=window, infinite=False, pad_id=int(eos) if eos is not None else 0)  # fmt: skip
    rows = sum(1 for _ in stream)
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    st = stream.packing_stats()
    return _report(store.description, packing, seq_len, window, st, rows, dt, cpu,
                   store.manifest["bad_records"])  # fmt: skip


def stdlib_texts() -> list[str]:
    """The embedded corpus as the loader sees it (good documents only, in order)."""
    return [t for _, t, _ in open_source("stdlib").records() if t is not None]


def measure_torchtitan(texts: list[str], tokenizer, *, seq_len: int) -> dict[str, Any]:
    """torchtitan's HuggingFaceTextDataset (concat, shift within document, drops the final
    partial row) over `texts`, through its documented DATASETS registry."""
    from datasets import Dataset
    from torchtitan.hf_datasets import DatasetConfig
    from torchtitan.hf_datasets import text_datasets as td

    name = "titanscale_bench"
    ds = Dataset.from_dict({"text": texts})
    td.DATASETS[name] = DatasetConfig(
        path="in-memory", loader=lambda _path: ds, sample_processor=lambda s: s["text"]
    )
    try:
        hf = td.HuggingFaceTextDataset(
            dataset_name=name, dataset_path=None, tokenizer=tokenizer, seq_len=seq_len
        )
        t0, c0 = time.perf_counter(), time.process_time()
        rows = 0
        for _ in hf:
            rows += 1
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    finally:
        del td.DATASETS[name]
    placed = rows * seq_len
    dropped = len(hf._inputs_buffer)
    return {
        "source": "stdlib (in-memory datasets.Dataset)",
        "packing": "torchtitan HuggingFaceTextDataset",
        "seq_len": seq_len,
        "documents": len(texts),
        "tokens": placed,
        "sequences": rows,
        "padding_fraction": 0.0,
        "dropped_tokens": dropped,
        "dropped_fraction": dropped / (placed + dropped) if placed + dropped else 0.0,
        "tokens_per_sec": placed / dt if dt > 0 else None,
        "seconds": dt,
        "tokens_per_cpu_sec": placed / cpu if cpu > 0 else None,
    }
