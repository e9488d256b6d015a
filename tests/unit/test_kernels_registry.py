"""Kernels registry: selection, capability errors on simulated devices, conversion plans."""

from __future__ import annotations

import typing

import pytest
from torchtitan.components.quantization import Float8LinearConverter
from torchtitan.components.quantization.float8 import Float8Linear
from torchtitan.models.common.attention import FlexAttention, VarlenAttention
from torchtitan.models.common.linear import Linear
from torchtitan.models.llama3 import llama3_configs, model_registry

from core.errors import ConfigError, exit_on_config_error
from kernels.attention import inner_attention_types
from kernels.caps import DeviceCaps
from kernels.dense_attention import DenseMaskAttention
from kernels.linear import EmulatedMXFP8Linear, Float8Converter, MXFP8Converter
from kernels.registry import (
    ATTENTION_BACKENDS,
    LINEAR_BACKENDS,
    apply_kernels,
    check_kernels,
    select_kernels,
)
from recipe.loader import load_recipe
from recipe.schema import KernelsSection
from tests.helpers.runs import ROOT

DEBUG = ROOT / "recipes" / "debug.toml"

CPU = DeviceCaps.cpu()
A100 = DeviceCaps.gpu("A100")
L40S = DeviceCaps.gpu("L40S")
H100 = DeviceCaps.gpu("H100")
B200 = DeviceCaps.gpu("B200")
H800 = DeviceCaps.gpu("H800")
B300 = DeviceCaps.gpu("B300")
GB300 = DeviceCaps.gpu("GB300")


def sel(caps, linear="bf16", attention="auto", **kw):
    return select_kernels(KernelsSection(attention=attention, linear=linear), caps, **kw)


def test_registry_covers_the_recipe_choices():
    hints = typing.get_type_hints(KernelsSection)
    assert set(typing.get_args(hints["linear"])) == {"auto", *LINEAR_BACKENDS}
    assert set(typing.get_args(hints["attention"])) == {"auto", *ATTENTION_BACKENDS}


def test_caps():
    assert H100.sm == "SM90" and B200.sm == "SM100" and L40S.at_least(8, 9)
    assert not A100.at_least(8, 9) and not CPU.at_least(8, 0)
    assert DeviceCaps.detect().is_cpu  # this machine has no GPU
    with pytest.raises(KeyError, match="known"):
        DeviceCaps.gpu("V100")


# (device, requested linear) -> (resolved, emulated, precision)
LINEAR_OK = [
    (CPU, "bf16", "bf16", False, "bf16"),
    (CPU, "fp8_rowwise", "fp8_rowwise", True, "fp8"),
    (CPU, "fp8_rowwise_gw_hp", "fp8_rowwise_gw_hp", True, "fp8"),
    (CPU, "mxfp8", "mxfp8", True, "mxfp8"),
    (CPU, "auto", "bf16", False, "bf16"),
    (A100, "auto", "bf16", False, "bf16"),
    (L40S, "fp8_rowwise", "fp8_rowwise", False, "fp8"),
    (L40S, "auto", "fp8_rowwise", False, "fp8"),
    (H100, "fp8_rowwise_gw_hp", "fp8_rowwise_gw_hp", False, "fp8"),
    (H100, "auto", "fp8_rowwise", False, "fp8"),
    (B200, "mxfp8", "mxfp8", False, "mxfp8"),
    (B200, "auto", "mxfp8", False, "mxfp8"),
    (CPU, "fp8_tensorwise", "fp8_tensorwise", True, "fp8"),
    (H800, "fp8_tensorwise", "fp8_tensorwise", False, "fp8"),
    (H800, "auto", "fp8_rowwise", False, "fp8"),  # tensorwise is never auto's pick
    (B300, "mxfp8", "mxfp8", False, "mxfp8"),
    (B300, "nvfp4", "nvfp4", False, "nvfp4"),
    (GB300, "auto", "mxfp8", False, "mxfp8"),  # NVFP4 is an explicit choice, never auto's
]


