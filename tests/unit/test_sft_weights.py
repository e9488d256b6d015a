"""Per-example SFT weights: packing channel, weighted CE, normalizer, resume (docs/sft.md).

References are independent of the implementation: per-token weights are checked against each
row's documents read back from positions and labels; the loss against plain torch
`F.cross_entropy(reduction="none") * w / sum(w)`.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torchdata.stateful_dataloader import StatefulDataLoader
from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss

from data.chat import ChatRenderer
from data.loader import PackedStream, _plain, collate_rows
from data.packing import IGNORE_INDEX, LOSS_WEIGHT_DELTA, LOSS_WEIGHTS
from runtime.loss import WeightedChunkedLoss, WeightedCrossEntropyLoss
from tests.helpers.tiny_data import CharTokenizer, ListSource

SEQ = 64
VOCAB = 256
# Each weight's completions use their own letter, so a trained label tells its example.
LETTER = {0.0: "z", 0.5: "a", 1.0: "o", 2.0: "b"}


def char_ids(text: str) -> list[int]:
    return CharTokenizer(VOCAB).encode(text, add_bos=False, add_eos=False)


def renderer() -> ChatRenderer:
    return ChatRenderer(char_ids, template="embedded", bos="\x01", eos="\x02")


def records(n: int, weights=(0.5, 2.0, 1.0), *, explicit_one: bool = True) -> list[str]:
    out = []
    for i in range(n):
        w = weights[i % len(weights)]
        rec = {"prompt": f"q{i} " * (1 + i % 3), "completion": LETTER[w] * (2 + i % 5)}
        if w != 1.0 or explicit_one:
            rec["weight"] = w
        out.append(json.dumps(rec))
    return out


def stream(lines, *, dp=1, rank=0, infinite=False, weights=True) -> PackedStream:
    return PackedStream(
        source=ListSource(lines),
        tokenizer=CharTokenizer(VOCAB),
        seq_len=SEQ,
        dp_rank=rank,
        dp_world_size=dp,
        packing="bfd",
        window=8,
        infinite=infinite,
        renderer=renderer(),
        weights=weights,
    )


def spans(pos: torch.Tensor) -> list[tuple[int, int]]:
    starts = (pos == 0).nonzero(as_tuple=True)[0].tolist()
    return list(zip(starts, starts[1:] + [pos.numel()], strict=True))


def expected_weights(labels: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Per token: the weight of the example the token belongs to (read from the letter of its
    trained labels) at trained labels, 0 at prompt labels and padding."""
    by_id = {char_ids(c)[0]: w for w, c in LETTER.items()}
    out = torch.zeros(labels.shape, dtype=torch.float32)
    for s, e in spans(pos):
        trained = labels[s:e][labels[s:e] != IGNORE_INDEX]
        found = {by_id[int(t)] for t in trained if int(t) in by_id}
        if not found:
            continue  # padding, or a piece with no trained label
        assert len(found) == 1
        w = found.pop()
        out[s:e] = torch.where(labels[s:e] != IGNORE_INDEX, w, 0.0)
    return out


def test_packed_rows_carry_each_examples_weight_at_its_assistant_tokens_only():
    rows = list(stream(records(40)))
    mixed = 0
    for x, y in rows:
        assert LOSS_WEIGHTS in x  # every row here has a 0.5 or 2 example in its group
        w = x[LOSS_WEIGHTS]
        assert w.dtype == torch.float32 and w.shape == (SEQ,)
        want = expected_weights(y, x["positions"])
        assert torch.equal(w, want)
        assert (w[y == IGNORE_INDEX] == 0).all()  # prompt tokens and padding: weight 0
        kinds = {float(v) for v in w.unique()}
        mixed += {0.5, 2.0} <= kinds
    assert mixed >= 2  # rows that mix examples of weight 0.5 and 2 were checked


