"""Published training throughput as Workloads: the calibration set of the performance model.

Each row is what its source states (model, GPUs, layout, precision, batch, sequence length,
throughput; memory where stated), on a cluster profile for its platform, priced with the
software-stack profile of the run (`stacks/<name>.toml`). Where a source leaves a setting
out, the row says what we assumed (`assumed`). No row has its own constant: the only
fitted numbers are the stack profiles' (`FIT_PARAMS`), fitted by `fit()` over every row and
cross-validated by leaving one source out (`leave_one_source_out`) and by leaving one GPU
generation out (`leave_one_generation_out`: what a user of new hardware relies on).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from core.axes import Layout
from core.hardware import GENERATIONS, GPUS
from core.models import ModelShape, model_shape
from parallel.cluster import Cluster, load_cluster
from parallel.perf import Prediction, predict
from parallel.stacks import Stack, load_stack
from parallel.workload import Workload


@dataclass(frozen=True)
class Source:
    key: str
    title: str
    url: str
    date: str
    stack: str


SOURCES = {
    s.key: s
    for s in (
        Source(
            "tt2412",
            "torchtitan Llama 3.1 on H100 (Grand Teton, 500 W, 96 GB)",
            "https://github.com/pytorch/torchtitan/blob/main/benchmarks/llama3_h100_202412_torchtitan.md",
            "2024-12",
            "torchtitan",
        ),
        Source(
            "tt2506",
            "torchtitan async TP, Llama 3 70B on 256 H100 (Grand Teton)",
            "https://github.com/pytorch/torchtitan/blob/main/benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md",
            "2025-06",
            "torchtitan",
        ),
        Source(
            "tt2506h200",
            "torchtitan Llama 3.1 8B on 32 / 64 H200 (Trainy)",
            "https://github.com/pytorch/torchtitan/blob/main/benchmarks/llama3_8b_h200_2025-06_torchtitan.md",
            "2025-06",
            "torchtitan",
        ),
        Source(
            "nemo2407",
            "NeMo performance summary, NeMo 24.07 container, DGX-H100, FP8",
            "https://github.com/NVIDIA/NeMo/blob/main/docs/source/performance/performance_summary.md",
            "2024-07",
            "megatron_te",
        ),
        Source(
            "dgxc2502",
            "NVIDIA dgxc-benchmarking llama3.1 70B README v25.02 (H100 SXM, BF16)",
            "https://github.com/NVIDIA/dgxc-benchmarking",
            "2025-02",
            "megatron_te",
        ),
        Source(
            "nemo2502",
            "NeMo Framework performance summary, NeMo 25.02 container, DGX-B200, FP8",
            "https://docs.nvidia.com/nemo-framework/user-guide/latest/performance/performance_summary.html",
            "2025-02",
            "megatron_te",
        ),
        Source(
            "nemo2504",
            "NeMo Framework performance summary, NeMo 25.04 container, DGX-GB200, FP8 current scaling",
            "https://docs.nvidia.com/nemo-framework/user-guide/latest/performance/archive/25.04-performance-summary.html",
            "2025-04",
            "megatron_te",
        ),
        Source(
            "mb2511",
            "Megatron-Bridge performance summary, NeMo 25.11 container",
            "https://github.com/NVIDIA-NeMo/Megatron-Bridge/blob/main/docs/performance-summary.md",
            "2025-11",
            "megatron_te",
        ),
        Source(
            "mb2602",
            "Megatron-Bridge performance summary archive, NeMo 26.02 container",
            "https://github.com/NVIDIA-NeMo/Megatron-Bridge/blob/main/docs/performance-summary-archive.md",
            "2026-02",
            "megatron_te",
        ),
        Source(
            "llama3",
            "The Llama 3 Herd of Models, Table 4 (405B on 8K / 16K H100, BF16)",
            "https://arxiv.org/abs/2407.21783",
            "2024-07",
            "megatron_te",
        ),
    )
}


_CLUSTERS: dict[tuple[str, int], Cluster] = {}


@dataclass(frozen=True)
class Row:
    name: str
    source: str  # key in SOURCES
    cluster: str  # profile name in clusters/
    nodes: int
    workload: Workload
    tokens_per_sec_per_gpu: float
    memory_gib: float | None = None
    assumed: str = ""

    @property
    def src(self) -> Source:
        return SOURCES[self.source]

    @property
    def gpus(self) -> int:
        return self.workload.layout.world_size

    def load_cluster(self) -> Cluster:
        key = (self.cluster, self.nodes)
        if key not in _CLUSTERS:  # parsed once: the fit predicts every row many times
            _CLUSTERS[key] = load_cluster(self.cluster, nodes=self.nodes)
        return _CLUSTERS[key]

    def predict(self, stacks: dict[str, Stack] | None = None) -> Prediction:
        st = (stacks or {}).get(self.workload.stack)
        return predict(self.workload, self.load_cluster(), stack=st)


def megatron_flops_per_token(shape: ModelShape, seq_len: int) -> float:
    """Model FLOPs per token as NVIDIA's tables count them (Megatron's formula: 6 x
    non-embedding params + 6 x layers x seq x heads x head_dim, i.e. causal attention).
    Checked: 744 TFLOP/s / 14,451 tok/s = 51.5 GFLOP per token for Llama 3 8B at 8192."""
    s = shape
    return 6 * s.non_embedding_params + 6 * s.n_layers * seq_len * s.n_heads * s.head_dim


def _w8(**kw: Any) -> Workload:
    base: dict[str, Any] = dict(
        shape=model_shape("8B"), seq_len=8192, local_batch_size=2, ac="selective"
    )
    base.update(kw)
    return Workload(**base)


def _w70(**kw: Any) -> Workload:
    base: dict[str, Any] = dict(
        shape=model_shape("70B"),
        seq_len=8192,
        local_batch_size=16,
        layout=Layout(dp_shard=32, tp=8),
        ac="full",
        compile=True,
    )
    base.update(kw)
    return Workload(**base)


def _mcore(
    flavor: str,
    gpus: int,
    gbs: int,
    mbs: int,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    vp: int = 0,
    fsdp: bool = False,
    linear: str = "fp8_tensorwise",
    seq: int = 8192,
    family: str = "llama3",
) -> Workload:
    """A Megatron-Core run as NVIDIA's tables state it: GBS, MBS, TP, PP, CP, VP, FSDP
    (else DDP + distributed optimizer); dp = GPUs / (TP x PP x CP); microbatches = GBS /
    (dp x MBS) (pipelined with PP, gradient accumulation without)."""
    dp = gpus // (tp * pp * cp)
    micro = gbs // (dp * mbs)
    lay = (
        Layout(pp=pp, dp_shard=dp, cp=cp, tp=tp)
        if fsdp
        else Layout(pp=pp, dp_replicate=dp, cp=cp, tp=tp)
    )
    sched = "Interleaved1F1B" if vp > 1 else "1F1B"
    return Workload(
        shape=model_shape(flavor, family),
        seq_len=seq,
        local_batch_size=mbs * (micro if pp > 1 else 1),
        layout=lay,
        grad_accum=1 if pp > 1 else micro,
        pp_schedule=sched,
        pp_microbatches=micro if pp > 1 else 0,
        virtual_stages=vp if vp > 1 else 0,
        ac="none",
        linear=linear,
        # Transformer Engine gathers the sequence-parallel inputs of its FP8 GEMMs in FP8.
        fp8_tp_all_gather=linear == "fp8_tensorwise",
        compile=True,
        cp_rotate="alltoall",
        stack="megatron_te",
    )


# torchtitan's Float8 of 2024-2025: tensorwise with FP8 all-gathers in FSDP and in TP (its
# float8 TP styles, since removed).
FP8_TW = dict(linear="fp8_tensorwise", fp8_all_gather=True, fp8_tp_all_gather=True)
GT, H100, H200, B200, GB200, GB300 = (
    "grand_teton_h100",
    "hgx_h100_ib",
    "hgx_h200_ib",
    "hgx_b200_ib",
    "gb200_nvl72",
    "gb300_nvl72",
)
MCORE_ASSUMED = "no activation recompute (the tables list none)"
FP8_CS = "FP8-CS = per-tensor current scaling (fp8_tensorwise GEMMs)"
FP8_DELAYED = "FP8 = per-tensor delayed scaling (TE's default then; the table says FP8)"
NVFP4_ALL = "NVFP4 in every block linear (the table does not say which layers stay BF16)"

# NVIDIA's tables, row by row as published: (source, cluster, model, GPUs, GBS, MBS,
# layout {tp, pp, cp, vp, fsdp, linear}, tokens/s/GPU). FP8 is per-tensor unless MXFP8.
# fmt: off
MCORE_ROWS: tuple[tuple[str, str, str, int, int, int, dict[str, Any], float], ...] = (
    ("dgxc2502", H100, "70B", 64, 128, 1, dict(tp=4, pp=4, cp=2, vp=5, linear="bf16"), 1121),
    ("nemo2407", H100, "8B", 8, 128, 1, dict(cp=2), 12036),
    ("nemo2407", H100, "70B", 64, 128, 1, dict(tp=4, pp=4, cp=2, vp=5), 1533),
    ("nemo2502", B200, "8B", 8, 128, 2, {}, 26006),
    ("nemo2502", B200, "70B", 64, 128, 1, dict(tp=2, pp=4, cp=2, vp=5), 3062),
    ("nemo2502", B200, "405B", 128, 64, 1, dict(tp=4, pp=8, cp=2, vp=8), 625),
    ("nemo2504", GB200, "8B", 8, 128, 2, {}, 33099),
    ("nemo2504", GB200, "70B", 64, 128, 1, dict(fsdp=True), 4035),
    ("nemo2504", GB200, "405B", 128, 64, 1, dict(tp=4, pp=8, cp=2, vp=8), 665),
    ("mb2511", H100, "8B", 8, 128, 1, dict(fsdp=True), 14451),
    ("mb2511", H100, "70B", 64, 128, 1, dict(tp=4, pp=8, vp=5), 1602),
    ("mb2511", H100, "405B", 1024, 512, 1, dict(tp=8, pp=8, cp=2, vp=8), 292),
    ("mb2511", B200, "8B", 8, 128, 2, {}, 30624),
    ("mb2511", B200, "405B", 128, 64, 1, dict(tp=4, pp=8, cp=2, vp=8), 661),
    ("mb2511", GB200, "8B", 8, 128, 2, {}, 31508),
    ("mb2511", GB200, "70B", 64, 256, 2, dict(fsdp=True), 4312),
    ("mb2511", GB200, "405B", 256, 1536, 1, dict(tp=4, pp=16, vp=4), 813),
    ("mb2602", H100, "70B", 64, 256, 1, dict(tp=4, pp=8, vp=5), 1621),
    ("mb2602", H100, "405B", 1024, 1536, 1, dict(tp=8, pp=8, cp=2, vp=8), 311),
    ("mb2602", GB200, "70B", 64, 256, 2, dict(fsdp=True), 4040),
    ("mb2602", GB200, "70B", 64, 256, 1, dict(tp=2, pp=4, vp=5, linear="mxfp8"), 3613),
    ("mb2602", GB200, "405B", 256, 1536, 1, dict(tp=4, pp=16, vp=4), 793),
    ("mb2602", GB200, "405B", 256, 1536, 1, dict(tp=4, pp=16, vp=8, linear="mxfp8"), 786),
    # Rows added with the Blackwell Ultra profiles (issue 29): GB300, the MXFP8 figures the
    # 25.11 tables give in parentheses ("FP8-MX"), and NVFP4.
    ("mb2511", GB300, "8B", 8, 128, 2, {}, 37556),
    ("mb2511", GB300, "8B", 8, 128, 2, dict(linear="mxfp8"), 36108),
    ("mb2511", GB300, "70B", 64, 256, 2, dict(fsdp=True), 4520),
    ("mb2511", GB300, "405B", 256, 1536, 1, dict(tp=2, pp=8, cp=2, vp=4), 999),
    ("mb2511", GB200, "8B", 8, 128, 2, dict(linear="mxfp8"), 29789),
    ("mb2511", B200, "8B", 8, 128, 2, dict(linear="mxfp8"), 29521),
    ("mb2511", B200, "405B", 128, 64, 1, dict(tp=4, pp=8, cp=2, vp=8, linear="mxfp8"), 624),
    ("mb2602", GB300, "70B", 64, 256, 2, dict(fsdp=True), 5003),
    ("mb2602", GB300, "70B", 64, 256, 1, dict(pp=4, vp=5, linear="mxfp8"), 4596),
    ("mb2602", GB300, "70B", 64, 256, 1, dict(pp=4, vp=5, linear="nvfp4"), 6798),
    ("mb2602", GB200, "70B", 64, 256, 1, dict(tp=2, pp=4, vp=5, linear="nvfp4"), 4458),
    ("mb2602", GB300, "405B", 256, 1536, 1, dict(tp=4, pp=8, vp=4), 988),
    ("mb2602", GB300, "405B", 256, 1536, 1, dict(tp=2, pp=8, cp=2, vp=4, linear="mxfp8"), 931),
    ("mb2602", GB300, "405B", 256, 1536, 1, dict(tp=4, pp=8, vp=4, linear="nvfp4"), 1333),
    ("mb2602", GB200, "405B", 256, 1536, 1, dict(tp=4, pp=16, vp=8, linear="nvfp4"), 1076),
)
# fmt: on


def _mcore_layout(w: Workload, kw: dict[str, Any]) -> str:
    """A row's layout as NVIDIA's columns state it, e.g. TP4xPP8(VP5)xCP2 or FSDP64."""
    lay = w.layout
    if kw.get("fsdp"):
        return f"FSDP{lay.dp_shard}"
    parts = [f"TP{lay.tp}"] if lay.tp > 1 else []
    if lay.pp > 1:
        parts.append(f"PP{lay.pp}" + (f"(VP{w.virtual_stages})" if w.virtual_stages else ""))
    if lay.cp > 1:
        parts.append(f"CP{lay.cp}")
    return "x".join(parts) or f"DP{lay.dp}"


def rows() -> list[Row]:
    out = [
        Row("8B FSDP8 BF16 eager", "tt2412", GT, 1, _w8(layout=Layout(dp_shard=8)), 5762, 82.4),
        Row(
            "8B FSDP8 BF16 compile",
            "tt2412",
            GT,
            1,
            _w8(layout=Layout(dp_shard=8), compile=True),
            6667,
            77.0,
        ),
        Row(
            "8B FSDP8 FP8 compile",
            "tt2412",
            GT,
            1,
            _w8(layout=Layout(dp_shard=8), compile=True, **FP8_TW),
            8532,
            76.8,
            assumed="FP8 = tensorwise scaling with FP8 all-gather (torchtitan's Float8 of 2024)",
        ),
        Row(
            "8B FSDP128 BF16 eager",
            "tt2412",
            GT,
            16,
            _w8(layout=Layout(dp_shard=128)),
            5605,
            67.0,
        ),
        Row(
            "8B FSDP128 BF16 compile",
            "tt2412",
            GT,
            16,
            _w8(layout=Layout(dp_shard=128), compile=True),
            6514,
            62.0,
        ),
        Row(
            "8B FSDP128 FP8 compile",
            "tt2412",
            GT,
            16,
            _w8(layout=Layout(dp_shard=128), compile=True, **FP8_TW),
            8380,
            61.8,
            assumed="FP8 = tensorwise with FP8 all-gather",
        ),
        Row("70B FSDP32xTP8 FP8", "tt2412", GT, 32, _w70(**FP8_TW), 829, 71.9),
        Row(
            "70B FSDP32xTP8 FP8 asyncTP",
            "tt2412",
            GT,
            32,
            _w70(async_tp=True, **FP8_TW),
            876,
            67.6,
        ),
    ]
    w405: dict[str, Any] = dict(
        shape=model_shape("405B"),
        seq_len=8192,
        local_batch_size=32,
        layout=Layout(pp=8, dp_shard=8, tp=8),
        ac="full",
        compile=True,
        async_tp=True,
        **FP8_TW,
    )
    out += [
        Row(
            "405B FSDP8xTP8xPP8 1F1B",
            "tt2412",
            GT,
            64,
            Workload(pp_schedule="1F1B", pp_microbatches=8, **w405),
            100,
            82.5,
            assumed="microbatches = number of stages (torchtitan's 2024 default): 8",
        ),
        Row(
            "405B FSDP8xTP8xPP8 Interleaved1F1B",
            "tt2412",
            GT,
            64,
            Workload(pp_schedule="Interleaved1F1B", pp_microbatches=16, **w405),
            128,
            72.7,
            assumed="microbatches = number of stages (torchtitan's 2024 default): 16",
        ),
    ]
    for label, kw, tps, tps_async in (
        ("BF16", {}, 597, 652),
        ("FP8 tensorwise", FP8_TW, 810, 942),
        ("FP8 rowwise", {"linear": "fp8_rowwise"}, 600, 625),
    ):
        out.append(Row(f"70B FSDP32xTP8 {label} (2025)", "tt2506", GT, 32, _w70(**kw), tps))
        out.append(
            Row(
                f"70B FSDP32xTP8 {label} asyncTP (2025)",
                "tt2506",
                GT,
                32,
                _w70(async_tp=True, **kw),
                tps_async,
            )
        )
    for nodes, tps, mem in ((4, 10938, 47.96), (8, 10753, 46.97)):
        out.append(
            Row(
                f"8B FSDP{8 * nodes} FP8 compile H200",
                "tt2506h200",
                H200,
                nodes,
                _w8(layout=Layout(dp_shard=8 * nodes), compile=True, **FP8_TW),
                tps,
                mem,
                assumed="llama3_8b.toml defaults: seq 8192, selective AC; float8 = tensorwise",
            )
        )
    gpn = {H100: 8, H200: 8, B200: 8, GB200: 4, GB300: 4}
    gpu_of = {H100: "H100", B200: "B200", GB200: "GB200", GB300: "GB300"}
    for src, cl, flavor, gpus, gbs, mbs, kw, mc_tps in MCORE_ROWS:
        w = _mcore(flavor, gpus, gbs, mbs, **kw)
        lin = w.linear
        prec = {"bf16": "BF16", "mxfp8": "MXFP8", "nvfp4": "NVFP4"}.get(lin, "FP8")
        assumed = MCORE_ASSUMED
        if prec == "FP8":
            delayed = src in ("nemo2407", "nemo2502")
            assumed += "; " + (FP8_DELAYED if delayed else FP8_CS)
        if prec == "NVFP4":
            assumed += "; " + NVFP4_ALL
        out.append(
            Row(
                f"{flavor} {_mcore_layout(w, kw)} {prec} {gpu_of[cl]} x{gpus}",
                src,
                cl,
                gpus // gpn[cl],
                w,
                mc_tps,
                assumed=assumed,
            )
        )
    # Llama 3 paper, Table 4: 405B, BF16, seq 8192, 16M tokens per step, TFLOPs/GPU.
    s405 = model_shape("405B")
    for gpus, dp, per_dp, tflops in ((8192, 64, 32, 430), (16384, 128, 16, 400)):
        w = _mcore("405B", gpus, dp * per_dp, 1, tp=8, pp=16, vp=2, linear="bf16")
        out.append(
            Row(
                f"405B TP8xPP16 DP{dp} BF16 H100 x{gpus} (Meta)",
                "llama3",
                H100,
                gpus // 8,
                w,
                round(tflops * 1e12 / megatron_flops_per_token(s405, 8192), 1),
                assumed=(
                    f"published {tflops} TFLOPs/GPU, converted with Megatron's FLOP count "
                    "(Meta's count not stated); Meta's 4D-parallel stack priced as megatron_te; "
                    "interleaved schedule with 2 stages per rank (the paper gives no count); "
                    "RoCE fabric modelled as the 400G-per-GPU H100 profile"
                ),
            )
        )
    return out


# ----------------------------------------------------------------------------------------
# Fitting and cross-validation


@dataclass(frozen=True)
class FitParam:
    """One fitted constant: `get`/`set` it on the stacks map; `affects` says which rows
    move with it (only those are re-predicted while it is fitted).

    `neutral` is where every cold fit starts: the middle of the bounds, a value no row
    informed (the profiles' values in stacks/*.toml were fitted on every row, so a fold that
    started from them, or kept one that no remaining row moves, would price the held-out
    rows with constants fitted on those rows). `sibling` names the constant that prices
    this one in a fold where no remaining row informs it (the same stack's nearest
    precision, or the previous GPU generation): the documented sibling rule. Without one,
    the rows that need it are set apart, never predicted."""

    name: str
    get: Callable[[dict[str, Stack]], float]
    set: Callable[[dict[str, Stack], float], dict[str, Stack]]
    affects: Callable[[Row], bool]
    lo: float
    hi: float
    sibling: str | None = None

    @property
    def neutral(self) -> float:
        return round((self.lo + self.hi) / 2, 3)


def _mm(stack: str, prec: str, sibling: str | None = None) -> FitParam:
    def get(m: dict[str, Stack]) -> float:
        return m[stack].matmul_eff[prec]

    def set_(m: dict[str, Stack], v: float) -> dict[str, Stack]:
        st = m[stack]
        return {**m, stack: replace(st, matmul_eff={**st.matmul_eff, prec: v})}

    def affects(r: Row) -> bool:
        lin = r.workload.linear
        return r.workload.stack == stack and (lin == prec or (prec == "bf16"))

    sib = f"{stack}.matmul_eff.{sibling}" if sibling else None
    return FitParam(f"{stack}.matmul_eff.{prec}", get, set_, affects, 0.2, 0.95, sib)


def _const(stack: str, name: str, lo: float, hi: float, affects: Callable[[Row], bool]) -> FitParam:
    def get(m: dict[str, Stack]) -> float:
        return float(getattr(m[stack], name))

    def set_(m: dict[str, Stack], v: float) -> dict[str, Stack]:
        kw: dict[str, Any] = {name: v}
        return {**m, stack: replace(m[stack], **kw)}

    return FitParam(f"{stack}.{name}", get, set_, affects, lo, hi)


def generation_of(r: Row) -> str:
    """The GPU generation of a row's cluster (core.hardware: Hopper, Blackwell, ...)."""
    return GPUS[r.load_cluster().gpu].generation


