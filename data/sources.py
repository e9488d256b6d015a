"""Document sources: the embedded standard-library corpus, local files through `datasets`, hub.

Every source yields `(record index, text or None, bad-record reason or None)` in a fixed
order from any start index, so the packing stream can resume at a record. Bad records are
classified here and skipped or refused by the caller (`[data] bad_records`):

- undecodable: bytes that are not UTF-8 (text/jsonl lines are decoded with errors="replace"
  and a line holding U+FFFD is counted as undecodable; a literal U+FFFD in a source is
  counted too: it marks an earlier lossy decode).
- invalid_json: a JSON Lines line that does not parse to an object (blank lines are not
  records and are skipped silently).
- missing_field / not_text: the record lacks `text_field`, or it is not a string.
- empty: nothing but whitespace.

Local kinds: .jsonl/.json (JSON Lines, one object per line), .parquet, .txt (one document
per file), or a folder of one of these kinds (files in sorted path order). Files are read
through `datasets` ("text" and "parquet" builders): in memory-mapped Arrow form, or
streamed when `streaming` says so ("auto": above 1 GiB), which avoids the Arrow cache copy
but makes resuming at record n read n records again. Hub names are only tried when the
hub is not offline (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE); nothing is downloaded otherwise.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.errors import ConfigError
from core.jsonio import loads_line

BAD_REASONS = ("undecodable", "invalid_json", "missing_field", "not_text", "empty")
KINDS = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet", ".txt": "text"}
STREAM_ABOVE_BYTES = 1 << 30
BOM = b"\xef\xbb\xbf"  # UTF-8 byte-order mark: dropped at the start of a file
_BATCH = 256

Record = tuple[int, "str | None", "str | None"]
# text_field value meaning "the whole JSON record" (SFT: data.chat renders the line itself).
RAW_RECORD = "*"


def _classify_text(text: Any, *, check_replacement: bool) -> tuple[str | None, str | None]:
    if not isinstance(text, str):
        return None, "not_text" if text is not None else "missing_field"
    if check_replacement and "\ufffd" in text:
        return None, "undecodable"
    if not text.strip():
        return None, "empty"
    return text, None


def classify_jsonl_line(line: str, text_field: str) -> tuple[str | None, str | None]:
    if "\ufffd" in line:
        return None, "undecodable"
    try:
        obj = loads_line(line)
    except ValueError:
        return None, "invalid_json"
    if not isinstance(obj, dict):
        return None, "invalid_json"
    if text_field == RAW_RECORD:
        return line, None
    if text_field not in obj:
        return None, "missing_field"
    return _classify_text(obj[text_field], check_replacement=False)


@dataclass
class Source:
    """A fixed, ordered sequence of records (one pass = one epoch)."""

    description: str

    def records(self, start: int = 0) -> Iterator[Record]:
        raise NotImplementedError

    def __len__(self) -> int:  # pragma: no cover - overridden where known
        raise TypeError("length unknown (streaming source)")

    def resume_state(self, next_record: int) -> Any:
        """A small token from which `records(next_record)` resumes without re-reading
        (streamed `datasets` sources); None = resume by index."""
        return None

    def restore(self, next_record: int, state: Any) -> None:
        return None

    @property
    def known_length(self) -> int | None:
        try:
            return len(self)
        except TypeError:
            return None


class StdlibSource(Source):
    """This Python's standard-library sources, one document per .py file (data.corpus)."""

    def __init__(self) -> None:
        from data.corpus import stdlib_files, stdlib_root

        super().__init__(description=f"stdlib:{stdlib_root()}")
        self.files = stdlib_files()

    def __len__(self) -> int:
        return len(self.files)

    def records(self, start: int = 0) -> Iterator[Record]:
        for i in range(start, len(self.files)):
            try:
                raw = self.files[i].read_bytes()
            except OSError:
                yield i, None, "undecodable"
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                yield i, None, "undecodable"
                continue
            t, bad = _classify_text(text, check_replacement=False)
            yield i, t, bad


