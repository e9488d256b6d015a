"""Prepared token stores: atomic and resumable preparation, rows equal to the streaming
path, resume at another dp, mixing proportions, tokenizer mismatch, streamed-source resume.

Ranks are simulated in one process (as in test_data_resume.py): dp streams advanced in
lockstep, each yielding its row of every group of dp global rows.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from torchtitan.components.tokenizer import HuggingFaceTokenizer

from core.errors import ConfigError
from data.loader import PackedStream, TitanscaleDataLoader
from data.sources import check_source
from data.store import TokenStore, is_store, prepare
from data.store_stream import MixedStream, MixSource, PlannedRows, StoreStream, mix_counts
from tests.helpers.tiny_data import ListSource, lockstep, make_tokenizer_dir
from tests.helpers.tiny_data import same_rows as same

SEQ = 48
WORDS = ["alpha", "beta", "gamma", "delta", "(", ")", "x", "y", "def", "return"]


def texts(n: int, seed: int, prefix: str = "") -> list[str | None]:
    rng = random.Random(seed)
    out: list[str | None] = [
        prefix + " ".join(rng.choices(WORDS, k=rng.randint(1, 90))) for _ in range(n)
    ]
    out[3] = None  # a bad record: skipped and counted, in the stream and in the store
    return out


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> str:
    return make_tokenizer_dir(tmp_path_factory.mktemp("tok"), [t for t in texts(80, 1) if t])


@pytest.fixture(scope="module")
def tok(tok_dir):
    return HuggingFaceTokenizer(tokenizer_path=tok_dir)


def make_store(path: Path, src, tok_dir: str, **kw) -> TokenStore:
    prepare(src, tokenizer_dir=tok_dir, tokenizer_spec="test", out=path, fingerprint="fp",
            progress=False, **kw)  # fmt: skip
    return TokenStore(path)


@pytest.fixture(scope="module")
def store(tmp_path_factory, tok_dir) -> TokenStore:
    src = ListSource(texts(120, 2))
    return make_store(tmp_path_factory.mktemp("s") / "store", src, tok_dir, shard_tokens=500,
                      chunk_records=16)  # fmt: skip


def store_streams(store, dp: int, packing: str, tok, **kw):
    return [
        StoreStream(
            store,
            seq_len=SEQ,
            dp_rank=r,
            dp_world_size=dp,
            packing=packing,
            window=8,
            pad_id=tok.eos_id,
            vocab_size=tok.get_vocab_size(),
            **kw,
        )  # fmt: skip
        for r in range(dp)
    ]


def test_store_layout_and_counts(store, tok):
    m = store.manifest
    assert len(m["shards"]) > 2, "small shard_tokens should give several shards"
    assert m["documents"] == 119 and m["bad_records"]["empty"] == 1
    good = [t for t in texts(120, 2) if t]
    want = [tok.encode(t, add_bos=True, add_eos=True) for t in good]
    assert m["tokens"] == sum(len(w) for w in want)
    for d in (0, 57, 118):  # document d's ids read back through the memory map
        assert store.doc_tokens(d).tolist() == want[d]
    assert store.doc_tokens(0).dtype == np.uint16  # vocab 320 fits 16 bits
    assert isinstance(store.offsets, np.memmap)


@pytest.mark.parametrize("packing", ["concat", "bfd", "none"])
@pytest.mark.parametrize("infinite", [False, True])
def test_store_rows_equal_stream_rows(store, tok, packing, infinite):
    stream = PackedStream(source=ListSource(texts(120, 2)), tokenizer=tok, seq_len=SEQ,
                          dp_rank=0, dp_world_size=1, packing=packing, window=8,
                          infinite=infinite)  # fmt: skip
    (s,) = store_streams(store, 1, packing, tok, infinite=infinite)
    n = None if not infinite else 3 * s.rows.plan.rows_per_epoch + 5  # crosses 3 epochs
    want = lockstep([stream], n)
    assert same(lockstep([s], n), want)
    # dp = 3: rank r holds global rows r, r + 3, ...; finite streams end with padding rows
    got = lockstep(store_streams(store, 3, packing, tok, infinite=infinite),
                   None if n is None else n // 3)  # fmt: skip
    if infinite:  # n // 3 groups of 3 rows: the first 3 * (n // 3) of the reference's
        assert len(got) == 3 * (n // 3) and same(got, want[: len(got)])
    else:  # every row, then fewer than dp padding rows (each rank yields as many rows)
        assert len(want) <= len(got) < len(want) + 3, (len(got), len(want))
        assert same(got[: len(want)], want)
        assert all(bool((r[2] == -100).all()) for r in got[len(want) :])


@pytest.mark.parametrize("packing", ["bfd", "concat"])
@pytest.mark.parametrize(("before", "after"), [(2, 3), (4, 1)])
def test_store_resume_at_other_dp(store, tok, packing, before, after):
    ref = lockstep(store_streams(store, 1, packing, tok, infinite=False))
    a = store_streams(store, before, packing, tok, infinite=False)
    head = lockstep(a, groups=29 // before + 1)
    states = [json.dumps(s.state_dict()) for s in a]
    assert len(set(states)) == 1 and len(states[0]) < 1000, "small, identical on every rank"
    b = store_streams(store, after, packing, tok, infinite=False)
    for s in b:
        s.load_state_dict(json.loads(states[0]))
    rows = head + lockstep(b)
    assert same(rows[: len(ref)], ref)
    assert all(bool((r[2] == -100).all()) for r in rows[len(ref) :])
    wrong = store_streams(store, 1, "none" if packing != "none" else "bfd", tok)[0]
    with pytest.raises(ValueError, match="packing: checkpoint"):
        wrong.load_state_dict(json.loads(states[0]))


def mixed(sources, dp, tok, window=8):
    return [MixedStream(sources, seq_len=SEQ, dp_rank=r, dp_world_size=dp, window=window,
                        vocab_size=tok.get_vocab_size()) for r in range(dp)]  # fmt: skip


def three_sources(tmp_path, tok_dir, tok, store):
    """The module's store (weight 5), a second store (2) and an in-memory source (1)."""
    other = make_store(tmp_path / "other", ListSource(texts(40, 3, prefix="@ ")), tok_dir)
    from data.store_stream import MemoryStore

    mem = MemoryStore(ListSource(texts(30, 4, prefix="# ")), tok)
    mk = lambda s: PlannedRows(s, packing="bfd", seq_len=SEQ, window=8, pad_id=tok.eos_id)  # noqa: E731
    return [MixSource("a", 5.0, mk(store)), MixSource("b", 2.0, mk(other)),
            MixSource("c", 1.0, mk(mem))]  # fmt: skip


