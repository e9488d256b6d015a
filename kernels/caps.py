"""What the device can run: type, name, compute capability and optional kernel packages.

`DeviceCaps.detect()` reads the local device (CUDA if torch sees one, else CPU). Tests, the
planner and login nodes without a GPU use simulated capabilities instead:
`DeviceCaps.gpu("H100")`, `DeviceCaps.cpu()`. The kernels registry checks every backend's
requirements against these, so a recipe fails at validation, not an hour into a job.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field

from core.hardware import GPUS
from core.launch_env import launch_env
from core.linear_backends import LINEAR_BACKENDS, LinearBackend, ranked, requirement_problem

# torch.cuda.get_device_name()-style names of the GPU kinds, for simulated devices and the
# registry's error messages. Compute capabilities come from the hardware table (one home:
# core.hardware.GPUS); L40S (Ada, SM89) is listed for the FP8-without-MX case and has no
# training numbers there.
DEVICE_NAMES: dict[str, str] = {
    "A100": "NVIDIA A100-SXM4-80GB",
    "H100": "NVIDIA H100 80GB HBM3",
    "H100_PCIE": "NVIDIA H100 PCIe",
    "H100_NVL": "NVIDIA H100 NVL",
    "H200": "NVIDIA H200",
    "H200_NVL": "NVIDIA H200 NVL",
    "H800": "NVIDIA H800",
    "B200": "NVIDIA B200",
    "GB200": "NVIDIA GB200",
    "B300": "NVIDIA B300 SXM6 AC",
    "GB300": "NVIDIA GB300",
}
KNOWN_GPUS: dict[str, tuple[str, tuple[int, int]]] = {
    # kind: (torch.cuda.get_device_name()-style name, capability)
    **{
        kind: (DEVICE_NAMES[kind], spec.capability)
        for kind, spec in GPUS.items()
        if spec.capability is not None
    },
    "L40S": ("NVIDIA L40S", (8, 9)),
}

# Optional kernel packages, by the feature name backends declare. torch's varlen attention
# dispatches to FlashAttention 3 on SM90 and FlashAttention 4 on SM100 (torchtitan activates
# them in VarlenAttention.__init__); both ship outside torch. The module names are the ones
# torch imports: torch/nn/attention/_fa3.py "flash_attn_interface", _fa4.py
# "flash_attn.cute.interface" (a flash_attn without its cute interface cannot serve FA4).
FEATURE_MODULES: dict[str, str] = {
    "fa3": "flash_attn_interface",
    "fa4": "flash_attn.cute.interface",
    "torchao": "torchao",
    # torchao's NVFP4 training linear (Triton kernels; what torchtitan's NVFP4 converter builds).
    "torchao_nvfp4": "torchao.prototype.moe_training.nvfp4_training",
}


# What a plain install of the pinned dependencies provides (torchao 0.18 ships the NVFP4
# training prototype).
PINNED_FEATURES = frozenset({"torchao", "torchao_nvfp4"})


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing or broken
        return False


def detect_features() -> frozenset[str]:
    return frozenset(name for name, mod in FEATURE_MODULES.items() if _importable(mod))


@dataclass(frozen=True)
class DeviceCaps:
    """A device as the kernel backends see it.

    device_type: "cuda", "rocm" or "cpu". capability: (major, minor) for CUDA, else None.
    features: importable optional packages (see FEATURE_MODULES).
    """

    device_type: str
    name: str
    capability: tuple[int, int] | None = None
    features: frozenset[str] = field(default_factory=frozenset)

    @property
    def is_cuda(self) -> bool:
        return self.device_type == "cuda"

    @property
    def is_cpu(self) -> bool:
        return self.device_type == "cpu"

    @property
    def sm(self) -> str:
        """'SM90' style label ('' when not a CUDA device)."""
        if self.capability is None:
            return ""
        return f"SM{self.capability[0]}{self.capability[1]}"

    def at_least(self, major: int, minor: int = 0) -> bool:
        return self.is_cuda and self.capability is not None and self.capability >= (major, minor)

    def describe(self) -> str:
        if self.is_cuda:
            return f"{self.name} ({self.sm})"
        return self.name

    @staticmethod
    def detect() -> DeviceCaps:
        """The local device: the current CUDA device (LOCAL_RANK) when torch sees one."""
        import torch

        if torch.cuda.is_available():
            idx = launch_env().local_rank % max(torch.cuda.device_count(), 1)
            name = torch.cuda.get_device_name(idx)
            if torch.version.hip is not None:
                return DeviceCaps("rocm", name, None, detect_features())
            major, minor = torch.cuda.get_device_capability(idx)
            return DeviceCaps("cuda", name, (major, minor), detect_features())
        return DeviceCaps.cpu(features=detect_features())

    @staticmethod
    def cpu(features: frozenset[str] | None = None) -> DeviceCaps:
        return DeviceCaps("cpu", "cpu", None, PINNED_FEATURES if features is None else features)

    @staticmethod
    def gpu(kind: str, features: frozenset[str] | set[str] | None = None) -> DeviceCaps:
        """Simulated caps of a known GPU kind ("H100", "B200", ...).

        `features` defaults to torchao with its NVFP4 prototype and no FlashAttention 3/4
        packages: the state of a plain `pip install` of the pinned dependencies.
        """
        key = kind if kind in KNOWN_GPUS else kind.upper()
        if key not in KNOWN_GPUS:
            raise KeyError(f"unknown GPU kind {kind!r}; known: {', '.join(KNOWN_GPUS)}")
        name, cap = KNOWN_GPUS[key]
        feats = PINNED_FEATURES if features is None else frozenset(features)
        return DeviceCaps("cuda", name, cap, feats)


def linear_problem(name: str, caps: DeviceCaps) -> str:
    """Why linear backend `name` cannot run natively on `caps` ("" = it can)."""
    return requirement_problem(
        LINEAR_BACKENDS[name],
        is_cuda=caps.is_cuda,
        capability=caps.capability,
        features=frozenset(caps.features),
    )


def auto_linear(caps: DeviceCaps) -> LinearBackend:
    """`[kernels] linear = "auto"`: the fastest backend `caps` runs natively. The one rule,
    used by recipe validation (kernels.registry) and by the planner (parallel.workload)."""
    for be in ranked():
        if not linear_problem(be.name, caps):
            return be
    raise AssertionError("bf16 runs everywhere")


def simulated_caps(gpu_kind: str) -> DeviceCaps:
    """Caps of a cluster profile's GPU kind (with torchao); CPU for "cpu" or an unknown kind."""
    known = gpu_kind in KNOWN_GPUS or gpu_kind.upper() in KNOWN_GPUS
    return DeviceCaps.gpu(gpu_kind) if known else DeviceCaps.cpu()
