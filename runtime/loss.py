"""torchtitan's cross-entropy with optional per-token weights (SFT records' "weight").

The one definition (docs/sft.md, "Per-example weights"), the same per-token term as the
service's Tinker `cross_entropy` (`weights` in loss_fn_inputs; service.titan_backend passes
them as rl.losses' mask) and rl.losses' "token_mean" aggregation over that mask:

    loss = sum_t w_t * CE_t / sum_t w_t

over the trained tokens t of the whole optimizer step (every data-parallel rank, every
gradient-accumulation microbatch). w_t is the example's weight at its trained (assistant)
tokens and 0 elsewhere. Each rank's loss is its local weighted sum divided by that global
normalizer, which runtime.trainer passes in place of torchtitan's global_valid_tokens, so
the data-parallel gradient sum is the gradient of the global weighted mean. All weights 1:
the normalizer is the trained-token count and no weight tensor exists, i.e. torchtitan's
own loss, bit for bit.

Without weights these classes are torchtitan's CrossEntropyLoss / ChunkedLossWrapper
unchanged (the same call). With weights: CE with reduction "none" (the vocab-parallel
variant under TP, torchtitan's `_LossParallelCrossEntropy`), times the weights, summed.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard
from torchtitan.components.loss import (
    IGNORE_INDEX,
    ChunkedLossWrapper,
    CrossEntropyLoss,
    _LossParallelCrossEntropy,
)
from torchtitan.distributed.spmd_types import current_spmd_mesh, spmd_mesh_size
from torchtitan.distributed.utils import get_spmd_backend

from data.packing import LOSS_WEIGHTS


def weighted_cross_entropy_sum(
    pred: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    *,
    global_vocab_size: int | None = None,
) -> torch.Tensor:
    """sum_t weights_t * CE(pred_t, labels_t) in float32; labels IGNORE_INDEX give 0."""
    if isinstance(pred, DTensor) and isinstance(labels, DTensor):
        raise NotImplementedError(
            "per-example SFT weights are not supported with the full_dtensor backend"
        )
    if isinstance(pred, DTensor) and pred.placements == (Shard(pred.ndim - 1),):
        nll = _LossParallelCrossEntropy.apply(
            pred.to_local().flatten(0, 1).float(),
            labels.flatten(0, 1),
            pred.device_mesh.get_group("tp"),
            pred.shape[-1],
            "none",
        )
    elif get_spmd_backend() == "spmd_types" and spmd_mesh_size("tp") > 1:
        mesh = current_spmd_mesh()
        assert mesh is not None
        nll = _LossParallelCrossEntropy.apply(
            pred.flatten(0, 1).float(),
            labels.flatten(0, 1),
            mesh.get_group("tp"),
            global_vocab_size,
            "none",
        )
    else:
        nll = F.cross_entropy(
            pred.flatten(0, 1).float(),
            labels.flatten(0, 1),
            reduction="none",
            ignore_index=IGNORE_INDEX,
        )
    return (nll * weights.flatten(0, 1).to(nll.dtype)).sum()


class WeightedCrossEntropyLoss(CrossEntropyLoss):
    """CrossEntropyLoss that also accepts `loss_weights` [B, L] (per-token weights)."""

    @dataclass(kw_only=True, slots=True)
    class Config(CrossEntropyLoss.Config):
        pass

    def __call__(
        self,
        pred: torch.Tensor,
        labels: torch.Tensor,
        global_valid_tokens: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        weights = kwargs.pop(LOSS_WEIGHTS, None)
        if weights is None:
            return super().__call__(pred, labels, global_valid_tokens, **kwargs)
        loss = weighted_cross_entropy_sum(
            pred, labels, weights, global_vocab_size=self.global_vocab_size
        )
        if global_valid_tokens is not None:
            loss = loss / global_valid_tokens  # the step's sum of weights (runtime.trainer)
        return loss, {}


class WeightedChunkedLoss(ChunkedLossWrapper):
    """ChunkedLossWrapper whose inner loss gets this microbatch's per-token weights.

    torchtitan's training step passes the loss only `positions`; the trainer sets the
    weights around the forward-backward call (`with loss.token_weights(w): ...`) and they
    reach the inner loss chunked along the sequence like any `loss_inputs`.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(ChunkedLossWrapper.Config):
        pass

    def __init__(self, config: ChunkedLossWrapper.Config, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self._weights: torch.Tensor | None = None

    @contextmanager
    def token_weights(self, weights: torch.Tensor) -> Iterator[None]:
        self._weights = weights
        try:
            yield
        finally:
            self._weights = None

    def __call__(
        self,
        pred: torch.Tensor,
        labels: torch.Tensor,
        global_valid_tokens: torch.Tensor | None = None,
        **loss_inputs: Any,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if self._weights is not None:
            loss_inputs[LOSS_WEIGHTS] = self._weights
        return super().__call__(pred, labels, global_valid_tokens, **loss_inputs)
