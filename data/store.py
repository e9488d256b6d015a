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

Verified when opened (`TokenStore`, before any process group; a damaged store is one
`StoreDamaged` line naming the file and what was expected, never a traceback or garbage
ids mid-training): the manifest parses and has its fields; every shard named exists, is a
regular file of the size recorded and opens as Arrow with the documents and tokens
recorded; documents.npy is an int64 array of documents + 1 offsets from 0 to the token
count that agrees with the shards at every shard boundary; and, for stores of at most
`CHECKSUM_BYTES` (or when asked), the CRC32 of every file equals the manifest's. Larger
stores are checksummed by `python -m tools.prepare_data --verify STORE` (one pass at about
1 GB/s per core), and every document read is checked against the index length and the
vocabulary (a few comparisons per row), so bytes changed after the check still end in one
line naming the shard and the document rather than an IndexError in the embedding.

Writing (`prepare`): shards are written into `<out>.partial/` one at a time (file written,
fsynced, renamed), with `progress.json` naming the shards done and the next source record,
so an interrupted run resumes at the last finished shard. The finished folder is fsynced
and renamed to `<out>` in one rename (core.atomic.publish_folder): a reader sees a whole store or none.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

from core import jsonio
from core.atomic import crc32_file, fsync_path, publish_file, publish_folder, write_json_atomic
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
    try:
        return p.is_dir() and (p / MANIFEST).is_file()
    except (OSError, ValueError):  # a NUL byte, a name too long: not a store
        return False


def looks_like_store(path: str | Path) -> bool:
    """A folder holding a store's data files (documents.npy, shard-*.arrow) without a
    readable manifest: a damaged store, not a folder of text files."""
    p = Path(path)
    try:
        return p.is_dir() and ((p / INDEX).exists() or any(p.glob("shard-*.arrow")))
    except (OSError, ValueError):
        return False


class StoreDamaged(ConfigError):
    """A prepared store whose files do not match its manifest (or cannot be read)."""


# Stores up to this size (all files) are checksummed every time they are opened (about 1 s
# per GiB on one core; each process once: TokenStore caches what it verified). Larger ones
# get the size and structure checks only; `tools.prepare_data --verify` checksums them.
CHECKSUM_BYTES = 1 << 30
_VERIFIED: set[tuple[Any, ...]] = set()


