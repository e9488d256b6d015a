"""SFT rows through a real model: prompt tokens contribute exactly zero loss and gradient, and
chat examples packed into one row never see each other (the contamination test, chat rows)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torchtitan.components.loss import CrossEntropyLoss

from data.chat import make_renderer
from data.loader import PackedStream
from posttrain.tasks import letter_sort
from tests.helpers.doc_mask import build_model, contamination, logits, spans
from tests.helpers.tiny_data import make_tokenizer_dir


@pytest.fixture(scope="module")
def chat_batch(tmp_path_factory):
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    d = tmp_path_factory.mktemp("chat")
    train, _ = letter_sort(60, 1, seed=3)
    multi = {"messages": [{"role": "system", "content": "sort letters"},
                          {"role": "user", "content": "sort: c a"},
                          {"role": "assistant", "content": "a c"},
                          {"role": "user", "content": "sort: b a d"},
                          {"role": "assistant", "content": "a b d"}]}  # fmt: skip
    rows = [*train[:30], multi, *train[30:]]
    (d / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok = make_tokenizer_dir(d / "tok", [json.dumps(r) for r in rows] * 4, vocab_size=300)
    s = PackedStream(source=str(d / "c.jsonl"), tokenizer=HuggingFaceTokenizer(tokenizer_path=tok),
                     seq_len=128, dp_rank=0, dp_world_size=1, packing="bfd", window=16,
                     infinite=False, renderer=make_renderer(tok))  # fmt: skip
    got = list(iter(s))[:2]
    x = torch.stack([r[0]["input"] for r in got])
    pos = torch.stack([r[0]["positions"] for r in got])
    y = torch.stack([r[1] for r in got])
    # Several examples per row, and both prompt (-100) and trained labels in each.
    assert all(len(spans(p)) >= 3 for p in pos)
    return x, pos, y


def test_prompt_tokens_get_exactly_zero_loss_and_gradient(chat_batch):
    x, pos, y = chat_batch
    model = build_model("dense").train()
    loss_fn = CrossEntropyLoss(CrossEntropyLoss.Config())
    out = model(x, pos, model.get_attention_masks(positions=pos))
    out.retain_grad()
    n = (y != -100).sum()
    loss = loss_fn(out, y, n)
    loss = loss[0] if isinstance(loss, tuple) else loss
    loss.backward()
    prompt = y == -100
    assert prompt.sum() > 0 and (~prompt).sum() > 0
    # d loss / d logits is exactly zero at every position whose label is a prompt token.
    assert torch.count_nonzero(out.grad[prompt]) == 0
    assert torch.count_nonzero(out.grad[~prompt]) > 0
    # Reference loss (float64, numpy): mean -log p(label) over trained positions only.
    lp = torch.log_softmax(out.detach().double(), -1).numpy()
    yy = y.numpy()
    idx = np.nonzero(yy != -100)
    want = -lp[idx[0], idx[1], yy[idx]].mean()
    assert abs(float(loss) - want) < 1e-5

    # Changing every prompt label (to any token id) and masking it again through the same
    # path gives bit-identical parameter gradients: prompt labels carry no gradient at all.
    def grads(labels):
        model.zero_grad(set_to_none=True)
        o = model(x, pos, model.get_attention_masks(positions=pos))
        lo = loss_fn(o, labels, n)
        (lo[0] if isinstance(lo, tuple) else lo).backward()
        return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}

    g1 = grads(y)
    alt = y.clone()
    alt[prompt] = torch.randint(
        3, 299, (int(prompt.sum()),), generator=torch.Generator().manual_seed(0)
    )
    # Control: unmasked, those labels change the gradient...
    g_leak = grads(alt)
    assert any(not torch.equal(g1[k], g_leak[k]) for k in g1)
    # ...masked as the loader masks them (labels of prompt tokens -> IGNORE_INDEX), nothing does.
    g2 = grads(torch.where(prompt, torch.full_like(alt, -100), alt))
    for k in g1:
        assert torch.equal(g1[k], g2[k]), k


def test_chat_examples_in_one_row_do_not_see_each_other(chat_batch):
    x, pos, _ = chat_batch
    model = build_model("dense")
    res = contamination(model, x, pos)
    assert res["outside"] == 0.0  # other examples' logits: exactly unchanged
    assert res["inside"] > 0 and res["causal_control"] > 0  # the perturbation matters
    base = logits(model, x, pos)
    assert torch.isfinite(base).all()