def kinds_of(generation: str) -> tuple[str, ...]:
    return tuple(k for k, g in GPUS.items() if g.generation == generation)


def _set_generation(m: dict[str, Stack], generation: str, v: float) -> dict[str, Stack]:
    kinds = kinds_of(generation)
    return {
        k: replace(st, gpu_eff={**st.gpu_eff, **dict.fromkeys(kinds, v)}) for k, st in m.items()
    }


def _generation_param(generation: str, name: str, sibling: str | None = None) -> FitParam:
    """A generation's efficiency relative to Hopper: one hardware factor shared by both
    stacks and every part of the generation (only NVIDIA's tables have Blackwell rows)."""
    ref = kinds_of(generation)[0]

    def get(m: dict[str, Stack]) -> float:
        return m["megatron_te"].gpu_factor(ref)

    def set_(m: dict[str, Stack], v: float) -> dict[str, Stack]:
        return _set_generation(m, generation, v)

    return FitParam(
        f"gpu_eff.{name}",
        get,
        set_,
        lambda r: generation_of(r) == generation,
        0.4,
        1.2,
        f"gpu_eff.{sibling}" if sibling else None,
    )


def fit_params() -> list[FitParam]:
    """Every fitted constant, with its sibling (the nearest precision of the same stack: a
    lower-precision GEMM's efficiency is priced by the next higher one's; a GPU generation
    by the one before it). The order is the coordinate descent's."""
    tt, mc = "torchtitan", "megatron_te"
    return [
        _mm(tt, "bf16"),
        _mm(tt, "fp8_tensorwise", "bf16"),
        _mm(tt, "fp8_rowwise", "fp8_tensorwise"),
        _const(tt, "tp_hidden", 0.0, 1.0, lambda r: r.workload.stack == tt and r.workload.async_tp),
        _mm(mc, "bf16"),
        _mm(mc, "fp8_tensorwise", "bf16"),
        _generation_param("Blackwell", "Blackwell"),
        _generation_param("Blackwell Ultra", "BlackwellUltra", "Blackwell"),
        _mm(mc, "mxfp8", "fp8_tensorwise"),
        _mm(mc, "nvfp4", "mxfp8"),
    ]


