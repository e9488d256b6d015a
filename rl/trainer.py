"""The trainer's side of RL on one model: rollouts -> padded tensors -> loss -> update.

`PolicyTrainer` wraps a (possibly FSDP-sharded) torchtitan model with torchtitan's optimizer
and LR-scheduler containers. Three ways to get gradients, all through the same forward:
- `forward_backward(rollouts, loss_fn)`: a built-in or user loss of (logprobs, batch);
- `forward_backward_grads(rollouts, grads_fn)`: "gradients from outside": the user gets the
  detached logprobs and returns d loss / d logprobs per token, which are backpropagated;
- then `optim_step()` (gradient clipping, optimizer, scheduler, zero_grad).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rl.losses import LossBatch, LossFn, backward_from_logprob_grads
from rl.policy import token_logprobs


@dataclass
class Rollout:
    """One sampled completion with everything the losses need."""

    prompt: list[int]
    completion: list[int]
    sampling_logprobs: list[float]
    advantage: float = 0.0
    reward: float = 0.0
    version: int = 0  # generator weight version that sampled it
    group: int = 0


@dataclass
class Collated:
    tokens: torch.Tensor  # (B, L) prompt + completion, right-padded
    mask: torch.Tensor  # (B, L-1) 1 on completion tokens (as predicted positions)
    sampling_logprobs: torch.Tensor  # (B, L-1), 0 off the mask
    advantages: torch.Tensor  # (B,)
    versions: torch.Tensor  # (B,)


def collate(rollouts: Sequence[Rollout], pad_id: int, device: torch.device) -> Collated:
    L = max(len(r.prompt) + len(r.completion) for r in rollouts)
    B = len(rollouts)
    tokens = torch.full((B, L), pad_id, dtype=torch.long)
    mask = torch.zeros(B, L - 1)
    slp = torch.zeros(B, L - 1)
    for b, r in enumerate(rollouts):
        p, c = len(r.prompt), len(r.completion)
        tokens[b, : p + c] = torch.tensor(r.prompt + r.completion)
        # logprob index t scores token t+1: completion tokens sit at p .. p+c-1
        mask[b, p - 1 : p - 1 + c] = 1.0
        slp[b, p - 1 : p - 1 + c] = torch.tensor(r.sampling_logprobs, dtype=torch.float32)
    return Collated(
        tokens.to(device),
        mask.to(device),
        slp.to(device),
        torch.tensor([r.advantage for r in rollouts], dtype=torch.float32, device=device),
        torch.tensor([r.version for r in rollouts], device=device),
    )


class PolicyTrainer:
    def __init__(
        self,
        model: torch.nn.Module,
        optimizers: Any,
        lr_schedulers: Any = None,
        *,
        max_norm: float = 1.0,
        temperature: float = 1.0,
        pad_id: int = 0,
        reference: torch.nn.Module | None = None,
    ) -> None:
        self.model = model
        self.optimizers = optimizers
        self.lr_schedulers = lr_schedulers
        self.max_norm = max_norm
        self.temperature = temperature
        self.pad_id = pad_id
        self.reference = reference

    @property
    def device(self) -> torch.device:
        p = next(self.model.parameters())
        return p.device

    def _logprobs(self, model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        return token_logprobs(model, tokens, temperature=self.temperature)

    @torch.no_grad()
    def score(self, rollouts: Sequence[Rollout]) -> tuple[Collated, torch.Tensor]:
        """The trainer's logprobs of the sampled tokens under the current weights (pi_old)."""
        c = collate(rollouts, self.pad_id, self.device)
        return c, self._logprobs(self.model, c.tokens)

    def loss_batch(self, c: Collated, old_logprobs: torch.Tensor | None) -> LossBatch:
        ref = None
        if self.reference is not None:
            with torch.no_grad():
                ref = self._logprobs(self.reference, c.tokens)
        return LossBatch(
            mask=c.mask,
            advantages=c.advantages,
            sampling_logprobs=c.sampling_logprobs,
            old_logprobs=old_logprobs,
            ref_logprobs=ref,
        )

    def forward_backward(
        self, c: Collated, batch: LossBatch, loss_fn: LossFn, *, scale: float = 1.0
    ) -> float:
        logprobs = self._logprobs(self.model, c.tokens)
        loss = loss_fn(logprobs, batch)
        if loss.dim() != 0:
            raise ValueError(f"the loss must be a scalar, got shape {tuple(loss.shape)}")
        (loss * scale).backward()
        return float(loss.detach())

    def forward_backward_grads(
        self,
        c: Collated,
        batch: LossBatch,
        grads_fn: Callable[[torch.Tensor, LossBatch], torch.Tensor],
    ) -> None:
        logprobs = self._logprobs(self.model, c.tokens)
        grads = grads_fn(logprobs.detach().clone(), batch)
        backward_from_logprob_grads(logprobs, grads)

    def optim_step(self) -> float:
        from torchtitan.distributed import utils as dist_utils

        params = [p for p in self.model.parameters() if p.requires_grad]
        grad_norm = dist_utils.clip_grad_norm_(params, self.max_norm, foreach=True)
        self.optimizers.step()
        if self.lr_schedulers is not None:
            self.lr_schedulers.step()
        self.optimizers.zero_grad()
        gn = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        return float(gn)