def test_weight_zero_is_a_mask_and_weights_0_1_need_no_channel():
    lines = records(30, weights=(0.0, 1.0))
    masked = list(stream(lines))
    plain = list(stream(lines, weights=False))  # weights ignored: every example trained
    assert len(masked) == len(plain)
    zero_id = char_ids(LETTER[0.0])[0]
    n_zero = 0
    for (xm, ym), (xp, yp) in zip(masked, plain, strict=True):
        assert set(xm) == {"input", "positions"}  # no weight tensor for 0/1 weights
        assert torch.equal(xm["input"], xp["input"])
        changed = ym != yp
        # Exactly the weight-0 examples' trained labels are masked, nothing else changes.
        assert (ym[changed] == IGNORE_INDEX).all()
        for s, e in spans(xp["positions"]):
            seg = yp[s:e]
            if (seg == zero_id).any():
                n_zero += 1
                assert (ym[s:e] == IGNORE_INDEX).all()
            else:
                assert torch.equal(ym[s:e], seg)
    assert n_zero >= 10


def loader(s: PackedStream, batch_size: int) -> StatefulDataLoader:
    """What TitanscaleDataLoader batches with (its stream, num_workers 0, its collate)."""
    return StatefulDataLoader(s, batch_size=batch_size, num_workers=0, collate_fn=collate_rows)


def test_all_weights_one_gives_the_unweighted_batches_bit_for_bit():
    def batches(lines):
        return list(loader(stream(lines), 3))

    a = batches(records(30, weights=(1.0,), explicit_one=True))
    b = batches(records(30, weights=(1.0,), explicit_one=False))
    assert len(a) == len(b) > 3
    for (xa, ya), (xb, yb) in zip(a, b, strict=True):
        assert set(xa) == set(xb) == {"input", "positions"}
        assert all(torch.equal(xa[k], xb[k]) for k in xa) and torch.equal(ya, yb)


def test_group_delta_gives_the_global_weight_sum_on_every_rank():
    lines = records(50)
    ranks = [stream(lines, dp=2, rank=r) for r in range(2)]
    groups = list(zip(*ranks, strict=True))
    assert len(groups) > 5
    for (x0, y0), (x1, y1) in groups:
        # Both ranks know the group's delta without communicating.
        assert float(x0[LOSS_WEIGHT_DELTA]) == float(x1[LOSS_WEIGHT_DELTA])
        count = int((y0 != IGNORE_INDEX).sum() + (y1 != IGNORE_INDEX).sum())
        wsum = float(x0[LOSS_WEIGHTS].double().sum() + x1[LOSS_WEIGHTS].double().sum())
        assert count + float(x0[LOSS_WEIGHT_DELTA]) == pytest.approx(wsum, abs=1e-9)


def test_mixed_batch_collate_fills_implicit_weights():
    lines = records(6, weights=(1.0,)) + records(6, weights=(2.0,))
    s = PackedStream(
        source=ListSource(lines), tokenizer=CharTokenizer(VOCAB), seq_len=SEQ, dp_rank=0,
        dp_world_size=1, packing="none", infinite=False, renderer=renderer(),
    )  # fmt: skip
    (x, y), *_ = list(loader(s, 12))
    w = x[LOSS_WEIGHTS]
    assert w.shape == y.shape
    assert torch.equal(w, torch.where(y != IGNORE_INDEX, w.amax(1, keepdim=True), 0.0))
    assert sorted({float(v) for v in w.amax(1)}) == [1.0, 2.0]
    d = x[LOSS_WEIGHT_DELTA]
    assert torch.equal(d, ((w.amax(1) - 1) * (y != IGNORE_INDEX).sum(1)).double())


def test_resume_mid_epoch_with_weights_is_exact():
    lines = records(60)
    ref = list(stream(lines))
    for cut in (3, 7):
        s = stream(lines)
        it = iter(s)
        first = [next(it) for _ in range(cut)]
        state = json.loads(json.dumps(s.state_dict(), default=_plain))
        assert state["weights"]  # pending weighted documents were saved with their weights
        t = stream(lines)
        t.load_state_dict(state)
        got = first + list(t)
        assert len(got) == len(ref)
        for (xa, ya), (xb, yb) in zip(got, ref, strict=True):
            assert set(xa) == set(xb)
            assert all(torch.equal(xa[k], xb[k]) for k in xa) and torch.equal(ya, yb)