class DatasetsSource(Source):
    """Records from a `datasets` Dataset (random access) or IterableDataset (streaming)."""

    def __init__(self, ds: Any, *, kind: str, text_field: str, description: str) -> None:
        super().__init__(description=description)
        self.ds = ds
        self.kind = kind
        self.text_field = text_field
        self._states: dict[int, Any] = {}
        self._resume: tuple[int, Any] | None = None
        self._initial_state: Any = None

    def __len__(self) -> int:
        import datasets

        if isinstance(self.ds, datasets.Dataset):
            return len(self.ds)
        raise TypeError("length unknown (streaming source)")

    def _classify(self, value: Any) -> tuple[str | None, str | None]:
        if self.kind == "jsonl":
            return classify_jsonl_line(value, self.text_field)
        return _classify_text(value, check_replacement=self.kind == "text")

    def _column(self, batch: dict[str, list], n: int) -> list[Any]:
        col = "text" if self.kind in ("jsonl", "text") else self.text_field
        return batch[col] if col in batch else [None] * n

    def records(self, start: int = 0) -> Iterator[Record]:
        import datasets

        i = start
        if isinstance(self.ds, datasets.Dataset):
            n = len(self.ds)
            ds = self.ds
            col = "text" if self.kind in ("jsonl", "text") else self.text_field
            if col in ds.column_names:
                ds = ds.select_columns([col])
            for a in range(start, n, _BATCH):
                batch = ds[a : min(a + _BATCH, n)]
                m = min(a + _BATCH, n) - a
                for value in self._column(batch, m):
                    if self.kind == "jsonl" and not value.strip():
                        i += 1  # a blank line: not a record; keeps indices = line numbers
                        continue
                    yield (i, *self._classify(value))
                    i += 1
            return
        # A stream resumes through datasets' own state_dict (a shard and an offset in it),
        # not by reading the `start` records before it again.
        resume = self._resume
        self._resume = None
        if self._initial_state is None:
            self._initial_state = self.ds.state_dict()
        if start and resume is not None and resume[0] == start:
            self.ds.load_state_dict(resume[1])
            it = self.ds
        else:
            self.ds.load_state_dict(self._initial_state)
            it = self.ds.skip(start) if start else self.ds
        col = "text" if self.kind in ("jsonl", "text") else self.text_field
        for ex in it:
            value = ex.get(col)
            if self.kind == "jsonl" and not value.strip():
                i += 1
                continue
            self._states[i] = self.ds.state_dict() if it is self.ds else None
            if len(self._states) > 4 * _BATCH:
                for old in sorted(self._states)[: 2 * _BATCH]:
                    del self._states[old]
            yield (i, *self._classify(value))
            i += 1

    def resume_state(self, next_record: int) -> Any:
        """datasets' state after record next_record - 1 (streams only; None otherwise)."""
        if next_record == 0:
            return None
        return self._states.get(next_record - 1)

    def restore(self, next_record: int, state: Any) -> None:
        """The next `records(next_record)` starts from datasets' saved `state`."""
        self._resume = (next_record, state) if state is not None else None


def _offline() -> bool:
    truthy = {"1", "ON", "YES", "TRUE"}
    return any(
        os.environ.get(v, "").upper() in truthy for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    )


def local_files(path: Path, *, file: str | None, key: str) -> tuple[str, list[Path]]:
    """(kind, files) for a local file or folder; ConfigError for anything else."""
    want = ", ".join(sorted(KINDS))
    if path.is_file():
        kind = KINDS.get(path.suffix.lower())
        if kind is None:
            raise ConfigError(
                f"{str(path)!r}: unsupported file type {path.suffix or '(none)'!r}; expected "
                f"{want}, a folder of them, 'stdlib' or a hub dataset name",
                file=file,
                key=key,
            )
        return kind, [path]
    files = sorted(
        (
            p
            for p in path.rglob("*")
            if p.is_file()
            and not any(part.startswith(".") for part in p.relative_to(path).parts)
            and p.suffix.lower() in KINDS
        ),
        key=lambda p: p.relative_to(path).as_posix(),
    )
    kinds = sorted({KINDS[p.suffix.lower()] for p in files})
    if not kinds:
        raise ConfigError(f"folder {str(path)!r} holds no {want} files", file=file, key=key)
    if len(kinds) > 1:
        raise ConfigError(
            f"folder {str(path)!r} mixes {' and '.join(kinds)} files; use one kind per source",
            file=file,
            key=key,
        )
    return kinds[0], files


def _file_kind(path: Path) -> str:
    import stat

    try:
        mode = path.stat().st_mode
    except OSError:
        return "file that cannot be read"
    if stat.S_ISFIFO(mode):
        return "FIFO (named pipe)"
    if stat.S_ISSOCK(mode):
        return "socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "device"
    return "special file"


# check_records reads at most this much looking for one usable record; past it, the loader
# decides (a file this large with no usable record near its start is left to it).
SCAN_BYTES = 64 * 2**20


def scan_lines(files: list[Path], classify: Any, bad: dict[str, int], budget: list[int]) -> bool:
    """True at the first line `classify(line) -> reason | None` accepts (or when `budget[0]`
    bytes are read without deciding); counts the bad reasons in `bad`."""
    for p in files:
        with open(p, "rb") as fh:
            for n, raw in enumerate(fh):
                budget[0] -= len(raw)
                if budget[0] < 0:
                    return True  # not decided within the budget: the loader decides
                if n == 0:
                    raw = raw.removeprefix(BOM)  # as the loader reads it (utf-8-sig)
                line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
                if not line.strip():
                    continue  # blank lines are not records
                reason = classify(line)
                if reason is None:
                    return True
                bad[reason] = bad.get(reason, 0) + 1
    return False


