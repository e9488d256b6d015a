"""Data sources that cannot train are refused before any process group; tiny ones do not spam.

`data.sources.check_records` (called by runtime.session.prepare for every source key) against
files written here: each bad source is one ConfigError naming the key and what was found; the
good ones pass. The reference for "bad" is the loader itself: the same files through
`PackedStream` find no usable document (or `datasets` cannot read them).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from core.errors import ConfigError
from data.sources import check_records, check_source
from tools.reliability_report import record_case


def _check(spec: str, *, sft: bool = False, key: str = "data.source") -> None:
    check_source(spec, file="r.toml", key=key)
    check_records(spec, sft=sft, file="r.toml", key=key)


def _write(path: Path, text: str | bytes) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text.encode() if isinstance(text, str) else text)
    return str(path)


def _bad_sources(tmp: Path) -> list[tuple[str, str, bool, str]]:
    """(name, spec, sft, words the message must hold)."""
    fifo = tmp / "pipe.jsonl"
    tmp.mkdir(parents=True, exist_ok=True)
    os.mkfifo(fifo)
    (tmp / "emptydir").mkdir()
    (tmp / "txts").mkdir()
    _write(tmp / "txts" / "a.txt", "")
    _write(tmp / "txts" / "b.txt", "  \n\t\n")
    return [
        ("empty jsonl", _write(tmp / "e.jsonl", ""), False, "is empty (0 records)"),
        ("blank lines", _write(tmp / "b.jsonl", "\n\n  \n"), False, "only blank lines"),
        ("all invalid json", _write(tmp / "i.jsonl", "x\n[1]\n{\n"), False, "invalid_json 3"),
        ("no text field", _write(tmp / "m.jsonl", '{"t": "a"}\n'), False, "missing_field 1"),
        ("text not a string", _write(tmp / "n.jsonl", '{"text": 5}\n'), False, "not_text 1"),
        ("empty texts", _write(tmp / "w.jsonl", '{"text": " "}\n'), False, "empty 1"),
        ("undecodable", _write(tmp / "u.jsonl", b'{"text": "\xff\xfe"}\n'), False, "undecodable"),
        ("fifo", str(fifo), False, "FIFO"),
        ("empty folder", str(tmp / "emptydir"), False, "holds no"),
        ("blank txt folder", str(tmp / "txts"), False, "non-blank"),
        ("whitespace txt", _write(tmp / "w.txt", "\n \n"), False, "empty 1"),
        (
            "chat without assistant",
            _write(tmp / "c.jsonl", json.dumps({"messages": [{"role": "user", "content": "hi"}]})),
            True,
            "no_assistant 1",
        ),
        ("chat: not chats", _write(tmp / "p.jsonl", '{"text": "a"}\n'), True, "not_chat 1"),
        (
            "chat: bad role",
            _write(tmp / "r.jsonl", '{"messages": [{"role": "bot", "content": "x"}]}\n'),
            True,
            "unknown_role 1",
        ),
        ("parquet: not parquet", _write(tmp / "x.parquet", b"PAR1"), False, "parquet"),
    ]


def test_bad_sources_are_one_line_naming_the_key(tmp_path):
    for name, spec, sft, words in _bad_sources(tmp_path):
        for key in ("data.source", "data.sources[1].source"):
            with pytest.raises(ConfigError) as e:
                _check(spec, sft=sft, key=key)
            msg = str(e.value)
            assert e.value.key == key and words in msg and "\n" not in msg, (name, msg)
            assert spec.split("/")[-1] in msg, (name, msg)
            record_case("train.py", "data source")


def test_parquet_empty_and_without_the_column(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": pa.array([], pa.string())}), tmp_path / "e.parquet")
    pq.write_table(pa.table({"body": ["a"]}), tmp_path / "c.parquet")
    pq.write_table(pa.table({"text": ["a b"]}), tmp_path / "ok.parquet")
    with pytest.raises(ConfigError, match=r"is empty \(0 records\)"):
        _check(str(tmp_path / "e.parquet"))
    with pytest.raises(ConfigError, match="no column 'text'.*body"):
        _check(str(tmp_path / "c.parquet"))
    _check(str(tmp_path / "ok.parquet"))
    record_case("train.py", "data source", n=2)


def test_good_sources_pass_and_the_loader_agrees(tmp_path):
    """One good record among bad ones is enough (the loader skips the rest)."""
    good = _write(tmp_path / "g.jsonl", 'x\n{"t": 1}\n\n{"text": "hello"}\n')
    _check(good)
    chat = _write(tmp_path / "c.jsonl", '{"prompt": "a", "completion": "b"}\n')
    _check(chat, sft=True)
    _check(_write(tmp_path / "d" / "a.txt", "some text"))
    _check("data/tasks/letter_sort/train.jsonl", sft=True)


def test_the_loader_finds_no_documents_where_the_check_refuses(tmp_path):
    """Independent reference: the training loader on the same all-bad files fails too."""
    from data.loader import PackedStream
    from tests.helpers.tiny_data import CharTokenizer

    for name, spec, sft, _ in _bad_sources(tmp_path / "ref"):
        if sft or name in ("fifo", "empty folder", "parquet: not parquet", "empty jsonl"):
            continue
        stream = PackedStream(
            source=spec, tokenizer=CharTokenizer(), seq_len=16, dp_rank=0, dp_world_size=1
        )
        with pytest.raises(ConfigError, match="no usable documents"):
            next(iter(stream))


def _epoch_lines(caplog, rows_per_step: int, texts: list[str], rows: int) -> list[str]:
    from data.loader import PackedStream
    from tests.helpers.tiny_data import CharTokenizer, ListSource

    stream = PackedStream(
        source=ListSource(texts), tokenizer=CharTokenizer(), seq_len=64, dp_rank=0,
        dp_world_size=1,
    )  # fmt: skip
    stream.rows_per_step = rows_per_step
    caplog.clear()
    with caplog.at_level(logging.INFO):
        it = iter(stream)
        for _ in range(rows):
            next(it)
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("data:")]


def test_tiny_dataset_logs_epochs_sparingly(caplog):
    """A 3-token source (one row per pass) read for 1024 rows: 1024 passes, but one warning
    and an epoch line only at powers of two (11 lines, not 1023)."""
    lines = _epoch_lines(caplog, rows_per_step=8, texts=["a"], rows=1024)
    warnings = [ln for ln in lines if "less than one step's batch" in ln]
    epochs = [ln for ln in lines if ln.startswith("data: epoch")]
    assert len(warnings) == 1, lines[:5]
    assert "3 tokens" in warnings[0] or "2 tokens" in warnings[0], warnings[0]
    assert len(epochs) <= 11 and any("epoch 512" in ln and "re-read 511" in ln for ln in epochs)
    record_case("train.py", "tiny dataset")


def test_normal_dataset_logs_every_epoch(caplog):
    """A pass longer than a step keeps one line per epoch (nothing hidden)."""
    text = "x" * 400  # 401 token pairs: 7 rows of 64 per pass
    lines = _epoch_lines(caplog, rows_per_step=2, texts=[text], rows=7 * 5)
    assert len(lines) >= 4, lines
    assert [ln.split(" of ")[0] for ln in lines] == [
        f"data: epoch {e}" for e in range(1, len(lines) + 1)
    ]


def test_tiny_store_warns_once_and_store_checks(tmp_path, caplog):
    """A prepared store of one short document: the loader warns (rows per epoch < one
    batch) when built; check_records opens the store (index and shards must agree)."""
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    from data.loader import TitanscaleDataLoader
    from data.store import prepare
    from tests.helpers.tiny_data import ListSource, make_tokenizer_dir

    tok_dir = make_tokenizer_dir(tmp_path / "tok", ["some words here"] * 20)
    out = tmp_path / "store"
    prepare(ListSource(["a b"]), tokenizer_dir=tok_dir, tokenizer_spec="test", out=out,
            fingerprint="fp", progress=False)  # fmt: skip
    _check(str(out))  # one document: usable
    cfg = TitanscaleDataLoader.Config(source=str(out))
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        TitanscaleDataLoader(cfg, dp_world_size=1, dp_rank=0, seq_len=64, local_batch_size=8,
                             tokenizer=HuggingFaceTokenizer(tokenizer_path=tok_dir))  # fmt: skip
    warned = [
        r.getMessage() for r in caplog.records if "less than one step's batch" in r.getMessage()
    ]
    assert len(warned) == 1 and "8 rows" in warned[0], warned
    record_case("train.py", "tiny dataset")


def test_sft_needs_json_lines(tmp_path):
    """data.format = 'sft' over the stdlib corpus, a text folder or parquet: refused before
    the mesh (the loader found no usable example only after it)."""
    txt = _write(tmp_path / "a.txt", "hello")
    for spec in ("stdlib", txt):
        with pytest.raises(ConfigError, match="JSON Lines"):
            check_records(spec, sft=True, file="r.toml")
        record_case("train.py", "data source")
