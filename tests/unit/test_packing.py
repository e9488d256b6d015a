"""Property tests of the packers (pure: lengths in, rows out) and of row materialization."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from data.packing import (
    IGNORE_INDEX,
    BestFitDecreasingPacker,
    ConcatPacker,
    NonePacker,
    Row,
    make_packer,
    materialize,
)

PACKINGS = ("concat", "bfd", "none")

doc_lengths = st.lists(st.one_of(st.integers(1, 12), st.integers(1, 200)), min_size=0, max_size=60)
seq_lens = st.sampled_from([1, 2, 7, 16, 64])


def run_packer(packing: str, seq_len: int, lengths: list[int], window: int = 8):
    p = make_packer(packing, seq_len, window=window)
    rows: list[Row] = []
    for d, n in enumerate(lengths):
        rows += p.push(d, n)
    rows += p.flush()
    return p, rows


def fake_tokens(lengths: list[int]) -> dict[int, np.ndarray]:
    # Token k of document d = d * 1000 + k: every (document, pair) is recognisable.
    return {d: np.arange(n + 1, dtype=np.int64) + d * 1000 for d, n in enumerate(lengths)}


@pytest.mark.parametrize("packing", PACKINGS)
@settings(max_examples=120, deadline=None)
@given(lengths=doc_lengths, seq_len=seq_lens, window=st.integers(1, 9))
def test_every_pair_exactly_once_in_order(packing, lengths, seq_len, window):
    packer, rows = run_packer(packing, seq_len, lengths, window)
    seen: dict[int, list[tuple[int, int]]] = {}
    for row in rows:
        assert row.used <= seq_len, "row longer than seq_len"
        assert row.seq_len == seq_len
        for piece in row.pieces:
            assert 0 <= piece.start < piece.end <= lengths[piece.doc]
            seen.setdefault(piece.doc, []).append((piece.start, piece.end))
    # No truncation in any packer: every pair of every document appears exactly once, and a
    # document's pieces come out in order (row order, then position in the row).
    assert sorted(seen) == list(range(len(lengths)))
    for d, spans in seen.items():
        assert spans[0][0] == 0 and spans[-1][1] == lengths[d]
        for (_, e), (s, _) in zip(spans, spans[1:], strict=False):
            assert e == s, f"document {d}: pieces {spans} not contiguous and in order"
    st_ = packer.stats
    assert st_.useful_tokens == sum(lengths)
    assert st_.rows == len(rows)
    assert st_.padding_tokens == len(rows) * seq_len - sum(lengths)
    assert st_.split_documents == sum(len(s) > 1 for s in seen.values())
    assert st_.documents == len(lengths)


@pytest.mark.parametrize("packing", PACKINGS)
@settings(max_examples=60, deadline=None)
@given(lengths=doc_lengths, seq_len=seq_lens)
def test_materialized_rows(packing, lengths, seq_len):
    _, rows = run_packer(packing, seq_len, lengths)
    toks = fake_tokens(lengths)
    for row in rows:
        inp, lab, pos = materialize(row, toks, pad_id=0)
        assert inp.shape == lab.shape == pos.shape == (seq_len,)
        assert pos[0] == 0, "every row starts a document (torchtitan's masks rely on it)"
        o = 0
        for piece in row.pieces:
            n = piece.size
            # positions restart at 0 at each piece, count up within it
            assert list(pos[o : o + n]) == list(range(n))
            # shift within the document: label = the next token of the same document
            assert list(inp[o : o + n]) == list(toks[piece.doc][piece.start : piece.end])
            assert list(lab[o : o + n]) == list(toks[piece.doc][piece.start + 1 : piece.end + 1])
            o += n
        # padding: ignored labels, one pseudo-document with positions 0..p-1
        assert (lab[o:] == IGNORE_INDEX).all()
        assert list(pos[o:]) == list(range(seq_len - o))
        assert (lab[:o] != IGNORE_INDEX).all()


@settings(max_examples=80, deadline=None)
@given(lengths=doc_lengths, seq_len=seq_lens, window=st.integers(1, 9))
def test_bfd_splits_only_long_documents(lengths, seq_len, window):
    _, rows = run_packer("bfd", seq_len, lengths, window)
    pieces_per_doc: dict[int, int] = {}
    for row in rows:
        for p in row.pieces:
            pieces_per_doc[p.doc] = pieces_per_doc.get(p.doc, 0) + 1
            if p.size == seq_len:
                assert len(row.pieces) == 1
    for d, n in enumerate(lengths):
        if n <= seq_len:
            assert pieces_per_doc[d] == 1, f"document {d} ({n} <= {seq_len}) was split"
        else:
            assert pieces_per_doc[d] == -(-n // seq_len)


@settings(max_examples=60, deadline=None)
@given(lengths=doc_lengths, seq_len=seq_lens)
def test_concat_rows_full_except_last(lengths, seq_len):
    _, rows = run_packer("concat", seq_len, lengths)
    assert all(r.used == seq_len for r in rows[:-1])
    assert len(rows) == -(-sum(lengths) // seq_len)


@settings(max_examples=60, deadline=None)
@given(lengths=doc_lengths, seq_len=seq_lens)
def test_none_one_document_per_row(lengths, seq_len):
    _, rows = run_packer("none", seq_len, lengths)
    assert all(len(r.pieces) == 1 for r in rows)
    assert len(rows) == sum(-(-n // seq_len) for n in lengths)


@pytest.mark.parametrize("packing", PACKINGS)
@settings(max_examples=60, deadline=None)
@given(
    lengths=doc_lengths.filter(lambda x: len(x) > 1),
    seq_len=seq_lens,
    cut=st.floats(0, 1),
)
def test_state_restore_continues_identically(packing, lengths, seq_len, cut):
    """A packer rebuilt from state() mid-stream emits exactly the rows the original would."""
    k = int(cut * len(lengths))
    ref = make_packer(packing, seq_len, window=5)
    ref_rows = [r for d, n in enumerate(lengths) for r in ref.push(d, n)] + ref.flush()

    a = make_packer(packing, seq_len, window=5)
    rows = [r for d, n in enumerate(lengths[:k]) for r in a.push(d, n)]
    b = make_packer(packing, seq_len, window=5)
    b.restore(a.state(), {d: n for d, n in enumerate(lengths)})
    rows += [r for d, n in enumerate(lengths[k:], start=k) for r in b.push(d, n)] + b.flush()
    assert rows == ref_rows


def test_bfd_beats_concat_on_splits_and_none_on_padding():
    # A mixed distribution: bfd should split only the long documents and pad little.
    rng = np.random.default_rng(0)
    lengths = [int(x) for x in rng.lognormal(5.5, 1.0, size=3000).clip(1, 20000)]
    L = 2048
    c, _ = run_packer("concat", L, lengths)
    n, _ = run_packer("none", L, lengths)
    b, _ = run_packer("bfd", L, lengths, window=256)
    assert b.stats.split_documents == sum(x > L for x in lengths)
    assert b.stats.split_documents < c.stats.split_documents
    assert b.stats.padding_fraction < 0.01
    assert n.stats.padding_fraction > 10 * b.stats.padding_fraction


def test_packer_rejects_bad_input():
    with pytest.raises(ValueError):
        ConcatPacker(0)
    with pytest.raises(ValueError):
        BestFitDecreasingPacker(8, window=0)
    with pytest.raises(ValueError):
        NonePacker(8).push(0, 0)
    with pytest.raises(ValueError):
        make_packer("greedy", 8)
