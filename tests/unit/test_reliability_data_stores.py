"""Token stores and tools.prepare_data: damage and bad arguments end in one line, exit 2.

A store is verified when it is opened (data.store.TokenStore, reached from
runtime.session.prepare through data.sources.check_source / check_records): each damaged
file below is one StoreDamaged line naming the key, the store and the file, where the old
code raised JSONDecodeError, FileNotFoundError, EOFError, ArrowInvalid or opened garbage.
The reference for "intact" is independent of the checks: the documents read back equal
the token ids the tokenizer gives for the source texts. tools.prepare_data runs in-process
through its `main` (what `python -m tools.prepare_data` runs); its resume after a damaged
progress file or shard must give the same store as an uninterrupted run.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from core.errors import ConfigError
from data.sources import check_records, check_source
from data.store import StoreDamaged, TokenStore, prepare
from tests.helpers.tiny_data import ListSource, make_tokenizer_dir
from tools import prepare_data
from tools.reliability_report import record_case

TEXTS = [f"alpha beta gamma {i} delta " * (1 + i % 4) for i in range(60)]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> str:
    return make_tokenizer_dir(tmp_path_factory.mktemp("tok"), TEXTS)


@pytest.fixture(scope="module")
def expected(tok_dir) -> list[np.ndarray]:
    """Independent reference: the ids of each text, BOS + tokens + EOS, from `tokenizers`."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(tok_dir) / "tokenizer.json"))
    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    return [np.array([bos, *tok.encode(t).ids, eos]) for t in TEXTS]


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory, tok_dir) -> Path:
    out = tmp_path_factory.mktemp("s") / "store"
    prepare(ListSource(TEXTS), tokenizer_dir=tok_dir, tokenizer_spec="t", out=out,
            fingerprint="fp", progress=False, shard_tokens=300)  # fmt: skip
    return out


def _open(spec: str, key: str = "data.source") -> TokenStore:
    """What session.prepare runs on a store (check_source, check_records), then the open."""
    check_source(spec, file="r.toml", key=key)
    check_records(spec, file="r.toml", key=key)
    return TokenStore(spec, key=key)


def _flip(path: Path, at: float, n: int = 16) -> None:
    b = bytearray(path.read_bytes())
    i = int(len(b) * at)
    for j in range(i, min(i + n, len(b))):
        b[j] ^= 0xFF
    path.write_bytes(bytes(b))


def _cut(path: Path, keep: float) -> None:
    path.write_bytes(path.read_bytes()[: int(path.stat().st_size * keep)])


def _edit_manifest(d: Path, fn) -> None:
    m = json.loads((d / "manifest.json").read_text())
    fn(m)
    (d / "manifest.json").write_text(json.dumps(m))


DAMAGE = {
    # name: (damage, file the message must name)
    "manifest missing": (lambda d: (d / "manifest.json").unlink(), "manifest.json"),
    "manifest empty": (lambda d: (d / "manifest.json").write_text(""), "manifest.json"),
    "manifest truncated": (lambda d: _cut(d / "manifest.json", 0.5), "manifest.json"),
    "manifest not an object": (lambda d: (d / "manifest.json").write_text("[]"), "manifest.json"),
    "manifest without shards": (
        lambda d: _edit_manifest(d, lambda m: m.pop("shards")),
        "manifest.json",
    ),
    "manifest shard path outside the store": (
        lambda d: _edit_manifest(d, lambda m: m["shards"][0].update(file="../x.arrow")),
        "shards[0]",
    ),
    "manifest counts wrong": (
        lambda d: _edit_manifest(d, lambda m: m["shards"][1].update(documents=999)),
        "shard-00001.arrow",
    ),
    "index missing": (lambda d: (d / "documents.npy").unlink(), "documents.npy"),
    "index empty": (lambda d: (d / "documents.npy").write_bytes(b""), "documents.npy"),
    "index truncated": (lambda d: _cut(d / "documents.npy", 0.6), "documents.npy"),
    "index garbage": (lambda d: _flip(d / "documents.npy", 0.7), "documents.npy"),
    "index a folder": (
        lambda d: ((d / "documents.npy").unlink(), (d / "documents.npy").mkdir()),
        "documents.npy",
    ),
    "shard missing": (lambda d: (d / "shard-00001.arrow").unlink(), "shard-00001.arrow"),
    "shard empty": (lambda d: (d / "shard-00001.arrow").write_bytes(b""), "shard-00001.arrow"),
    "shard truncated": (lambda d: _cut(d / "shard-00002.arrow", 0.5), "shard-00002.arrow"),
    "garbage inside a shard": (lambda d: _flip(d / "shard-00000.arrow", 0.5), "shard-00000.arrow"),
}