def base_stacks() -> dict[str, Stack]:
    return {n: load_stack(n) for n in ("torchtitan", "megatron_te")}


def log_errors(rs: list[Row], stacks: dict[str, Stack]) -> list[float]:
    return [
        math.log(r.predict(stacks).tokens_per_sec_per_gpu / r.tokens_per_sec_per_gpu) for r in rs
    ]


def _golden(f: Callable[[float], float], a: float, b: float, steps: int = 18) -> float:
    """Minimum of a unimodal f on [a, b] by golden-section search (interval / 1.6 a step)."""
    gr = (math.sqrt(5) - 1) / 2
    c, d = b - gr * (b - a), a + gr * (b - a)
    fc, fd = f(c), f(d)
    for _ in range(steps):
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - gr * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + gr * (b - a)
            fd = f(d)
    return (a + b) / 2


def _sq_loss(prm: FitParam, sub: list[Row], m: dict[str, Stack]) -> Callable[[float], float]:
    def loss(v: float) -> float:
        return sum(e * e for e in log_errors(sub, prm.set(m, v)))

    return loss


# A sweep that moves no constant by more than this (the precision stacks/*.toml keep) ends
# the coordinate descent; MAX_SWEEPS only turns a non-converging fit into a reported one.
FIT_TOL = 0.001
MAX_SWEEPS = 40


