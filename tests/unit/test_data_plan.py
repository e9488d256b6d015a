"""Packing plans (data.plan) against the streaming packers they precompute.

Reference: the packers of data.packing run document by document (the streaming loader's
code), epoch after epoch with a flush at each epoch's end. A plan must give the same rows
and the same counts at any global row index, computed without the rows before it.
"""

from __future__ import annotations

import numpy as np
import pytest

from data.packing import make_packer
from data.plan import make_plan
from tests.helpers.tiny_data import random_lengths


def packer_rows(packing: str, pairs: list[int], seq_len: int, epochs: int, window: int = 8):
    """Rows as (doc, start, end) tuples from the streaming packer, epoch after epoch."""
    p = make_packer(packing, seq_len, window=window)
    rows = []
    D = len(pairs)
    for e in range(epochs):
        out = []
        for d, n in enumerate(pairs):
            out += p.push(e * D + d, n)
        out += p.flush()
        for r in out:
            rows.append(tuple((q.doc, q.start, q.end) for q in r.pieces))
    return rows


def prefix_counts(rows, pairs, seq_len, k):
    D = len(pairs)
    useful = sum(e - s for r in rows[:k] for _, s, e in r)
    docs = sum(1 for r in rows[:k] for _, s, _ in r if s == 0)
    split = sum(1 for r in rows[:k] for d, s, e in r if s == 0 and e < pairs[d % D])
    return k, useful, k * seq_len - useful, docs, split


@pytest.mark.parametrize("packing", ["concat", "bfd", "none"])
@pytest.mark.parametrize("seq_len", [16, 64])
@pytest.mark.parametrize("seed", [0, 1])
def test_plan_rows_and_counts_equal_the_packer(packing, seq_len, seed):
    pairs = [n - 1 for n in random_lengths(seed, 70, lo=2, hi=150)]
    ref = packer_rows(packing, pairs, seq_len, epochs=3)
    plan = make_plan(packing, np.asarray(pairs), seq_len, window=8)
    assert len(ref) == 3 * plan.rows_per_epoch
    rng = np.random.default_rng(seed)
    ks = sorted({0, 1, len(ref) - 1, *rng.integers(0, len(ref), 40).tolist()})
    for k in ks:  # random access: no row before k is computed
        got = tuple((p.doc, p.start, p.end) for p in plan.row(k).pieces)
        assert got == ref[k], f"row {k}"
    for k in [0, 5, plan.rows_per_epoch, plan.rows_per_epoch + 3, len(ref)]:
        st = plan.stats(k)
        assert st.astuple() == prefix_counts(ref, pairs, seq_len, k), f"counts at row {k}"


def test_bfd_plan_cache_round_trip(tmp_path):
    pairs = np.asarray([n - 1 for n in random_lengths(5, 200, lo=2, hi=300)])
    cache = tmp_path / "plans" / "bfd-L64-W16"
    a = make_plan("bfd", pairs, 64, window=16, cache=cache)
    assert (cache / "row_ptr.npy").exists()
    b = make_plan("bfd", pairs, 64, window=16, cache=cache)  # memory-mapped from the cache
    assert isinstance(b.row_ptr, np.memmap)
    for k in range(0, 3 * a.rows_per_epoch, 7):
        assert a.row(k) == b.row(k)