@pytest.mark.parametrize("name", list(DAMAGE))
def test_damaged_store_is_one_line_naming_the_file(tmp_path, store_dir, name):
    damage, names = DAMAGE[name]
    d = tmp_path / "store"
    shutil.copytree(store_dir, d)
    damage(d)
    for key in ("data.source", "data.sources[1].source"):
        with pytest.raises(ConfigError) as e:
            _open(str(d), key)
        msg = str(e.value)
        assert isinstance(e.value, StoreDamaged) and e.value.key == key, msg
        assert names in msg and str(d) in msg and "\n" not in msg, msg
    record_case("token store", name, n=2)


def test_intact_store_reads_the_tokenizer_ids(store_dir, expected):
    store = _open(str(store_dir))
    assert store.n_docs == len(expected)
    for d, ids in enumerate(expected):
        assert np.array_equal(store.doc_tokens(d), ids)


def test_garbage_after_the_check_is_caught_at_read(tmp_path, store_dir, tok_dir):
    """A store too large to checksum at every open (checksums=False here) whose values
    changed: the document read says so in one line, instead of ids past the vocabulary
    reaching the embedding (shown to be there: the raw values exceed the vocabulary)."""
    import pyarrow as pa

    d = tmp_path / "store"
    shutil.copytree(store_dir, d)
    shard = d / "shard-00000.arrow"
    table = pa.ipc.open_stream(pa.memory_map(str(shard))).read_all()
    vals = table.column("ids").chunks[0].values.to_numpy()
    raw = bytearray(shard.read_bytes())
    start = bytes(raw).find(vals[:8].tobytes())  # the values buffer, by content
    raw[start + 4 : start + 40] = b"\xff" * 36
    shard.write_bytes(bytes(raw))
    vocab = json.loads((d / "manifest.json").read_text())["tokenizer"]["vocab_size"]
    again = pa.ipc.open_stream(pa.memory_map(str(shard))).read_all()
    assert int(again.column("ids").chunks[0].values.to_numpy().max()) >= vocab
    store = TokenStore(d, checksums=False)
    with pytest.raises(StoreDamaged, match=r"document 0 in shard-00000.arrow .*vocabulary"):
        store.doc_tokens(0)
    with pytest.raises(StoreDamaged, match="CRC32"):
        TokenStore(d, checksums=True)
    record_case("token store", "garbage read after the check")


@settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    file=st.sampled_from(
        ["manifest.json", "documents.npy", "shard-00000.arrow", "shard-00001.arrow"]
    ),  # fmt: skip
    how=st.sampled_from(["flip", "cut", "zero"]),
    at=st.floats(0.0, 0.999),
    n=st.integers(1, 64),
    checksums=st.booleans(),
)
def test_fuzzed_damage_is_refused_or_harmless(tmp_path_factory, store_dir, expected, file, how,
                                             at, n, checksums):  # fmt: skip
    """Any byte damage to any file: refused in one line naming the store, or (a change the
    manifest does not describe, e.g. its creation date) every document still reads exactly.
    Without checksums (a store too large to checksum at open) the Arrow and index checks
    and the per-document checks face the damage alone: one line or plain arrays, never
    another exception (found: an ArrowInvalid traceback, and once a SIGSEGV in pyarrow's
    reader, before shards were validated and checksummed ahead of parsing)."""
    d = tmp_path_factory.mktemp("fz") / "store"
    shutil.copytree(store_dir, d)
    p = d / file
    if how == "flip":
        _flip(p, at, n)
    elif how == "cut":
        _cut(p, at)
    else:
        b = bytearray(p.read_bytes())
        i = int(len(b) * at)
        b[i : i + n] = bytes(len(b[i : i + n]))
        p.write_bytes(bytes(b))
    try:
        store = _open(str(d)) if checksums else TokenStore(d, checksums=False)
        got = [store.doc_tokens(i) for i in range(store.n_docs)]
    except ConfigError as e:
        assert str(d) in str(e) and "\n" not in str(e), str(e)
        record_case("token store", "fuzzed damage (refused)")
        return
    if not checksums:  # undetectable without checksums: ids changed within the vocabulary
        record_case("token store", "fuzzed damage (no checksums, read)")
        return
    assert len(got) == len(expected)
    assert all(np.array_equal(a, b) for a, b in zip(got, expected, strict=True))
    record_case("token store", "fuzzed damage (harmless)")