@pytest.mark.parametrize("caps,req,name,emulated,precision", LINEAR_OK)
def test_linear_selection(caps, req, name, emulated, precision):
    choice = sel(caps, linear=req)
    assert (choice.linear, choice.emulated, choice.linear_precision) == (name, emulated, precision)
    assert choice.precision == precision  # the runtime's name for it
    notes = " | ".join(choice.notices)
    if emulated:
        assert f"kernels.linear={req}" in notes and "emulated" in notes
    if req == "auto":
        assert f"kernels.linear=auto -> {name}" in notes
    if not emulated and req != "auto":
        assert "kernels.linear" not in notes  # nothing to say when it runs as asked


@pytest.mark.parametrize(
    "caps,req,needs",
    [
        (H100, "mxfp8", "SM100"),
        (A100, "mxfp8", "SM100"),
        (A100, "fp8_rowwise", "SM89"),
        (A100, "fp8_rowwise_gw_hp", "SM89"),
        (A100, "fp8_tensorwise", "SM89"),
        (H100, "nvfp4", "SM100"),
        (H800, "nvfp4", "SM100"),
        (DeviceCaps("rocm", "AMD Instinct MI300X"), "fp8_rowwise", "NVIDIA"),
        # No CPU emulation for NVFP4: torchao's training linear is Triton-only.
        (CPU, "nvfp4", "no CPU emulation"),
    ],
)
def test_linear_capability_errors(caps, req, needs):
    with pytest.raises(ConfigError) as e:
        sel(caps, linear=req, attention="dense", file="r.toml")
    msg = str(e.value)
    assert e.value.key == "kernels.linear" and e.value.file == "r.toml"
    assert req in msg and caps.name in msg and needs in msg


def test_emulation_refuses_compile():
    with pytest.raises(ConfigError, match="training.compile"):
        sel(CPU, linear="fp8_rowwise", compile=True)
    assert not sel(H100, linear="fp8_rowwise", compile=True).emulated  # hardware compiles


@pytest.mark.parametrize(
    "linear,seq_len,cp,ok",
    [
        ("mxfp8", 256, 1, True),
        ("mxfp8", 272, 1, False),  # 272 = 17 x 16: not a multiple of 32
        ("mxfp8", 256, 16, False),  # 16 tokens per rank
        ("fp8_rowwise", 200, 1, False),
        ("fp8_rowwise_gw_hp", 200, 1, True),  # weight gradient in high precision
        ("bf16", 7, 1, True),
    ],
)
def test_token_alignment(linear, seq_len, cp, ok):
    if ok:
        sel(H100 if linear != "mxfp8" else B200, linear=linear, seq_len=seq_len, cp=cp)
    else:
        with pytest.raises(ConfigError, match="multiple of"):
            sel(H100 if linear != "mxfp8" else B200, linear=linear, seq_len=seq_len, cp=cp)


FA3 = frozenset({"torchao", "fa3"})


@pytest.mark.parametrize(
    "caps,req,cp,name,config_type",
    [
        (CPU, "auto", 1, "dense", DenseMaskAttention.Config),
        (CPU, "dense", 1, "dense", DenseMaskAttention.Config),
        (H100, "auto", 1, "flex", FlexAttention.Config),  # no FA3 package: flex
        (DeviceCaps.gpu("H100", FA3), "auto", 1, "varlen", VarlenAttention.Config),
        (DeviceCaps.gpu("H100", FA3), "auto", 2, "flex", FlexAttention.Config),  # varlen: no CP
        (A100, "auto", 1, "varlen", VarlenAttention.Config),  # torch's built-in FA2
        (B200, "auto", 1, "flex", FlexAttention.Config),
        (H100, "flex", 4, "flex", FlexAttention.Config),
        (H100, "dense", 1, "dense", DenseMaskAttention.Config),
    ],
)
def test_attention_selection(caps, req, cp, name, config_type):
    choice = sel(caps, attention=req, cp=cp)
    assert choice.attention == name
    assert type(choice.attention_config) is config_type
    if req == "auto":
        assert f"kernels.attention=auto -> {name}" in choice.notices[0]
    if name == "dense" and not caps.is_cpu:
        assert any("for tests" in n for n in choice.notices)


