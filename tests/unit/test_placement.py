"""Placement: NVLink-contained tp/cp groups, few leaves per dp_shard group, and less
cross-switch traffic than plain rank order on shuffled hosts."""

from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from core.axes import Layout
from core.models import model_shape
from parallel.cluster import load_cluster
from parallel.perf import predict
from parallel.placement import (
    PlacementError,
    RankPlace,
    check_nvlink,
    cross_switch_traffic,
    group_spans,
    groups,
    monotone_violation,
    node_order,
    placement_table,
    plain_rank_order,
    planned_rank_order,
    planned_traffic,
)
from parallel.workload import Workload, planned_spans
from runtime.startup import check_placement, local_rank_info, placement_summary


def _pod():
    return load_cluster("hgx_h100_16n_4leaf")  # 16 nodes, 4 leaves of 4, 2:1 spine


def test_16_nodes_4_leaves_shuffled_planned_beats_plain_order():
    c = _pod()
    fabric = c.fabric().shuffled(seed=3)
    assert [h.name for h in fabric.hosts] != sorted(h.name for h in fabric.hosts)
    lay = Layout(dp_replicate=2, dp_shard=8, tp=8)
    w = Workload(model_shape("70B"), 8192, 4, lay, ac="full", compile=True)
    colls = predict(w, c).collectives
    planned = planned_rank_order(lay, fabric)
    plain = plain_rank_order(lay.world_size)
    t_plan = cross_switch_traffic(colls, lay, planned, fabric)
    t_plain = cross_switch_traffic(colls, lay, plain, fabric)
    # Each 64-GPU dp_shard group sits in 2 leaves (planned) instead of wandering across all
    # 4 in shuffled order; replicate (outermost) is what crosses the spine.
    assert t_plan.spine_gb < t_plain.spine_gb
    assert t_plan.leaf_gb <= t_plain.leaf_gb
    spans = group_spans(lay, planned, fabric)
    assert spans["dp_shard"].leaves == 2 and spans["tp"].domains == 1
    assert (
        group_spans(lay, plain, fabric)["dp_shard"].ring_leaf_hops
        > spans["dp_shard"].ring_leaf_hops
    )
    # And the model prices the difference (oversubscribed spine).
    fast = predict(w, c, spans).tokens_per_sec_per_gpu
    slow = predict(w, c, group_spans(lay, plain, fabric)).tokens_per_sec_per_gpu
    assert fast >= slow
    # The analytic spans the planner uses agree with the measured planned placement.
    assert planned_spans(lay, c)["dp_shard"].leaves == spans["dp_shard"].leaves
    # ... and so does the traffic the planner computes from them, per axis, to the byte.
    analytic = planned_traffic(colls, lay, planned_spans(lay, c))
    assert analytic.spine_bytes == pytest.approx(t_plan.spine_bytes)
    assert analytic.leaf_bytes == pytest.approx(t_plan.leaf_bytes)
    assert analytic.spine_gb > 0  # replicas and 64-GPU shard groups must cross the spine
    # Applied at launch: hosts in node_order get node ranks 0..15, so plain rank order on
    # the relaunched job is the planned order (and trivially safe for DeviceMesh).
    hosts = node_order(lay, fabric)
    assert sorted(hosts) == sorted(h.name for h in fabric.hosts)
    by_name = {h.name: h for h in fabric.hosts}
    relaunched = type(fabric)(tuple(by_name[h] for h in hosts), fabric.gpus_per_node)
    assert planned_rank_order(lay, relaunched) == plain_rank_order(lay.world_size)
    assert monotone_violation(lay, plain_rank_order(lay.world_size)) is None
    assert monotone_violation(Layout(dp_shard=2, tp=2), [3, 1, 2, 0]) is not None
    assert monotone_violation(Layout(dp_shard=2, tp=2), [0, 2, 1, 3]) is None
    table = placement_table(lay, planned, fabric, limit=10)
    assert "dp_shard groups" in table and "spine0/leaf" in table


