"""Document sources through `datasets` (offline): jsonl, parquet, text, folders, bad records."""

from __future__ import annotations

import json

import pytest

from core.errors import ConfigError
from data.sources import open_source


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))


def write_jsonl(path, lines: list[bytes]) -> None:
    path.write_bytes(b"".join(line + b"\n" for line in lines))


BAD_JSONL = [
    json.dumps({"text": "first"}).encode(),
    b"",  # blank line: not a record
    json.dumps({"text": "   "}).encode(),  # empty
    b"{not json",  # invalid_json
    json.dumps(["a", "list"]).encode(),  # invalid_json (not an object)
    json.dumps({"body": "x"}).encode(),  # missing_field
    json.dumps({"text": 7}).encode(),  # not_text
    b'{"text": "bad \xff byte"}',  # undecodable
    json.dumps({"text": "last \u00e9"}).encode(),
]
EXPECTED = [
    (0, "first", None),
    (2, None, "empty"),
    (3, None, "invalid_json"),
    (4, None, "invalid_json"),
    (5, None, "missing_field"),
    (6, None, "not_text"),
    (7, None, "undecodable"),
    (8, "last \u00e9", None),
]


@pytest.mark.parametrize("streaming", ["never", "always"])
def test_jsonl_records_and_bad_records(tmp_path, streaming):
    p = tmp_path / "a.jsonl"
    write_jsonl(p, BAD_JSONL)
    src = open_source(str(p), streaming=streaming)
    assert list(src.records()) == EXPECTED
    # Resume at a record index: the same records from there on.
    assert list(src.records(5)) == EXPECTED[4:]
    assert ("streaming" in src.description) == (streaming == "always")


def test_parquet_text_field(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    table = pa.table({"content": ["one", None, "", "four"], "id": [1, 2, 3, 4]})
    pq.write_table(table, tmp_path / "d.parquet")
    src = open_source(str(tmp_path / "d.parquet"), text_field="content")
    assert list(src.records()) == [
        (0, "one", None),
        (1, None, "missing_field"),
        (2, None, "empty"),
        (3, "four", None),
    ]
    wrong = open_source(str(tmp_path / "d.parquet"), text_field="text")
    assert {bad for _, _, bad in wrong.records()} == {"missing_field"}


def test_text_folder_one_document_per_file(tmp_path):
    d = tmp_path / "corpus"
    (d / "sub").mkdir(parents=True)
    (d / "b.txt").write_text("second\nfile\n")
    (d / "a.txt").write_text("first file")
    (d / "sub" / "c.txt").write_bytes(b"caf\xe9 in latin-1")
    (d / "empty.txt").write_text("\n\n")
    (d / ".hidden.txt").write_text("never read")
    (d / "notes.md").write_text("other extensions are ignored")
    src = open_source(str(d))
    recs = list(src.records())
    assert recs == [
        (0, "first file", None),
        (1, "second\nfile\n", None),
        (2, None, "empty"),
        (3, None, "undecodable"),
    ]


def test_errors_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        open_source(str(tmp_path / "missing.jsonl"))
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(ConfigError, match="unsupported file type '.csv'"):
        open_source(str(tmp_path / "x.csv"))
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "a.txt").write_text("a")
    (mixed / "b.jsonl").write_text('{"text": "b"}\n')
    with pytest.raises(ConfigError, match="mixes jsonl and text"):
        open_source(str(mixed))
    (tmp_path / "none").mkdir()
    with pytest.raises(ConfigError, match="holds no"):
        open_source(str(tmp_path / "none"))
    with pytest.raises(ConfigError, match="hub is offline") as e:
        open_source("allenai/c4")
    assert e.value.key == "data.source"


def test_stdlib_source_matches_corpus():
    from data.corpus import stdlib_files

    src = open_source("stdlib")
    assert len(src) == len(stdlib_files())
    first = list(zip(range(5), src.records(), strict=False))
    assert [r[1][0] for r in first] == list(range(5))
    i, text, bad = next(iter(src.records(len(src) - 1)))
    assert i == len(src) - 1 and (text is not None or bad is not None)
