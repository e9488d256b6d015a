"""SFT data: weights past float32, all-zero weights, a byte-order mark, a huge record.

Each case used to train silently wrong or slowly: `"weight": 1e39` (finite in Python, inf in
float32) made the loss non-finite; weights all 0 or all below float32's range trained
nothing and reported success; a UTF-8 byte-order mark made the first record invalid JSON;
a 48 MB record was tokenized whole (12 GiB, 170 s) before being skipped as too long.
References: the batches of the same records with plain weights (or none), a float64
weighted mean computed here, and `tokenizers` on the text itself.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from core.errors import ConfigError
from data.chat import ChatRenderer, make_renderer
from data.loader import WEIGHT_RANGE, BadRecordError, PackedStream
from data.packing import IGNORE_INDEX, LOSS_WEIGHT_DELTA, LOSS_WEIGHTS
from data.sources import check_records, open_source
from tests.helpers.tiny_data import CharTokenizer, ListSource
from tools.reliability_report import record_case

SEQ = 64
VOCAB = 256


def char_ids(text: str) -> list[int]:
    return CharTokenizer(VOCAB).encode(text, add_bos=False, add_eos=False)


def records(weights) -> list[str]:
    out = []
    for i, w in enumerate(weights):
        rec: dict = {"prompt": f"q{i} " * (1 + i % 3), "completion": "abcde"[i % 5] * (2 + i % 4)}
        if w is not None:
            rec["weight"] = w
        out.append(json.dumps(rec))
    return out


def stream(lines, *, bad_records: str = "skip", source=None) -> PackedStream:
    return PackedStream(
        source=source or ListSource(lines),
        tokenizer=CharTokenizer(VOCAB),
        seq_len=SEQ,
        dp_rank=0,
        dp_world_size=1,
        packing="bfd",
        window=8,
        infinite=False,
        bad_records=bad_records,
        renderer=ChatRenderer(char_ids, template="embedded", bos="\x01", eos="\x02"),
    )


def weighted_mean(rows, ce: torch.Tensor) -> float:
    """sum_t w_t CE_t / sum_t w_t over the rows, in float64 (docs/sft.md), CE given per token."""
    num = den = 0.0
    for (x, y), c in zip(rows, ce, strict=True):
        w = x.get(LOSS_WEIGHTS, (y != IGNORE_INDEX).to(torch.float32)).double()
        num += float((w * c).sum())
        den += float(w.sum())
    return num / den


def test_scaled_weights_change_nothing():
    """The same relative weights multiplied past float32's range (1e39: inf in float32;
    1e-40: subnormal; 5e-324: the smallest double) give the same weighted mean; equal
    weights at any scale give the unweighted batches bit for bit."""
    base = [0.5, 2.0, 1.0] * 10
    ref = list(stream(records(base)))
    ce = torch.rand(len(ref), SEQ, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    want = weighted_mean(ref, ce)
    for c in (1e39, 1e-40, 1e300, 1e-300):
        rows = list(stream(records([w * c for w in base])))
        assert len(rows) == len(ref)
        for (x, y), (xr, yr) in zip(rows, ref, strict=True):
            assert torch.equal(y, yr) and torch.equal(x["input"], xr["input"])
            if LOSS_WEIGHTS in x:
                assert torch.isfinite(x[LOSS_WEIGHTS]).all()
                assert math.isfinite(x[LOSS_WEIGHT_DELTA])
        assert weighted_mean(rows, ce) == pytest.approx(want, rel=1e-6), c
        record_case("SFT data", "weights scaled past float32")
    plain = list(stream(records([None] * 30)))
    for w in (1e39, 1e-40, 5e-324, 3.0e-10):
        rows = list(stream(records([w] * 30)))
        assert len(rows) == len(plain)
        for (x, y), (xp, yp) in zip(rows, plain, strict=True):
            assert set(x) == {"input", "positions"}, w  # no weight channel: the plain loss
            assert torch.equal(x["input"], xp["input"]) and torch.equal(y, yp)
        record_case("SFT data", "equal weights at any scale")


def test_one_weight_past_the_range_is_a_bad_record():
    """1e39 among weights of 1 (2^129 times the rest, inf in float32) is a bad record
    ("weight"), counted or refused by name; it never reaches the loss as inf."""
    lines = records([1.0] * 5 + [1e39] + [1.0] * 5)
    s = stream(lines)
    rows = list(s)
    assert s.packing_stats()["bad_records"]["weight"] == 1
    assert all(LOSS_WEIGHTS not in x for x, _ in rows)  # the rest are plain weight 1
    with pytest.raises(BadRecordError, match=r"record 5 of .* is bad \(weight\)"):
        list(stream(lines, bad_records="fail"))
    small = records([1.0] * 3 + [1.0 / WEIGHT_RANGE / 4])
    t = stream(small)
    list(t)
    assert t.packing_stats()["bad_records"]["weight"] == 1
    record_case("SFT data", "one weight past the range", n=2)


def test_all_zero_weights_are_an_error_naming_the_data(tmp_path):
    f = tmp_path / "zero.jsonl"
    f.write_text("\n".join(records([0.0] * 6)) + "\n")
    with pytest.raises(ConfigError) as e:
        check_records(str(f), sft=True, file="r.toml", key="adapters[0].source")
    msg = str(e.value)
    assert e.value.key == "adapters[0].source" and "zero.jsonl" in msg and "weight 0 6" in msg
    assert "\n" not in msg
    # Past the scan (a large file): the stream stops at the end of its first pass.
    with pytest.raises(ConfigError, match=r'every usable record has "weight": 0'):
        list(stream(records([0.0] * 6)))
    record_case("SFT data", "all weights zero", n=2)


def test_byte_order_mark_keeps_the_first_record(tmp_path):
    f = tmp_path / "bom.jsonl"
    f.write_bytes(b"\xef\xbb\xbf" + "\n".join(records([None] * 3)).encode() + b"\n")
    one = tmp_path / "one.jsonl"
    one.write_bytes(b"\xef\xbb\xbf" + records([None])[0].encode())
    check_records(str(one), sft=True, file="r.toml", key="data.source")
    src = open_source(str(f), text_field="*")
    s = stream(None, source=src)
    list(s)
    stats = s.packing_stats()
    assert stats["bad_records_total"] == 0 and stats["documents"] == 3, stats
    from posttrain.evaluate import load_examples

    assert len(load_examples(f)) == 3
    record_case("SFT data", "UTF-8 byte-order mark", n=3)


@pytest.fixture(scope="module")
def embedded_renderer() -> ChatRenderer:
    from data.tokenizer import resolve_tokenizer

    return make_renderer(resolve_tokenizer("embedded", vocab_size=2048))


def test_huge_record_is_too_long_without_tokenizing_it(embedded_renderer, monkeypatch):
    """A 4 MB record (48 MB took 12 GiB and 170 s): decided from its length, never given
    whole to the tokenizer; with data.truncate its first max_tokens tokens are the ones
    tokenizing it whole gives (checked on a record small enough to tokenize whole)."""
    r = embedded_renderer
    seen: list[int] = []
    encode = r.encode
    monkeypatch.setattr(r, "encode", lambda text: (seen.append(len(text)), encode(text))[1])
    big = json.dumps({"prompt": "hi", "completion": "word " * 800_000})
    arr, _, bad = r.render_line(big, max_tokens=SEQ + 1, truncate=False)
    assert arr is None and bad == "too_long"
    assert max(seen, default=0) < 10_000, max(seen)
    seen.clear()
    arr, _, bad = r.render_line(big, max_tokens=SEQ + 1, truncate=True)
    assert bad is None and len(arr) == SEQ + 1 and max(seen) < 10_000
    mid = json.dumps({"prompt": "hi", "completion": "some words, " * 3000})
    cut, _, _ = r.render_line(mid, max_tokens=SEQ + 1, truncate=True)
    monkeypatch.setattr(r, "max_token_chars", None)  # no bound: tokenized whole, then cut
    whole, _, _ = r.render_line(mid, max_tokens=SEQ + 1, truncate=True)
    assert np.array_equal(cut, whole)
    record_case("SFT data", "huge record", n=2)


def test_the_length_bound_holds_for_the_tokenizer(embedded_renderer):
    """max_token_chars is a real bound: no token of the vocabulary covers more characters
    (decoded) than it says (reference: decoding every id with `tokenizers`)."""
    from tokenizers import Tokenizer

    from data.tokenizer import resolve_tokenizer

    tok = Tokenizer.from_file(str(Path(resolve_tokenizer("embedded", vocab_size=2048)) /
                                  "tokenizer.json"))  # fmt: skip
    longest = max(len(tok.decode([i], skip_special_tokens=False))
                  for i in range(tok.get_vocab_size()))  # fmt: skip
    assert embedded_renderer.max_token_chars is not None
    assert longest <= embedded_renderer.max_token_chars


WEIGHTS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, 0.0, -0.0, 1, True, False, 1e39, 1e-40, 5e-324, 3.4e38, 1.7e308]),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.text(max_size=3),
    st.none(),
)


@settings(max_examples=60, deadline=None)
@given(weights=st.lists(WEIGHTS, min_size=1, max_size=8))
def test_fuzzed_weights_never_reach_the_loss_non_finite(weights):
    lines = []
    for i, w in enumerate(weights):
        rec: dict = {"prompt": f"p{i}", "completion": "abc"[i % 3] * 3}
        if w is not None:
            rec["weight"] = w
        lines.append(json.dumps(rec))  # json writes NaN / Infinity: Python's reader takes them
    s = stream(lines)
    try:
        rows = list(s)
    except ConfigError as e:  # nothing usable, or every usable weight 0
        assert "\n" not in str(e)
        record_case("SFT data", "fuzzed weights (refused)")
        return
    for x, _ in rows:
        if LOSS_WEIGHTS in x:
            w = x[LOSS_WEIGHTS]
            assert torch.isfinite(w).all() and (w >= 0).all()
            assert w.max() <= WEIGHT_RANGE and math.isfinite(x[LOSS_WEIGHT_DELTA])
    record_case("SFT data", "fuzzed weights")
