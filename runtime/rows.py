"""Rows of tokens for the post-training loops, and their split into microbatches.

`Rows` is the batch every loop that is not torchtitan's Trainer loop hands the step engine
(runtime.steps): token ids, the targets each position predicts, document positions, real
lengths and (MoE) routing to replay. `split_rows` cuts it into consecutive spans under a
token budget (at most `max_tokens` padded tokens and `max_rows` rows each, at least one
row): pure, so the planner's and the dry run's counts are the engine's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torchtitan.components.loss import IGNORE_INDEX


@dataclass
class Rows:
    """A batch of rows: `inputs` (B, L) token ids, `targets` (B, L) the token each position
    predicts (IGNORE_INDEX where nothing is scored), optional `positions` (B, L) (packed
    documents restart at 0; None = 0..L-1 per row) and `lengths` (real tokens per row, for
    the budget; None = L). MoE: `routing` (B, L, n_moe_layers, K) expert ids to replay at
    the `routing_known` (B, L) positions (runtime.routing; None = the routers' own choice);
    `replay` False: only count the routers' agreement with them (runtime.routing.Seam)."""

    inputs: torch.Tensor
    targets: torch.Tensor
    positions: torch.Tensor | None = None
    lengths: list[int] | None = None
    routing: torch.Tensor | None = None
    routing_known: torch.Tensor | None = None
    replay: bool = True

    def __len__(self) -> int:
        return int(self.inputs.shape[0])

    def lens(self) -> list[int]:
        return self.lengths if self.lengths is not None else [self.inputs.shape[1]] * len(self)

    def span(self, lo: int, hi: int) -> Rows:
        """Rows lo..hi-1, cut to their longest real length (padding after it is dropped)."""
        n = max(self.lens()[lo:hi])
        pos = None if self.positions is None else self.positions[lo:hi, :n]
        lengths = None if self.lengths is None else self.lengths[lo:hi]
        route = known = None
        if self.routing is not None:
            route = self.routing[lo:hi, :n]
            known = None if self.routing_known is None else self.routing_known[lo:hi, :n]
        return Rows(self.inputs[lo:hi, :n], self.targets[lo:hi, :n], pos, lengths, route, known,
                    self.replay)  # fmt: skip


def shifted_rows(tokens: torch.Tensor, lengths: Sequence[int]) -> Rows:
    """(B, L) right-padded sequences -> rows predicting token t+1 from tokens 0..t; targets
    past each sequence's end are IGNORE_INDEX."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:].clone()
    L = inputs.shape[1]
    real = torch.as_tensor([max(n - 1, 0) for n in lengths], device=tokens.device)
    targets[torch.arange(L, device=tokens.device)[None, :] >= real[:, None]] = IGNORE_INDEX
    return Rows(inputs, targets, None, [max(n - 1, 1) for n in lengths])


def split_rows(lengths: Sequence[int], max_tokens: int, max_rows: int = 0) -> list[tuple[int, int]]:
    """Consecutive spans of rows, each at most `max_rows` rows (0 = no limit) and at most
    `max_tokens` padded tokens (rows x the span's longest row); a row longer than the budget
    is a span of its own. Pure."""
    spans: list[tuple[int, int]] = []
    lo, longest = 0, 0
    for i, n in enumerate(lengths):
        grown = max(longest, n)
        rows = i - lo + 1
        if i > lo and (grown * rows > max_tokens or (max_rows and rows > max_rows)):
            spans.append((lo, i))
            lo, grown = i, n
        longest = grown
    if len(lengths) > lo:
        spans.append((lo, len(lengths)))
    return spans
