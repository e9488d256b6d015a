"""The published throughput rows (docs/published_throughput.md) as Workloads.

Each row is what the source states (model, GPUs, layout, precision, compile, async TP,
local batch, seq) on a cluster profile for its platform. Where the source leaves a
setting out, the row says which value we assumed and why (`assumed`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from core.axes import Layout
from core.models import model_shape
from parallel.cluster import Cluster, load_cluster
from parallel.perf import Prediction, predict
from parallel.workload import Workload


@dataclass(frozen=True)
class Row:
    name: str
    source: str
    cluster: str  # profile name in clusters/
    nodes: int
    workload: Workload
    tokens_per_sec_per_gpu: float
    memory_gib: float | None = None
    assumed: str = ""

    def load_cluster(self) -> Cluster:
        return load_cluster(self.cluster, nodes=self.nodes)

    def predict(self) -> Prediction:
        return predict(self.workload, self.load_cluster())


TT24 = "torchtitan benchmarks/llama3_h100_202412_torchtitan.md (Grand Teton H100, 2024-12)"
TT25 = "torchtitan async-TP report, 2025-06 (Grand Teton H100)"
NEMO = "NVIDIA dgxc-benchmarking llama3.1 70B README v25.02 (H100 SXM)"


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


FP8_TW = dict(linear="fp8_tensorwise", fp8_all_gather=True)


def rows() -> list[Row]:
    gt = "grand_teton_h100"
    out = [
        Row("8B FSDP8 BF16 eager", TT24, gt, 1, _w8(layout=Layout(dp_shard=8)), 5762, 82.4),
        Row(
            "8B FSDP8 BF16 compile",
            TT24,
            gt,
            1,
            _w8(layout=Layout(dp_shard=8), compile=True),
            6667,
            77.0,
        ),
        Row(
            "8B FSDP8 FP8 compile",
            TT24,
            gt,
            1,
            _w8(layout=Layout(dp_shard=8), compile=True, **FP8_TW),
            8532,
            76.8,
            assumed="FP8 = tensorwise scaling with FP8 all-gather (torchtitan's Float8 of 2024)",
        ),
        Row("8B FSDP128 BF16 eager", TT24, gt, 16, _w8(layout=Layout(dp_shard=128)), 5605, 67.0),
        Row(
            "8B FSDP128 BF16 compile",
            TT24,
            gt,
            16,
            _w8(layout=Layout(dp_shard=128), compile=True),
            6514,
            62.0,
        ),
        Row(
            "8B FSDP128 FP8 compile",
            TT24,
            gt,
            16,
            _w8(layout=Layout(dp_shard=128), compile=True, **FP8_TW),
            8380,
            61.8,
            assumed="FP8 = tensorwise with FP8 all-gather",
        ),
        Row("70B FSDP32xTP8 FP8", TT24, gt, 32, _w70(**FP8_TW), 829, 71.9),
        Row("70B FSDP32xTP8 FP8 asyncTP", TT24, gt, 32, _w70(async_tp=True, **FP8_TW), 876, 67.6),
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
            TT24,
            gt,
            64,
            Workload(pp_schedule="1F1B", pp_microbatches=8, **w405),
            100,
            82.5,
            assumed="microbatches = number of stages (torchtitan's 2024 default): 8",
        ),
        Row(
            "405B FSDP8xTP8xPP8 Interleaved1F1B",
            TT24,
            gt,
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
        out.append(Row(f"70B FSDP32xTP8 {label} (2025)", TT25, gt, 32, _w70(**kw), tps))
        out.append(
            Row(
                f"70B FSDP32xTP8 {label} asyncTP (2025)",
                TT25,
                gt,
                32,
                _w70(async_tp=True, **kw),
                tps_async,
            )
        )
    out.append(
        Row(
            "70B NeMo TP4xPP4(VP5)xCP2 BF16",
            NEMO,
            "hgx_h100_ib",
            8,
            Workload(
                shape=model_shape("70B"),
                seq_len=8192,
                local_batch_size=64,
                layout=Layout(pp=4, dp_shard=2, cp=2, tp=4),
                pp_schedule="Interleaved1F1B",
                pp_microbatches=64,
                virtual_stages=5,
                ac="none",
                compile=True,
                async_tp=True,
                cp_rotate="alltoall",
            ),
            1121,
            assumed=(
                "Megatron with Transformer Engine modelled as: compiled (TE fusions), async TP "
                "(TP comm overlap), ring CP overlapped with attention, no activation "
                "recompute; distributed optimizer ~ FSDP over dp x cp gathered once per step"
            ),
        )
    )
    return out