@pytest.mark.parametrize(
    "caps,req,cp,needs",
    [
        (CPU, "flex", 1, "no backward on CPU"),
        (CPU, "varlen", 1, "CUDA-only"),
        (H100, "varlen", 1, "FlashAttention 3"),
        (B200, "varlen", 1, "FlashAttention 4"),
        (DeviceCaps.gpu("H100", FA3), "varlen", 2, "context parallel"),
    ],
)
def test_attention_errors(caps, req, cp, needs):
    with pytest.raises(ConfigError) as e:
        sel(caps, attention=req, cp=cp)
    assert e.value.key == "kernels.attention" and needs in str(e.value) and req in str(e.value)


def test_check_kernels_from_recipe_exits_2(capsys):
    recipe = load_recipe(DEBUG, ["kernels.linear=mxfp8"])
    assert check_kernels(recipe, CPU).emulated  # CPU: emulated, fine

    @exit_on_config_error
    def validate():
        check_kernels(recipe, H100)

    with pytest.raises(SystemExit) as e:
        validate()
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0  # one line, no traceback
    assert "debug.toml" in err and "kernels.linear" in err and "SM100" in err and "H100" in err


def _debug_config():
    return llama3_configs["debugmodel"](attn_backend="flex")


@pytest.mark.parametrize("linear", ["bf16", "fp8_rowwise", "fp8_rowwise_gw_hp", "mxfp8"])
def test_apply_kernels_on_cpu(linear):
    choice = sel(CPU, linear=linear)
    report = apply_kernels(_debug_config(), choice)
    cfg = report.model_config
    assert inner_attention_types(cfg) == {DenseMaskAttention.Config}
    kinds = {fqn: type(c) for fqn, c, _p, _a in cfg.traverse(Linear.Config)}
    assert kinds["lm_head"] is Linear.Config  # the output head is never converted
    layer_kinds = {t for f, t in kinds.items() if f != "lm_head"}
    expected = {
        "bf16": Linear.Config,
        "fp8_rowwise": Float8Linear.Config,
        "fp8_rowwise_gw_hp": Float8Linear.Config,
        "mxfp8": EmulatedMXFP8Linear.Config,
    }[linear]
    assert layer_kinds == {expected}
    lines = report.lines()
    if linear == "bf16":
        assert report.converters == [] and "unconverted" in lines[0]
    else:
        assert len(report.conversion.converted) == 30
        # The report names exactly the linears whose built config changed type, and the one
        # it skipped, with the reason.
        assert sorted(report.conversion.converted) == sorted(
            f for f, t in kinds.items() if t is expected
        )
        assert report.conversion.skipped == [
            ("lm_head", "output head, kept in high precision (torchtitan's practice)")
        ]
        assert "converted 30 of 31" in lines[0] and "(emulated)" in lines[0]
        assert "skipped lm_head: output head" in lines[1]


def test_tp_local_dims_decide_conversion():
    # debugmodel: dim 256, ffn 768. At tp=16 the local dims are 48 (wqkv, w1, w3, w2) and 16
    # (wo): multiples of 16 (FP8 converts) but not of 32 (MX skips them all).
    fp8 = apply_kernels(_debug_config(), sel(CPU, linear="fp8_rowwise"), tp=16)
    assert len(fp8.conversion.converted) == 30
    mx = apply_kernels(_debug_config(), sel(CPU, linear="mxfp8"), tp=16)
    assert mx.conversion.converted == [] and mx.converters == []
    reasons = dict(mx.conversion.skipped)
    assert "out 48 per rank at tp=16 not a multiple of 32" in reasons["layers.0.feed_forward.w1"]
    assert "in 16 per rank at tp=16" in reasons["layers.0.attention.wo"]
    assert any("layers.*.attention.wo x6" in line for line in mx.lines())


