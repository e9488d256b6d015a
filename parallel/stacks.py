"""Software-stack profiles: the efficiency constants of one training stack, as data.

A stack (`stacks/<name>.toml`) says how fast a given software stack turns the model's work
into time on a GPU: the fraction of the dense peak its GEMMs sustain per precision, how
much of the other GPUs' peak it keeps (`gpu_eff`), attention efficiency, how fused its
pointwise work is, whether TP communication overlaps compute, which data-parallel scheme it
runs and what its activations keep. Every constant carries its source in `[sources]`
(the loader refuses a profile where one is missing). Recipes run `torchtitan`;
`megatron_te` prices published NeMo / Megatron-Bridge runs (`tools.predict --stack`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from functools import cache
from pathlib import Path
from typing import Any

import tomllib

from core.errors import ConfigError, did_you_mean
from core.hardware import GPUS, PROFILE_KINDS

STACK_DIR = Path(__file__).resolve().parent.parent / "stacks"
DEFAULT_STACK = "torchtitan"

DATA_PARALLEL = ("fsdp", "distributed_optimizer")
TP_OVERLAP = ("async_tp", "always")
PRECISIONS = ("bf16", "fp8_tensorwise", "fp8_rowwise", "mxfp8", "nvfp4")
# Precisions a profile may leave out: pricing one on that stack is then refused with one line
# (a profile written before NVFP4 existed still loads).
OPTIONAL_PRECISIONS = ("nvfp4",)


@dataclass(frozen=True, eq=False)  # identity hash: refitted copies are distinct cache keys
class Stack:
    name: str
    description: str
    # fsdp: FSDP2 per block (gather before use, reduce-scatter after backward, every
    # microstep). distributed_optimizer: ZeRO-1, whole bf16 params resident, gradients
    # reduce-scattered and params gathered once per optimizer step over dp x cp.
    data_parallel: str
    # async_tp: TP collectives overlap only with [parallel] async_tp and compile;
    # always: the stack overlaps them whenever tp > 1 (TE userbuffers).
    tp_overlap: str
    # SP: the column-parallel linears keep the all-gathered input (True) or keep the
    # sequence shard and gather again in backward (False).
    sp_saves_gathered: bool
    # SwiGLU keeps fc1's output and the activation output only (fused activation).
    fused_ffn_activations: bool
    # A recipe's training config as this stack would run it (`workload_from_recipe`):
    # gradient accumulation under PP as more microbatches of one pipeline flush (Megatron)
    # instead of one flush per microstep (torchtitan); what an FP8 recipe's linears are
    # on this stack ("" = the recipe's own choice); the CP rotation ("" = the recipe's).
    grad_accum_in_pipeline: bool
    # FP8 linears keep their FP8-cast inputs for the weight gradient instead of the bf16
    # ones (Transformer Engine); torchao's Float8Linear keeps the high-precision input.
    fp8_saves_fp8_inputs: bool
    # Pipeline stages allocate one activation and one gradient receive buffer per microbatch
    # up front (torch's PipelineStage) rather than per transfer (Megatron's p2p_communication).
    pp_recv_buffers_per_microbatch: bool
    fp8_linear: str
    cp_rotate: str
    matmul_eff: dict[str, float]  # precision -> fraction of its dense peak (H100)
    gpu_eff: dict[str, float]  # GPU kind -> multiplier of matmul/attention efficiency
    gemm_half_dim: float
    attention_eff: float
    pointwise_scale_eager: float
    pointwise_scale_compiled: float
    loss_bytes_eager: float
    loss_bytes_compiled: float
    tp_hidden: float
    comm_sm_slowdown: float
    optimizer_bytes_per_param: float
    grad_reduce_bytes: float
    kernel_launch_s: float
    kernels_per_block_eager: float
    kernels_per_block_compiled: float
    # Mixture of experts (parallel.moe): grouped GEMMs' efficiency relative to a dense GEMM
    # of the same per-expert shape; the share of the expert all-to-all hidden behind compute;
    # routed tokens on the busiest EP rank over the mean (dropless routing).
    grouped_gemm_eff: float
    ep_a2a_hidden: float
    moe_imbalance: float
    # Seconds per MoE layer and microbatch (forward + backward) the host spends waiting on
    # the device: the dispatch reads the per-expert token counts back (a device-to-host sync
    # for the all-to-all's split sizes), draining the launch queue, then launches the
    # layer's many small kernels (permute, router, grouped GEMM setup) with nothing queued.
    moe_layer_overhead_s: float
    sources: dict[str, str] = field(default_factory=dict)
    path: str = ""
    # The loss runs over this many sequence chunks, each projected, scored and
    # back-propagated before the next (torchtitan's ChunkedLossWrapper): one chunk's logits
    # are alive at a time. 1 = the whole sequence's logits at once.
    loss_chunks: int = 1

    def gpu_factor(self, gpu: str) -> float:
        """The GPU kind's factor; a kind the profile does not list takes its generation's
        (H800 and the PCIe/NVL Hopper cards take H100's; B300 takes GB300's), else 1."""
        if gpu in self.gpu_eff:
            return self.gpu_eff[gpu]
        return _generation_factor(self.gpu_eff, gpu)

    def matmul(self, precision: str) -> float:
        """`matmul_eff[precision]`; ConfigError (one line) for a precision this profile
        does not price."""
        if precision not in self.matmul_eff:
            raise ConfigError(
                f"stack {self.name!r} has no efficiency for {precision} (its profile has no "
                f"matmul_eff.{precision})",
                file=self.path or None,
                key=f"matmul_eff.{precision}",
            )
        return self.matmul_eff[precision]

    def with_(self, **kw: Any) -> Stack:
        return replace(self, **kw)

    def constants(self) -> dict[str, Any]:
        """Every efficiency constant (what `[sources]` must cover), by name."""
        skip = {"name", "description", "sources", "path"}
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in skip}


_CONSTANTS = (
    "gemm_half_dim",
    "attention_eff",
    "pointwise_scale_eager",
    "pointwise_scale_compiled",
    "loss_bytes_eager",
    "loss_bytes_compiled",
    "tp_hidden",
    "comm_sm_slowdown",
    "optimizer_bytes_per_param",
    "grad_reduce_bytes",
    "kernel_launch_s",
    "kernels_per_block_eager",
    "kernels_per_block_compiled",
    "grouped_gemm_eff",
    "ep_a2a_hidden",
    "moe_imbalance",
    "moe_layer_overhead_s",
)
_TOP = (
    "name",
    "description",
    "data_parallel",
    "tp_overlap",
    "sp_saves_gathered",
    "fused_ffn_activations",
    "grad_accum_in_pipeline",
    "fp8_saves_fp8_inputs",
    "pp_recv_buffers_per_microbatch",
    "fp8_linear",
    "cp_rotate",
    "loss_chunks",
    "matmul_eff",
    "gpu_eff",
    "constants",
    "sources",
)


def _generation_factor(gpu_eff: dict[str, float], gpu: str) -> float:
    spec = GPUS.get(gpu)
    if spec is None or not spec.generation:
        return 1.0
    same = [v for k, v in gpu_eff.items() if k in GPUS and GPUS[k].generation == spec.generation]
    return same[0] if same else 1.0


def stack_names() -> list[str]:
    return sorted(p.stem for p in STACK_DIR.glob("*.toml"))


def _num(raw: Any, file: str, key: str, lo: float = 0.0, hi: float = float("inf")) -> float:
    if isinstance(raw, bool) or not isinstance(raw, int | float) or not lo <= raw <= hi:
        raise ConfigError(f"expected a number in [{lo}, {hi}], got {raw!r}", file=file, key=key)
    return float(raw)


def _choice(raw: Any, choices: tuple[str, ...], file: str, key: str) -> str:
    if raw not in choices:
        raise ConfigError(
            f"expected one of {', '.join(choices)}, got {raw!r}"
            + (did_you_mean(str(raw), choices) if isinstance(raw, str) else ""),
            file=file,
            key=key,
        )
    return raw


def parse_stack(data: dict[str, Any], file: str) -> Stack:
    """A Stack from a parsed TOML table; ConfigError naming the key on anything wrong."""
    for k in data:
        if k not in _TOP:
            raise ConfigError(f"unknown key{did_you_mean(k, _TOP)}", file=file, key=k)
    for k in ("name", "matmul_eff", "constants", "sources"):
        if k not in data:
            raise ConfigError("missing", file=file, key=k)
    mm = {}
    for k, v in data["matmul_eff"].items():
        _choice(k, PRECISIONS, file, f"matmul_eff.{k}")
        mm[k] = _num(v, file, f"matmul_eff.{k}", 0.01, 1.0)
    for p in PRECISIONS:
        if p not in mm and p not in OPTIONAL_PRECISIONS:
            raise ConfigError("missing", file=file, key=f"matmul_eff.{p}")
    gpu = {}
    for k, v in data.get("gpu_eff", {}).items():
        _choice(k, PROFILE_KINDS, file, f"gpu_eff.{k}")
        gpu[k] = _num(v, file, f"gpu_eff.{k}", 0.1, 2.0)
    consts = data["constants"]
    for k in consts:
        if k not in _CONSTANTS:
            raise ConfigError(
                f"unknown constant{did_you_mean(k, _CONSTANTS)}", file=file, key=f"constants.{k}"
            )
    for k in _CONSTANTS:
        if k not in consts:
            raise ConfigError("missing", file=file, key=f"constants.{k}")
    c: dict[str, Any] = {k: _num(consts[k], file, f"constants.{k}") for k in _CONSTANTS}
    for k in (
        "attention_eff",
        "tp_hidden",
        "comm_sm_slowdown",
        "grouped_gemm_eff",
        "ep_a2a_hidden",
    ):
        _num(c[k], file, f"constants.{k}", 0.0, 1.0)
    flags: dict[str, Any] = {}
    for k in (
        "sp_saves_gathered",
        "fused_ffn_activations",
        "grad_accum_in_pipeline",
        "fp8_saves_fp8_inputs",
        "pp_recv_buffers_per_microbatch",
    ):
        v = data.get(k, False)
        if not isinstance(v, bool):
            raise ConfigError(f"expected true or false, got {v!r}", file=file, key=k)
        flags[k] = v
    stack = Stack(
        name=str(data["name"]),
        description=str(data.get("description", "")),
        data_parallel=_choice(
            data.get("data_parallel", "fsdp"), DATA_PARALLEL, file, "data_parallel"
        ),
        tp_overlap=_choice(data.get("tp_overlap", "async_tp"), TP_OVERLAP, file, "tp_overlap"),
        fp8_linear=_choice(data.get("fp8_linear", ""), ("",) + PRECISIONS, file, "fp8_linear"),
        cp_rotate=_choice(
            data.get("cp_rotate", ""), ("", "allgather", "alltoall"), file, "cp_rotate"
        ),
        loss_chunks=int(_num(data.get("loss_chunks", 1), file, "loss_chunks", 1, 4096)),
        matmul_eff=mm,
        gpu_eff=gpu,
        sources={str(k): str(v) for k, v in data["sources"].items()},
        path=file,
        **flags,
        **c,
    )
    missing = [k for k in stack.constants() if k not in stack.sources]
    if missing:
        raise ConfigError(
            f"every constant needs its source; missing for {', '.join(missing)}",
            file=file,
            key="sources",
        )
    return stack


@cache
def load_stack(name: str = DEFAULT_STACK) -> Stack:
    """The profile `stacks/<name>.toml` (or a path to a .toml file)."""
    path = Path(name) if name.endswith(".toml") else STACK_DIR / f"{name}.toml"
    if not path.is_file():
        raise ConfigError(
            f"no stack profile {name!r}; known: {', '.join(stack_names())}"
            + did_you_mean(name, stack_names()),
            key="stack",
        )
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"TOML syntax: {e}", file=str(path)) from None
    return parse_stack(data, str(path))
