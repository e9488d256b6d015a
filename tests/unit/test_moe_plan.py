"""Tier 1: the MoE terms of the memory and performance models (parallel.moe) against hand
formulas with DeepSeek-V3's published dimensions (arXiv 2412.19437, Table/section 4.2)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from parallel.moe import (
    A2A_ALPHA_NET,
    A2A_ALPHA_NVLINK,
    A2A_NET_EFF,
    A2A_NVLINK_EFF,
    MoEDims,
    a2a_per_layer,
    a2a_time,
    dispatch_buffer_bytes,
    dropped_fraction,
    effective_imbalance,
    ep_placement,
    ep_reason,
    moe_activation_bytes,
    moe_dims,
)
from parallel.workload import GroupSpan

# DeepSeek-V3: dim 7168, 61 layers (first 3 dense), 256 routed experts of width 2048, one
# shared, top-8 (the report's section 4.2).
V3 = MoEDims(dim=7168, n_layers=61, n_moe_layers=58, n_routed=256, n_shared=1, top_k=8,
             expert_hidden=2048)  # fmt: skip


def test_v3_expert_counts_match_the_report():
    # One expert: 3 x 7168 x 2048; all routed experts ~654B of the 671B; routed ones a token
    # touches: 8 per layer, ~20B of the 37B activated.
    assert V3.expert_params == 3 * 7168 * 2048 == 44_040_192
    assert V3.routed_params == 58 * 256 * 44_040_192
    assert 650e9 < V3.routed_params < 660e9
    assert V3.active_routed_params == 58 * 8 * 44_040_192
    assert 20e9 < V3.active_routed_params < 21e9
    assert V3.moe_fraction == pytest.approx(58 / 61)


def test_moe_dims_reads_the_contract_names_and_none_for_dense():
    dense = SimpleNamespace(dim=8, n_layers=2, n_routed_experts=0)
    assert moe_dims(dense) is None
    shape = SimpleNamespace(dim=7168, n_layers=61, n_routed_experts=256, n_shared_experts=1,
                            top_k=8, moe_ffn_hidden=2048, n_dense_layers=3)  # fmt: skip
    assert moe_dims(shape) == V3


@pytest.mark.parametrize(
    ("ep", "dp_shard", "cp", "tp", "ok"),
    [(1, 4, 1, 1, True), (64, 32, 1, 2, True), (64, 16, 1, 2, False), (3, 3, 1, 1, False),
     (256, 256, 1, 1, True), (512, 512, 1, 1, False)],
)  # fmt: skip
def test_ep_reason_is_torchtitans_constraint(ep, dp_shard, cp, tp, ok):
    # ParallelDims: efsdp = dp_shard x cp x tp / ep must be whole; ep must split the experts.
    assert (ep_reason(ep, 256, dp_shard, cp, tp) == "") is ok


def test_capacity_factor_caps_the_busiest_rank():
    assert effective_imbalance(1.3, 0.0) == 1.3  # dropless
    assert effective_imbalance(1.3, 1.1) == 1.1
    assert dropped_fraction(1.3, 1.1) == pytest.approx(1 - 1.1 / 1.3)
    assert dropped_fraction(1.3, 0.0) == 0.0


def _links(nvlink=450e9, net=50e9, over=1.0):
    return SimpleNamespace(nvlink=nvlink, net=net, oversubscription=over)


def test_a2a_inside_nvlink_is_volume_over_nvlink():
    span = GroupSpan(size=8, domains=1, per_domain=8)
    nbytes = 4096 * 8 * 7168 * 2  # 4K tokens, top-8, bf16 rows
    got = a2a_time(nbytes, 8, span, _links(), imbalance=1.25)
    want = A2A_ALPHA_NVLINK + nbytes * 1.25 * 7 / 8 / (450e9 * A2A_NVLINK_EFF)
    assert got == pytest.approx(want)


def test_a2a_across_domains_is_paced_by_the_nic_share():
    # EP 32 over 4 HGX nodes: 8 peers per domain; 24/32 of the bytes go through the NIC.
    span = GroupSpan(size=32, domains=4, per_domain=8, nodes=4, leaves=1)
    nbytes = 1e8
    got = a2a_time(nbytes, 32, span, _links(), imbalance=1.0)
    inter = nbytes * 24 / 32 / (50e9 * A2A_NET_EFF)
    intra = nbytes * 7 / 32 / (450e9 * A2A_NVLINK_EFF)
    assert got == pytest.approx(A2A_ALPHA_NET + max(inter, intra))
    # The same group inside one NVL72 rack is several times faster.
    rack = GroupSpan(size=32, domains=1, per_domain=32)
    assert a2a_time(nbytes, 32, rack, _links(nvlink=900e9)) < got / 5
    assert a2a_time(nbytes, 1, span, _links()) == 0.0


def test_a2a_count_per_layer():
    # dispatch + combine forward, both transposed backward; full AC re-dispatches.
    assert a2a_per_layer("none") == a2a_per_layer("selective") == 4
    assert a2a_per_layer("full") == 6


def test_moe_activation_bytes_by_hand():
    m = MoEDims(dim=10, n_layers=2, n_moe_layers=2, n_routed=4, n_shared=1, top_k=2,
                expert_hidden=3)  # fmt: skip
    # none: router 8 x 4; shared 2 (10 + 4 x 3); routed 2 x (2 (10 + 12) x 1.5 + 20)
    assert moe_activation_bytes(m, "none", 1.5) == 32 + 44 + 2 * (44 * 1.5 + 20)
    # selective: router 6 x 4, shared 4 x 3 + 20, routed 2 x (20 x 1.5 + 20)
    assert moe_activation_bytes(m, "selective", 1.5) == 24 + 32 + 2 * (30 + 20)
    assert moe_activation_bytes(m, "full", 1.5) == 0.0
    assert moe_activation_bytes(m, "none", 1.5, tp=2) == moe_activation_bytes(m, "none", 1.5) / 2
    # dispatch: 2 copies x (send 20 + 1.5 x (20 + 12)) + router logits 16
    assert dispatch_buffer_bytes(m, 1.5) == 2 * (20 + 1.5 * 32) + 16


def test_ep64_fills_an_nvl72_rack_with_spares():
    nvl72 = SimpleNamespace(nvlink_domain_gpus=72, gpus_per_node=4)
    assert "64 of 72 GPUs used, 2 host(s)" in ep_placement(64, nvl72)
    assert "spans 2 NVLink domains" in ep_placement(128, nvl72)
    assert ep_placement(1, nvl72) == ""


# --- the models on torchtitan's real shapes (core.models, branch moe) -------------------


def _w(flavor="16B", family="deepseek_v3", **kw):
    from core.axes import Layout
    from core.models import model_shape
    from parallel.workload import Workload

    base = dict(shape=model_shape(flavor, family), seq_len=4096, local_batch_size=1,
                layout=Layout(dp_shard=8), ac="full")  # fmt: skip
    base.update(kw)
    return Workload(**base)


def test_ep_shrinks_the_fsdp_gather_by_the_remote_experts_only():
    """States per GPU do not depend on ep (torchtitan shards every parameter tp x dp_shard x
    cp ways: dense over tp x fsdp, experts over ep x efsdp); what FSDP gathers per block
    loses the experts held by the other ep - 1 ranks: 7/8 of the routed ones at ep 8."""
    from parallel.memory import estimate_memory

    w = _w()
    s = w.shape
    m1, m8 = estimate_memory(w), estimate_memory(w.with_(ep=8))
    assert m1.states == m8.states
    routed_per_block = s.n_moe_layers * s.n_routed_experts * 3 * s.dim * s.moe_ffn_hidden
    routed_per_block /= s.n_layers
    head = s.vocab_size * s.dim  # the largest unit FSDP gathers besides a block
    block = (s.total_params - 2 * head - s.dim) / s.n_layers
    u1, u8 = max(block, head), max(block - routed_per_block * 7 / 8, head)
    # per unit: two bf16 copies in flight, one bf16 gradient and its fp32 reduce input
    assert m1.unsharded - m8.unsharded == pytest.approx((u1 - u8) * (2 * 2 + 2 + 4))
    assert u8 < u1 / 2  # 16B's 64 experts are most of a block


def test_mfu_counts_active_parameters():
    from parallel.cluster import load_cluster
    from parallel.perf import predict

    w = _w(ep=8)
    p = predict(w, load_cluster("hgx_h100_ib", nodes=1))
    s = w.shape
    active = 6 * (s.active_params - s.vocab_size * s.dim)
    assert s.flops_per_token(4096) < 6 * s.total_params / 3  # a third would be dense-like
    attn = 6 * s.n_layers * s.n_heads * s.attention_head_dims * 4096
    assert p.mfu_pct == pytest.approx(100 * p.tokens_per_sec_per_gpu * (active + attn) / 989e12)
    assert p.moe["ep"] == 8 and "active" in p.moe["mfu_convention"]


def test_the_all_to_all_leaves_nvlink_past_the_node():
    """Qwen3 30B-A3B on 4 HGX H100 nodes: EP 8 stays in a node (NVLink), EP 16 crosses two
    (InfiniBand) and its all-to-all costs more although each GPU sends the same bytes."""
    from core.axes import Layout
    from parallel.cluster import load_cluster
    from parallel.perf import predict

    cl = load_cluster("hgx_h100_ib", nodes=4)
    w = _w("30B-A3B", "qwen3", layout=Layout(dp_shard=32), ac="none")
    p8, p16 = predict(w.with_(ep=8), cl), predict(w.with_(ep=16), cl)
    assert p8.moe["ep_fabric"] == "nvlink"
    assert p16.moe["ep_fabric"].startswith("infiniband (2 NVLink domains")
    assert p16.breakdown["ep_alltoall_s"] > 2 * p8.breakdown["ep_alltoall_s"] > 0


def test_planner_searches_ep_where_torchtitan_allows_it():
    from core.axes import Layout
    from parallel.cluster import load_cluster
    from parallel.planner import _Search
    from recipe.loader import load_recipe
    from tests.helpers.runs import ROOT

    run = _Search(load_recipe(str(ROOT / "recipes" / "moe_debug.toml")),
                  load_cluster("hgx_h100_ib", nodes=1), "torchtitan")  # fmt: skip
    # 8 routed experts; ep must also divide dp_shard x cp x tp.
    assert run.ep_options(Layout(dp_shard=4, tp=2)) == [1, 2, 4, 8]
    assert run.ep_options(Layout(dp_shard=3)) == [1]
    dense = _Search(load_recipe(str(ROOT / "recipes" / "llama3_8b.toml")),
                    load_cluster("hgx_h100_ib", nodes=1), "torchtitan")  # fmt: skip
    assert dense.ep_options(Layout(dp_shard=8)) == [1]


def test_dryrun_names_torchtitans_ep_and_efsdp_groups():
    """torchtitan's sparse mesh (pp, dp_replicate, efsdp, ep), ep innermost, over the dense
    block dp_shard x cp x tp: rank 5 of dp_shard 4 x tp 2 with ep 4 is in EP group 4..7 and
    in the efsdp group {1, 5} (efsdp = 8 / 4 = 2, stride ep)."""
    from core.axes import Layout
    from tools.dryrun.trackers import axis_groups

    named = {v: k for k, v in axis_groups(Layout(dp_shard=4, tp=2), 5, ep=4).items()}
    assert named["ep"] == frozenset({4, 5, 6, 7})
    assert named["efsdp"] == frozenset({1, 5})
    assert "ep" not in axis_groups(Layout(dp_shard=4, tp=2), 5).values()