# -- reading ------------------------------------------------------------------------------------
class TokenStore:
    """A published store, memory-mapped. `doc_tokens(d)` is a zero-copy view (no bytes are
    read until a slice of it is used), so a rank touches only the pages of its own rows."""

    def __init__(
        self,
        path: str | Path,
        *,
        key: str = "data.source",
        file: str | None = None,
        checksums: bool | None = None,
    ) -> None:
        """Open and verify (module docstring); `checksums`: None = when the store is at
        most CHECKSUM_BYTES, True/False = always/never. StoreDamaged names the key."""
        self.path = Path(path)
        self._key, self._file = key, file
        if not is_store(self.path):
            if looks_like_store(self.path):
                self._damaged(f"{MANIFEST} is missing (the folder holds a store's data files)")
            raise ConfigError(
                f"{str(path)!r} is not a prepared token store (no {MANIFEST})", file=file, key=key
            )
        self.manifest: dict[str, Any] = self._read_manifest()
        if self.manifest.get("format") != FORMAT or self.manifest.get("version") != FORMAT_VERSION:
            raise ConfigError(
                f"{str(path)!r}: store format {self.manifest.get('format')!r} version "
                f"{self.manifest.get('version')!r}, expected {FORMAT!r} {FORMAT_VERSION}",
                file=file,
                key=key,
            )
        self._check_fields()
        m = self.manifest
        # Sizes, then checksums, before any file is parsed: changed bytes are found by
        # their CRC32 rather than by the Arrow reader meeting them.
        for shard in m["shards"]:
            self._check_size(shard["file"], "shard", shard.get("bytes"))
        self._check_size(INDEX, "index", self._index_record().get("bytes"))
        self._verify_checksums(checksums)
        self.vocab_size = int(m["tokenizer"].get("vocab_size") or 0) or None
        # One (first document, list offsets, flat values) per Arrow record batch.
        starts: list[int] = []
        self._chunks: list[tuple[np.ndarray, np.ndarray]] = []
        d = 0
        bounds = [(0, 0)]  # (documents, tokens) at each shard's end
        for shard in m["shards"]:
            docs, tokens = self._open_shard(shard, starts, d)
            d += docs
            bounds.append((d, bounds[-1][1] + tokens))
        self.offsets = self._open_index(bounds)
        self.n_docs = len(self.offsets) - 1
        self._chunk_starts = np.asarray(starts, dtype=np.int64)

    # -- verification (module docstring) ------------------------------------------------------
    def _damaged(self, problem: str) -> NoReturn:
        raise StoreDamaged(
            f"store {str(self.path)!r} is damaged: {problem}; prepare it again "
            "(python -m tools.prepare_data)",
            file=self._file,
            key=self._key,
        )

    def _read_manifest(self) -> dict[str, Any]:
        try:
            m = jsonio.loads((self.path / MANIFEST).read_bytes())
        except (OSError, ValueError) as e:  # ValueError: not JSON, not UTF-8
            why = getattr(e, "strerror", None) or str(e).splitlines()[0][:120]
            self._damaged(f"{MANIFEST} is not readable JSON ({why})")
        if not isinstance(m, dict):
            self._damaged(f"{MANIFEST} is not a JSON object")
        return m

    def _check_fields(self) -> None:
        m = self.manifest

        def count(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool) and v >= 0

        shards = m.get("shards")
        if not isinstance(shards, list):
            self._damaged(f"{MANIFEST} has no 'shards' list")
        for i, sh in enumerate(shards):
            name = sh.get("file") if isinstance(sh, dict) else None
            # A plain file name in the folder: never a path out of it.
            if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
                self._damaged(f"{MANIFEST} shards[{i}] has no valid 'file' name")
            if not (count(sh.get("documents")) and count(sh.get("tokens"))):
                self._damaged(f"{MANIFEST} shards[{i}] ({name}) lacks its documents/tokens counts")
        for field in ("documents", "tokens"):
            if not count(m.get(field)):
                self._damaged(f"{MANIFEST} has no '{field}' count")
        if not isinstance(m.get("tokenizer"), dict) or not isinstance(
            m["tokenizer"].get("hash"), str
        ):
            self._damaged(f"{MANIFEST} has no tokenizer hash")
        if not isinstance(m.get("source"), dict):
            self._damaged(f"{MANIFEST} has no source description")

    def _regular_file(self, name: str, what: str) -> Path:
        p = self.path / name
        try:
            st = p.stat()
        except OSError as e:
            self._damaged(f"{what} {name} is missing ({e.strerror})")
        if not stat.S_ISREG(st.st_mode):
            self._damaged(f"{what} {name} is not a regular file")
        return p

    def _index_record(self) -> dict[str, Any]:
        rec = self.manifest.get("index")
        return rec if isinstance(rec, dict) else {}  # stores before checksums: none

    def _check_size(self, name: str, what: str, recorded: Any) -> None:
        size = self._regular_file(name, what).stat().st_size
        if isinstance(recorded, int) and size != recorded:
            self._damaged(f"{name} is {size} bytes, the manifest records {recorded}")

    def _open_shard(self, shard: dict[str, Any], starts: list[int], first: int) -> tuple[int, int]:
        import pyarrow as pa

        name = shard["file"]
        p = self.path / name
        parts: list[tuple[np.ndarray, np.ndarray]] = []
        try:
            # As datasets.Dataset.from_file reads it: memory-mapped, zero-copy (the map
            # stays open as long as the arrays do). validate(full=True) checks every buffer
            # size and offset before one is used (a garbage offset would read out of bounds:
            # O(documents), no token read).
            table = pa.ipc.open_stream(pa.memory_map(str(p))).read_all()
            table.validate(full=True)
            for chunk in table.column("ids").chunks:
                if chunk.null_count or chunk.offset or chunk.values.null_count:
                    raise ValueError("null or offset list entries (a store holds none)")
                offs = chunk.offsets.to_numpy(zero_copy_only=True)
                vals = chunk.values.to_numpy(zero_copy_only=True)
                if len(offs) and (offs[0] != 0 or offs[-1] != len(vals)):
                    raise ValueError("list offsets outside its values")
                parts.append((offs, vals))
        except Exception as e:  # pyarrow raises ArrowInvalid, OSError, KeyError ...
            self._damaged(f"shard {name} is not a readable Arrow file ({_first_line(e)})")
        docs = tokens = 0
        for offs, vals in parts:
            starts.append(first + docs)
            self._chunks.append((offs, vals))
            docs += len(offs) - 1
            tokens += len(vals)
        if docs != shard["documents"] or tokens != shard["tokens"]:
            self._damaged(
                f"shard {name} holds {docs} documents and {tokens} tokens, the manifest records "
                f"{shard['documents']} and {shard['tokens']}"
            )
        return docs, tokens

    def _open_index(self, bounds: list[tuple[int, int]]) -> np.ndarray:
        m = self.manifest
        p = self.path / INDEX
        try:
            off = np.load(p, mmap_mode="r", allow_pickle=False)
        except Exception as e:  # a garbage header: ValueError, EOFError, tokenize errors ...
            self._damaged(f"{INDEX} is not a numpy array file ({_first_line(e)})")
        want = m["documents"] + 1
        if off.dtype != np.int64 or off.ndim != 1 or len(off) != want:
            self._damaged(
                f"{INDEX} holds {off.dtype} {list(off.shape)}; the manifest's {m['documents']} "
                f"documents need int64 [{want}]"
            )
        if bounds[-1] != (m["documents"], m["tokens"]):
            self._damaged(
                f"the shards hold {bounds[-1][0]} documents and {bounds[-1][1]} tokens, the "
                f"manifest records {m['documents']} and {m['tokens']}"
            )
        for docs, tokens in bounds:  # O(shards): the index agrees at every shard boundary
            if int(off[docs]) != tokens:
                self._damaged(
                    f"{INDEX} gives document {docs} offset {int(off[docs])}, the shards {tokens}"
                )
        return off

    def _verify_checksums(self, checksums: bool | None) -> None:
        m = self.manifest
        named = [(s["file"], s.get("crc32")) for s in m["shards"]]
        named.append((INDEX, self._index_record().get("crc32")))
        files = [(n, c) for n, c in named if isinstance(c, int)]
        if not files:  # a store prepared before checksums were recorded
            return
        stats = tuple((n, (self.path / n).stat().st_size, (self.path / n).stat().st_mtime_ns)
                      for n, _ in files)  # fmt: skip
        ident = (str(self.path.resolve()), stats)
        total = sum(size for _, size, _ in stats)
        if checksums is False or ident in _VERIFIED:
            return
        if checksums is None and total > CHECKSUM_BYTES:
            return
        for name, crc in files:
            got = crc32_file(self.path / name)
            if got != crc:
                self._damaged(
                    f"{name} has CRC32 {got:08x}, the manifest records {crc:08x} (its bytes "
                    "changed after it was prepared)"
                )
        _VERIFIED.add(ident)

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
        out = vals[offs[i] : offs[i + 1]]
        # Bytes changed after the open-time check (or a large store, not checksummed): one
        # line naming the document, not garbage ids or an IndexError in the embedding.
        want = int(self.offsets[d + 1]) - int(self.offsets[d])
        bad_id = len(out) and self.vocab_size is not None and int(out.max()) >= self.vocab_size
        if len(out) != want or bad_id or (len(out) and int(out.min()) < 0):
            shard = self.manifest["shards"][self._shard_of(d)]["file"]
            self._damaged(
                f"document {d} in {shard} holds {len(out)} tokens (the index says {want})"
                + (f" with ids outside the vocabulary (< {self.vocab_size})" if bad_id else "")
            )
        return out

    def _shard_of(self, d: int) -> int:
        ends = np.cumsum([s["documents"] for s in self.manifest["shards"]])
        return int(np.searchsorted(ends, d, side="right"))

    def token_counts(self) -> np.ndarray:
        """Tokens per document (int64; BOS and EOS included)."""
        return np.diff(np.asarray(self.offsets, dtype=np.int64))

    def verify(self) -> None:
        """Every recorded checksum, whatever the store's size (tools.prepare_data --verify)."""
        self._verify_checksums(True)

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


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:160]}" if text else type(e).__name__


