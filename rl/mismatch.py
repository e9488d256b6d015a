"""Train/inference mismatch: the generator's and the trainer's logprobs of the same tokens.

Both sides score the tokens the generator sampled, with the same weights version, so any
difference is numerics (dtype, kernels, batch shapes). Reported per trained batch:
- train_infer_kl: KL(mu || pi) estimated on the sampled tokens with the k3 estimator
  exp(d) - d - 1, d = log pi - log mu (non-negative, unbiased; Schulman 2020), token mean.
- train_infer_max_abs_diff: max |log pi - log mu| over the batch's tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def mismatch_stats(
    generator_logprobs: Sequence[Sequence[float]] | torch.Tensor,
    trainer_logprobs: Sequence[Sequence[float]] | torch.Tensor,
    mask: torch.Tensor | None = None,
) -> dict[str, float]:
    """Lists of per-sequence logprobs (ragged), or (B, T) tensors with a mask."""
    if isinstance(generator_logprobs, torch.Tensor):
        assert isinstance(trainer_logprobs, torch.Tensor)
        m = mask.bool() if mask is not None else torch.ones_like(generator_logprobs).bool()
        mu = generator_logprobs.double()[m]
        pi = trainer_logprobs.double()[m]
    else:
        mu = torch.tensor([x for row in generator_logprobs for x in row], dtype=torch.float64)
        pi = torch.tensor([x for row in trainer_logprobs for x in row], dtype=torch.float64)
    if mu.numel() == 0:
        return {"train_infer_kl": 0.0, "train_infer_max_abs_diff": 0.0}
    d = pi - mu
    return {
        "train_infer_kl": float((torch.exp(d) - d - 1).mean()),
        "train_infer_max_abs_diff": float(d.abs().max()),
    }