@dataclass(frozen=True)
class Fit:
    """A cold fit: the stacks it produced and how each fitted constant got its value."""

    stacks: dict[str, Stack]
    informed: tuple[str, ...]  # constants that at least one fitted row moves
    by_sibling: dict[str, str]  # constant -> the informed sibling whose value it took
    uninformed: tuple[str, ...]  # neither: left at neutral; rows needing them are set apart
    sweeps: int
    converged: bool


def neutral_stacks(stacks: dict[str, Stack] | None = None) -> dict[str, Stack]:
    """The stack profiles with every fitted constant at its neutral start (`FitParam.neutral`):
    what a fold starts from, so that nothing the profiles learnt from the held-out rows
    reaches it."""
    m = dict(stacks or base_stacks())
    for prm in fit_params():
        m = prm.set(m, prm.neutral)
    return m


def fit_cold(rs: list[Row], stacks: dict[str, Stack] | None = None) -> Fit:
    """Coordinate descent (golden section per constant, within its bounds) minimising the
    sum of squared log errors of the rows each constant moves, from the neutral start, until
    a whole sweep moves no constant by more than FIT_TOL. A constant that no row in `rs`
    moves takes its sibling's fitted value (`FitParam.sibling`, recursively), else stays
    neutral and is reported in `uninformed`."""
    m = neutral_stacks(stacks)
    params = fit_params()
    informed = [p for p in params if any(p.affects(r) for r in rs)]
    sweeps, converged = 0, False
    while sweeps < MAX_SWEEPS and not converged:
        sweeps += 1
        moved = 0.0
        for prm in informed:
            sub = [r for r in rs if prm.affects(r)]
            v = round(_golden(_sq_loss(prm, sub, m), prm.lo, prm.hi), 3)
            moved = max(moved, abs(v - prm.get(m)))
            m = prm.set(m, v)
        converged = moved <= FIT_TOL + 1e-12
    by_name = {p.name: p for p in params}
    names = {p.name for p in informed}
    by_sibling: dict[str, str] = {}
    uninformed: list[str] = []
    for prm in params:  # siblings precede the constants they price (fit_params' order)
        if prm.name in names:
            continue
        sib = prm.sibling
        while sib is not None and sib not in names and sib not in by_sibling:
            sib = by_name[sib].sibling
        if sib is None:
            uninformed.append(prm.name)
            continue
        source = by_sibling.get(sib, sib)
        m = prm.set(m, by_name[source].get(m))
        by_sibling[prm.name] = source
    return Fit(m, tuple(p.name for p in informed), by_sibling, tuple(uninformed), sweeps, converged)


