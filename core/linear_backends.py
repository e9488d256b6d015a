"""The linear backends a recipe may choose (`[kernels] linear`): one table, the one home of
their names, precisions and hardware requirements.

Pure data (no torch): the recipe schema takes its choices from here, the kernels registry
its requirements and `auto` ranking (kernels.caps.auto_linear), the performance model its
precision. The implementations are torchtitan's and torchao's (kernels/linear.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, kw_only=True)
class LinearBackend:
    name: str
    precision: str  # key of the peak-FLOP/s table: "bf16" | "fp8" | "mxfp8" | "nvfp4"
    min_capability: tuple[int, int] | None  # NVIDIA compute capability; None = any device
    needs_for: str  # what the requirement buys, for error messages
    align: int  # TP-local in/out features must be multiples of this (0 = any)
    token_align: int  # tokens per GEMM (seq_len / cp) must be a multiple of this (0 = any)
    speed_rank: int  # auto picks the highest-ranked supported backend
    summary: str
    # `auto` considers only torchtitan's own recipes: a backend torchtitan dropped (tensorwise)
    # or one that changes the numerics enough to need a recipe of its own (NVFP4: stochastic
    # rounding, Hadamard transforms) is an explicit choice, never picked for the user.
    in_auto: bool = True
    # Why the backend cannot run emulated on CPU ("" = it can: same quantization, fp32 matmuls).
    no_emulation: str = ""
    # The optional package (kernels.caps.FEATURE_MODULES) its kernels come from.
    feature: str = "torchao"

    @property
    def quantized(self) -> bool:
        return self.precision != "bf16"


LINEAR_BACKENDS: dict[str, LinearBackend] = {
    b.name: b
    for b in (
        LinearBackend(
            name="bf16",
            precision="bf16",
            min_capability=None,
            needs_for="",
            align=0,
            token_align=0,
            speed_rank=0,
            summary="plain nn.Linear in the training dtype (bf16 on GPU, fp32 on CPU)",
        ),
        LinearBackend(
            name="fp8_rowwise",
            precision="fp8",
            min_capability=(8, 9),
            needs_for="FP8 tensor cores (Ada/Hopper or newer)",
            align=16,
            # The weight-gradient GEMM reduces over tokens; torch._scaled_mm needs the
            # reduction dimension to be a multiple of 16.
            token_align=16,
            speed_rank=2,
            summary="torchao Float8 rowwise (e4m3 everywhere, power-of-2 scales) via "
            "torchtitan's Float8LinearConverter",
        ),
        LinearBackend(
            name="fp8_rowwise_gw_hp",
            precision="fp8",
            min_capability=(8, 9),
            needs_for="FP8 tensor cores (Ada/Hopper or newer)",
            align=16,
            token_align=0,  # the weight gradient is computed in high precision
            speed_rank=1,
            summary="torchao Float8 rowwise_with_gw_hp (output and input-gradient GEMMs in "
            "FP8, weight gradient in high precision) via torchtitan's Float8LinearConverter",
        ),
        LinearBackend(
            name="fp8_tensorwise",
            precision="fp8",
            min_capability=(8, 9),
            needs_for="FP8 tensor cores (Ada/Hopper or newer)",
            align=16,
            token_align=16,  # as rowwise: the weight-gradient GEMM reduces over tokens
            # Faster than rowwise in torchtitan's own measurements (70B on 256 H100: 810 vs
            # 600 tokens/s/GPU, benchmarks/calibration.md), but torchtitan 0.3 no longer
            # ships it: never chosen by auto.
            speed_rank=4,
            in_auto=False,
            summary="torchao Float8 tensorwise (dynamic per-tensor scales, e4m3 forward, e5m2 "
            "gradients; NVIDIA's 'FP8-CS') with FP8 all-gather under FSDP, via "
            "kernels.linear.Float8Converter (torchtitan's Float8LinearConverter)",
        ),
        LinearBackend(
            name="mxfp8",
            precision="mxfp8",
            min_capability=(10, 0),
            needs_for="MX block-scaled tensor cores (Blackwell)",
            align=32,
            token_align=32,  # the weight-gradient casts run along tokens in blocks of 32
            speed_rank=3,
            summary="torchao MXFP8 (e4m3, one e8m0 scale per 32 elements, RCEIL) via "
            "torchtitan's MXFP8LinearConverter",
        ),
        LinearBackend(
            name="nvfp4",
            precision="nvfp4",
            min_capability=(10, 0),
            needs_for="NVFP4 tensor cores (Blackwell)",
            # torchao's NVFP4 Triton kernels need every GEMM dimension (M, K, N) to be a
            # multiple of 128 (nvfp4_mm_triton; torchtitan's NVFP4Linear.Config checks K, N).
            align=128,
            token_align=128,
            speed_rank=5,
            in_auto=False,
            no_emulation="torchao 0.18's NVFP4 training linear has Triton kernels only "
            "(nvfp4_linear accepts kernel_preference TRITON alone), no CPU emulation",
            feature="torchao_nvfp4",
            summary="torchao NVFP4 training (e2m1, one e4m3 scale per 16 elements and a "
            "per-tensor scale, random Hadamard transform, stochastic rounding of gradients) "
            "via torchtitan's NVFP4LinearConverter",
        ),
    )
}

# What `[kernels] linear` accepts: the table's names and "auto".
LINEAR_CHOICES: tuple[str, ...] = ("auto", *LINEAR_BACKENDS)
LinearChoice = Literal[LINEAR_CHOICES]  # type: ignore[valid-type]  # built from the table


def sm(cap: tuple[int, int]) -> str:
    return f"SM{cap[0]}{cap[1]}"


def requirement_problem(
    be: LinearBackend,
    *,
    is_cuda: bool,
    capability: tuple[int, int] | None,
    features: frozenset[str],
) -> str:
    """Why `be` cannot run natively on a device ("" = it can)."""
    if be.min_capability is None:
        return ""
    if not is_cuda:
        return f"needs an NVIDIA GPU with compute capability {sm(be.min_capability)}+"
    if capability is None or capability < be.min_capability:
        return f"needs compute capability {sm(be.min_capability)}+ ({be.needs_for})"
    if be.feature not in features:
        if be.feature == "torchao":
            return "needs the torchao package"
        return f"needs torchao's {be.feature} kernels (not installed)"
    return ""


def ranked() -> list[LinearBackend]:
    """Fastest first among the backends `auto` may pick: the order it tries."""
    return sorted((b for b in LINEAR_BACKENDS.values() if b.in_auto), key=lambda b: -b.speed_rank)
