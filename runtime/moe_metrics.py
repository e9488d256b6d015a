"""Per-layer expert load of a mixture-of-experts run, for the run report (runtime.metrics).

Each MoE layer of torchtitan counts, in its `tokens_per_expert_E` buffer, the tokens its
router sent to each expert during the step's forward passes (all microbatches). torchtitan's
aux-loss-free balancing hook reads and zeroes that buffer in an optimizer step pre-hook;
`record_expert_load` registers a pre-hook of ours BEFORE it (hooks run in registration
order), which sums the counts over the data-parallel ranks (the same "loss" mesh torchtitan
reduces over; one all-reduce of layers x experts floats per step) and keeps them on the
model part as `EXPERT_LOAD_ATTR`. With `moe.load_balance = "none"` torchtitan registers no
hook and never zeroes the buffer, so ours zeroes it.

Figures (`expert_load_figures`): per layer, the max and mean tokens per expert and their
ratio (1.0 = perfectly balanced; the most loaded expert bounds an expert-parallel step),
and `balance` = E x sum_e f_e^2 with f_e the expert's share of the routed tokens: the
Switch-Transformer auxiliary loss with router probabilities replaced by the load (1.0 when
balanced, E when one expert takes everything). torchtitan 0.3.0 trains no auxiliary loss, so
this count-based figure is what the report calls the load-balancing loss. Routing is dropless
(capacity_factor 0): dropped tokens are 0 by construction.
Activation checkpointing re-runs the router in the backward and counts twice; torchtitan
halves the counts under full AC, and so do we (the ratios are unaffected either way).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

EXPERT_LOAD_ATTR = "titanscale_expert_load"


def moe_blocks(model_part: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """The MoE modules of a model part's transformer blocks, in layer order."""
    layers = getattr(model_part, "layers", None)
    for block in layers.values() if layers is not None else ():
        if getattr(block, "moe_enabled", False):
            yield block.moe


def _recomputed(block_moe: torch.nn.Module, model_part: torch.nn.Module) -> bool:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl

    for block in model_part.layers.values():  # type: ignore[union-attr,operator]
        if getattr(block, "moe", None) is block_moe:
            return getattr(block, "checkpoint_impl", None) is CheckpointImpl.NO_REENTRANT
    return False


def read_expert_load(model_parts: list[torch.nn.Module], parallel_dims: Any) -> None:
    """Sum each MoE layer's token counts over the data-parallel ranks into EXPERT_LOAD_ATTR."""
    for part in model_parts:
        counts = []
        for moe in moe_blocks(part):
            c = moe.tokens_per_expert_E
            c = c.to_local() if hasattr(c, "to_local") else c  # type: ignore[operator]
            counts.append(c.detach().clone() / (2 if _recomputed(moe, part) else 1))
        if not counts:
            continue
        load = torch.stack(counts)
        mesh = parallel_dims.get_optional_mesh("loss") if parallel_dims is not None else None
        if mesh is not None:
            torch.distributed.all_reduce(load, group=mesh.get_group())
        setattr(part, EXPERT_LOAD_ATTR, load.cpu())
        for moe in moe_blocks(part):
            if moe.load_balance_coeff is None:  # no torchtitan hook zeroes it
                with torch.no_grad():
                    moe.tokens_per_expert_E.zero_()


def record_expert_load(post_optimizer_build_fn: Callable[..., Any] | None) -> Callable[..., Any]:
    """Wrap a ModelSpec's post_optimizer_build_fn: our expert-load pre-hook first."""

    def build(optimizers: Any, model_parts: list[torch.nn.Module], parallel_dims: Any) -> None:
        if any(True for part in model_parts for _ in moe_blocks(part)):
            optimizers.register_step_pre_hook(
                lambda *_args, **_kw: read_expert_load(model_parts, parallel_dims)
            )
        if post_optimizer_build_fn is not None:
            post_optimizer_build_fn(optimizers, model_parts, parallel_dims)

    return build


def expert_load_figures(load: torch.Tensor) -> dict[str, Any]:
    """Figures of a (layers, experts) token-count matrix (module docstring)."""
    load = load.double()
    mean = load.mean(dim=1)
    mx = load.max(dim=1).values
    total = load.sum(dim=1).clamp_min(1.0)
    share = load / total[:, None]
    balance = load.shape[1] * (share**2).sum(dim=1)
    ratio = torch.where(mean > 0, mx / mean.clamp_min(1e-12), torch.ones_like(mean))
    return {
        "moe_expert_load_max_tokens": [round(float(v), 1) for v in mx],
        "moe_expert_load_mean_tokens": [round(float(v), 1) for v in mean],
        "moe_expert_load_max_over_mean": float(ratio.max()),
        "moe_load_balance_loss": float(balance.mean()),
        "moe_dropped_tokens": 0,
    }
