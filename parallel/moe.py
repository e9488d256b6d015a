"""Mixture-of-experts terms of the planner, the memory model and the performance model (pure).

torchtitan 0.3.0's expert parallelism (distributed/parallel_dims.py, models/common/moe.py):
- the sparse mesh is (pp, dp_replicate, efsdp, ep) with ep innermost: an EP group is `ep`
  consecutive ranks carved out of dp_shard x cp x tp, so ep must divide dp_shard x cp x tp
  (and the routed experts); efsdp = dp_shard x cp x tp / ep shards each expert's weights.
  A rank holds n_routed / ep experts; every parameter is still sharded tp x dp_shard x cp
  ways in total (dense: tp x fsdp; experts: ep x efsdp), so the optimizer states per GPU do
  not depend on ep. What ep changes is what FSDP gathers per MoE layer (the local experts
  only: n_routed / ep of them) and the all-to-all.
- tokens are dispatched with `all_to_all_single` (dropless: the receive buffer is as large
  as the tokens the router sends, no capacity factor in torchtitan); the busiest rank of
  the EP group receives `imbalance` x the mean (tokens x top_k / ep each), and paces the
  grouped GEMMs and the all-to-all of the whole group.
- selective activation checkpointing saves the all-to-all outputs (no re-communication)
  and recomputes the grouped GEMMs (torch._grouped_mm is not in its save list).

MFU convention (Megatron-LM, DeepSeek-V3): model FLOPs on the ACTIVE parameters (top_k
routed + shared experts + attention + dense layers), 6 per parameter per token, plus the
attention term; against the dense BF16 peak.

The MoE dimensions come from `core.models.ModelShape` (the fields named in MOE_CONTRACT:
n_routed_experts, n_shared_experts, top_k, moe_ffn_hidden, n_dense_layers, attention and
the MLA dims); a dense shape has n_routed_experts = 0 and `moe_dims` returns None, so the
dense models' figures do not move.
"""

from __future__ import annotations

from dataclasses import dataclass

# Hardware efficiency of an all-to-all relative to the link's bandwidth (bus bandwidth of
# NCCL's all-to-all: every GPU pair at once; below a ring's). Assumed: NCCL-tests all_to_all
# on H100 NVSwitch reaches ~75% of the per-direction NVLink bandwidth, ~70% of NIC line rate
# across InfiniBand (rail-optimised, PXN).
A2A_NVLINK_EFF = 0.75
A2A_NET_EFF = 0.70
# Latency per all-to-all (one launch + the slowest peer's first bytes), seconds.
A2A_ALPHA_NVLINK = 10e-6
A2A_ALPHA_NET = 30e-6


@dataclass(frozen=True)
class MoEDims:
    """The numbers of an MoE decoder the models need (from ModelShape, MOE_CONTRACT names)."""

    dim: int
    n_layers: int
    n_moe_layers: int
    n_routed: int
    n_shared: int
    top_k: int
    expert_hidden: int  # hidden dim of one routed expert (a shared expert has the same)

    @property
    def expert_params(self) -> int:
        """One routed expert's SwiGLU: w1, w3 (dim x hidden) and w2 (hidden x dim)."""
        return 3 * self.dim * self.expert_hidden

    @property
    def routed_params_per_moe_layer(self) -> int:
        return self.n_routed * self.expert_params

    @property
    def routed_params(self) -> int:
        """Every routed expert of every MoE layer (what EP splits)."""
        return self.n_moe_layers * self.routed_params_per_moe_layer

    @property
    def active_routed_params(self) -> int:
        """Routed-expert parameters one token touches: top_k per MoE layer."""
        return self.n_moe_layers * self.top_k * self.expert_params

    @property
    def moe_fraction(self) -> float:
        """MoE layers over all layers (the average layer's share of MoE work)."""
        return self.n_moe_layers / self.n_layers if self.n_layers else 0.0


def moe_dims(shape) -> MoEDims | None:  # noqa: ANN001 (ModelShape)
    """The MoE dimensions of `shape`, None for a dense model (n_routed_experts = 0)."""
    n_routed = int(getattr(shape, "n_routed_experts", 0) or 0)
    if not n_routed:
        return None
    n_dense = int(getattr(shape, "n_dense_layers", 0) or 0)
    return MoEDims(
        dim=shape.dim,
        n_layers=shape.n_layers,
        n_moe_layers=shape.n_layers - n_dense,
        n_routed=n_routed,
        n_shared=int(getattr(shape, "n_shared_experts", 0) or 0),
        top_k=int(getattr(shape, "top_k", 0) or 0),
        expert_hidden=int(getattr(shape, "moe_ffn_hidden", 0) or 0),
    )


