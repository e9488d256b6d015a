"""The performance model: FLOP counts against torchtitan's, and monotone behaviour."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from core.axes import Layout
from core.models import LLAMA3_FLAVORS, model_shape
from parallel.cluster import Cluster, load_cluster
from parallel.perf import (
    hardware_flops_per_token,
    model_flops_per_token,
    predict,
)
from parallel.workload import GroupSpan, Workload, planned_spans


@pytest.mark.parametrize("flavor", LLAMA3_FLAVORS)
def test_flops_equal_torchtitans_count(flavor):
    """Our GEMM-by-GEMM count equals torchtitan's get_nparams_and_flops on the real model
    (built on the meta device: no memory, no init)."""
    from torchtitan.models.llama3 import llama3_configs

    cfg = llama3_configs[flavor](attn_backend="flex")
    with torch.device("meta"):
        model = cfg.build()
    shape = model_shape(flavor)
    for seq in (2048, 8192, 131072):
        _, flops = cfg.get_nparams_and_flops(model, seq)
        assert model_flops_per_token(shape, seq) == flops, seq
        assert shape.flops_per_token(seq) == flops, seq


def test_hardware_flops():
    s = model_shape("70B")
    w = Workload(s, 8192, 1)
    model = model_flops_per_token(s, 8192)
    attn_model = 12 * s.n_layers * s.n_heads * s.head_dim * 8192
    # No recompute, causal attention: the matmuls as counted, attention at about half
    # the counted work plus flash's backward recompute (3.5 forwards instead of 3).
    hw = hardware_flops_per_token(w)
    assert hw == pytest.approx(model - attn_model + attn_model / 2 * 3.5 / 3, rel=1e-3)
    full = hardware_flops_per_token(w.with_(ac="full"))
    sel = hardware_flops_per_token(w.with_(ac="selective"))
    assert hw < sel < full
    # Full AC reruns the forward: ~4/3 of the block work.
    assert full / hw == pytest.approx(4 / 3, rel=0.03)
    doc = hardware_flops_per_token(w.with_(doc_len=1024))
    assert doc < hw


def _h100(nodes=8, **kw):
    return Cluster(gpu="H100", nodes=nodes, gpus_per_node=8, **kw)


def test_breakdown_sums_to_step_and_outputs_are_consistent():
    w = Workload(model_shape("70B"), 8192, 4, Layout(pp=2, dp_shard=4, tp=8), pp_microbatches=4,
                 ac="full", compile=True)  # fmt: skip
    c = _h100(8)
    p = predict(w, c)
    assert sum(p.breakdown.values()) == pytest.approx(p.step_time_s)
    assert p.tokens_per_sec_per_gpu == pytest.approx(w.tokens_per_step / 64 / p.step_time_s)
    assert p.tokens_per_sec_per_node == pytest.approx(8 * p.tokens_per_sec_per_gpu)
    assert p.mfu_pct == pytest.approx(
        100 * p.tokens_per_sec_per_gpu * model_flops_per_token(w.shape, 8192) / 989e12
    )
    assert p.breakdown["pp_bubble_s"] > 0
    j = p.to_json()
    assert set(j) == {"tokens_per_sec_per_gpu", "tokens_per_sec_per_node", "mfu_pct",
                      "step_time_s", "memory_gib_per_gpu", "breakdown"}  # fmt: skip


def test_cpu_has_no_mfu():
    p = predict(Workload(model_shape("debugmodel"), 256, 2, Layout(dp_shard=2), dtype="float32"),
                load_cluster("local_cpu"))  # fmt: skip
    assert p.mfu_pct is None and p.tokens_per_sec_per_gpu > 0


workloads = st.builds(
    dict,
    flavor=st.sampled_from(["debugmodel", "8B", "70B", "405B"]),
    ac=st.sampled_from(["none", "selective", "full"]),
    linear=st.sampled_from(["bf16", "fp8_rowwise", "fp8_tensorwise"]),
    compile=st.booleans(),
    seq=st.sampled_from([2048, 8192]),
    lbs=st.sampled_from([1, 2, 4, 8]),
)


def _w(d, layout, **kw):
    return Workload(model_shape(d["flavor"]), d["seq"], d["lbs"], layout, ac=d["ac"],
                    linear=d["linear"], compile=d["compile"], **kw)  # fmt: skip


@settings(max_examples=40, deadline=None)
@given(d=workloads, gpn=st.sampled_from([1, 2, 4]), dp=st.sampled_from([1, 2, 4]),
       gpu=st.sampled_from(["H100", "B200"]))  # fmt: skip
def test_more_tp_over_infiniband_is_never_faster(d, gpn, dp, gpu):
    """Splitting each data-parallel rank over more GPUs, once tp leaves the NVLink domain
    (gpn GPUs), never raises per-GPU throughput."""
    prev = None
    for tp in (1, 2, 4, 8):
        c = Cluster(gpu=gpu, nodes=max(1, tp * dp // gpn), gpus_per_node=gpn,
                    nvlink_domain_gpus=gpn)  # fmt: skip
        if tp * dp < gpn:
            continue
        tps = predict(_w(d, Layout(dp_shard=dp, tp=tp)), c).tokens_per_sec_per_gpu
        if prev is not None and tp > gpn:
            assert tps <= prev * (1 + 1e-9), (tp, tps, prev)
        prev = tps


@settings(max_examples=30, deadline=None)
@given(d=workloads, tp=st.sampled_from([2, 4, 8]), dp=st.sampled_from([1, 2, 8]))
def test_tp_placed_over_infiniband_is_never_faster_than_on_nvlink(d, tp, dp):
    w = _w(d, Layout(dp_shard=dp, tp=tp))
    c = _h100(max(1, tp * dp // 8))
    spans = planned_spans(w.layout, c)
    assert spans["tp"].in_nvlink
    ib = dict(spans)
    ib["tp"] = GroupSpan(size=tp, domains=tp, per_domain=1, nodes=tp, ring_node_hops=tp)
    # Host-launch-bound steps tie (the host sets the pace on both): allow rounding only.
    ib_tps = predict(w, c, ib).tokens_per_sec_per_gpu
    assert ib_tps <= predict(w, c, spans).tokens_per_sec_per_gpu * (1 + 1e-9)


@settings(max_examples=30, deadline=None)
@given(d=workloads, tp=st.sampled_from([1, 2, 8]), gpu=st.sampled_from(["H100", "B200"]))
def test_more_nodes_never_beat_one_node(d, tp, gpu):
    """HSDP (fixed per-GPU work): per-GPU tokens/s never above the 1-node figure. FSDP over
    all nodes: only the optimizer's share shrinks; everything else never gets faster."""
    base_hsdp = base_fsdp = None
    for nodes in (1, 2, 4, 16, 64):
        c = Cluster(gpu=gpu, nodes=nodes, gpus_per_node=8)
        c.topology.nodes_per_leaf = 4
        hsdp = predict(_w(d, Layout(dp_replicate=nodes, dp_shard=8 // tp, tp=tp)), c)
        fsdp = predict(_w(d, Layout(dp_shard=nodes * 8 // tp, tp=tp)), c)
        no_opt = fsdp.step_time_s - fsdp.breakdown["optimizer_s"]
        if nodes == 1:
            base_hsdp, base_fsdp = hsdp.tokens_per_sec_per_gpu, no_opt
            continue
        assert hsdp.tokens_per_sec_per_gpu <= base_hsdp * (1 + 1e-9)
        assert no_opt >= base_fsdp * (1 - 1e-9)


def test_directional_facts():
    s70 = model_shape("70B")
    w = Workload(s70, 8192, 16, Layout(dp_shard=32, tp=8), ac="full", compile=True)
    gt = load_cluster("grand_teton_h100", nodes=32)
    h100 = load_cluster("hgx_h100_ib", nodes=32)
    b200 = load_cluster("hgx_b200_ib", nodes=32)
    base = predict(w, h100).tokens_per_sec_per_gpu
    assert predict(w, gt).tokens_per_sec_per_gpu < base  # 500 W cap
    assert predict(w, b200).tokens_per_sec_per_gpu > base
    assert predict(w.with_(async_tp=True), h100).tokens_per_sec_per_gpu > base
    assert predict(w.with_(linear="fp8_tensorwise"), h100).tokens_per_sec_per_gpu > base
    # A more oversubscribed spine is never faster (FSDP over 32 nodes crosses leaves).
    slow = load_cluster("hgx_h100_ib", nodes=32, overrides=["topology.nodes_per_leaf=4",
                                                             "topology.oversubscription=4.0"])  # fmt: skip
    fast = load_cluster("hgx_h100_ib", nodes=32, overrides=["topology.nodes_per_leaf=4"])
    w2 = w.with_(layout=Layout(dp_shard=256), local_batch_size=1, ac="selective")
    assert predict(w2, slow).tokens_per_sec_per_gpu <= predict(w2, fast).tokens_per_sec_per_gpu
    # Pipeline bubbles: interleaving and zero-bubble schedules shrink the bubble.
    wp = Workload(s70, 8192, 8, Layout(pp=8, dp_shard=4, tp=2), pp_microbatches=8)
    c = load_cluster("hgx_h100_ib", nodes=8)
    bub = {s: predict(wp.with_(pp_schedule=s), c).breakdown["pp_bubble_s"]
           for s in ("1F1B", "Interleaved1F1B", "ZBVZeroBubble")}  # fmt: skip
    assert bub["1F1B"] > bub["Interleaved1F1B"] > bub["ZBVZeroBubble"] > 0
    assert math.isfinite(predict(wp, c).step_time_s)


def test_tensorwise_recipes_gather_fsdp_weights_in_fp8():
    """A recipe's fp8_tensorwise (torchtitan's converter with FP8 all-gather) gathers FSDP
    weights at 1 byte per parameter, half of bf16's; its TP all-gathers stay bf16 on torchtitan
    (no float8 TP styles in 0.3) and are FP8 when the same recipe is priced as Megatron + TE."""
    from parallel.perf import Collective
    from parallel.workload import workload_from_recipe
    from recipe.loader import check_recipe, load_recipe

    c = load_cluster("hgx_h100_ib", nodes=1)
    s = model_shape("8B")

    def gathers(linear: str, stack: str, tp: int) -> dict[str, Collective]:
        r = load_recipe("llama3_8b", [f"kernels.linear={linear}", f"parallel.tp={tp}",
                                      "parallel.dp_shard=-1"])  # fmt: skip
        w = workload_from_recipe(r, check_recipe(r, 8), c, stack)
        p = predict(w, c)
        return {x.axis: x for x in p.collectives if x.kind == "all_gather"}

    tw, bf = gathers("fp8_tensorwise", "torchtitan", 1), gathers("bf16", "torchtitan", 1)
    assert tw["fsdp"].nbytes == pytest.approx(s.total_params)  # 1 byte per parameter
    assert bf["fsdp"].nbytes == pytest.approx(2 * s.total_params)
    assert "tp" not in tw
    assert gathers("fp8_rowwise", "torchtitan", 1)["fsdp"].nbytes == bf["fsdp"].nbytes
    tt_tp, te_tp = (
        gathers("fp8_tensorwise", "torchtitan", 8),
        gathers("fp8_tensorwise", "megatron_te", 8),
    )
    assert tt_tp["tp"].nbytes == 2 * te_tp["tp"].nbytes  # bf16 vs FP8 sequence-parallel gathers


def test_nvfp4_prices_the_block_gemms_at_the_fp4_peak():
    """On B300 (dense FP8 4.5, NVFP4 13.5 PFLOP/s: NVIDIA's tables) the block GEMMs' time under
    NVFP4 over MXFP8 is the ratio of peak x efficiency; on H100 NVFP4 has no peak."""
    from core.hardware import peak_flops
    from parallel.stacks import load_stack

    assert peak_flops("B300", "nvfp4") == 3 * peak_flops("B300", "mxfp8")
    assert peak_flops("H100", "nvfp4") is None
    c = Cluster(gpu="B300", nodes=1, gpus_per_node=8)
    w = Workload(model_shape("8B"), 8192, 1, layout=Layout(dp_shard=8), compile=True)
    st = load_stack("torchtitan")
    mx = predict(w.with_(linear="mxfp8"), c).breakdown["matmul_s"]
    nv = predict(w.with_(linear="nvfp4"), c).breakdown["matmul_s"]
    want = (4500 * st.matmul_eff["mxfp8"]) / (13500 * st.matmul_eff["nvfp4"])
    assert nv / mx == pytest.approx(want, rel=1e-9)