# -- tools.prepare_data -----------------------------------------------------------------------
def run_main(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        prepare_data.main(argv)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def source_file(tmp_path_factory) -> str:
    p = tmp_path_factory.mktemp("src") / "a.jsonl"
    p.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    return str(p)


def test_bad_arguments_are_one_line(tmp_path, source_file, tok_dir, capsys):
    (tmp_path / "file").write_text("x")
    good = ["--source", source_file, "--tokenizer", tok_dir, "--out", str(tmp_path / "o")]
    cases = [
        ([], "--source, --tokenizer, --out"),
        (["--source", source_file], "--tokenizer, --out"),
        (["--tokenizer", "embedded", "--vocab-size", "-5", *good[:2], *good[4:]], "--vocab-size"),
        (["--tokenizer", "embedded", "--vocab-size", "0", *good[:2], *good[4:]], "--vocab-size"),
        (["--tokenizer", "embedded", "--vocab-size", "100", *good[:2], *good[4:]], "256 byte"),
        ([*good, "--max-records", "-1"], "--max-records"),
        ([*good, "--max-records", "0"], "--max-records"),
        ([*good, "--shard-tokens", "-1"], "--shard-tokens"),
        ([*good, "--shard-tokens", "0"], "--shard-tokens"),
        ([*good, "--shard-tokens", str(2**40)], "--shard-tokens"),
        ([*good, "--num-proc", "0"], "--num-proc"),
        ([*good, "--num-proc", "100000"], "--num-proc"),
        ([*good, "--vocab-size", "x"], "--vocab-size"),
        ([*good[:4], "--out", str(tmp_path / "file" / "sub")], "--out"),
        ([*good[:4], "--out", ""], "--out"),
        ([*good, "--plan", "bfd:0"], "--plan"),
        (["--verify", str(tmp_path / "nothing")], "--verify"),
        (["--verify", source_file], "--verify"),
    ]
    for argv, needle in cases:
        code, _, err = run_main(argv, capsys)
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (argv, err)
        assert needle in lines[0], (needle, lines[0])
        record_case("tools.prepare_data", "bad argument")
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.partial").exists()


@settings(max_examples=30, deadline=None)
@given(flag=st.sampled_from(["--max-records", "--shard-tokens", "--num-proc"]),
       value=st.integers(max_value=0))  # fmt: skip
def test_fuzzed_non_positive_sizes_are_refused(flag, value):
    args = prepare_data.parse_args(["--source", "s", "--tokenizer", "t", "--out", "o",
                                    flag, str(value)])  # fmt: skip
    with pytest.raises(ConfigError) as e:
        prepare_data.check_sizes(args)
    assert e.value.key == flag and "\n" not in str(e.value)
    record_case("tools.prepare_data", "bad argument (fuzzed)")


def _interrupted(tmp_path: Path, source_file: str, tok_dir: str, after: int) -> Path:
    """A prepare_data run stopped after shard `after` (its .partial folder left behind)."""
    from data.sources import open_source

    class Stop(Exception):
        pass

    def stop(n: int) -> None:
        if n == after:
            raise Stop

    out = tmp_path / "store"
    args = prepare_data.parse_args(["--source", source_file, "--tokenizer", tok_dir,
                                    "--out", str(out)])  # fmt: skip
    src = open_source(source_file, key="--source")
    with pytest.raises(Stop):
        prepare(src, tokenizer_dir=tok_dir, tokenizer_spec=tok_dir, out=out, progress=False,
                fingerprint=prepare_data._fingerprint(args, src), shard_tokens=300,
                on_shard=stop)  # fmt: skip
    return out


@pytest.mark.parametrize(
    "damage",
    [
        "progress.json garbage",
        "progress.json truncated",
        "progress.json empty",
        "shard truncated",
        "shard missing",
        "shard garbage",
        "stray tmp file",
    ],  # fmt: skip
)
def test_resume_after_damage_gives_the_uninterrupted_store(tmp_path, source_file, tok_dir,
                                                           expected, damage, capsys):  # fmt: skip
    out = _interrupted(tmp_path, source_file, tok_dir, after=2)
    work = out.with_name("store.partial")
    prog = work / "progress.json"
    if damage == "progress.json garbage":
        prog.write_bytes(b"\x00\xffnot json")
    elif damage == "progress.json truncated":
        _cut(prog, 0.5)
    elif damage == "progress.json empty":
        prog.write_text("")
    elif damage == "shard truncated":
        _cut(work / "shard-00001.arrow", 0.5)
    elif damage == "shard missing":
        (work / "shard-00002.arrow").unlink()
    elif damage == "shard garbage":
        _flip(work / "shard-00001.arrow", 0.5)
    else:
        (work / "shard-00003.arrow.tmp").write_bytes(b"half a shard")
    code, _, err = run_main(["--source", source_file, "--tokenizer", tok_dir, "--out", str(out),
                             "--shard-tokens", "300", "--no-progress"], capsys)  # fmt: skip
    assert code == 0 and "Traceback" not in err, err
    if damage != "stray tmp file":
        assert len([ln for ln in err.splitlines() if ln.startswith("prepare: ")]) == 1, err
    store = TokenStore(out)
    assert [list(store.doc_tokens(i)) for i in range(store.n_docs)] == [list(e) for e in expected]
    assert not work.exists()
    record_case("tools.prepare_data", "resume after damage")