def fit(rs: list[Row], stacks: dict[str, Stack] | None = None) -> dict[str, Stack]:
    """The stacks of a cold fit on `rs` (what stacks/*.toml hold for every row)."""
    return fit_cold(rs, stacks).stacks


@dataclass(frozen=True)
class Fold:
    """One held-out group of a cross-validation: its scored rows (row, signed error %), the
    rows priced through the sibling rule (with the constants it used), and the rows set
    apart because a constant they need is informed by no remaining row."""

    scored: list[tuple[Row, float]]
    by_sibling: dict[str, str]
    set_apart: list[Row]
    sweeps: int
    converged: bool


def _error_pct(r: Row, m: dict[str, Stack]) -> float:
    return 100 * (r.predict(m).tokens_per_sec_per_gpu / r.tokens_per_sec_per_gpu - 1)


def _fold(train: list[Row], held: list[Row], f: Fit | None = None) -> Fold:
    f = f or fit_cold(train)
    missing = [p for p in fit_params() if p.name in f.uninformed]
    apart = [r for r in held if any(p.affects(r) for p in missing)]
    scored = [(r, _error_pct(r, f.stacks)) for r in held if r not in apart]
    used = {
        k: v for k, v in f.by_sibling.items() for p in fit_params()
        if p.name == k and any(p.affects(r) for r in held)
    }  # fmt: skip
    return Fold(scored, used, apart, f.sweeps, f.converged)