def test_unaligned_linear_is_skipped_and_listed():
    cfg = _debug_config()
    cfg.layers[2].feed_forward.w1.out_features = 1000  # 1000 = 62.5 x 16
    report = apply_kernels(cfg, sel(CPU, linear="fp8_rowwise"))
    reasons = dict(report.conversion.skipped)
    assert set(reasons) == {"lm_head", "layers.2.feed_forward.w1"}
    assert "out 1000 not a multiple of 16" in reasons["layers.2.feed_forward.w1"]
    # torchtitan's converter received exactly that list.
    assert set(report.converters[0].filter_fqns) == set(reasons)


def test_generic_converters_work_with_model_registry():
    choice = sel(CPU, linear="fp8_rowwise_gw_hp")
    (conv,) = choice.converters
    assert isinstance(conv, Float8Converter.Config)
    assert (
        conv.recipe_name == "rowwise_with_gw_hp"
        and conv.emulate
        and conv.filter_fqns == ["lm_head"]
    )
    spec = model_registry("debugmodel", converters=choice.converters)
    n = sum(
        isinstance(c, Float8Linear.Config) for _f, c, _p, _a in spec.model.traverse(Linear.Config)
    )
    assert n == 30


def test_hardware_choices_carry_compile_and_no_emulation():
    (fp8,) = sel(H100, linear="fp8_rowwise", compile=True).converters
    assert not fp8.emulate and fp8.model_compile_enabled and fp8.recipe_name == "rowwise"
    (mx,) = sel(B200, linear="mxfp8", compile=True).converters
    assert isinstance(mx, MXFP8Converter.Config) and not mx.emulate and mx.fqns == ["layers"]
    assert sel(H100).converters == []


def test_upstream_emulation_drops_the_recipe():
    """Why kernels.linear.Float8Converter exists: torchtitan 0.3.0's emulate=True swaps the
    recipe for torchao's default (tensorwise) config. If this starts failing, upstream fixed
    it and the subclass can go."""
    from torchao.float8.config import ScalingGranularity, ScalingType

    stock = Float8LinearConverter.Config(emulate=True, recipe_name="rowwise_with_gw_hp").build()
    ours = Float8Converter.Config(emulate=True, recipe_name="rowwise_with_gw_hp").build()
    assert stock.torchao_config.cast_config_input.scaling_granularity is (
        ScalingGranularity.TENSORWISE
    )
    cfg = ours.torchao_config
    assert cfg.emulate and cfg.round_scales_to_power_of_2
    assert cfg.cast_config_input.scaling_granularity is ScalingGranularity.AXISWISE
    assert cfg.cast_config_input_for_grad_weight.scaling_type is ScalingType.DISABLED


def test_describe():
    d = sel(CPU, linear="mxfp8").describe()
    assert d == "attention=dense linear=mxfp8 (emulated) on cpu"
    assert "SM90" in sel(H100).describe()


@pytest.mark.parametrize(
    "gpu,want",
    [("H100", "fp8_rowwise"), ("H200", "fp8_rowwise"), ("B200", "mxfp8"), ("GB200", "mxfp8"),
     ("cpu", "bf16")],
)  # fmt: skip
def test_auto_linear_is_one_rule_for_validation_and_planning(gpu, want):
    """`linear = "auto"` resolves the same for the planner (a profile's GPU kind) and for recipe
    validation (the device's capabilities): FP8 from SM89, MX from SM100 (the datasheets)."""
    from parallel.workload import linear_for

    caps = CPU if gpu == "cpu" else DeviceCaps.gpu(gpu)
    assert sel(caps, linear="auto").linear == want
    assert linear_for("auto", gpu) == want
    assert linear_for("bf16", gpu) == "bf16"