def test_mixing_proportions_exact_per_window(tmp_path, tok_dir, tok, store):
    srcs = three_sources(tmp_path, tok_dir, tok, store)
    (m,) = mixed(srcs, 1, tok, window=8)
    assert mix_counts([5, 2, 1], 8) == [5, 2, 1]
    # Each source's rows, in order, from its own plan: the reference for what the mix holds.
    # A mixed row must be the next unused row of exactly one source.
    per_source_rows = [[s.rows.row(k) for k in range(60)] for s in srcs]
    taken = [0, 0, 0]
    useful = [0, 0, 0]
    window_counts = []
    rows = lockstep([m], 8 * 12)
    for w in range(12):
        c = Counter()
        for inp, _pos, lab in rows[8 * w : 8 * w + 8]:
            nxt = [torch.from_numpy(per_source_rows[j][taken[j]][0]) for j in range(3)]
            hits = [j for j in range(3) if torch.equal(inp, nxt[j])]
            assert len(hits) == 1, "a source's next row, in order"
            i = hits[0]
            taken[i] += 1
            useful[i] += int((lab != -100).sum())
            c[i] += 1
        window_counts.append([c[0], c[1], c[2]])
    assert all(wc == [5, 2, 1] for wc in window_counts)
    st = m.packing_stats()
    assert [s["useful_tokens"] for s in st["sources"]] == useful
    assert [s["rows"] for s in st["sources"]] == taken
    assert st["useful_tokens"] == sum(useful)
    with pytest.raises(ValueError, match="gives a source no row"):
        mix_counts([100, 1], 8)


