"""Held-out exact match by teacher forcing == greedy decoding (checked with a decode loop)."""

from __future__ import annotations

import torch

from data.chat import ChatRenderer, Example
from posttrain.evaluate import exact_match
from runtime.logprobs import forward_logits
from tests.helpers.doc_mask import build_model


def _renderer() -> ChatRenderer:
    # One token per character (ids = code points), no EOS: answers are exactly K tokens.
    return ChatRenderer(lambda t: [ord(c) for c in t], template="embedded", bos="\x01", eos="")


def _greedy(model, prompt: list[int], k: int) -> list[int]:
    ids = list(prompt)
    for _ in range(k):  # the naive loop: a full forward per new token
        x = torch.tensor([ids])
        pos = torch.arange(len(ids))[None]
        ids.append(int(forward_logits(model, x, pos)[0, -1].argmax()))
    return ids[len(prompt) :]


def test_exact_match_equals_greedy_decoding():
    model = build_model("dense", seed=3)
    r = _renderer()
    examples, wrong = [], []
    for q in ("sort: c a b", "sort: d b", "hello there", "x"):
        msgs = ({"role": "user", "content": q},)
        ans = _greedy(model, r.prompt_ids(msgs), 6)
        printable = [a % 90 + 32 if a < 32 else a for a in ans]
        text = "".join(chr(a) for a in printable)
        ex = Example((*msgs, {"role": "assistant", "content": text}))
        # An answer made printable is no longer the greedy one: it belongs to the wrong set.
        (examples if printable == ans else wrong).append(ex)
        # The same answer with its last token changed is not what greedy decoding gives.
        bad = text[:-1] + chr(ord(text[-1]) % 90 + 33 if ord(text[-1]) != 65 else 66)
        wrong.append(Example((*msgs, {"role": "assistant", "content": bad})))
    assert examples, "no example decoded to printable characters"
    res = exact_match(model, r, examples, batch_size=3)
    assert res["exact_match"] == 1.0 and res["token_accuracy"] == 1.0
    res = exact_match(model, r, wrong, batch_size=3)
    assert res["exact_match"] == 0.0
    # Mixed batches (padding next to other examples) give the same per-example verdicts.
    res = exact_match(model, r, [*examples, *wrong], batch_size=8)
    assert res["exact_match"] == len(examples) / (len(examples) + len(wrong))
