"""Per-token log-probabilities from a torchtitan decoder (the trainer's side of RL).

The trainer scores (prompt + completion) rows with the model's own full forward, the same
path pretraining and SFT train through (attention masks from `get_attention_masks`, so the
dense backend on CPU and flex on GPU). Rows are right-padded: causal attention means padding
after a row's last token never changes that row's logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def forward_logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """(B, L) tokens -> (B, L, V) logits, each row one document starting at position 0."""
    B, L = tokens.shape
    positions = torch.arange(L, device=tokens.device).unsqueeze(0).expand(B, L)
    masks = None
    get_masks = getattr(model, "get_attention_masks", None)
    if get_masks is not None:
        masks = get_masks(positions=positions)
    # torchtitan's trainer sets `_skip_lm_head` when its chunked loss applies the head itself;
    # RL needs the logits, so the head runs inside this forward (FSDP unshards it there).
    skip = getattr(model, "_skip_lm_head", False)
    if skip:
        model._skip_lm_head = False  # type: ignore[assignment]
    try:
        return model(tokens, positions, masks)
    finally:
        if skip:
            model._skip_lm_head = True  # type: ignore[assignment]


def token_logprobs(
    model: torch.nn.Module, tokens: torch.Tensor, *, temperature: float = 1.0
) -> torch.Tensor:
    """(B, L) tokens -> (B, L-1): log p(tokens[:, t+1] | tokens[:, :t+1]) at `temperature`
    (the distribution the generator samples from before top-p), in float32."""
    logits = forward_logits(model, tokens)[:, :-1].float()
    if temperature != 1.0:
        logits = logits / temperature
    logp = F.log_softmax(logits, dim=-1)
    return logp.gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)


def full_state_dict(
    model: torch.nn.Module, trainable_only: bool = False
) -> dict[str, torch.Tensor]:
    """The model's weights as plain tensors (FSDP/TP DTensors gathered), detached.

    trainable_only: only parameters with requires_grad (a LoRA adapter's), the small update
    a generator needs when the base is frozen.
    """
    from torch.distributed.tensor import DTensor

    wanted = None
    if trainable_only:
        wanted = {n for n, p in model.named_parameters() if p.requires_grad}
    out = {}
    for k, v in model.state_dict().items():
        # (A fused QKV weight is saved split into wq/wk/wv; those names are not parameters,
        # so trainable_only is for adapters, whose parameter and state-dict names agree.)
        if wanted is not None and k not in wanted:
            continue
        t = v.full_tensor() if isinstance(v, DTensor) else v
        out[k] = t.detach()
    return out
