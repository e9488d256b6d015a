"""Per-token logprobs of a torchtitan decoder: the forward and the chunked log-softmax.

`token_logprobs`: the model's own forward (document masks from positions; MoE routing
replayed through runtime.routing), then log p(target) in float32 computed over CHUNK_TOKENS
tokens at a time by one autograd function that keeps the logits in the model's dtype and
recomputes each chunk's softmax in backward (`_ChunkedLogprobs`, the row-chunked form of
torchtitan's chunked loss): float32 full-vocabulary logits exist for one chunk, never for
the batch. Vocabulary-sharded (tensor-parallel) logits go through torchtitan's
`compute_logprobs`.
"""

from __future__ import annotations

from typing import Any

import torch
from torchtitan.components.loss import IGNORE_INDEX

from runtime import routing
from runtime.rows import Rows

# Tokens whose float32 log-softmax exists at once (forward and backward): 1024 x a 128K
# vocabulary is 0.5 GiB of float32; the model-dtype logits of the microbatch stay whole.
CHUNK_TOKENS = 1024


def forward_logits(
    model: torch.nn.Module, inputs: torch.Tensor, positions: torch.Tensor | None = None
) -> torch.Tensor:
    """(B, L) -> (B, L, V) logits of a torchtitan decoder, each row one document from
    position 0 unless `positions` says where documents restart (document masks)."""
    B, L = inputs.shape
    if positions is None:
        positions = torch.arange(L, device=inputs.device).unsqueeze(0).expand(B, L)
    get_masks = getattr(model, "get_attention_masks", None)
    masks = None
    if get_masks is not None:
        # torchtitan builds masks with a torch.compile'd create_block_mask, which recompiles
        # for each new (rows, length) shape: seconds each on CPU, where microbatch shapes
        # vary. The CPU attention backend (dense) only evaluates the mask: eager is exact.
        eager = inputs.device.type == "cpu"
        with torch.compiler.set_stance("force_eager" if eager else "default"):
            masks = get_masks(positions=positions)
    # torchtitan's trainer sets `_skip_lm_head` when its chunked loss applies the head; these
    # loops need the logits, so the head runs inside this forward (FSDP unshards it there).
    skip = getattr(model, "_skip_lm_head", False)
    if skip:
        model._skip_lm_head = False  # type: ignore[assignment]
    try:
        out = model(inputs, positions, masks)
    finally:
        if skip:
            model._skip_lm_head = True  # type: ignore[assignment]
    return out


class _ChunkedLogprobs(torch.autograd.Function):
    """log_softmax(x / T)[target] per row of (N, V) logits, float32, CHUNK_TOKENS rows at a
    time. Saves the logits (their own dtype) and one float32 logsumexp per row; backward
    recomputes each chunk's softmax: d lp / d x = (onehot(target) - softmax) / T."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, logits: torch.Tensor, targets: torch.Tensor, temperature: float
    ) -> torch.Tensor:
        N = logits.shape[0]
        ok = targets != IGNORE_INDEX
        safe = torch.where(ok, targets, 0)
        out = torch.zeros(N, dtype=torch.float32, device=logits.device)
        lse = torch.zeros(N, dtype=torch.float32, device=logits.device)
        for s in range(0, N, CHUNK_TOKENS):
            x = logits[s : s + CHUNK_TOKENS].float() / temperature
            lse[s : s + CHUNK_TOKENS] = torch.logsumexp(x, dim=-1)
            picked = x.gather(-1, safe[s : s + CHUNK_TOKENS, None]).squeeze(-1)
            out[s : s + CHUNK_TOKENS] = picked - lse[s : s + CHUNK_TOKENS]
        out = torch.where(ok, out, 0.0)
        ctx.save_for_backward(logits, safe, ok, lse)
        ctx.temperature = temperature
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        logits, safe, ok, lse = ctx.saved_tensors
        T = ctx.temperature
        g = torch.where(ok, grad, 0.0).float()
        out = torch.empty_like(logits)
        for s in range(0, logits.shape[0], CHUNK_TOKENS):
            e = s + CHUNK_TOKENS
            p = torch.exp(logits[s:e].float() / T - lse[s:e, None])
            d = -p * g[s:e, None]
            d.scatter_add_(-1, safe[s:e, None], g[s:e, None])
            out[s:e] = (d / T).to(out.dtype)
        return out, None, None


def logprobs_of(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """(B, L, V) logits, (B, L) targets -> (B, L) float32 log p(target) at `temperature`
    (0 where the target is IGNORE_INDEX). Vocabulary-sharded (tensor-parallel) logits go
    through torchtitan's `compute_logprobs`, which gathers the vocabulary."""
    from torch.distributed.tensor import DTensor

    if isinstance(logits, DTensor):
        from torchtitan.components.loss import compute_logprobs

        lp = compute_logprobs(logits / temperature, targets)
        assert isinstance(lp, torch.Tensor)
        return lp
    B, L, V = logits.shape
    flat = _ChunkedLogprobs.apply(logits.reshape(B * L, V), targets.reshape(B * L), temperature)
    return flat.view(B, L)


def token_logprobs(model: torch.nn.Module, rows: Rows, *, temperature: float = 1.0) -> torch.Tensor:
    """(B, L) float32 logprobs of `rows.targets` under `model` (0 at ignored targets).
    Rows with `routing` replay it (set before the forward and left set, so that an
    activation-checkpointed recompute in backward routes the same; rows without clear it)."""
    routing.set_replay(model, rows.routing, rows.routing_known, replay=rows.replay)
    return logprobs_of(
        forward_logits(model, rows.inputs, rows.positions), rows.targets, temperature
    )