# Compute capability of each kind, from NVIDIA's "CUDA GPU Compute Capability" table
# (developer.nvidia.com/cuda-gpus): an independent reference for core.hardware.GPUS.
NVIDIA_CC = {"A100": (8, 0), "H100": (9, 0), "H200": (9, 0), "B200": (10, 0), "GB200": (10, 0),
             "B300": (10, 3), "GB300": (10, 3)}  # fmt: skip


def test_every_gpu_kind_has_caps_from_the_hardware_table():
    from core.hardware import GPUS

    for kind, cc in NVIDIA_CC.items():
        assert DeviceCaps.gpu(kind).capability == cc, kind
    for kind in GPUS:
        if kind != "cpu":  # every profile kind is a simulated device for the checks
            assert DeviceCaps.gpu(kind).is_cuda
    assert B300.sm == "SM103" and B300.at_least(10, 0)


def test_tensorwise_converter_gathers_fp8_and_matches_a_tensorwise_reference():
    """fp8_tensorwise: torchao's tensorwise recipe (e4m3 forward, one dynamic scale per
    tensor: 448 / amax) with the FP8-all-gather weight; the emulated forward equals the same
    quantization computed here with torch's float8 cast and fp32 matmul."""
    import math

    import torch
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    from kernels.registry import build_linear

    choice = sel(CPU, linear="fp8_tensorwise")
    (conv,) = choice.converters
    assert conv.recipe_name == "tensorwise" and conv.fsdp_float8_all_gather and conv.emulate
    assert sel(H100, linear="fp8_rowwise").converters[0].fsdp_float8_all_gather is False
    mod = build_linear(choice, 256, 128)
    assert isinstance(mod.weight, WeightWithDynamicFloat8CastTensor)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(128, 256, generator=g) / math.sqrt(256)
    x = torch.randn(64, 256, generator=g)
    x[3, 7] = 40.0  # one outlier sets the whole tensor's scale
    with torch.no_grad():
        mod.weight.copy_(w)
        out = mod(x)

    def q(t):  # per-tensor e4m3 with scale = max / amax, then back to fp32
        scale = torch.finfo(torch.float8_e4m3fn).max / t.abs().max()
        return (t * scale).to(torch.float8_e4m3fn).float() / scale

    ref = q(x) @ q(w).t()
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-5), (out - ref).abs().max()
    assert (out - x @ w.t()).abs().max() > 1e-3  # quantization happened


def test_nvfp4_plan_on_blackwell():
    """NVFP4 converts with torchtitan's NVFP4LinearConverter: the block linears whose dims
    are multiples of 128 (torchao's Triton kernels), never the output head."""
    from torchtitan.components.quantization import NVFP4LinearConverter

    from kernels.linear import plan_linear_conversion

    choice = sel(B300, linear="nvfp4", attention="flex")
    be = choice.linear_backend
    assert (be.align, be.token_align, be.in_auto) == (128, 128, False)
    plan = plan_linear_conversion(_debug_config(), align=be.align, tp=2, kernel=be.name)
    (conv,) = choice._converters(plan)
    assert isinstance(conv, NVFP4LinearConverter.Config)
    # debugmodel: dim 256, ffn 768, 16 heads of 16: at tp=2 wo's local input is 128, w1's
    # local output 384, w2's local input 384: all multiples of 128; lm_head is kept.
    assert sorted(conv.fqns) == sorted(d.fqn for d in plan if d.convert)
    assert "lm_head" not in conv.fqns and len(conv.fqns) == 30
    # tp=4: wo's local input is 64, not a multiple of 128: skipped with the reason.
    plan4 = plan_linear_conversion(_debug_config(), align=128, tp=4, kernel="nvfp4")
    skipped = {d.fqn: d.reason for d in plan4 if not d.convert}
    assert (
        "in 64 per rank at tp=4 not a multiple of 128 (nvfp4)" in skipped["layers.0.attention.wo"]
    )
    with pytest.raises(ConfigError, match="multiple of 128"):
        sel(B300, linear="nvfp4", seq_len=192)
