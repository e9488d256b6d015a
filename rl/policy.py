"""Per-token log-probabilities of (prompt + completion) rows through the model's own full
forward (runtime.steps: the path pretraining trains through, float32 log-softmax in chunks);
rows right-padded, which causal attention makes harmless. Weights as plain tensors."""

from __future__ import annotations

import torch

from runtime.logprobs import forward_logits, logprobs_of
from runtime.rows import Rows

__all__ = ["forward_logits", "full_state_dict", "token_logprobs"]


def token_logprobs(
    model: torch.nn.Module, tokens: torch.Tensor, *, temperature: float = 1.0
) -> torch.Tensor:
    """(B, L) tokens -> (B, L-1): log p(tokens[:, t+1] | tokens[:, :t+1]) at `temperature`
    (the distribution the generator samples from before top-p), in float32."""
    rows = Rows(tokens[:, :-1], tokens[:, 1:])
    return logprobs_of(forward_logits(model, rows.inputs), rows.targets, temperature)


def full_state_dict(
    model: torch.nn.Module,
    trainable_only: bool = False,
    like: dict[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """The model's weights as plain tensors (FSDP/TP DTensors gathered), detached.

    trainable_only: only parameters with requires_grad (a LoRA adapter's), the small update
    a generator needs when the base is frozen.
    like: the receiving model's state dict; each floating tensor is cast, as it is gathered,
    to the dtype of its counterpart there (what load_state_dict would cast it to), so the
    whole copy exists only in the receiver's dtypes: a bfloat16 generator's push is half the
    float32 copy that the RL dry run measured as a synchronous update's peak (29.9 GiB on
    Llama 3 8B), while float32 buffers (MoE expert biases) stay float32.
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
        if like is not None and k in like and t.is_floating_point():
            t = t.to(like[k].dtype)
        out[k] = t.detach()
    return out