def test_tp_groups_stay_in_nvlink_domains_on_nvl72():
    c = load_cluster("gb200_nvl72", nodes=36)  # two racks of 18 trays x 4 GPUs
    fabric = c.fabric().shuffled(seed=11)
    lay = Layout(dp_shard=4, cp=2, tp=18)  # tp x cp = 36 GPUs: 9 trays of one rack
    order = planned_rank_order(lay, fabric)
    for grp in groups(lay, order)["tp"] + groups(lay, order)["cp"]:
        assert len({fabric.host_of(r).nvlink_domain for r in grp}) == 1
    # A tp group straddling racks is refused with the group and hosts named.
    with pytest.raises(PlacementError, match="tp group .* spans 2 NVLink domains"):
        check_nvlink(Layout(dp_shard=4, tp=36), list(range(4, 144)) + list(range(4)), c.fabric())
    with pytest.raises(PlacementError, match="must fit one domain"):
        planned_rank_order(Layout(dp_shard=1, tp=144), c.fabric())


@settings(max_examples=40, deadline=None)
@given(
    nodes=st.sampled_from([2, 4, 8, 16]),
    gpn=st.sampled_from([2, 4, 8]),
    tp=st.sampled_from([1, 2, 4, 8]),
    cp=st.sampled_from([1, 2]),
    rep=st.sampled_from([1, 2]),
    seed=st.integers(0, 10**6),
)
def test_planned_order_is_a_permutation_with_local_tp(nodes, gpn, tp, cp, rep, seed):
    assume(tp * cp <= gpn and (nodes * gpn) % (tp * cp * rep) == 0)
    c = load_cluster("hgx_h100_ib", nodes=nodes, overrides=[f"gpus_per_node={gpn}",
                                                            f"nvlink_domain_gpus={gpn}",
                                                            "topology.nodes_per_leaf=2"])  # fmt: skip
    fabric = c.fabric().shuffled(seed)
    world = nodes * gpn
    lay = Layout(dp_replicate=rep, dp_shard=world // (tp * cp * rep), cp=cp, tp=tp)
    order = planned_rank_order(lay, fabric)
    assert sorted(order) == list(range(world))
    gs = groups(lay, order)
    for axis in ("tp", "cp"):
        for grp in gs[axis]:
            assert len({fabric.host_of(r).name for r in grp}) == 1
    # dp_shard groups: as few leaves as their size allows (2 hosts per leaf here).
    shard_hosts = lay.dp_shard * tp * cp // gpn
    for grp in gs["dp_shard"]:
        leaves = {fabric.host_of(r).leaf for r in grp}
        assert len(leaves) <= max(1, -(-shard_hosts // 2))


def test_startup_check_pure():
    lay = Layout(dp_shard=2, tp=2)
    infos = [RankPlace(r, f"n{r % 2}", f"n{r % 2}", ("s", f"l{r % 2}")) for r in range(4)]
    check_placement(infos, lay, [0, 2, 1, 3])  # tp groups {0,2} and {1,3}: one host each
    with pytest.raises(PlacementError, match=r"tp group \[0, 1\] .*rank 0 on n0, rank 1 on n1"):
        check_placement(infos, lay, [0, 1, 2, 3])
    s = placement_summary(infos, lay, [0, 2, 1, 3])
    assert "2 hosts" in s and "tp" in s and len(s.splitlines()) < 25
    info = local_rank_info(3, {"SLURMD_NODENAME": "gpu7", "SLURM_TOPOLOGY_ADDR": "sp.lf2.gpu7"})
    assert (info.host, info.switch_path, info.nvlink_domain) == ("gpu7", ("sp", "lf2"), "gpu7")
    info = local_rank_info(0, {"SLURMD_NODENAME": "h", "TITANSCALE_NVLINK_DOMAIN": "rack3"})
    assert info.nvlink_domain == "rack3"
