"""Low-precision linear layers: torchtitan's converters, made exact under emulation, and a plan
of which linears they convert.

Two thin subclasses of torchtitan 0.3.0's converters (components/quantization), and its
NVFP4 converter as it ships:

- `Float8Converter` (Float8LinearConverter): with `emulate=True`, torchtitan replaces the
  recipe's torchao config by `Float8LinearConfig(emulate=True)`, i.e. *tensorwise* scaling
  (float8.py: "if cfg.emulate: self.torchao_config = TorchAOFloat8LinearConfig(emulate=True)"),
  so an emulated "rowwise" or "rowwise_with_gw_hp" run would test a recipe torchao no longer
  ships. This subclass keeps the recipe and only turns emulation on. It also takes the
  recipe torchtitan 0.3 dropped from its config (`recipe_name` "rowwise" or
  "rowwise_with_gw_hp" only) but torchao 0.18 still ships: "tensorwise"
  (`Float8LinearConfig.from_recipe_name("tensorwise")`, dynamic per-tensor scales, NVIDIA's
  "FP8-CS"), with `enable_fsdp_float8_all_gather` so FSDP2 gathers the weights in FP8
  (torchao's WeightWithDynamicFloat8CastTensor; only tensorwise weight scaling allows it).
  Without torchtitan's old post-optimizer `precompute_float8_dynamic_scale_for_fsdp` hook each
  weight's scale costs one small all-reduce of its amax before the gather (torchao's
  fsdp_pre_all_gather, `reduce_amax=True`): a latency-bound call per linear, the same scale.
  Rowwise hardware runs are torchtitan's code unchanged.
- NVFP4 (`torchtitan.components.quantization.NVFP4LinearConverter`, unchanged): SM100+ and
  Triton only, so no emulated mode (the registry refuses it on CPU with one line).
- `MXFP8Converter` (MXFP8LinearConverter): torchtitan's converter refuses anything below
  SM100 and builds torchao's MXFP8Linear with kernel_preference AUTO (SM100 kernels). With
  `emulate=True` this subclass skips that check and builds the same layer with
  kernel_preference EMULATED (torch-native MX casts and fp32 matmuls), which runs on CPU.
  Hardware runs use torchtitan's converter unchanged.

`plan_linear_conversion` decides, per Linear in a model config, convert or skip with a
reason: the output head stays in high precision (torchtitan's 405B float8 recipe filters
"lm_head"; its NVFP4 recipes convert "layers" only), and a linear whose TP-local
dimensions the kernel cannot take (multiples of 16 for FP8, 32 for MX blocks, 128 for
torchao's NVFP4 kernels) is skipped.
The converters are then given exactly that list, and `apply_linear_plan` checks the result.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Literal, cast

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torchao.float8 import Float8LinearConfig as TorchAOFloat8LinearConfig
from torchao.quantization.quantize_.common.kernel_preference import KernelPreference
from torchtitan.components.quantization import (
    Float8LinearConverter,
    MXFP8LinearConverter,
    NVFP4LinearConverter,
)
from torchtitan.components.quantization.float8 import Float8Linear
from torchtitan.components.quantization.mx import MXFP8Linear
from torchtitan.components.quantization.nvfp4 import NVFP4Linear
from torchtitan.models.common.linear import Linear

# Names of Llama linears that tensor parallelism shards by their input dimension
# (RowwiseParallel); the others (wqkv, w1, w3, lm_head) are sharded by output.
ROWWISE_TP_NAMES = ("wo", "w2")
OUTPUT_HEAD = "lm_head"


if Float8Linear is not None:
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    class Float8AllGatherLinear(Float8Linear):
        """torchtitan's Float8Linear whose weight FSDP2 all-gathers in FP8.

        torchao wraps the weight in WeightWithDynamicFloat8CastTensor only in
        `Float8Linear.from_float` (float8_linear.py: "If FSDP float8 all-gather is on, wrap the
        weight in a float8-aware tensor subclass"); torchtitan builds the module from its
        config through `__init__`, so the wrap is done here. FSDP2 then calls the subclass's
        fsdp_pre_all_gather: the shard is cast with the tensor's global amax (one all-reduce)
        and gathered as 1-byte data plus its scale; the matmul takes the gathered FP8 weight.
        """

        @dataclass(kw_only=True, slots=True)
        class Config(Float8Linear.Config):
            pass

        def __init__(self, config: Config):
            super().__init__(config)
            weight = cast(torch.Tensor, self._parameters["weight"])
            self.weight = nn.Parameter(
                WeightWithDynamicFloat8CastTensor(
                    weight,
                    self.linear_mm_config,
                    self.config.cast_config_weight.target_dtype,
                ),
                requires_grad=weight.requires_grad,
            )
            self.register_state_dict_post_hook(_plain_weight_in_state_dict)

    def _plain_weight_in_state_dict(module, state_dict, prefix, local_metadata) -> None:
        """The checkpoint sees the weight's plain high-precision tensor (same storage).

        torchtitan's checkpointer caches the state dict and compares storages
        (checkpointer/base.py `_shares_storage`: `untyped_storage().data_ptr()`), which a
        wrapper subclass has none of; a view of the wrapped tensor keeps the checkpoint
        format that of a plain Float8Linear (loads in both directions) and DCP's in-place
        load still writes the parameter.
        """
        key = prefix + "weight"
        t = state_dict.get(key)
        if isinstance(t, DTensor) and isinstance(
            t._local_tensor, WeightWithDynamicFloat8CastTensor
        ):
            state_dict[key] = DTensor.from_local(
                t._local_tensor._tensor,
                t.device_mesh,
                t.placements,
                run_check=False,
                shape=t.shape,
                stride=t.stride(),
            )
        elif isinstance(t, WeightWithDynamicFloat8CastTensor):
            state_dict[key] = t._tensor

else:  # torchao without Float8: the registry reports the FP8 backends as unavailable.
    Float8AllGatherLinear = None  # type: ignore[assignment,misc]


def _linear_fields(cfg) -> dict:
    return {
        "in_features": cfg.in_features,
        "out_features": cfg.out_features,
        "bias": cfg.bias,
        "param_init": cfg.param_init,
    }


def _swap_linears(model_config, keep, make):
    """torchtitan's converter loop: every Linear.Config `keep(cfg, fqn)` selects is replaced by
    `make(cfg)` in its parent (or becomes the root)."""
    for fqn, cfg, parent, attr in model_config.traverse(Linear.Config):
        if not keep(cfg, fqn):
            continue
        new = make(cfg)
        if parent is None:
            model_config = new
        elif isinstance(parent, list):
            parent[attr] = new
        else:
            setattr(parent, attr, new)
    return model_config


class Float8Converter(Float8LinearConverter):
    """torchtitan's Float8LinearConverter, plus torchao's tensorwise recipe (with FP8
    all-gather under FSDP); under emulation the recipe's scaling is kept."""

    @dataclass(kw_only=True, slots=True)
    class Config(Float8LinearConverter.Config):
        recipe_name: Literal["rowwise", "rowwise_with_gw_hp", "tensorwise"] = "rowwise"  # type: ignore[assignment]
        """torchao Float8 recipe: torchtitan's two, or torchao's tensorwise."""

        fsdp_float8_all_gather: bool = False
        """FSDP2 all-gathers the converted weights in FP8 (tensorwise only: torchao allows it
        for tensorwise weight scaling alone)."""

    def __init__(self, config: Config):
        if config.fsdp_float8_all_gather and config.recipe_name != "tensorwise":
            raise ValueError(
                f"FP8 all-gather needs tensorwise weight scaling, not {config.recipe_name!r}"
            )
        super().__init__(config)
        if self.enabled and (config.emulate or config.recipe_name == "tensorwise"):
            # Same casts, scale rounding and per-GEMM precision as on hardware; under
            # emulation only the scaled matmul becomes an fp32 matmul of the dequantized
            # operands.
            recipe = TorchAOFloat8LinearConfig.from_recipe_name(config.recipe_name)
            self.torchao_config = dataclasses.replace(
                recipe,
                emulate=config.emulate,
                enable_fsdp_float8_all_gather=config.fsdp_float8_all_gather,
            )

    def convert(self, model_config):
        if not (self.enabled and self.config.fsdp_float8_all_gather):
            return super().convert(model_config)
        # torchtitan's own loop, building the FP8-all-gather subclass's config instead.
        return _swap_linears(
            model_config,
            self.filter_fn,
            lambda cfg: Float8AllGatherLinear.Config(
                **_linear_fields(cfg), _torchao_config=self.torchao_config
            ),
        )


if MXFP8Linear is not None:

    class EmulatedMXFP8Linear(MXFP8Linear):
        """torchtitan's MXFP8Linear with torchao's EMULATED kernel preference."""

        @dataclass(kw_only=True, slots=True)
        class Config(MXFP8Linear.Config):
            pass

        def __init__(self, config: Config):
            super().__init__(config)
            self.kernel_preference = KernelPreference.EMULATED

else:  # torchao without the MX prototype: the registry reports mxfp8 as unavailable.
    EmulatedMXFP8Linear = None  # type: ignore[assignment,misc]


class MXFP8Converter(MXFP8LinearConverter):
    """torchtitan's MXFP8LinearConverter, plus an emulated mode that runs on any device."""

    @dataclass(kw_only=True, slots=True)
    class Config(MXFP8LinearConverter.Config):
        emulate: bool = False
        """Build torchao MXFP8Linear with kernel_preference EMULATED (testing only)."""

    def __init__(self, config: Config):
        if not config.emulate:
            super().__init__(config)  # torchtitan's own SM100 check and compile warning
            return
        if EmulatedMXFP8Linear is None:
            raise ImportError("torchao's MXFP8Linear is unavailable")
        self.config = config

    def convert(self, model_config):
        if not self.config.emulate:
            return super().convert(model_config)
        fqns = self.config.fqns
        return _swap_linears(
            model_config,
            lambda _cfg, fqn: not fqns or any(t in fqn for t in fqns),
            lambda cfg: EmulatedMXFP8Linear.Config(**_linear_fields(cfg)),
        )


# torchtitan's NVFP4 converter as it ships (SM100+ check, Triton kernels); named here so the
# registry imports every converter from one module.
NVFP4Converter = NVFP4LinearConverter

# Config types that mean "this linear runs in low precision".
QUANTIZED_LINEAR_CONFIGS: tuple[type, ...] = tuple(
    c.Config for c in (Float8Linear, MXFP8Linear, NVFP4Linear) if c is not None
)


@dataclass(frozen=True)
class LinearDecision:
    fqn: str
    in_features: int
    out_features: int
    convert: bool
    reason: str = ""


def _local_dims(fqn: str, in_f: int, out_f: int, tp: int) -> tuple[float, float]:
    name = fqn.rsplit(".", 1)[-1]
    if name in ROWWISE_TP_NAMES:
        return in_f / tp, out_f
    return in_f, out_f / tp


def plan_linear_conversion(
    model_config, *, align: int, tp: int = 1, kernel: str = "fp8"
) -> list[LinearDecision]:
    """Per Linear (in traversal order): convert, or skip with the reason.

    `align`: every TP-local GEMM dimension must be a multiple of it (16 for FP8, whose
    tensor-core GEMM needs 16-byte aligned rows; 32 for MX, its scaling block).
    """
    out = []
    for fqn, cfg, _parent, _attr in model_config.traverse(Linear.Config):
        i, o = cfg.in_features, cfg.out_features
        reason = ""
        if fqn.split(".")[-1] == OUTPUT_HEAD:
            reason = "output head, kept in high precision (torchtitan's practice)"
        else:
            li, lo = _local_dims(fqn, i, o, tp)
            bad = [f"{label} {dim:g}" for label, dim in (("in", li), ("out", lo)) if dim % align]
            if bad:
                where = f" per rank at tp={tp}" if tp > 1 else ""
                reason = f"{' and '.join(bad)}{where} not a multiple of {align} ({kernel})"
        out.append(LinearDecision(fqn, i, o, convert=not reason, reason=reason))
    return out


@dataclass
class ConversionReport:
    """Which linears a backend converted and which it skipped (with reasons)."""

    backend: str
    converted: list[str] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    emulated: bool = False

    @staticmethod
    def _pattern(fqn: str) -> str:
        return re.sub(r"^layers\.\d+\.", "layers.*.", fqn)

    def lines(self) -> list[str]:
        """Log lines, compact: layer indices folded into 'layers.*'."""
        total = len(self.converted) + len(self.skipped)
        if self.backend == "bf16":
            return [f"linear bf16: {total} linears unconverted (plain nn.Linear)"]
        mode = " (emulated)" if self.emulated else ""
        groups = Counter(self._pattern(f) for f in self.converted)
        names = ", ".join(f"{p} x{n}" if n > 1 else p for p, n in groups.items())
        lines = [
            f"linear {self.backend}{mode}: converted {len(self.converted)} of {total} "
            f"linears: {names or 'none'}"
        ]
        reasons: dict[str, list[str]] = {}
        for f, r in self.skipped:
            reasons.setdefault(r, []).append(f)
        for r, fs in reasons.items():
            pats = Counter(self._pattern(f) for f in fs)
            names = ", ".join(f"{p} x{n}" if n > 1 else p for p, n in pats.items())
            lines.append(f"linear {self.backend}: skipped {names}: {r}")
        return lines


def converted_fqns(model_config) -> list[str]:
    return [
        fqn
        for fqn, cfg, _p, _a in model_config.traverse(Linear.Config)
        if isinstance(cfg, QUANTIZED_LINEAR_CONFIGS)
    ]