def layer_params(shape) -> float:  # noqa: ANN001
    """Parameters of the average transformer block (all experts counted): the dense
    `params_per_layer` for a dense model; for an MoE one, total parameters less the
    embedding, the output projection and the final norm, over the layers (dense-FFN and
    MoE layers averaged; MLA, shared experts, router and MTP modules included)."""
    m = moe_dims(shape)
    if m is None:
        return float(shape.params_per_layer)
    head = 0 if shape.weight_tying else shape.vocab_size * shape.dim
    rest = shape.total_params - shape.vocab_size * shape.dim - head - shape.dim
    return rest / shape.n_layers


def gathered_layer_params(shape, tp: int, ep: int) -> float:  # noqa: ANN001
    """Parameters FSDP gathers for the average block on one GPU: the non-expert part split
    by tp; the routed experts split by ep (only the local experts are gathered over
    efsdp), or by tp when ep = 1 (torchtitan then shards each expert's hidden dim by tp)."""
    m = moe_dims(shape)
    if m is None:
        return shape.params_per_layer / tp
    routed = m.routed_params / m.n_layers
    dense = layer_params(shape) - routed
    return dense / tp + routed / (ep if ep > 1 else tp)


def ep_reason(ep: int, n_routed: int, dp_shard: int, cp: int, tp: int) -> str:
    """'' when torchtitan accepts expert-parallel degree `ep`, else why not."""
    if ep < 1:
        return f"ep={ep} must be >= 1"
    if ep == 1:
        return ""
    if not n_routed:
        return f"ep={ep} needs a mixture-of-experts model (this one is dense)"
    if n_routed % ep:
        return f"ep={ep} must divide the {n_routed} routed experts"
    if (dp_shard * cp * tp) % ep:
        return (
            f"ep={ep} must divide dp_shard x cp x tp = {dp_shard * cp * tp} (torchtitan carves "
            "the EP groups out of them)"
        )
    return ""


def effective_imbalance(imbalance: float, capacity_factor: float) -> float:
    """Routed tokens on the busiest rank over the mean: `imbalance` (dropless), capped by
    the capacity factor when one is set (tokens past it are dropped)."""
    if capacity_factor > 0:
        return min(imbalance, capacity_factor)
    return imbalance


def busiest_load(w, st) -> float:  # noqa: ANN001 (Workload, Stack)
    """The busiest EP rank's routed tokens over the mean for workload `w` on stack `st`:
    the workload's own figure when it states one, else the stack's, capped by the capacity
    factor."""
    return effective_imbalance(w.load_imbalance or st.moe_imbalance, w.capacity_factor)


def dropped_fraction(imbalance: float, capacity_factor: float) -> float:
    """Upper bound on the routed tokens a capacity factor drops on the busiest rank."""
    if capacity_factor <= 0 or imbalance <= capacity_factor:
        return 0.0
    return 1.0 - capacity_factor / imbalance


# ----------------------------------------------------------------------------------------
# Memory


def moe_activation_bytes(m: MoEDims, ac: str, imbalance: float, tp: int = 1) -> float:
    """Bytes kept for backward per token in one MoE layer's FFN (router, shared experts,
    routed experts), bf16; replaces the dense SwiGLU's share of `layer_activation_bytes`.

    none: the router's fp32 logits and scores (8 n_routed), the shared experts' SwiGLU
      (input d, w1/w3 outputs, silu, product: 2 (d + 4 h_s)), and per routed copy (top_k
      per token): on the expert side the dispatched input and the grouped GEMMs' w1, w3,
      silu and product (2 (d + 4h)) times the busiest rank's imbalance, on the token side
      the combine's output (2d) the score weighting keeps.
    selective: torchtitan saves the all-to-all outputs (dispatch: 2d x imbalance per copy,
      combine: 2d), linear outputs (router 2 n_routed, shared w1/w3 4 h_s) and recomputes
      the grouped GEMMs.
    full: nothing beyond the block input (counted with the attention part).
    Token-side tensors are sequence-sharded under tp; the routed ones are not (EP works on
    whole tokens).
    """
    if ac == "full":
        return 0.0
    d, h, k = m.dim, m.expert_hidden, m.top_k
    hs = m.n_shared * h
    if ac == "selective":
        router = 2 * m.n_routed + 4 * m.n_routed
        shared = 4 * hs + 2 * d
        routed = k * (2 * d * imbalance + 2 * d)
    else:
        router = 8 * m.n_routed
        shared = 2 * (d + 4 * hs)
        routed = k * (2 * (d + 4 * h) * imbalance + 2 * d)
    return (router + shared) / tp + routed / tp


