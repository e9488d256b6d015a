"""The packed stream: sharding over data-parallel ranks, exact resume at any dp size, epochs.

Ranks are simulated in one process: dp streams over the same source, advanced in lockstep
(as training does), each yielding its row of every group of dp global rows.
"""

from __future__ import annotations

import pickle
from collections import Counter

import pytest
import torch

from core.errors import ConfigError
from data.loader import BadRecordError, PackedStream, TitanscaleDataLoader
from tests.helpers.tiny_data import (
    BOS,
    CharTokenizer,
    ListSource,
    doc_text,
    lockstep,
    random_lengths,
    same_rows,
)

SEQ = 32
TEXTS = [doc_text(i, n) for i, n in enumerate(random_lengths(7, 300, hi=120))]


def streams(world: int, packing: str, texts=TEXTS, **kw) -> list[PackedStream]:
    src = ListSource(texts)
    return [
        PackedStream(
            source=src,
            tokenizer=CharTokenizer(),
            seq_len=SEQ,
            dp_rank=r,
            dp_world_size=world,
            packing=packing,
            window=8,
            **{"infinite": False, **kw},
        )
        for r in range(world)
    ]


def reference(packing: str):
    (s,) = streams(1, packing)
    return lockstep([iter(s)])


def is_padding_row(row) -> bool:
    return bool((row[2] == -100).all())


def check_coverage(rows, texts=TEXTS) -> None:
    """Every document's tokens appear exactly once (each document is one repeated char)."""
    counts = Counter()
    bos = 0
    for inp, _pos, lab in rows:
        real = lab != -100
        counts.update(inp[real].tolist())
        bos += int((inp[real] == BOS).sum())
    tok = CharTokenizer()
    want = Counter()
    for t in texts:
        want.update(tok.encode(t)[1:-1])
    assert bos == len(texts)
    assert {k: v for k, v in counts.items() if k != BOS} == dict(want)