# -- writing ------------------------------------------------------------------------------------
def _arrow_dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "int32"


def _write_shard(path: Path, docs: list[np.ndarray], dtype: str) -> tuple[int, int]:
    """One Arrow file through datasets' ArrowWriter, fsynced, then renamed into place;
    returns its (bytes, CRC32), read back from the written file."""
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
    size, crc = tmp.stat().st_size, crc32_file(tmp)
    publish_file(tmp, path)
    return size, crc


def _shard_lengths(folder: Path, files: list[str]) -> np.ndarray:
    """Tokens per document over the shards, from their Arrow list offsets (no token read)."""
    import pyarrow as pa

    parts = [np.zeros(0, dtype=np.int64)]
    for name in files:
        table = pa.ipc.open_stream(pa.memory_map(str(folder / name))).read_all()
        for chunk in table.column("ids").chunks:
            parts.append(np.diff(chunk.offsets.to_numpy()).astype(np.int64))
    return np.concatenate(parts)


def _shard_ok(work: Path, shard: Any) -> str | None:
    """None when a shard listed in progress.json is on disk as written, else why not."""
    if not isinstance(shard, dict) or not isinstance(shard.get("file"), str):
        return "an entry without a file name"
    name = shard["file"]
    p = work / Path(name).name
    try:
        size = p.stat().st_size
    except OSError as e:
        return f"{name} is missing ({e.strerror})"
    recorded = ("bytes", "crc32", "next_record")
    if not all(isinstance(shard.get(k), int) for k in recorded) or not isinstance(
        shard.get("bad"), dict
    ):
        return f"{name} has no size, checksum and source position recorded"
    if size != shard["bytes"]:
        return f"{name} is {size} bytes, {shard['bytes']} were written"
    if crc32_file(p) != shard["crc32"]:
        return f"{name} differs from what was written (CRC32)"
    return None


