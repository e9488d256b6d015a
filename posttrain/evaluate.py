"""Held-out exact match of SFT answers, by teacher forcing (one forward pass per batch).

Greedy decoding produces a fixed answer a_1..a_n (ending in EOS) iff, for every k, a_k is the
argmax of the model's next-token distribution given the prompt and a_1..a_{k-1}: that is
exactly the argmax under teacher forcing at each answer position. So "every trained token is
the argmax" is an exact, generator-free equivalent of "greedy decoding answers exactly"
(ties in the argmax aside, which have probability ~0 in float32). Multi-turn examples are
checked on every assistant turn with the true history.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from core.jsonio import loads_line
from data.chat import BadChat, ChatRenderer, Example, decode_masked, parse_record
from runtime.logprobs import forward_logits, logprobs_of


def load_examples(path: str | Path) -> list[Example]:
    """The usable examples of a JSON Lines file (bad lines are left out)."""
    out = []
    for line in Path(path).read_text(encoding="utf-8-sig").splitlines():  # a BOM is not JSON
        if not line.strip():
            continue
        try:
            out.append(parse_record(loads_line(line)))
        except (BadChat, ValueError):
            continue
    return out


@torch.no_grad()
def exact_match(
    model: Any,
    renderer: ChatRenderer,
    examples: Sequence[Example],
    *,
    device: torch.device | str = "cpu",
    batch_size: int = 32,
    pad_id: int = 0,
) -> dict[str, float]:
    """{'exact_match': fraction of examples whose every trained token is the argmax,
    'token_accuracy', 'nll_per_trained_token' (the held-out loss: mean -log p of the trained
    tokens, natural log, float32), 'examples'}; one example per row, padding as its own
    document."""
    was_training = model.training
    model.eval()
    rows = []
    for ex in examples:
        ids_np, trained_np = decode_masked(renderer.render(ex))
        rows.append((torch.as_tensor(ids_np), torch.as_tensor(trained_np)))
    correct = tokens = tokens_ok = 0
    nll = 0.0
    try:
        for i in range(0, len(rows), batch_size):
            chunk = rows[i : i + batch_size]
            L = max(len(r[0]) - 1 for r in chunk)
            x = torch.full((len(chunk), L), pad_id, dtype=torch.long)
            y = torch.zeros((len(chunk), L), dtype=torch.long)
            m = torch.zeros((len(chunk), L), dtype=torch.bool)
            pos = torch.zeros((len(chunk), L), dtype=torch.long)
            for b, (ids, trained) in enumerate(chunk):
                n = len(ids) - 1
                x[b, :n], y[b, :n], m[b, :n] = ids[:-1], ids[1:], trained[1:]
                pos[b, :n] = torch.arange(n)
                pos[b, n:] = torch.arange(L - n)
            logits = forward_logits(model, x.to(device), pos.to(device))
            logits = (logits.full_tensor() if hasattr(logits, "full_tensor") else logits).cpu()
            hit = (logits.argmax(-1) == y) | ~m
            correct += int(hit.all(dim=1).sum())
            tokens += int(m.sum())
            tokens_ok += int((hit & m).sum())
            nll -= float(logprobs_of(logits, y)[m].sum())  # float32 in chunks
    finally:
        model.train(was_training)
    n = len(rows)
    return {
        "exact_match": correct / n if n else 0.0,
        "token_accuracy": tokens_ok / tokens if tokens else 0.0,
        "nll_per_trained_token": nll / tokens if tokens else 0.0,
        "examples": n,
    }
