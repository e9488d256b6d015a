"""A prepared token store: documents tokenized once, memory-mapped, read by offset.

Layout of a store folder (published only when complete, docs/data.md):

- `shard-NNNNN.arrow`: `datasets` Arrow files (written by `datasets.arrow_writer.ArrowWriter`,
  opened with `datasets.Dataset.from_file`, i.e. memory-mapped), one column `ids`: a list of
  token ids per document (BOS + text + EOS, uint16 when the vocabulary fits, else int32);
  good documents only, in source order.
- `documents.npy`: the document index, int64 cumulative token offsets (documents + 1
  entries): document d holds global tokens [off[d], off[d+1]). Memory-mapped with numpy.
- `manifest.json`: format, source fingerprint, tokenizer hash, documents, tokens, bad-record
  counts, shards. Written last; a folder without it is not a store.
- `plans/`: cached packing plans (data.plan), added by prepare_data or on first use.

Writing (`prepare`): shards are written into `<out>.partial/` one at a time (file written,
fsynced, renamed), with `progress.json` naming the shards done and the next source record,
so an interrupted run resumes at the last finished shard. The finished folder is fsynced
and renamed to `<out>` in one `os.rename`: a reader sees a whole store or none.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from core.errors import ConfigError

FORMAT = "titanscale-token-store"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
INDEX = "documents.npy"
PROGRESS = "progress.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt")


# -- identities --------------------------------------------------------------------------------
def tokenizer_hash(folder: str | Path) -> str:
    """sha256 over the tokenizer folder's files that decide the ids (names and bytes)."""
    h = hashlib.sha256()
    for name in TOKENIZER_FILES:
        p = Path(folder) / name
        if p.exists():
            h.update(name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def source_fingerprint(files: Sequence[Path], extra: str = "") -> str:
    """sha256 over the source files' paths, sizes and modification times (not their bytes:
    reading terabytes to name them would cost as much as preparing them)."""
    h = hashlib.sha256(extra.encode())
    for p in files:
        st = p.stat()
        h.update(f"{p}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def is_store(path: str | Path) -> bool:
    p = Path(path)
    return p.is_dir() and (p / MANIFEST).is_file()


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# -- reading ------------------------------------------------------------------------------------
class TokenStore:
    """A published store, memory-mapped. `doc_tokens(d)` is a zero-copy view (no bytes are
    read until a slice of it is used), so a rank touches only the pages of its own rows."""

    def __init__(self, path: str | Path, *, key: str = "data.source") -> None:
        import datasets

        self.path = Path(path)
        if not is_store(self.path):
            raise ConfigError(
                f"{str(path)!r} is not a prepared token store (no {MANIFEST})", key=key
            )
        self.manifest: dict[str, Any] = json.loads((self.path / MANIFEST).read_text())
        if self.manifest.get("format") != FORMAT or self.manifest.get("version") != FORMAT_VERSION:
            raise ConfigError(
                f"{str(path)!r}: store format {self.manifest.get('format')!r} version "
                f"{self.manifest.get('version')!r}, expected {FORMAT!r} {FORMAT_VERSION}",
                key=key,
            )
        self.offsets = np.load(self.path / INDEX, mmap_mode="r")
        self.n_docs = len(self.offsets) - 1
        # One (first document, list offsets, flat values) per Arrow record batch.
        starts: list[int] = []
        self._chunks: list[tuple[np.ndarray, np.ndarray]] = []
        d = 0
        for shard in self.manifest["shards"]:
            table = datasets.Dataset.from_file(str(self.path / shard["file"])).data.table
            for chunk in table.column("ids").chunks:
                starts.append(d)
                offs = chunk.offsets.to_numpy(zero_copy_only=True)
                vals = chunk.values.to_numpy(zero_copy_only=True)
                self._chunks.append((offs, vals))
                d += len(chunk)
        if d != self.n_docs:
            raise ConfigError(
                f"{str(path)!r}: shards hold {d} documents, the index {self.n_docs}", key=key
            )
        self._chunk_starts = np.asarray(starts, dtype=np.int64)

    @property
    def description(self) -> str:
        return f"store:{self.path} ({self.manifest['source']['description']})"

    @property
    def tokenizer_hash(self) -> str:
        return str(self.manifest["tokenizer"]["hash"])

    def doc_tokens(self, d: int) -> np.ndarray:
        c = int(np.searchsorted(self._chunk_starts, d, side="right")) - 1
        offs, vals = self._chunks[c]
        i = d - int(self._chunk_starts[c])
        return vals[offs[i] : offs[i + 1]]

    def token_counts(self) -> np.ndarray:
        """Tokens per document (int64; BOS and EOS included)."""
        return np.diff(np.asarray(self.offsets, dtype=np.int64))

    def check_tokenizer(self, folder: str | Path, *, file: str | None = None) -> None:
        got = tokenizer_hash(folder)
        if got != self.tokenizer_hash:
            raise ConfigError(
                f"store {str(self.path)!r} was prepared with another tokenizer "
                f"({self.manifest['tokenizer']['spec']!r}, hash {self.tokenizer_hash[:12]}) than "
                f"{str(folder)!r} (hash {got[:12]}); prepare it again with this tokenizer",
                file=file,
                key="data.source",
            )


# -- writing ------------------------------------------------------------------------------------
def _arrow_dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "int32"


def _write_shard(path: Path, docs: list[np.ndarray], dtype: str) -> None:
    """One Arrow file through datasets' ArrowWriter, fsynced, then renamed into place."""
    import pyarrow as pa
    from datasets import Features, List, Value
    from datasets.arrow_writer import ArrowWriter

    lengths = np.fromiter((len(x) for x in docs), dtype=np.int64, count=len(docs))
    offsets = np.zeros(len(docs) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    flat = np.concatenate(docs).astype(dtype, copy=False) if docs else np.zeros(0, dtype)
    arr = pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat))
    table = pa.table({"ids": arr})
    tmp = path.with_name(path.name + ".tmp")
    features = Features({"ids": List(Value(dtype))})
    with ArrowWriter(features=features, path=str(tmp), writer_batch_size=len(docs) or 1) as w:
        w.write_table(table)
        w.finalize()
    _fsync_path(tmp)
    os.replace(tmp, path)


def _shard_lengths(folder: Path, files: list[str]) -> np.ndarray:
    """Tokens per document over the shards, from their Arrow list offsets (no token read)."""
    import datasets

    parts = [np.zeros(0, dtype=np.int64)]
    for name in files:
        table = datasets.Dataset.from_file(str(folder / name)).data.table
        for chunk in table.column("ids").chunks:
            parts.append(np.diff(chunk.offsets.to_numpy()).astype(np.int64))
    return np.concatenate(parts)


class _Encoder:
    """Tokenize chunks of texts, in this process or a pool of `num_proc` processes."""

    def __init__(self, tokenizer_dir: str, num_proc: int) -> None:
        self.num_proc = num_proc
        self.pool: Any = None
        if num_proc > 1:
            import multiprocessing as mp

            # spawn: a forked child of a process that already used `tokenizers` deadlocks.
            ctx = mp.get_context("spawn")
            self.pool = ctx.Pool(num_proc, initializer=_worker_init, initargs=(tokenizer_dir,))
        else:
            _worker_init(tokenizer_dir)

    def map(
        self, chunks: Iterator[tuple[Any, list[str]]]
    ) -> Iterator[tuple[Any, list[np.ndarray]]]:
        """(meta, encoded texts) in input order; at most 2 x num_proc chunks in flight
        (Pool.imap would read the whole source ahead into memory)."""
        if self.pool is None:
            for meta, texts in chunks:
                yield meta, _worker_encode(texts)
            return
        from collections import deque

        pending: deque[tuple[Any, Any]] = deque()
        for meta, texts in chunks:
            pending.append((meta, self.pool.apply_async(_worker_encode, (texts,))))
            if len(pending) >= 2 * self.num_proc:
                m, r = pending.popleft()
                yield m, r.get()
        while pending:
            m, r = pending.popleft()
            yield m, r.get()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.terminate()
            self.pool.join()


_WORKER_TOKENIZER: Any = None


def _worker_init(tokenizer_dir: str) -> None:
    global _WORKER_TOKENIZER
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    _WORKER_TOKENIZER = HuggingFaceTokenizer(tokenizer_path=tokenizer_dir)


def _worker_encode(texts: list[str]) -> list[np.ndarray]:
    from data.loader import encode_documents  # the loader's own encoding: identical ids

    return encode_documents(_WORKER_TOKENIZER, texts) if texts else []


def prepare(
    source: Any,
    *,
    tokenizer_dir: str,
    tokenizer_spec: str,
    out: str | Path,
    fingerprint: str,
    num_proc: int = 1,
    shard_tokens: int = 1 << 27,
    chunk_records: int = 256,
    progress: bool = True,
    on_shard: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Tokenize `source` (a data.sources.Source) into a store at `out`; returns the manifest.

    Resumes from `<out>.partial/progress.json` when it belongs to the same source and
    tokenizer. `on_shard(n)` is called after shard n is durable (tests interrupt here).
    """
    from torchtitan.components.tokenizer import HuggingFaceTokenizer
    from tqdm import tqdm

    from data.sources import BAD_REASONS

    out = Path(out)
    tok_hash = tokenizer_hash(tokenizer_dir)
    vocab = HuggingFaceTokenizer(tokenizer_path=tokenizer_dir).get_vocab_size()
    dtype = _arrow_dtype(vocab)
    ident = {"fingerprint": fingerprint, "tokenizer_hash": tok_hash, "dtype": dtype}
    work = out.with_name(out.name + ".partial")
    work.mkdir(parents=True, exist_ok=True)
    prog_path = work / PROGRESS
    prog: dict[str, Any] = {**ident, "shards": [], "next_record": 0}
    prog["bad"] = dict.fromkeys(BAD_REASONS, 0)
    if prog_path.exists():
        old = json.loads(prog_path.read_text())
        if all(old.get(k) == v for k, v in ident.items()):
            prog = old
        else:  # another source or tokenizer: start over
            for f in work.iterdir():
                f.unlink()
    done_tokens = sum(s["tokens"] for s in prog["shards"])
    total = getattr(source, "known_length", None)
    bar = tqdm(
        total=total,
        initial=prog["next_record"],
        unit="rec",
        desc=f"prepare {out.name}",
        disable=not progress,
        dynamic_ncols=True,
    )
    enc = _Encoder(tokenizer_dir, num_proc)
    t0 = time.perf_counter()
    tokens_this_run = 0
    try:
        buf: list[np.ndarray] = []
        buf_tokens = 0
        bad = dict(prog["bad"])
        next_record = prog["next_record"]

        def chunks() -> Iterator[tuple[list[Any], list[str]]]:
            source.restore(prog["next_record"], prog.get("source_state"))
            recs: list[Any] = []
            for rec in source.records(prog["next_record"]):
                recs.append(rec)
                if len(recs) == chunk_records:
                    yield recs, [t for _, t, _ in recs if t is not None]
                    recs = []
            if recs:
                yield recs, [t for _, t, _ in recs if t is not None]

        def flush_shard() -> None:
            nonlocal buf, buf_tokens
            n = len(prog["shards"])
            name = f"shard-{n:05d}.arrow"
            _write_shard(work / name, buf, dtype)
            prog["shards"].append(
                {
                    "file": name,
                    "documents": len(buf),
                    "tokens": int(buf_tokens),
                }
            )
            prog["next_record"] = next_record
            # A streamed source resumes from datasets' own position, not by re-reading.
            prog["source_state"] = source.resume_state(next_record)
            prog["bad"] = dict(bad)
            write_json_atomic(prog_path, prog)
            buf, buf_tokens = [], 0
            if on_shard is not None:
                on_shard(n)

        for recs, encoded in enc.map(chunks()):
            it = iter(encoded)
            for idx, text, reason in recs:
                ids = next(it) if text is not None else None
                if ids is not None and len(ids) < 2:
                    reason = "empty"
                next_record = idx + 1
                if reason is not None:
                    bad[reason] += 1
                    continue
                assert ids is not None
                buf.append(ids)
                buf_tokens += len(ids)
                tokens_this_run += len(ids)
                if buf_tokens >= shard_tokens:  # a shard ends after a whole record
                    flush_shard()
            bar.update(len(recs))
            bar.set_postfix(tokens=f"{done_tokens + tokens_this_run:,}", refresh=False)
        if buf:
            flush_shard()
    finally:
        enc.close()
        bar.close()
    seconds = time.perf_counter() - t0
    lengths = _shard_lengths(work, [s["file"] for s in prog["shards"]])
    if not len(lengths):
        raise ConfigError(
            f"{source.description}: no usable documents (bad records: {prog['bad']})",
            key="--source",
        )
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(np.asarray(lengths, dtype=np.int64), out=offsets[1:])
    with open(work / INDEX, "wb") as fh:
        np.save(fh, offsets)
        fh.flush()
        os.fsync(fh.fileno())
    manifest = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "source": {"description": source.description, "fingerprint": fingerprint},
        "tokenizer": {"spec": tokenizer_spec, "hash": tok_hash, "vocab_size": vocab},
        "dtype": dtype,
        "documents": len(lengths),
        "tokens": int(offsets[-1]),
        "records": prog["next_record"],
        "bad_records": prog["bad"],
        "shards": prog["shards"],
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "prepare_seconds_last_run": seconds,
    }
    prog_path.unlink()
    write_json_atomic(work / MANIFEST, manifest)
    _fsync_path(work)
    os.rename(work, out)  # atomic publish; fails if `out` exists (checked by the caller)
    _fsync_path(out.parent if str(out.parent) else Path("."))
    return manifest
