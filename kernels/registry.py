"""The kernels registry: `[kernels] attention` and `[kernels] linear` -> torchtitan configs.

    choice = check_kernels(recipe, DeviceCaps.detect(), cp=layout.cp)  # validation, exit 2
    spec.model = apply_kernels(spec.model, choice, tp=layout.tp).model_config  # model build
    for line in choice.log_lines(): logger.info(line)  # once, first

Each backend declares what it needs (device type, compute capability, optional packages,
dimension alignment); `select_kernels` checks those against a `DeviceCaps` and raises
ConfigError naming the backend, the GPU and the requirement. On CPU, FP8 and MXFP8 run
emulated (same quantization, fp32 matmuls) with a one-line notice. `auto` picks the fastest
backend the device supports and says which.

Implementations are torchtitan's and torchao's (see kernels/linear.py, kernels/attention.py);
nothing here is a kernel.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from torchtitan.models.common.attention import FlexAttention, VarlenAttention

from core.errors import ConfigError
from core.linear_backends import LINEAR_BACKENDS, LinearBackend, sm
from kernels.attention import set_inner_attention
from kernels.caps import DeviceCaps, auto_linear, linear_problem
from kernels.dense_attention import DenseMaskAttention
from recipe.schema import KernelsSection

if TYPE_CHECKING:
    from kernels.linear import ConversionReport

# kernels.linear (torchao's float8/MX converters) is imported where a model is converted,
# not here: the planning tools check `[kernels]` through this module, and importing torchao
# costs seconds and logs torch deprecation warnings before their one line.


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    min_capability: tuple[int, int] | None  # on CUDA; None = no CUDA requirement
    cpu_problem: str  # why it cannot train on CPU ("" = it can)
    supports_cp: bool
    summary: str
    make_config: Callable[[], Any]
    # Extra CUDA requirement (e.g. a FlashAttention package for this SM): caps -> problem.
    extra_check: Callable[[DeviceCaps], str] | None = None


def _varlen_problem(caps: DeviceCaps) -> str:
    # torchtitan's VarlenAttention activates FA3 on SM90 and FA4 on SM100+ (tools/utils.py
    # get_cuda_flash_attention_impl); both come from packages outside torch. Below SM90 torch's
    # built-in FlashAttention 2 runs.
    if caps.at_least(10, 0) and "fa4" not in caps.features:
        return (
            "FlashAttention 4 on SM100+ (torchtitan activates it; package "
            "'flash_attn.cute.interface' is not installed)"
        )
    if caps.at_least(9, 0) and not caps.at_least(10, 0) and "fa3" not in caps.features:
        return (
            "FlashAttention 3 on SM90 (torchtitan activates it; package "
            "'flash_attn_interface' is not installed)"
        )
    return ""


ATTENTION_BACKENDS: dict[str, AttentionBackend] = {
    b.name: b
    for b in (
        AttentionBackend(
            "flex",
            (8, 0),
            "FlexAttention has no backward on CPU (PyTorch: 'FlexAttention does not support "
            "backward on CPU')",
            True,
            "torch FlexAttention (compiled, Triton), causal + packed-document BlockMask",
            FlexAttention.Config,
        ),
        AttentionBackend(
            "varlen",
            (8, 0),
            "varlen needs aten::_flash_attention_forward, which is CUDA-only",
            False,  # torchtitan: "Varlen + CP is unsupported"
            "torch varlen_attn (FlashAttention 2/3/4 by SM) over packed documents",
            VarlenAttention.Config,
            _varlen_problem,
        ),
        AttentionBackend(
            "dense",
            None,
            "",
            True,
            "exact masked SDPA from the same BlockMask (memory grows with seq_len^2); the CPU path",
            DenseMaskAttention.Config,
        ),
    )
}

# Attention preference on CUDA, fastest first. Published kernel figures: FlashAttention 3
# reaches 1.5-2x FlashAttention 2 on H100 (FA3 paper); FlexAttention reaches ~85-90% of
# FlashAttention 2 (PyTorch FlexAttention blog). Unverified here: tools.kernel_bench measures it.
ATTENTION_SPEED_ORDER = ("varlen", "flex", "dense")


# kernels.linear -> torchao's Float8LinearRecipeName.
FLOAT8_RECIPES: dict[str, Literal["rowwise", "rowwise_with_gw_hp", "tensorwise"]] = {
    "fp8_rowwise": "rowwise",
    "fp8_rowwise_gw_hp": "rowwise_with_gw_hp",
    "fp8_tensorwise": "tensorwise",
}


@dataclass
class KernelChoice:
    """The resolved kernels: what the runtime builds, and what to tell the user first."""

    attention: str
    linear: str
    attention_config: object  # a torchtitan inner-attention Config instance
    caps: DeviceCaps
    emulated: bool = False
    compile: bool = False
    notices: list[str] = field(default_factory=list)
    report: KernelReport | None = None  # set by apply_kernels

    @property
    def linear_backend(self) -> LinearBackend:
        return LINEAR_BACKENDS[self.linear]

    @property
    def linear_precision(self) -> str:
        """Key of the peak-FLOP/s table for MFU: "bf16", "fp8", "mxfp8" or "nvfp4"."""
        return self.linear_backend.precision

    # The runtime's earlier name for the same thing.
    precision = linear_precision

    @property
    def converters(self) -> list:
        """Model-independent converter configs (output head excluded), for
        `model_registry(..., converters=...)`. `apply_kernels` is preferred: it also skips
        linears whose TP-local dimensions the kernel cannot take, and reports them."""
        return self._converters(None)

    def _converters(self, plan) -> list:
        from kernels.linear import Float8Converter, MXFP8Converter, NVFP4Converter

        be = self.linear_backend
        if not be.quantized:
            return []
        if be.precision == "fp8":
            skip = ["lm_head"] if plan is None else [d.fqn for d in plan if not d.convert]
            return [
                Float8Converter.Config(
                    recipe_name=FLOAT8_RECIPES[self.linear],
                    # Tensorwise weights gather in FP8 under FSDP2 (torchao's weight subclass);
                    # without FSDP the subclass only casts, as a plain Float8Linear would.
                    fsdp_float8_all_gather=self.linear == "fp8_tensorwise",
                    filter_fqns=skip,
                    emulate=self.emulated,
                    model_compile_enabled=self.compile,
                )
            ]
        keep = ["layers"] if plan is None else [d.fqn for d in plan if d.convert]
        if not keep:  # torchtitan's MX/NVFP4 converters read an empty list as "everything"
            return []
        if be.precision == "nvfp4":
            return [NVFP4Converter.Config(fqns=keep, model_compile_enabled=self.compile)]
        return [
            MXFP8Converter.Config(
                fqns=keep, emulate=self.emulated, model_compile_enabled=self.compile
            )
        ]

    def describe(self) -> str:
        lin = self.linear + (" (emulated)" if self.emulated else "")
        return f"attention={self.attention} linear={lin} on {self.caps.describe()}"

    def log_lines(self) -> list[str]:
        """What to log once, first: the choice, the notices, then (after `apply_kernels`)
        which linears were converted and which skipped."""
        lines = [f"kernels: {self.describe()}", *self.notices]
        return lines + (self.report.lines() if self.report is not None else [])


def _error(msg: str, key: str, file: str | None) -> ConfigError:
    return ConfigError(msg, file=file, key=key)


def attention_problem(name: str, caps: DeviceCaps) -> str:
    be = ATTENTION_BACKENDS[name]
    if caps.is_cpu:
        return be.cpu_problem
    if be.min_capability is None:
        return ""
    if not caps.is_cuda:
        return f"needs an NVIDIA GPU with compute capability {sm(be.min_capability)}+"
    if not caps.at_least(*be.min_capability):
        return f"needs compute capability {sm(be.min_capability)}+"
    return be.extra_check(caps) if be.extra_check else ""


def _select_attention(
    requested: str, caps: DeviceCaps, cp: int, file: str | None, notices: list[str]
) -> str:
    key = "kernels.attention"
    if requested == "auto":
        for name in ATTENTION_SPEED_ORDER:
            be = ATTENTION_BACKENDS[name]
            if caps.is_cpu != (name == "dense"):
                continue  # dense is the CPU path only; on GPU it is a test backend
            if attention_problem(name, caps) or (cp > 1 and not be.supports_cp):
                continue
            why = "CPU path" if caps.is_cpu else "fastest available here"
            notices.append(f"kernels.attention=auto -> {name} ({why}, {caps.describe()})")
            return name
        raise _error(
            f"no attention backend runs on {caps.describe()} (the GPU backends need an NVIDIA "
            "GPU, SM80+); set kernels.attention = dense to test anyway",
            key,
            file,
        )
    if requested not in ATTENTION_BACKENDS:
        raise _error(f"unknown attention backend {requested!r}", key, file)
    problem = attention_problem(requested, caps)
    if problem:
        alt = "dense (or auto)" if caps.is_cpu else "flex (or auto)"
        raise _error(
            f"attention backend '{requested}' cannot run on {caps.describe()}: {problem}; "
            f"use {alt}",
            key,
            file,
        )
    if cp > 1 and not ATTENTION_BACKENDS[requested].supports_cp:
        raise _error(
            f"attention backend '{requested}' does not support context parallelism "
            f"(parallel.cp={cp}); use flex",
            key,
            file,
        )
    if requested == "dense" and not caps.is_cpu:
        notices.append(
            "kernels.attention=dense on GPU: exact but materialises seq_len^2 masks and "
            "scores; for tests, not throughput"
        )
    return requested


def _select_linear(
    requested: str, caps: DeviceCaps, file: str | None, notices: list[str]
) -> tuple[str, bool]:
    key = "kernels.linear"
    if requested == "auto":
        be = auto_linear(caps)
        if caps.is_cpu:
            why = "no low-precision hardware on CPU; emulation is never faster"
        elif be.quantized:
            why = f"fastest supported on {caps.describe()}"
        else:
            why = f"{caps.describe()} has no FP8 tensor cores (SM89+)"
        notices.append(f"kernels.linear=auto -> {be.name} ({why})")
        return be.name, False
    if requested not in LINEAR_BACKENDS:
        raise _error(f"unknown linear backend {requested!r}", key, file)
    be = LINEAR_BACKENDS[requested]
    problem = linear_problem(requested, caps)
    if not problem:
        return requested, False
    if caps.is_cpu and be.no_emulation:
        raise _error(
            f"linear backend '{requested}' cannot run on cpu: {be.no_emulation}; it needs "
            f"an NVIDIA GPU with compute capability {sm(be.min_capability or (0, 0))}+ "
            "(use mxfp8 or fp8_rowwise, emulated on CPU, or bf16)",
            key,
            file,
        )
    if caps.is_cpu:
        notices.append(
            f"kernels.linear={requested}: no {be.precision.upper()} hardware on CPU; running "
            "emulated (same quantization, fp32 matmuls): correctness only, slower than bf16"
        )
        return requested, True
    raise _error(
        f"linear backend '{requested}' cannot run on {caps.describe()}: {problem}; "
        "use bf16 or auto",
        key,
        file,
    )


def select_kernels(
    kernels: KernelsSection,
    caps: DeviceCaps,
    *,
    compile: bool = False,
    seq_len: int | None = None,
    cp: int = 1,
    file: str | None = None,
) -> KernelChoice:
    """Resolve `[kernels]` for `caps`. Raises ConfigError (file + key) when it cannot run."""
    notices: list[str] = []
    attention = _select_attention(kernels.attention, caps, cp, file, notices)
    linear, emulated = _select_linear(kernels.linear, caps, file, notices)
    be = LINEAR_BACKENDS[linear]
    if emulated and compile:
        raise _error(
            f"emulated {linear} cannot run under torch.compile (torchtitan's converters allow "
            "emulation in eager mode only); set training.compile = false",
            "kernels.linear",
            file,
        )
    if be.token_align and seq_len is not None and (seq_len // cp) % be.token_align:
        raise _error(
            f"{linear} needs tokens per sequence (seq_len / cp = {seq_len // cp}) to be a "
            f"multiple of {be.token_align}: its weight-gradient GEMM reduces over tokens",
            "kernels.linear",
            file,
        )
    return KernelChoice(
        attention=attention,
        linear=linear,
        attention_config=ATTENTION_BACKENDS[attention].make_config(),
        caps=caps,
        emulated=emulated,
        compile=compile,
        notices=notices,
    )


def check_kernels(recipe, caps: DeviceCaps | None = None, *, cp: int | None = None) -> KernelChoice:
    """Recipe validation for `[kernels]` against the device (detected when `caps` is None).

    Call before any process group starts: a ConfigError here exits 2 via
    `exit_on_config_error`. `cp` defaults to the recipe's parallel.cp.
    """
    caps = caps or DeviceCaps.detect()
    return select_kernels(
        recipe.kernels,
        caps,
        compile=recipe.training.compile,
        seq_len=recipe.training.seq_len,
        cp=recipe.parallel.cp if cp is None else cp,
        file=recipe.source,
    )


@dataclass
class KernelReport:
    """What `apply_kernels` did to a model config."""

    model_config: object
    converters: list
    conversion: ConversionReport

    def lines(self) -> list[str]:
        return self.conversion.lines()


def apply_kernels(model_config, choice: KernelChoice, *, tp: int = 1) -> KernelReport:
    """Set the inner attention and convert the linears of a torchtitan model config.

    Returns the (possibly replaced) config with the converters used and the per-linear
    report. Apply after any change to the model's dimensions (e.g. a vocabulary override),
    and before `ModelSpec`/`Trainer.Config` are built from it.
    """
    from kernels.linear import ConversionReport, converted_fqns, plan_linear_conversion

    set_inner_attention(model_config, choice.attention_config)
    be = choice.linear_backend
    if not be.quantized:
        plan = plan_linear_conversion(model_config, align=1, tp=1)
        choice.report = KernelReport(
            model_config,
            [],
            ConversionReport("bf16", [], [(d.fqn, "bf16") for d in plan]),
        )
        return choice.report
    plan = plan_linear_conversion(model_config, align=be.align, tp=tp, kernel=be.name)
    converters = choice._converters(plan)
    for c in converters:
        model_config = c.build().convert(model_config)
    done = converted_fqns(model_config)
    want = [d.fqn for d in plan if d.convert]
    if sorted(done) != sorted(want):
        # The converters match FQNs by substring; the plan uses exact names. A mismatch
        # means a model whose names collide, which this layer does not handle.
        raise RuntimeError(
            f"{choice.linear}: converted {sorted(set(done) ^ set(want))} differently from the plan"
        )
    conversion = ConversionReport(
        choice.linear,
        converted=done,
        skipped=[(d.fqn, d.reason) for d in plan if not d.convert],
        emulated=choice.emulated,
    )
    choice.report = KernelReport(model_config, converters, conversion)
    return choice.report


def build_linear(choice: KernelChoice, in_features: int, out_features: int, *, bias: bool = False):
    """One linear layer built the way `apply_kernels` builds the model's (benchmarks, tests).

    Raises ValueError when the backend's kernel cannot take these dimensions.
    """
    from torchtitan.models.common.linear import Linear

    from kernels.linear import LinearDecision

    be = choice.linear_backend
    cfg = Linear.Config(in_features=in_features, out_features=out_features, bias=bias)
    if be.quantized:
        if in_features % be.align or out_features % be.align:
            raise ValueError(
                f"{choice.linear}: {in_features}x{out_features} is not a multiple of {be.align}"
            )
        # fqn "" is the root of this one-node config tree: the plan converts it.
        for c in choice._converters([LinearDecision("", in_features, out_features, True)]):
            cfg = c.build().convert(cfg)
    mod = cfg.build()
    if be.precision == "nvfp4":
        # NVFP4Linear's stochastic-rounding seed and Hadamard signs are buffers torchtitan
        # materialises in init_states (its meta-init protocol); callers set the weight after.
        mod.init_states()
    return mod