@pytest.mark.parametrize("packing", ["concat", "bfd", "none"])
@pytest.mark.parametrize(("before", "after"), [(2, 2), (2, 3), (4, 1), (1, 4)])
def test_resume_at_same_or_other_dp_size(packing, before, after):
    ref = reference(packing)
    check_coverage(ref)
    a = streams(before, packing)
    its = [iter(s) for s in a]
    head = lockstep(its, groups=37 // before + 1)
    states = [pickle.dumps(s.state_dict()) for s in a]
    assert all(st == states[0] for st in states), "ranks disagree on the stream position"

    b = streams(after, packing)
    for s in b:
        s.load_state_dict(pickle.loads(states[0]))
    tail = lockstep([iter(s) for s in b])
    rows = head + tail
    # The same global rows as one uninterrupted process, then (finite stream) padding rows
    # that keep every rank at the same count.
    assert same_rows(rows[: len(ref)], ref)
    assert all(is_padding_row(r) for r in rows[len(ref) :])
    assert len(rows) - len(ref) < max(before, after)
    check_coverage(rows)


def test_rank_r_takes_rows_r_mod_dp():
    ref = reference("bfd")
    a = streams(3, "bfd")
    its = [iter(s) for s in a]
    for g in range(12):
        for r, it in enumerate(its):
            x, y = next(it)
            assert torch.equal(x["input"], ref[3 * g + r][0])
            assert torch.equal(y, ref[3 * g + r][2])


def test_infinite_stream_loops_and_resumes_across_epochs():
    texts = TEXTS[:20]
    (s,) = streams(1, "concat", texts=texts, infinite=True)
    it = iter(s)
    total = sum(len(t) + 1 for t in texts)
    rows = [next(it) for _ in range(3 * total // SEQ)]  # about three epochs
    st = s.packing_stats()
    assert st["epoch"] >= 2 and st["documents"] >= 2 * len(texts)
    state = pickle.dumps(s.state_dict())
    more_ref = [next(it) for _ in range(30)]
    (t,) = streams(1, "concat", texts=texts, infinite=True)
    t.load_state_dict(pickle.loads(state))
    it2 = iter(t)
    more = [next(it2) for _ in range(30)]
    assert all(torch.equal(a[1], b[1]) for a, b in zip(more, more_ref, strict=True))
    assert rows


def test_bad_records_skipped_and_counted_or_fatal():
    texts = ["abc", None, "defg", None, "hi"]
    (s,) = streams(1, "concat", texts=texts)
    list(iter(s))
    st = s.packing_stats()
    assert st["bad_records"]["empty"] == 2 and st["documents"] == 3
    (f,) = streams(1, "concat", texts=texts, bad_records="fail")
    with pytest.raises(BadRecordError, match=r"record 1 of .* \(empty\)"):
        list(iter(f))
    (e,) = streams(1, "concat", texts=[None, None])
    with pytest.raises(ConfigError, match="no usable documents"):
        list(iter(e))


def test_fingerprint_mismatch_is_refused():
    (a,) = streams(1, "bfd")
    next(iter(a))
    state = a.state_dict()
    b = PackedStream(
        source=ListSource(TEXTS),
        tokenizer=CharTokenizer(),
        seq_len=2 * SEQ,
        dp_rank=0,
        dp_world_size=1,
        packing="bfd",
        window=8,
    )
    with pytest.raises(ValueError, match="seq_len: checkpoint 32, now 64"):
        b.load_state_dict(state)


def test_dataloader_component_batches_and_checkpoint(tmp_path, monkeypatch):
    """TitanscaleDataLoader as torchtitan's Trainer builds it; state moves 2 ranks -> 1."""
    import json

    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"body": t}) + "\n" for t in TEXTS[:120]))
    cfg = TitanscaleDataLoader.Config(
        source=str(path), packing="bfd", text_field="body", window=16, infinite=False
    )
    tok = CharTokenizer()
    mk = lambda dp, r: cfg.build(  # noqa: E731
        dp_world_size=dp, dp_rank=r, tokenizer=tok, seq_len=SEQ, local_batch_size=2
    )
    one = mk(1, 0)
    ref = [(x["input"], y) for x, y in one]
    ref_rows = [(i[k], y[k]) for i, y in ref for k in range(i.shape[0])]

    ranks = [mk(2, 0), mk(2, 1)]
    its = [iter(r) for r in ranks]
    got = []
    for _ in range(5):
        (x0, y0), (x1, y1) = (next(it) for it in its)
        assert x0["input"].shape == (2, SEQ) and x0["positions"].shape == (2, SEQ)
        # rank 0 holds global rows 4s, 4s+2; rank 1 holds 4s+1, 4s+3
        got += [(x0["input"][0], y0[0]), (x1["input"][0], y1[0])]
        got += [(x0["input"][1], y0[1]), (x1["input"][1], y1[1])]
    sd = ranks[0].state_dict()
    assert pickle.dumps(sd) == pickle.dumps(ranks[1].state_dict())
    resumed = mk(1, 0)
    resumed.load_state_dict(sd)
    for x, y in resumed:
        got += [(x["input"][k], y[k]) for k in range(x["input"].shape[0])]
    assert len(got) == len(ref_rows)
    assert all(
        torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        for a, b in zip(got, ref_rows, strict=True)
    )
    stats = resumed.packing_stats()
    assert stats["documents"] == 120 and stats["padding_fraction"] < 0.2
    with pytest.raises(ValueError, match="num_workers"):
        TitanscaleDataLoader.Config(num_workers=2)


def test_state_survives_torch_distributed_checkpoint(tmp_path, monkeypatch):
    """The loader state goes through DCP (as torchtitan's checkpointer saves it) unchanged."""
    import json
    import warnings

    import torch.distributed.checkpoint as dcp

    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS[:80]))
    cfg = TitanscaleDataLoader.Config(source=str(path), packing="bfd", window=16)
    mk = lambda: cfg.build(  # noqa: E731
        dp_world_size=1, dp_rank=0, tokenizer=CharTokenizer(), seq_len=SEQ, local_batch_size=2
    )
    a = mk()
    it = iter(a)
    for _ in range(7):
        next(it)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group: single-process save/load"
        dcp.save({"dataloader": a}, checkpoint_id=str(tmp_path / "ckpt"))
        b = mk()
        dcp.load({"dataloader": b}, checkpoint_id=str(tmp_path / "ckpt"))
    want = [next(it) for _ in range(10)]
    got_it = iter(b)
    got = [next(got_it) for _ in range(10)]
    for (x, y), (u, v) in zip(want, got, strict=True):
        assert torch.equal(x["input"], u["input"]) and torch.equal(y, v)
