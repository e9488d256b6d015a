"""GPU facts in one place: dense peak FLOP/s per precision, memory, bandwidths, compute
capability, generation and the largest NVLink domain each part ships in.

Everything that reports MFU (runtime metrics, the performance model, tools.reproduce)
imports `peak_flops` from here, so one table decides what "100% of peak" means; cluster
profiles (`parallel.cluster`) accept exactly the kinds in `GPUS`, and the kernels registry
(`kernels.caps`) takes each kind's compute capability from here.

Peaks are the vendor's dense (non-sparse) tensor-core figures, in FLOP/s. A CPU has no
tensor-core peak: `peak_flops("cpu", ...)` is None and MFU is "n/a".
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

# Precisions the peak table knows. Linear-backend names map onto these (`precision_of`).
PRECISIONS = ("bf16", "fp8", "fp4", "tf32")

# Sizes past which a cluster profile, a --nodes argument or a declared world size is a typo,
# not a machine; refused with one line, because the planner's search and the fabric grow
# with them (a divisor search over 2**62 GPUs never ends).
# - GPUs per host: the largest NVLink domain in GPUS is GB200/GB300 NVL72 (72 GPUs); an
#   HGX host holds 8 and a GB200 compute tray 4, so a whole NVL72 rack described as one
#   host is the largest meaningful "node". (On CPU profiles it counts processes per host.)
# - GPUs per NVLink domain: 576, the most NVIDIA's NVLink 5 switch system connects.
# - hosts and GPUs in one job: 2**17 hosts and 2**20 GPUs, over 5x the largest published
#   training cluster (about 200k GPUs).
MAX_GPUS_PER_NODE = 72
MAX_NVLINK_DOMAIN_GPUS = 576
MAX_NODES = 2**17
MAX_WORLD_SIZE = 2**20


@dataclass(frozen=True)
class GpuSpec:
    """Datasheet numbers for one GPU kind (per GPU)."""

    kind: str
    peak_tflops: dict[str, float]  # precision -> dense TFLOP/s; absent = unsupported
    hbm_gib: float  # what torch.cuda reports as total memory, GiB
    hbm_tbps: float  # HBM bandwidth, TB/s
    nvlink_gbps: float  # NVLink, gigabits/s per GPU per direction (0 = none)
    tdp_w: float  # board power the peak is quoted at
    mxfp8: bool = False  # block-scaled FP8 tensor cores (SM100 and later)
    capability: tuple[int, int] | None = None  # CUDA compute capability (None: no CUDA)
    generation: str = ""  # architecture generation (leave-one-generation-out calibration)
    max_nvlink_domain: int = 0  # most GPUs one NVLink domain of this part holds (0 = no bound)

    @property
    def nvfp4(self) -> bool:
        """NVFP4 tensor cores (Blackwell and later): the table has an FP4 peak."""
        return "fp4" in self.peak_tflops


# Sources, per column:
# - peaks: NVIDIA H100/H200/B200/GB200 datasheets (dense figures = half the "with sparsity"
#   ones); torchtitan's get_peak_flops uses the same BF16 values. H100 and H200 share the
#   compute die; H200 differs in memory (141 GB HBM3e, 4.8 TB/s). GB200's BF16 is quoted as
#   2.45-2.5 PFLOP/s depending on the document; we take 2.5 like torchtitan.
# - fp4 (dense NVFP4): NVIDIA dgxc-benchmarking README, "Peak Theoretical Throughput"
#   (non-sparse, the table NVIDIA's own training recipes compute MFU with): B200 9,000,
#   GB200 9,800, B300 13,500, GB300 14,700 TFLOP/s; "NVFP4 precision is not supported on
#   Hopper" (https://github.com/NVIDIA/dgxc-benchmarking, README.md).
# - hbm_gib: torch's total_memory (80 GB -> 79.2 GiB; 141 GB -> 139.8 GiB; B200 "180 GB"
#   -> 178.4 GiB; GB200 186 GB -> 184 GiB, unverified on hardware).
# - nvlink_gbps: NVLink 4 450 GB/s and NVLink 5 900 GB/s per direction; H100 PCIe has only
#   PCIe Gen5 x16 (~64 GB/s).
# - capability: NVIDIA "CUDA GPU Compute Capability" (developer.nvidia.com/cuda-gpus): 10.3
#   GB300/B300, 10.0 GB200/B200, 9.0 H200/H100 (H800 and the PCIe/NVL cards are the same
#   dies), 8.0 A100.
# - max_nvlink_domain: A100 16 (HGX A100 16-GPU, NVSwitch gen 2); H100/H200 SXM 256 (H100
#   datasheet: "NVLink Switch System ... up to 256 H100 GPUs"); H800 8 (HGX H800, NVLink cut
#   to 400 GB/s, no NVLink switch system offered); H100 PCIe and H100 NVL 2 (two-way NVLink
#   bridge, H100 PCIe / NVL product briefs); H200 NVL 4 ("2- or 4-way NVLink bridge", H200
#   datasheet); B200 and B300 8 (HGX B200 / HGX B300: eight GPUs on one NVSwitch tray);
#   GB200 and GB300 72 (the NVL72 rack: "72 Blackwell GPUs in one NVLink domain", GB200 /
#   GB300 NVL72 pages).
GPUS: dict[str, GpuSpec] = {
    "H100": GpuSpec(
        "H100", {"bf16": 989, "fp8": 1979, "tf32": 494.5}, 79.2, 3.35, 3600, 700,
        capability=(9, 0), generation="Hopper", max_nvlink_domain=256,
    ),
    "H100_PCIE": GpuSpec(
        "H100_PCIE", {"bf16": 756, "fp8": 1513, "tf32": 378}, 79.2, 2.0, 512, 350,
        capability=(9, 0), generation="Hopper", max_nvlink_domain=2,
    ),
    "H100_NVL": GpuSpec(
        "H100_NVL", {"bf16": 835, "fp8": 1671, "tf32": 418}, 87.5, 3.9, 4800, 400,
        capability=(9, 0), generation="Hopper", max_nvlink_domain=2,
    ),
    "H200": GpuSpec(
        "H200", {"bf16": 989, "fp8": 1979, "tf32": 494.5}, 139.8, 4.8, 3600, 700,
        capability=(9, 0), generation="Hopper", max_nvlink_domain=256,
    ),
    "B200": GpuSpec(
        "B200", {"bf16": 2250, "fp8": 4500, "fp4": 9000, "tf32": 1100}, 178.4, 8.0, 7200, 1000,
        mxfp8=True, capability=(10, 0), generation="Blackwell", max_nvlink_domain=8,
    ),
    "GB200": GpuSpec(
        "GB200", {"bf16": 2500, "fp8": 4900, "fp4": 9800, "tf32": 1250}, 184.0, 8.0, 7200, 1200,
        mxfp8=True, capability=(10, 0), generation="Blackwell", max_nvlink_domain=72,
    ),
    # H200 NVL (PCIe card, 2-/4-way NVLink bridge 900 GB/s bidirectional, up to 600 W): NVIDIA
    # H200 datasheet, "H200 NVL" column: BF16 1,671 / FP8 3,341 / TF32 835 TFLOPS with
    # sparsity -> halved. Same 141 GB HBM3e at 4.8 TB/s as the SXM part.
    "H200_NVL": GpuSpec(
        "H200_NVL", {"bf16": 835.5, "fp8": 1670.5, "tf32": 417.5}, 139.8, 4.8, 3600, 600,
        capability=(9, 0), generation="Hopper", max_nvlink_domain=4,
    ),
    # H800 SXM5: NVIDIA H800 datasheet, the same tensor-core figures as H100 SXM (BF16 1,979 /
    # FP8 3,958 TFLOPS with sparsity), 80 GB HBM3 3.35 TB/s, NVLink cut to 400 GB/s
    # bidirectional (200 GB/s = 1,600 Gb/s per direction), 700 W.
    "H800": GpuSpec(
        "H800", {"bf16": 989, "fp8": 1979, "tf32": 494.5}, 79.2, 3.35, 1600, 700,
        capability=(9, 0), generation="Hopper", max_nvlink_domain=8,
    ),
    # Blackwell Ultra. HGX B300: NVIDIA HGX B300 datasheet, 8 GPUs "FP8 72 PFLOPS, BF16 36
    # PFLOPS" with sparsity -> 4.5 / 2.25 PFLOP/s dense per GPU (TF32 1.1); GB300 NVL72: NVIDIA
    # GB300 NVL72 page, 360 PFLOPS FP8 dense per 72 GPUs -> 5 PFLOP/s FP8, 2.5 BF16, 1.25
    # TF32 per GPU. Per-GPU dense tables: verda.com/blog/gb300-nvl72-architecture and
    # glennklockwood.com/garden/processors/B300 (agree). Memory "270 GB" / "279 GB" HBM3e
    # (251.5 / 259.8 GiB as torch would report; unverified on hardware), 8 TB/s, NVLink 5.
    # Dense FP4 from dgxc-benchmarking (above).
    "B300": GpuSpec(
        "B300", {"bf16": 2250, "fp8": 4500, "fp4": 13500, "tf32": 1100}, 251.5, 8.0, 7200, 1100,
        mxfp8=True, capability=(10, 3), generation="Blackwell Ultra", max_nvlink_domain=8,
    ),
    "GB300": GpuSpec(
        "GB300", {"bf16": 2500, "fp8": 5000, "fp4": 14700, "tf32": 1250}, 259.8, 8.0, 7200, 1400,
        mxfp8=True, capability=(10, 3), generation="Blackwell Ultra", max_nvlink_domain=72,
    ),
    "A100": GpuSpec(
        "A100", {"bf16": 312, "tf32": 156}, 79.2, 2.0, 2400, 400,
        capability=(8, 0), generation="Ampere", max_nvlink_domain=16,
    ),
    "cpu": GpuSpec("cpu", {}, 0.0, 0.05, 0, 0),
}  # fmt: skip

# GPU kinds a cluster profile may name: every kind in the table (issue 29; a profile of a
# GPU without numbers here could be planned but not priced).
PROFILE_KINDS: tuple[str, ...] = tuple(GPUS)

# Generations in release order (leave-one-generation-out calibration holds one out and
# prices it with the constants of the nearest other).
GENERATIONS: tuple[str, ...] = ("Ampere", "Hopper", "Blackwell", "Blackwell Ultra")


@lru_cache(maxsize=256)
def gpu_kind(name: str) -> str | None:
    """Map a kind ("H100") or a torch device name ("NVIDIA H100 80GB HBM3") to a kind.

    None for names we have no numbers for. Order matters: "GB200" before "B200",
    "H200" before "H20", PCIe/NVL H100 variants before plain H100.
    """
    if name in GPUS:
        return name
    n = name.upper()
    if n in ("CPU", "") or n.startswith("CPU"):
        return "cpu"
    if "GB300" in n:
        return "GB300"
    if "B300" in n:
        return "B300"
    if "GB200" in n:
        return "GB200"
    if "B200" in n:
        return "B200"
    if "H200" in n:
        return "H200_NVL" if "NVL" in n else "H200"
    if "H800" in n:
        # H800 PCIe has H100 PCIe's tensor-core figures (756 BF16 dense, NVIDIA datasheet).
        return "H100_PCIE" if "PCIE" in n else "H800"
    if "H100" in n:
        if "PCIE" in n:
            return "H100_PCIE"
        if "NVL" in n:
            return "H100_NVL"
        return "H100"
    if "A100" in n:
        return "A100"
    return None


def precision_of(linear: str) -> str:
    """The peak column a linear backend (recipe `kernels.linear`) runs at."""
    p = linear.lower()
    if p in ("bf16", "bfloat16", "auto"):
        return "bf16"
    if p.startswith("fp8") or p.startswith("float8") or p == "mxfp8":
        return "fp8"
    if p in ("fp4", "nvfp4"):
        return "fp4"
    if p in ("fp32", "float32", "tf32"):
        return "tf32"
    raise ValueError(f"unknown precision {linear!r}; known: {', '.join(PRECISIONS)}")


@lru_cache(maxsize=256)
def peak_flops(gpu_name_or_kind: str, precision: str = "bf16") -> float | None:
    """Dense peak FLOP/s of one GPU at `precision`, or None (CPU, unknown GPU, unsupported).

    `precision` is "bf16", "fp8", "fp4", "tf32" or a linear-backend name ("fp8_rowwise",
    "mxfp8", "nvfp4", "float32" -> tf32). MXFP8 needs block-scaled tensor cores
    (Blackwell); NVFP4 an FP4 peak in the table (Blackwell too).
    """
    kind = gpu_kind(gpu_name_or_kind)
    if kind is None:
        return None
    spec = GPUS[kind]
    if precision.lower() == "mxfp8" and not spec.mxfp8:
        return None
    tflops = spec.peak_tflops.get(precision_of(precision))
    return None if tflops is None else tflops * 1e12


def gpu_spec(gpu_name_or_kind: str) -> GpuSpec:
    kind = gpu_kind(gpu_name_or_kind)
    if kind is None:
        raise KeyError(f"no hardware numbers for GPU {gpu_name_or_kind!r}")
    return GPUS[kind]


def mfu_pct(flops_per_sec: float, gpu_name_or_kind: str, precision: str = "bf16") -> float | None:
    """Model FLOP/s as a percentage of the peak; None where there is no peak (CPU)."""
    peak = peak_flops(gpu_name_or_kind, precision)
    return None if not peak else 100.0 * flops_per_sec / peak


def mfu_pair(
    flops_per_sec: float, gpu_name_or_kind: str, precision: str
) -> tuple[float | None, float | None]:
    """(mfu_pct, mfu_at_precision_peak_pct) of a run whose linears run at `precision`.

    `mfu_pct` is always against the dense BF16 peak, as torchtitan and Megatron quote it: an
    FP8 run exactly as fast as BF16 shows the same MFU, and a faster one shows more.
    `mfu_at_precision_peak_pct` divides by the peak of the linears' precision (FP8's is twice
    BF16's on H100/H200/B200), i.e. how close the run is to what its own tensor cores allow;
    for a BF16 run the two are equal.
    """
    return (
        mfu_pct(flops_per_sec, gpu_name_or_kind, "bf16"),
        mfu_pct(flops_per_sec, gpu_name_or_kind, precision),
    )