def check_records(
    spec: str,
    *,
    text_field: str = "text",
    sft: bool = False,
    file: str | None = None,
    key: str = "data.source",
) -> None:
    """A local source holds at least one usable record, checked before any process group
    (the loader would otherwise find out after the device mesh exists). Reads only until
    the first usable record (at most SCAN_BYTES); `sft`: records must be chats with an
    assistant turn (data.chat.parse_record; rendering and length need the tokenizer and are
    left to the loader). Empty files, all-bad files and parquet without the text column
    are one ConfigError naming the key and what was found."""
    path = Path(spec)
    from data.store import is_store

    if sft and (spec == "stdlib" or is_store(path)):
        raise ConfigError(
            f"{spec!r} is not JSON Lines: sft records (chats or prompt/completion pairs) are "
            "read from local .jsonl files or folders (data.format = 'sft')",
            file=file,
            key=key,
        )
    if spec == "stdlib" or not path.exists():
        return
    if is_store(path):
        from data.store import TokenStore

        store = TokenStore(path, key=key)  # manifest, index and shards agree, or ConfigError
        if store.n_docs == 0:
            raise ConfigError(f"store {spec} holds 0 documents", file=file, key=key)
        return
    kind, files = local_files(path, file=file, key=key)
    where = spec if len(files) == 1 else f"{spec} ({len(files)} {kind} files)"
    if sft and kind != "jsonl":
        raise ConfigError(
            f"{where} holds {kind} files: sft records are read from JSON Lines (.jsonl)",
            file=file,
            key=key,
        )
    try:
        if sum(p.stat().st_size for p in files) == 0:
            raise ConfigError(f"{where} is empty (0 records)", file=file, key=key)
        bad: dict[str, int] = {}
        budget = [SCAN_BYTES]
        if kind == "parquet":
            _check_parquet(files, text_field, where, file=file, key=key)
            return
        if kind == "text":
            ok = False
            for p in files:
                with open(p, "rb") as fh:
                    text = fh.read(SCAN_BYTES).removeprefix(BOM).decode("utf-8", errors="replace")
                _t, reason = _classify_text(text, check_replacement=True)
                if reason is None or p.stat().st_size > SCAN_BYTES:  # too big to decide here
                    ok = True
                    break
                bad[reason] = bad.get(reason, 0) + 1
        elif sft:
            from data.chat import BadChat, parse_record

            def classify_chat(line: str) -> str | None:
                try:
                    ex = parse_record(loads_line(line))
                except BadChat as e:
                    return e.reason
                except ValueError:
                    return "invalid_json"
                # Weight 0 masks the whole example: a file of only those trains nothing.
                return "weight 0" if ex.weight == 0 else None

            ok = scan_lines(files, classify_chat, bad, budget)
        else:
            ok = scan_lines(files, lambda ln: classify_jsonl_line(ln, text_field)[1], bad, budget)
    except OSError as e:
        raise ConfigError(f"cannot read {spec!r}: {e.strerror or e}", file=file, key=key) from None
    if not ok:
        if kind == "text":
            what = "documents (non-blank UTF-8 text)"
        elif sft:
            what = "chat records with an assistant turn and a positive weight"
        else:
            what = f"records with a string field {text_field!r}"
        found = ", ".join(f"{k} {v}" for k, v in sorted(bad.items()))
        found = f"{sum(bad.values())} bad: {found}" if bad else "only blank lines"
        if "invalid_json" in bad and kind == "jsonl":
            found += "; .json/.jsonl files are read as JSON Lines, one object per line"
        raise ConfigError(f"{where} holds no usable {what} ({found})", file=file, key=key)


def _check_parquet(
    files: list[Path], text_field: str, where: str, *, file: str | None, key: str
) -> None:
    import pyarrow.parquet as pq

    rows = 0
    for p in files:
        try:
            meta = pq.read_metadata(p)
            names = pq.read_schema(p).names
        except Exception as e:  # pyarrow raises ArrowInvalid / OSError for a damaged file
            raise ConfigError(
                f"{p} is not a readable parquet file: {str(e).splitlines()[0][:200]}",
                file=file,
                key=key,
            ) from None
        if meta.num_rows and text_field not in names:
            raise ConfigError(
                f"{p} has no column {text_field!r} (columns: {', '.join(names[:20])}); set "
                "the source's text_field",
                file=file,
                key=key,
            )
        rows += meta.num_rows
    if rows == 0:
        raise ConfigError(f"{where} is empty (0 records)", file=file, key=key)


