"""Routed experts at titanscale's seam: LoRA on torchtitan's grouped GEMM, and the experts'
compute dtype.

torchtitan's `GroupedExperts` (models/common/moe.py) holds the routed experts' SwiGLU
weights as three stacked tensors w1 (E, F, D), w3 (E, F, D), w2 (E, D, F) and computes
every expert in one `torch._grouped_mm` per projection over the tokens sorted by expert
(`offs`: cumulative token counts), always in bfloat16. `LoRAGroupedExperts` subclasses it:

- LoRA on routed experts: one low-rank pair per expert and projection, stacked the same way
  (A1, A3: (E, r, D), B1, B3: (E, F, r); A2: (E, r, F), B2: (E, D, r)), so an adapted
  projection is base + alpha/r * B_e A_e x for the token's expert e, computed as two more
  grouped GEMMs over the same `offs` (no Python loop over experts: 3 x 2 extra
  `_grouped_mm` calls per layer, whatever E is). A is drawn as torchtitan's LoRA converter
  draws it (uniform in +-1/sqrt(fan_in), i.e. kaiming_uniform(a=sqrt(5)) per expert), B is
  zeros, so a fresh adapter leaves the model unchanged. The base w1/w2/w3 are frozen.
  Costs: 6 x E x r x (D + F) / 2 parameters per layer (E x r x (2D + F) + E x r x (2F + D)),
  and the grouped GEMMs on r columns.
- `compute_dtype`: "bfloat16" is torchtitan's (inputs and weights cast to bfloat16, the
  grouped GEMM kernels' dtype on GPU); "param" computes in the weights' own dtype (float32
  on CPU: the train/inference logprob equality of routing replay is checked to 1e-5 in
  float32, which bfloat16 experts cannot give; runtime.build picks it for CPU runs).

`torch._grouped_mm` needs every row stride a multiple of 16 bytes, so the rank must be a
multiple of 8 (bfloat16) -- checked when the config is built.

`bind_adapter` points a module at another adapter's pairs (by reference, at its own scale):
the service holds one frozen base whose experts have no pairs of their own and binds each
client's (a folder with `routed_experts_lora.safetensors`, posttrain.lora) per operation.

`convert_experts` swaps every `GroupedExperts.Config` in a model config tree for this one
(after torchtitan's LoRA converter, which freezes every non-Linear module, so it is the
last converter).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, fields
from typing import Any

import spmd_types as spmd
import torch
import torch.nn.functional as F
from torch import nn
from torchtitan.models.common.moe import GroupedExperts
from torchtitan.protocols.module import Module

# (projection, A shape from (E, F, D) dims, B shape): w1/w3 map D -> F, w2 maps F -> D.
_PROJ = ("1", "3", "2")


def _a_init(t: torch.Tensor) -> None:
    # kaiming_uniform_(a=sqrt(5)) of a 2-D (r, in) A per expert: bound 1/sqrt(in)
    bound = 1.0 / math.sqrt(t.shape[-1])
    with torch.no_grad():
        t.uniform_(-bound, bound)


def pair_shapes(experts: int, rank: int, dim: int, hidden: int) -> dict[str, tuple[int, ...]]:
    """The per-expert LoRA pairs of one routed-experts module: name -> shape (A1, A3:
    (E, r, D); B1, B3: (E, F, r); A2: (E, r, F); B2: (E, D, r); 1 = gate, 3 = up, 2 = down)."""
    E, r, D, Fh = experts, rank, dim, hidden
    return {
        "lora_a1": (E, r, D), "lora_b1": (E, Fh, r),
        "lora_a3": (E, r, D), "lora_b3": (E, Fh, r),
        "lora_a2": (E, r, Fh), "lora_b2": (E, D, r),
    }  # fmt: skip


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class LoRAGroupedExperts(GroupedExperts):
    """torchtitan's GroupedExperts with optional per-expert LoRA and a compute dtype."""

    @dataclass(kw_only=True, slots=True)
    class Config(GroupedExperts.Config):
        rank: int = 0  # 0: no adapter
        alpha: float = 16.0
        compute_dtype: str = "bfloat16"  # "bfloat16" (torchtitan's) or "param"
        freeze_base: bool = False

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        if config.rank < 0 or config.rank % 8:
            raise ValueError(f"expert LoRA rank must be a multiple of 8, got {config.rank}")
        if config.compute_dtype not in ("bfloat16", "param"):
            raise ValueError(
                f"compute_dtype: expected bfloat16 or param, got {config.compute_dtype}"
            )
        self.rank = config.rank
        self.scaling = config.alpha / config.rank if config.rank else 0.0
        self.compute_dtype = config.compute_dtype
        self._bound: dict[str, torch.Tensor] | None = None  # bind_adapter's pairs
        self._bound_scaling = 0.0
        if config.freeze_base or config.rank:
            for p in (self.w1_EFD, self.w2_EDF, self.w3_EFD):
                p.requires_grad_(False)
        if config.rank:
            shapes = pair_shapes(config.num_experts, config.rank, config.dim, config.hidden_dim)
            for name, shape in shapes.items():
                self.register_parameter(name, nn.Parameter(torch.empty(shape)))

    def bind_adapter(self, pairs: dict[str, torch.Tensor] | None, scaling: float) -> None:
        """Compute with `pairs` (lora_{a,b}{1,2,3} -> tensor, the shapes of this module's
        own; used by reference) at `scaling` in place of the module's own pairs; None: the
        module's own again (none at rank 0: the base experts)."""
        self._bound = dict(pairs) if pairs else None
        self._bound_scaling = scaling

    def _distribute_states(self, parallel_dims: Any) -> None:
        """torchtitan places the base weights (its sharding config names w1/w2/w3 only);
        the adapters follow them. EP: every tensor sharded on the expert dim as the base.
        TP without EP: B1/B3 sharded on the hidden dim as w1/w3, A2 on its input (hidden)
        dim as w2 -- the same partial-sum result as the base -- and A1/A3/B2 replicated."""
        cfg: Any = self._sharding_config  # type: ignore[has-type]
        if self.rank and cfg is not None:
            from torchtitan.models.common.moe_sharding import (
                expert_param_placement_dense,
                expert_param_placement_sparse,
            )

            st = cfg.state_shardings
            w1, w2 = st["w1_EFD"], st["w2_EDF"]
            rep = (
                w1
                if w1 == expert_param_placement_sparse()
                else expert_param_placement_dense(tp_placement=spmd.R)
            )
            extra = {"lora_a1": rep, "lora_a3": rep, "lora_b2": rep,
                     "lora_b1": w1, "lora_b3": w1, "lora_a2": w2}  # fmt: skip
            self._sharding_config = dataclasses.replace(cfg, state_shardings={**st, **extra})
        super()._distribute_states(parallel_dims)

    def _mm(self, x: torch.Tensor, w_EOI: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """(R, I) tokens sorted by expert, (E, O, I) weights -> (R, O)."""
        return self._grouped_mm(A=x, B_t=w_EOI.transpose(-2, -1), offs=offs)

    def _proj(self, x: torch.Tensor, which: str, offs: torch.Tensor, dt: torch.dtype):
        w = _local(getattr(self, {"1": "w1_EFD", "2": "w2_EDF", "3": "w3_EFD"}[which]))
        y = self._mm(x, w.to(dt), offs)
        if self._bound is not None:
            a, b = self._bound[f"lora_a{which}"], self._bound[f"lora_b{which}"]
            scaling = self._bound_scaling
        elif self.rank:
            a, b = getattr(self, f"lora_a{which}"), getattr(self, f"lora_b{which}")
            scaling = self.scaling
        else:
            return y
        a, b = _local(a).to(dt), _local(b).to(dt)
        return y + scaling * self._mm(self._mm(x, a, offs), b, offs)

    def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        dt = torch.bfloat16 if self.compute_dtype == "bfloat16" else _local(self.w1_EFD).dtype
        offs = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
        x = x_RD.to(dt)
        h = F.silu(self._proj(x, "1", offs, dt)) * self._proj(x, "3", offs, dt)
        return self._proj(h, "2", offs, dt).type_as(x_RD)


def _targets(cfg: Any) -> bool:
    return isinstance(cfg, GroupedExperts.Config)


def convert_experts(
    model_config: Any,
    *,
    rank: int = 0,
    alpha: float = 16.0,
    compute_dtype: str = "bfloat16",
    freeze_base: bool = False,
) -> Any:
    """Every routed-experts config in the tree -> LoRAGroupedExperts.Config (in place where
    nested; returns the root). `freeze_base`: the experts' base weights frozen without an
    adapter (LoRA on other modules)."""
    params = {
        f"lora_{ab}{p}": (_a_init if ab == "a" else nn.init.zeros_) for p in _PROJ for ab in "ab"
    }
    for _fqn, cfg, parent, attr in list(model_config.traverse(Module.Config, recurse=True)):
        if not _targets(cfg) or isinstance(cfg, LoRAGroupedExperts.Config):
            continue
        kw = {f.name: getattr(cfg, f.name) for f in fields(GroupedExperts.Config) if f.init}
        kw["param_init"] = {**(cfg.param_init or {}), **(params if rank else {})}
        new = LoRAGroupedExperts.Config(
            **kw, rank=rank, alpha=alpha, compute_dtype=compute_dtype, freeze_base=freeze_base
        )
        if parent is None:
            return new
        if isinstance(parent, list):
            parent[attr] = new
        else:
            setattr(parent, attr, new)
    return model_config


def expert_modules(model: nn.Module) -> list[tuple[str, LoRAGroupedExperts]]:
    """(name, module) of every routed-experts module, in model order, named as the state
    dict names it (an activation-checkpointing wrapper's name left out)."""
    return [
        (n.replace("._checkpoint_wrapped_module", ""), m)
        for n, m in model.named_modules()
        if isinstance(m, LoRAGroupedExperts)
    ]


def expert_lora_modules(model: nn.Module) -> list[tuple[str, LoRAGroupedExperts]]:
    """(name, module) of every routed-experts module carrying an adapter, in model order."""
    return [(n, m) for n, m in expert_modules(model) if m.rank]


def expert_adapter_shapes(model: nn.Module, rank: int) -> dict[str, tuple[int, ...]]:
    """The routed-expert pairs a rank-`rank` adapter of `model` holds: name
    (`<module>.lora_{a,b}{1,2,3}`) -> shape (`pair_shapes`), from each module's base
    weights (whole shapes)."""
    out: dict[str, tuple[int, ...]] = {}
    for name, m in expert_modules(model):
        E, Fh, D = m.w1_EFD.shape
        out |= {f"{name}.{k}": v for k, v in pair_shapes(E, rank, D, Fh).items()}
    return out


def bind_expert_adapter(model: nn.Module, params: Any, scaling: float) -> None:
    """Point every routed-experts module at the pairs `params` holds for it (name ->
    tensor, `expert_adapter_shapes` names; by reference), computed at `scaling`; a module
    with none in `params` computes its base experts (or its own pairs)."""
    for name, m in expert_modules(model):
        pairs = {k: params[f"{name}.{k}"] for k in (f"lora_{ab}{p}" for p in _PROJ for ab in "ab")
                 if f"{name}.{k}" in params}  # fmt: skip
        m.bind_adapter(pairs or None, scaling)