def dispatch_buffer_bytes(m: MoEDims, imbalance: float, tp: int = 1) -> float:
    """Transient bytes per token of one MoE layer's dispatch at its peak (the backward
    workspace): the permuted send buffer (top_k copies, 2d each), the receive buffer on the
    busiest rank (x imbalance), the grouped GEMM's w1/w3 outputs for the recompute
    (2 x 2h per received copy) and the router's fp32 logits (4 n_routed)."""
    d, h, k = m.dim, m.expert_hidden, m.top_k
    return (k * (2 * d + imbalance * (2 * d + 4 * h)) + 4 * m.n_routed) / tp


# ----------------------------------------------------------------------------------------
# Time


def a2a_time(nbytes: float, ep: int, span, links, imbalance: float = 1.0) -> float:  # noqa: ANN001
    """Seconds of one all-to-all in which each GPU of an EP group of `ep` sends `nbytes`
    (its routed copies; the busiest receives `imbalance` x as much): (ep - 1)/ep of it
    leaves the GPU. Inside one NVLink domain all of it goes over NVLink; across domains the
    share for peers in other domains (ep - per_domain)/ep goes through the GPU's own NIC
    (rail-optimised; / oversubscription past a leaf) while the rest uses NVLink, at the
    same time: the slower of the two paces it."""
    if ep <= 1 or nbytes <= 0:
        return 0.0
    vol = nbytes * imbalance
    nvl = links.nvlink * A2A_NVLINK_EFF
    if span.in_nvlink:
        if nvl <= 0:
            return float("inf")
        return A2A_ALPHA_NVLINK + vol * (ep - 1) / ep / nvl
    per_dom = max(1, min(span.per_domain, ep))
    intra = vol * (per_dom - 1) / ep / nvl if nvl > 0 else 0.0
    net = links.net * A2A_NET_EFF
    if span.leaves > 1:
        net /= links.oversubscription
    if net <= 0:
        return float("inf")
    inter = vol * (ep - per_dom) / ep / net
    return A2A_ALPHA_NET + max(intra, inter)


def a2a_per_layer(ac: str) -> int:
    """All-to-alls per MoE layer per microbatch: dispatch and combine forward, their
    transposes backward; full checkpointing recomputes the forward's two (selective saves
    the all-to-all outputs)."""
    return 4 + (2 if ac == "full" else 0)


def fabric_of_ep(ep: int, span, cluster) -> str:  # noqa: ANN001
    """Where an EP group's all-to-all runs: 'nvlink' inside one NVLink domain, else the
    inter-domain fabric it crosses, with the domain count."""
    if ep <= 1:
        return "none"
    if span.in_nvlink:
        return "nvlink"
    return f"{cluster.nccl.fabric} ({span.domains} NVLink domains of {cluster.nvlink_domain_gpus})"


def ep_placement(ep: int, cluster) -> str:  # noqa: ANN001
    """How EP groups lie in the NVLink domains under the planned placement."""
    dom = cluster.nvlink_domain_gpus
    if ep <= 1:
        return ""
    if ep > dom:
        return f"each EP group spans {-(-ep // dom)} NVLink domains of {dom} GPUs"
    per = dom // ep
    used = per * ep
    if used == dom:
        return f"{per} EP group(s) per NVLink domain of {dom} GPUs"
    spare = (dom - used) // cluster.gpus_per_node
    return (
        f"{per} EP group(s) per NVLink domain: {used} of {dom} GPUs used, {spare} "
        f"host(s) of {cluster.gpus_per_node} spare per domain (the job's hosts are placed so "
        "that no EP group straddles two domains)"
    )