def leave_one_source_out(rs: list[Row] | None = None, only: str | None = None) -> dict[str, Fold]:
    """For each source (or `only` that one): a cold fit on every other source's rows, then
    this source's rows predicted (or set apart: `Fold`)."""
    rs = rs or rows()
    out: dict[str, Fold] = {}
    for key in [k for k in dict.fromkeys(r.source for r in rs) if only in (None, k)]:
        held = [r for r in rs if r.source == key]
        out[key] = _fold([r for r in rs if r.source != key], held)
    return out


def donor_generation(held: str, present: set[str]) -> str | None:
    """The generation whose fitted factor prices a held-out one: the nearest earlier one
    with rows (what is known when a new generation ships), else the nearest later one."""
    order = list(GENERATIONS)
    i = order.index(held)
    for g in reversed(order[:i]):
        if g in present:
            return g
    for g in order[i + 1 :]:
        if g in present:
            return g
    return None


def leave_one_generation_out(
    rs: list[Row] | None = None, only: str | None = None
) -> dict[str, tuple[str | None, list[tuple[Row, float]], list[Row]]]:
    """For each GPU generation: a cold fit on the other generations' rows, the held-out
    generation priced with the factor of its donor (`donor_generation`; its own factor has
    no row left to inform it), its rows predicted.

    Returns generation -> (donor, [(row, signed error %)], rows set apart). A row that needs
    a constant no remaining row informs (nor a sibling: torchtitan's rows are all Hopper, so
    holding Hopper out leaves every torchtitan constant at its neutral start) cannot be held
    out honestly: it is returned in the third list instead of being scored. `only`: hold out
    that generation alone.
    """
    rs = rs or rows()
    gens = [generation_of(r) for r in rs]
    params = {p.name: p for p in fit_params()}
    out: dict[str, tuple[str | None, list[tuple[Row, float]], list[Row]]] = {}
    for gen in [g for g in GENERATIONS if g in set(gens) and only in (None, g)]:
        train = [r for r, g in zip(rs, gens, strict=True) if g != gen]
        held = [r for r, g in zip(rs, gens, strict=True) if g == gen]
        f = fit_cold(train)
        m = f.stacks
        donor = donor_generation(gen, {g for g in gens if g != gen})
        own = {n for n, p in params.items() if n.startswith("gpu_eff.") and p.affects(held[0])}
        if donor is not None:
            m = _set_generation(m, gen, m["megatron_te"].gpu_factor(kinds_of(donor)[0]))
        else:
            own = set()
        f = replace(f, stacks=m, uninformed=tuple(n for n in f.uninformed if n not in own))
        fold = _fold(train, held, f)
        out[gen] = (donor, fold.scored, fold.set_apart)
    return out