# -- the loss ------------------------------------------------------------------------------
def _setup(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    B, L, D = 2, 16, 8
    head = nn.Linear(D, VOCAB, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(VOCAB, D, generator=g))
    hidden = torch.randn(B, L, D, generator=g)
    labels = torch.randint(0, VOCAB, (B, L), generator=g)
    labels[:, :3] = IGNORE_INDEX  # prompt
    labels[1, -4:] = IGNORE_INDEX  # padding
    # Row 0: an example of weight 2 (positions 3..9) and one of weight 1; row 1: weight 0.5.
    w = torch.zeros(B, L)
    w[0, 3:10], w[0, 10:] = 2.0, 1.0
    w[1, 3:12] = 0.5
    return head, hidden, labels, w


def _chunked(cls, inner):
    loss = cls(cls.Config(num_chunks=4, loss_fn=inner.Config()))
    return loss


def test_weighted_loss_and_gradients_match_plain_torch():
    head, hidden, labels, w = _setup()
    W = w.sum()  # the normalizer: sum of weights over trained tokens
    loss_fn = _chunked(WeightedChunkedLoss, WeightedCrossEntropyLoss)
    loss_fn.set_lm_head(head)
    h = hidden.clone().requires_grad_(True)
    with loss_fn.token_weights(w):
        loss, _ = loss_fn(h, labels, W)
    loss.backward()
    got = (float(loss), h.grad.clone(), head.weight.grad.clone())

    head.weight.grad = None
    h2 = hidden.clone().requires_grad_(True)
    ce = F.cross_entropy(
        head(h2).flatten(0, 1), labels.flatten(), reduction="none", ignore_index=IGNORE_INDEX
    )
    ref = (ce * w.flatten()).sum() / W
    ref.backward()
    assert abs(got[0] - float(ref)) <= 1e-6
    assert torch.allclose(got[1], h2.grad, atol=1e-6, rtol=0)
    assert torch.allclose(got[2], head.weight.grad, atol=1e-6, rtol=0)
    # The weight-2 example counts exactly twice: duplicating its tokens at weight 1 (the
    # normalizer grows by the same amount) gives the same loss.
    dup_labels = torch.cat([labels, labels[:1]])
    dup_w = torch.cat([w, torch.where(w[:1] == 2.0, 1.0, 0.0)])
    dup_w[0][w[0] == 2.0] = 1.0
    dup_ce = F.cross_entropy(
        head(torch.cat([hidden, hidden[:1]])).flatten(0, 1), dup_labels.flatten(),
        reduction="none", ignore_index=IGNORE_INDEX,
    )  # fmt: skip
    assert abs(float((dup_ce * dup_w.flatten()).sum() / dup_w.sum()) - got[0]) <= 1e-6


def test_without_weights_the_loss_is_torchtitans_bit_for_bit():
    head, hidden, labels, _ = _setup(1)
    n = (labels != IGNORE_INDEX).sum()
    out = []
    for cls, inner in ((WeightedChunkedLoss, WeightedCrossEntropyLoss),
                       (ChunkedLossWrapper, CrossEntropyLoss)):  # fmt: skip
        head.weight.grad = None
        fn = _chunked(cls, inner)
        fn.set_lm_head(head)
        h = hidden.clone().requires_grad_(True)
        loss, _ = fn(h, labels, n)
        loss.backward()
        out.append((loss.detach(), h.grad, head.weight.grad.clone()))
    assert all(torch.equal(a, b) for a, b in zip(*out, strict=True))


@pytest.mark.parametrize(
    ("pp", "cp", "graphs_off", "why"),
    [(True, False, True, "pipeline"), (False, True, True, "context"),
     (False, False, False, "cuda_graphs"), (False, False, True, None)],
)  # fmt: skip
def test_weighted_steps_refused_where_the_loss_path_cannot_carry_weights(pp, cp, graphs_off, why):
    from types import SimpleNamespace

    from core.errors import ConfigError
    from runtime.trainer import TitanscaleTrainer

    fake = SimpleNamespace(
        parallel_dims=SimpleNamespace(pp_enabled=pp, cp_enabled=cp),
        config=SimpleNamespace(training=SimpleNamespace(disable_cuda_graphs=graphs_off)),
    )
    if why is None:
        TitanscaleTrainer._check_weighted(fake)  # type: ignore[arg-type]
        return
    with pytest.raises(ConfigError, match=f"data.source: .*weight other than 0 or 1.*{why}"):
        TitanscaleTrainer._check_weighted(fake)  # type: ignore[arg-type]