@pytest.mark.parametrize(("before", "after"), [(2, 3), (3, 1)])
def test_mixed_resume_at_other_dp(tmp_path, tok_dir, tok, store, before, after):
    srcs = three_sources(tmp_path, tok_dir, tok, store)
    ref = lockstep(mixed(srcs, 1, tok), 60)
    a = mixed(srcs, before, tok)
    head = lockstep(a, groups=25 // before + 1)
    state = json.dumps(a[0].state_dict())
    assert len(state) < 2000
    b = mixed(srcs, after, tok)
    for s in b:
        s.load_state_dict(json.loads(state))
    rows = head + lockstep(b, (60 - len(head)) // after)
    assert len(rows) == len(head) + after * ((60 - len(head)) // after) > 50
    assert same(rows, ref[: len(rows)])


def test_interrupted_prepare_is_never_a_store_and_resumes(tmp_path, tok_dir, store):
    src = ListSource(texts(120, 2))
    out = tmp_path / "store"

    class Stop(Exception):
        pass

    def stop_after_two(n: int) -> None:
        if n == 1:
            raise Stop

    with pytest.raises(Stop):
        prepare(src, tokenizer_dir=tok_dir, tokenizer_spec="test", out=out, fingerprint="fp",
                progress=False, shard_tokens=500, chunk_records=16,
                on_shard=stop_after_two)  # fmt: skip
    assert not out.exists() and not is_store(out)
    assert (tmp_path / "store.partial" / "shard-00001.arrow").exists()
    with pytest.raises(ConfigError, match="not prepared yet"):
        check_source(str(out))
    with pytest.raises(ConfigError, match="not a prepared token store"):
        TokenStore(out)
    seen = []
    prepare(src, tokenizer_dir=tok_dir, tokenizer_spec="test", out=out, fingerprint="fp",
            progress=False, shard_tokens=500, chunk_records=16, on_shard=seen.append)  # fmt: skip
    assert seen[0] == 2, "resumed after the two finished shards"
    again = TokenStore(out)
    assert np.array_equal(np.asarray(again.offsets), np.asarray(store.offsets))
    for d in range(store.n_docs):
        assert np.array_equal(again.doc_tokens(d), store.doc_tokens(d))
    assert not (tmp_path / "store.partial").exists()


def test_store_from_another_tokenizer_is_refused(tmp_path, store):
    from tools import packstats

    other = make_tokenizer_dir(tmp_path / "tok2", ["completely different words"] * 20, 300)
    with pytest.raises(ConfigError, match="prepared with another tokenizer"):
        store.check_tokenizer(other)
    cfg = TitanscaleDataLoader.Config(source=str(store.path))
    with pytest.raises(ConfigError, match="prepared with another tokenizer"):
        cfg.build(dp_world_size=1, dp_rank=0, seq_len=SEQ, local_batch_size=1,
                  tokenizer=HuggingFaceTokenizer(tokenizer_path=other))  # fmt: skip
    with pytest.raises(SystemExit) as e:
        packstats.main(["--data", str(store.path), "--tokenizer", other, "--seq-len", "64",
                        "--dp", "2", "--rows", "3"])  # fmt: skip
    assert e.value.code == 2


def test_packstats_rank_rows(store, tok_dir, tok, capsys):
    from tools import packstats

    out = packstats.main(["--data", str(store.path), "--tokenizer", tok_dir, "--seq-len",
                          str(SEQ), "--packing", "bfd", "--window", "8", "--dp", "4",
                          "--rank", "3", "--rows", "5", "--json"])  # fmt: skip
    assert out["path"] == "store" and out["rows"] == 5 and out["rank_seconds"] > 0
    (s,) = store_streams(store, 1, "bfd", tok)
    ref = lockstep([s], 20)
    assert out["useful_tokens"] == sum(int((ref[3 + 4 * i][2] != -100).sum()) for i in range(5))
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rank"] == 3
    whole = packstats.main(["--data", str(store.path), "--tokenizer", tok_dir, "--seq-len",
                            str(SEQ), "--packing", "bfd", "--window", "8", "--json"])  # fmt: skip
    full = lockstep(store_streams(store, 1, "bfd", tok, infinite=False))
    assert whole["sequences"] == len(full) and whole["documents"] == 119
    assert whole["tokens"] == sum(int((r[2] != -100).sum()) for r in full)


def test_streamed_source_resumes_through_datasets_state(tmp_path, tok, monkeypatch):
    import datasets

    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "d.jsonl"
    good = [t for t in texts(150, 6) if t]
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in good))
    cfg = TitanscaleDataLoader.Config(source=str(path), packing="bfd", window=8,
                                      streaming="always", infinite=False)  # fmt: skip
    mk = lambda: cfg.build(dp_world_size=1, dp_rank=0, tokenizer=tok, seq_len=SEQ,  # noqa: E731
                           local_batch_size=1)  # fmt: skip
    ref = [(x["input"], y) for x, y in mk()]
    a = mk()
    it = iter(a)
    head = [next(it) for _ in range(40)]
    sd = a.state_dict()
    assert json.loads(sd["titanscale_stream"])["source_state"] is not None

    def no_skip(self, n):
        raise AssertionError("resumed by re-reading records (IterableDataset.skip)")

    monkeypatch.setattr(datasets.IterableDataset, "skip", no_skip)
    b = mk()
    b.load_state_dict(sd)
    rows = [(x["input"], y) for x, y in head] + [(x["input"], y) for x, y in b]
    assert len(rows) == len(ref)
    assert all(
        torch.equal(u[0], v[0]) and torch.equal(u[1], v[1]) for u, v in zip(rows, ref, strict=True)
    )


def test_hub_source_arguments_and_offline_error(monkeypatch):
    import datasets

    from data.sources import open_source

    with pytest.raises(ConfigError, match="hub is offline"):
        open_source("allenai/c4", subset="en")
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    seen = {}

    def fake_load(path, **kw):
        seen.update(kw, path=path)
        return datasets.IterableDataset.from_generator(lambda: iter([{"text": "hello"}]))

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    src = open_source("allenai/c4", subset="en", split="validation", data_files=["en/a.json.gz"])
    assert seen == {"path": "allenai/c4", "name": "en", "split": "validation",
                    "data_files": ["en/a.json.gz"], "streaming": True}  # fmt: skip
    assert "name=en" in src.description and "split=validation" in src.description
    assert [r[1] for r in src.records()] == ["hello"]


def test_recipe_sources_checked_before_launch(tmp_path, store, capsys):
    from recipe.loader import load_recipe
    from runtime.session import check_data_source, check_data_tokenizer
    from tools import packstats

    base = tmp_path / "r.toml"
    base.write_text(
        f'[data]\nmix_window = 4\n[[data.sources]]\nsource = "{store.path}"\nweight = 3\n'
        f'[[data.sources]]\nsource = "stdlib"\nweight = 1\n'
    )
    r = load_recipe(str(base), [])
    assert [e.weight for e in r.data.sources] == [3.0, 1.0]
    check_data_source(r)
    other = make_tokenizer_dir(tmp_path / "tok2", ["completely different words"] * 20, 300)
    with pytest.raises(ConfigError, match=r"r\.toml: data\.source: store .* another tokenizer"):
        check_data_tokenizer(r, other)
    tiny = load_recipe(str(base), ["data.mix_window=2"])  # 3:1 over 2 rows leaves one at 0
    with pytest.raises(ConfigError, match="data.mix_window: a mixing window of 2 rows"):
        check_data_source(tiny)
    bad = tmp_path / "bad.toml"
    bad.write_text('[[data.sources]]\nsource = "stdlib"\nwieght = 2\n')
    with pytest.raises(ConfigError, match=r"data\.sources\[0\]\.wieght: unknown key .*weight"):
        load_recipe(str(bad), [])
    both = tmp_path / "both.toml"
    both.write_text(f'[data]\nsource = "{store.path}"\n[[data.sources]]\nsource = "stdlib"\n')
    with pytest.raises(ConfigError, match="either data.source or"):
        load_recipe(str(both), [])
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        packstats.main(["--data", str(store.path), "--tokenizer", other, "--dp", "2"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1
    assert "prepared with another tokenizer" in err


def test_prepare_resumes_a_streamed_source_through_datasets_state(tmp_path, tok_dir, monkeypatch):
    import datasets

    from data.sources import open_source

    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts(100, 8) if t))
    kw = dict(tokenizer_dir=tok_dir, tokenizer_spec="test", fingerprint="fp", progress=False,
              shard_tokens=400, chunk_records=8)  # fmt: skip
    prepare(open_source(str(path), streaming="always"), out=tmp_path / "whole", **kw)
    whole = TokenStore(tmp_path / "whole")

    def stop(n: int) -> None:
        if n == 1:
            raise KeyboardInterrupt

    out = tmp_path / "cut"
    with pytest.raises(KeyboardInterrupt):
        prepare(open_source(str(path), streaming="always"), out=out, on_shard=stop, **kw)
    prog = json.loads((tmp_path / "cut.partial" / "progress.json").read_text())
    assert prog["source_state"] is not None and prog["next_record"] > 0

    def no_skip(self, n):
        raise AssertionError("resumed by re-reading records (IterableDataset.skip)")

    monkeypatch.setattr(datasets.IterableDataset, "skip", no_skip)
    prepare(open_source(str(path), streaming="always"), out=out, **kw)
    cut = TokenStore(out)
    assert np.array_equal(np.asarray(cut.offsets), np.asarray(whole.offsets))
    assert all(np.array_equal(cut.doc_tokens(d), whole.doc_tokens(d)) for d in range(cut.n_docs))