# ----------------------------------------------------------------------------------------
# Mixture-of-experts rows (issue 34): a calibration of their own. The dense constants are
# fitted on the dense rows only (so the MoE rows move no dense figure); the MoE rows fit the
# stacks' grouped-GEMM efficiency on top of them.

MOE_SOURCES = {
    s.key: s
    for s in (
        Source(
            "mb2511moe",
            "Megatron-Bridge performance summary, NeMo 25.11 container, MoE rows (routing "
            "force-balanced, dropless)",
            "https://github.com/NVIDIA-NeMo/Megatron-Bridge/blob/main/docs/performance-summary.md",
            "2025-11",
            "megatron_te",
        ),
        Source(
            "dsv3",
            "DeepSeek-V3 Technical Report (arXiv 2412.19437): 14.8T tokens in 2.664M H800 "
            "GPU hours on 2,048 H800, PP16 x EP64 x ZeRO-1 DP, FP8, DualPipe",
            "https://arxiv.org/abs/2412.19437",
            "2024-12",
            "megatron_te",
        ),
        Source(
            "tt1993",
            "torchtitan PR 1993, DeepSeek-V3 16B on 8 B200 (EP 1, seq 4096, local batch 4, "
            "compiled, no AC): 18% MFU",
            "https://github.com/pytorch/torchtitan/pull/1993",
            "2025-11",
            "torchtitan",
        ),
    )
}
MOE_MCORE_ASSUMED = (
    "no activation recompute (the table lists none); EP carved out of the data-parallel ranks "
    "(Megatron's parallel folding); routing balanced (load imbalance 1.0, as the table says)"
)
# (cluster, family, flavor, GPUs, precision, GBS, MBS, seq, PP, VP, EP, tokens/s/GPU), as
# published in the 25.11 table. The DGX-H100 Qwen3 235B row is malformed there (a column
# missing: GBS cannot be told from MBS) and is set apart.
# fmt: off
MOE_MCORE_ROWS: tuple[tuple[str, str, str, int, str, int, int, int, int, int, int, float], ...] = (
    (GB300, "deepseek_v3", "671B", 256, "bf16", 4096, 1, 4096, 2, 4, 32, 3848),
    (GB300, "deepseek_v3", "671B", 256, "mxfp8", 4096, 1, 4096, 2, 4, 32, 4357),
    (GB300, "gpt_oss", "120b", 64, "bf16", 1280, 2, 8192, 1, 1, 64, 18347),
    (GB300, "qwen3", "30B-A3B", 8, "mxfp8", 512, 4, 4096, 1, 1, 8, 28934),
    (GB300, "qwen3", "235B-A22B", 256, "bf16", 8192, 2, 4096, 4, 12, 16, 6131),
    (GB200, "deepseek_v3", "671B", 256, "bf16", 4096, 1, 4096, 4, 4, 64, 3139),
    (GB200, "deepseek_v3", "671B", 256, "mxfp8", 4096, 1, 4096, 8, 4, 32, 4018),
    (GB200, "gpt_oss", "120b", 64, "bf16", 1280, 1, 8192, 1, 1, 64, 15876),
    (GB200, "qwen3", "30B-A3B", 8, "mxfp8", 512, 4, 4096, 1, 1, 8, 23766),
    (GB200, "qwen3", "235B-A22B", 256, "bf16", 8192, 1, 4096, 8, 3, 32, 4916),
    (B200, "deepseek_v3", "671B", 256, "mxfp8", 2048, 1, 4096, 16, 1, 8, 2139),
    (B200, "gpt_oss", "120b", 64, "bf16", 512, 4, 4096, 1, 1, 8, 8213),
    (B200, "qwen3", "30B-A3B", 8, "mxfp8", 512, 1, 4096, 1, 1, 8, 9299),
    (B200, "qwen3", "235B-A22B", 64, "mxfp8", 1024, 1, 4096, 8, 2, 8, 3269),
    (H100, "gpt_oss", "120b", 64, "bf16", 512, 4, 4096, 4, 1, 8, 5630),
    (H100, "qwen3", "30B-A3B", 16, "fp8_tensorwise", 512, 2, 4096, 2, 24, 8, 5275),
)
# fmt: on
MOE_SET_APART = {
    "Qwen3_235B_a22B DGX-H100 x256 FP8-CS (mb2511moe)": "the published row has a column "
    "missing (GBS and MBS cannot be told apart), so its layout is unknown",
}