def check_source(spec: str, *, file: str | None = None, key: str = "data.source") -> str:
    """Cheap validation of `[data] source` (no `datasets` import, nothing read): returns
    'stdlib', 'local' or 'hub', or raises ConfigError naming the key."""
    if spec == "stdlib":
        return "stdlib"
    if not spec.strip():
        raise ConfigError(
            f"{spec!r} does not exist (expected 'stdlib', a file, a folder or a hub name)",
            file=file,
            key=key,
        )
    path = Path(spec)
    from data.store import TokenStore, is_store, looks_like_store

    if is_store(path):
        return "store"
    if looks_like_store(path):
        TokenStore(path, file=file, key=key)  # raises StoreDamaged: its manifest is missing
    if path.with_name(path.name + ".partial").exists() and not path.exists():
        raise ConfigError(
            f"{spec!r} is not prepared yet ({path.name}.partial holds an unfinished "
            "tools.prepare_data run: run it again to resume)",
            file=file,
            key=key,
        )
    if path.exists():
        if not path.is_file() and not path.is_dir():
            raise ConfigError(
                f"{spec!r} is a {_file_kind(path)}, not a regular file or a folder",
                file=file,
                key=key,
            )
        local_files(path, file=file, key=key)
        return "local"
    looks_local = spec.startswith((".", "/", "~")) or path.suffix.lower() in KINDS
    if looks_local or spec.count("/") > 1 or not spec.strip():
        raise ConfigError(f"{spec!r} does not exist", file=file, key=key)
    if _offline():
        raise ConfigError(
            f"{spec!r} is not a local file or folder, and the Hugging Face hub is offline "
            "(HF_HUB_OFFLINE / HF_DATASETS_OFFLINE): download the dataset and point "
            "data.source at the local copy",
            file=file,
            key=key,
        )
    return "hub"


def open_source(
    spec: str,
    *,
    text_field: str = "text",
    streaming: str = "auto",
    subset: str = "",
    split: str = "train",
    data_files: list[str] | None = None,
    file: str | None = None,
    key: str = "data.source",
) -> Source:
    """Resolve `[data] source`: 'stdlib', a local file/folder, or a hub dataset name
    (with its configuration `subset`, `split` and `data_files`). Not a store: the loader
    opens those with data.store.TokenStore."""
    if streaming not in ("auto", "always", "never"):
        raise ConfigError(
            f"expected 'auto', 'always' or 'never', got {streaming!r}",
            file=file,
            key="data.streaming",
        )
    where = check_source(spec, file=file, key=key)
    if where == "stdlib":
        return StdlibSource()
    if where == "store":
        raise ConfigError(f"{spec!r} is a prepared store, not a text source", file=file, key=key)
    import datasets

    datasets.disable_progress_bars()
    if where == "local":
        kind, files = local_files(Path(spec), file=file, key=key)
        size = sum(p.stat().st_size for p in files)
        stream = streaming == "always" or (streaming == "auto" and size > STREAM_ABOVE_BYTES)
        names = [str(p) for p in files]
        try:
            if kind == "parquet":
                ds = datasets.load_dataset(
                    "parquet", data_files=names, split="train", streaming=stream
                )
            else:
                ds = datasets.load_dataset(
                    "text",
                    data_files=names,
                    split="train",
                    streaming=stream,
                    sample_by="line" if kind == "jsonl" else "document",
                    # A UTF-8 byte-order mark at the start of a file (Windows editors write
                    # one) is not text: it would make the first JSON line invalid.
                    encoding="utf-8-sig",
                    encoding_errors="replace",
                    keep_linebreaks=kind == "text",
                )
        except Exception as e:  # datasets raises many types for unreadable files
            raise ConfigError(
                f"cannot read {spec!r} with datasets: {type(e).__name__}: {e}", file=file, key=key
            ) from None
        desc = f"{kind}:{spec} ({len(files)} file{'s' if len(files) != 1 else ''}"
        desc += ", streaming)" if stream else ")"
        return DatasetsSource(ds, kind=kind, text_field=text_field, description=desc)
    kwargs: dict[str, Any] = {"split": split, "streaming": True}
    if subset:
        kwargs["name"] = subset
    if data_files:
        kwargs["data_files"] = list(data_files)
    try:
        ds = datasets.load_dataset(spec, **kwargs)
    except Exception as e:
        raise ConfigError(
            f"cannot open hub dataset {spec!r}: {type(e).__name__}: {e} (no network? "
            "download it and point data.source at the local copy)",
            file=file,
            key=key,
        ) from None
    return DatasetsSource(
        ds, kind="hub", text_field=text_field, description=hub_description(spec, **kwargs)
    )


def hub_description(spec: str, **kwargs: Any) -> str:
    parts = [f"{k}={kwargs[k]}" for k in ("name", "split", "data_files") if kwargs.get(k)]
    return f"hub:{spec}" + (f" ({', '.join(parts)})" if parts else "")