def _resume_progress(
    work: Path, ident: dict[str, Any], fresh: dict[str, Any], log: Callable[[str], None]
) -> dict[str, Any]:
    """The progress of an interrupted run in `work`, cut to the shards that are intact on
    disk; `fresh` (and an emptied folder) when there is none, it belongs to another source
    or tokenizer, or it cannot be read. Files not listed (a shard whose rename or progress
    write the interruption cut short) are removed."""
    prog_path = work / PROGRESS
    prog = fresh
    if prog_path.exists():
        try:
            old = json.loads(prog_path.read_bytes())
            if not isinstance(old, dict) or not isinstance(old.get("shards"), list):
                raise ValueError("not a progress object")
        except (OSError, ValueError) as e:
            log(f"{prog_path} is not readable ({_first_line(e)}): starting over")
            old = None
        if old is not None and all(old.get(k) == v for k, v in ident.items()):
            kept: list[dict[str, Any]] = []
            for sh in old["shards"]:
                why = _shard_ok(work, sh)
                if why:
                    log(f"{work}: {why}; resuming after the {len(kept)} intact shard(s) before it")
                    break
                kept.append(sh)
            last = kept[-1] if kept else None
            prog = {
                **fresh,
                "shards": kept,
                "next_record": last["next_record"] if last else 0,
                "bad": dict(last["bad"]) if last else fresh["bad"],
                "source_state": last.get("source_state") if last else None,
            }
    keep = {PROGRESS} | {s["file"] for s in prog["shards"]}
    for f in work.iterdir():
        if f.name not in keep:
            shutil.rmtree(f) if f.is_dir() and not f.is_symlink() else f.unlink()
    return prog


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
    try:
        work.mkdir(parents=True, exist_ok=True)
    except (OSError, ValueError) as e:
        why = getattr(e, "strerror", None) or str(e)
        raise ConfigError(f"cannot create {str(work)!r}: {why}", key="--out") from None
    prog_path = work / PROGRESS
    fresh: dict[str, Any] = {**ident, "shards": [], "next_record": 0}
    fresh["bad"] = dict.fromkeys(BAD_REASONS, 0)

    def log(line: str) -> None:
        print(f"prepare: {line}", file=sys.stderr)

    prog = _resume_progress(work, ident, fresh, log)
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
            size, crc = _write_shard(work / name, buf, dtype)
            prog["next_record"] = next_record
            # A streamed source resumes from datasets' own position, not by re-reading.
            prog["source_state"] = source.resume_state(next_record)
            prog["bad"] = dict(bad)
            # Each shard records where the source stood after it, so a resume can restart
            # after any intact shard (a later one may be damaged; _resume_progress).
            prog["shards"].append(
                {
                    "file": name,
                    "documents": len(buf),
                    "tokens": int(buf_tokens),
                    "bytes": size,
                    "crc32": crc,
                    "next_record": next_record,
                    "bad": dict(bad),
                    "source_state": prog["source_state"],
                }
            )
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
    shards = [
        {k: v for k, v in sh.items() if k in ("file", "documents", "tokens", "bytes", "crc32")}
        for sh in prog["shards"]
    ]
    index = {"file": INDEX, "bytes": (work / INDEX).stat().st_size,
             "crc32": crc32_file(work / INDEX)}  # fmt: skip
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
        "shards": shards,
        "index": index,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "prepare_seconds_last_run": seconds,
    }
    prog_path.unlink()
    write_json_atomic(work / MANIFEST, manifest)
    fsync_path(work)
    publish_folder(work, out, replace=False)  # fails if `out` exists (checked by the caller)
    return manifest