def moe_rows() -> list[Row]:
    """The published MoE training rows (MOE_SOURCES), as Workloads on their clusters."""
    gpn = {GB300: 4, GB200: 4, B200: 8, H100: 8}
    gpu_of = {GB300: "GB300", GB200: "GB200", B200: "B200", H100: "H100"}
    prec = {"bf16": "BF16", "mxfp8": "FP8-MX", "fp8_tensorwise": "FP8-CS"}
    out = []
    for cl, fam, flavor, gpus, lin, gbs, mbs, seq, pp, vp, ep, tps in MOE_MCORE_ROWS:
        w = replace(
            _mcore(flavor, gpus, gbs, mbs, pp=pp, vp=vp, linear=lin, seq=seq, family=fam),
            ep=ep,
            load_imbalance=1.0,
        )
        lay = f"PP{pp}" + (f"(VP{vp})" if vp > 1 else "") + f"xEP{ep}" if pp > 1 else f"EP{ep}"
        out.append(
            Row(
                f"{fam} {flavor} {lay} {prec[lin]} {gpu_of[cl]} x{gpus}",
                "mb2511moe",
                cl,
                gpus // gpn[cl],
                w,
                tps,
                assumed=MOE_MCORE_ASSUMED,
            )
        )
    # DeepSeek-V3: 14.8T tokens / (2.664M GPU hours x 3600 s) = 1,543 tokens/s/GPU over the
    # whole pretraining (restarts and evaluation included, so a lower bound on a step's rate).
    v3 = Workload(
        shape=model_shape("671B", "deepseek_v3"),
        seq_len=4096,
        local_batch_size=60,
        layout=Layout(pp=16, dp_replicate=128),
        pp_schedule="DualPipeV",
        pp_microbatches=60,
        ac="selective",
        linear="fp8_rowwise",
        compile=True,
        stack="megatron_te",
        ep=64,
    )
    out.append(
        Row(
            "deepseek_v3 671B PP16xEP64 FP8 H800 x2048 (DeepSeek)",
            "dsv3",
            "hgx_h800_ib",
            256,
            v3,
            round(14.8e12 / (2.664e6 * 3600), 1),
            assumed=(
                "DeepSeek's own stack (HAI-LLM) priced as megatron_te; its 1x128/128x128 FP8 "
                "as fp8_rowwise; DualPipe as DualPipeV; the final batch (15,360 sequences, 120 "
                "per pipeline: 60 per rank and direction); MLA up-projection / SwiGLU recompute "
                "as selective AC; MTP module not counted; the stack's load imbalance"
            ),
        )
    )
    # torchtitan PR 1993: MFU 18% on B200 against torchtitan's own FLOP count (active
    # parameters) = tokens/s x flops_per_token / BF16 peak.
    s16 = model_shape("16B", "deepseek_v3")
    pk = GPUS["B200"].peak_tflops["bf16"] * 1e12
    out.append(
        Row(
            "deepseek_v3 16B FSDP8 BF16 B200 x8 (torchtitan)",
            "tt1993",
            B200,
            1,
            Workload(
                shape=s16,
                seq_len=4096,
                local_batch_size=4,
                layout=Layout(dp_shard=8),
                ac="none",
                compile=True,
            ),
            round(0.18 * pk / s16.flops_per_token(4096), 1),
            assumed="converted from the stated 18% MFU with torchtitan's FLOP count; the "
            "stack's load imbalance (the run does not state one)",
        )
    )
    return out


def moe_fit_params() -> list[FitParam]:
    def on(stack: str) -> Callable[[Row], bool]:
        return lambda r: r.workload.stack == stack

    return [
        _const("megatron_te", "grouped_gemm_eff", 0.2, 1.0, on("megatron_te")),
        _const("megatron_te", "moe_layer_overhead_s", 0.0, 0.03, on("megatron_te")),
        _const("torchtitan", "grouped_gemm_eff", 0.2, 1.0, on("torchtitan")),
    ]


def neutral(m: dict[str, Stack], params: list[FitParam]) -> dict[str, Stack]:
    """Every constant in `params` at its neutral start (`FitParam.neutral`, the middle of its
    bounds): a fold's starting point that nothing fitted before it (on any row) has touched."""
    for prm in params:
        m = prm.set(m, prm.neutral)
    return m


def fit_moe(moe: list[Row], dense: list[Row] | None = None) -> dict[str, Stack]:
    """The MoE constants fitted on `moe` from a neutral start, on top of the dense
    constants: the profiles' (`dense` None: what stacks/*.toml ship, fitted on the dense rows
    alone) or cold-fitted on `dense` (the cross-validation's folds), so that nothing keeps a
    value fitted on rows outside `moe` + `dense`. Coordinate descent to convergence
    (FIT_TOL), as the dense fit."""
    m = neutral(base_stacks(), moe_fit_params())
    if dense is not None:
        m = fit(dense, m)
    for _ in range(MAX_SWEEPS):
        moved = 0.0
        for prm in moe_fit_params():
            sub = [r for r in moe if prm.affects(r)]
            if sub:
                v = round(_golden(_sq_loss(prm, sub, m), prm.lo, prm.hi), 3)
                moved = max(moved, abs(v - prm.get(m)))
                m = prm.set(m, v)
        if moved <= FIT_TOL + 1e-12:
            break
    return m


def moe_leave_one_source_out(
    moe: list[Row] | None = None, dense: list[Row] | None = None
) -> dict[str, Fold]:
    """For each MoE source: every constant (dense and MoE) refitted from a neutral start
    without that source's rows (MoE rows, and its dense rows where the same document has
    them: mb2511moe holds out mb2511 too), then this source's MoE rows predicted. A held-out
    row whose stack keeps no MoE row in the fold (its grouped-GEMM efficiency would be the
    neutral start, informed by nothing: tt1993, torchtitan's only MoE row) is set apart."""
    moe = moe or moe_rows()
    dense = dense or rows()
    same_doc = {"mb2511moe": "mb2511"}
    out: dict[str, Fold] = {}
    for key in dict.fromkeys(r.source for r in moe):
        held = [r for r in moe if r.source == key]
        train = [r for r in moe if r.source != key]
        stacks_left = {r.workload.stack for r in train}
        m = fit_moe(train, [r for r in dense if r.source != same_doc.get(key)])
        scored = [(r, _error_pct(r, m)) for r in held if r.workload.stack in stacks_left]
        apart = [r for r in held if r.workload.stack not in stacks_left]
        out[key] = Fold(scored, {}, apart, 0, True)
    return out
