"""Pre-flight: mesh groups, placement summary, result checking, and a torchrun run."""

from __future__ import annotations

import pytest

from core.axes import Layout
from launch.preflight import (
    CollectiveResult,
    LaunchedRank,
    PreflightReport,
    bus_factor,
    placement_report,
    predicted_busbw,
)
from parallel.cluster import load_cluster
from tests.helpers.mesh import groups_by_coordinates
from tests.helpers.runs import ROOT, free_port


def test_mesh_groups_match_row_major_mesh():
    """Preflight's groups are parallel.placement's groups in plain rank order, and those are
    what init_device_mesh builds: ranks row-major over [pp, dp_replicate, dp_shard, cp, tp],
    one group per axis = the ranks whose coordinates agree on every other axis. The
    reference here computes coordinates by division, not by reshaping."""
    import itertools

    from core.axes import MESH_ORDER
    from parallel.placement import groups, plain_rank_order

    layout = Layout(pp=2, dp_replicate=1, dp_shard=3, cp=2, tp=2)
    dims = layout.shape()
    world = layout.world_size

    g = groups(layout, plain_rank_order(world))
    by_coord = groups_by_coordinates(list(range(world)), dims)
    for k, axis in enumerate(MESH_ORDER):
        assert g[axis.value] == by_coord[k], axis
        assert all(len(x) == dims[k] for x in g[axis.value])
    # The spot values a reader can check by hand, for pp2 x dp_shard2 x tp2.
    small = groups(Layout(pp=2, dp_shard=2, tp=2), plain_rank_order(8))
    assert small["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert small["dp_shard"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert small["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # Every rank is in exactly one group of each axis.
    for axis in MESH_ORDER:
        assert sorted(itertools.chain.from_iterable(g[axis.value])) == list(range(world))
    # The report lists exactly those groups (axes of degree > 1).
    infos = [
        LaunchedRank(r, r % 4, r // 4, f"n{r // 4}", f"s.l{r // 8}.n{r // 4}", 1)
        for r in range(world)
    ]
    rep = placement_report(infos, layout)
    assert set(rep["groups"]) == {"pp", "dp_shard", "cp", "tp"}
    for axis, rows in rep["groups"].items():
        assert [x["ranks"] for x in rows] == g[axis]
        for x in rows:
            assert x["nodes"] == sorted(
                {f"n{r // 4}" for r in x["ranks"]}, key=lambda n: int(n[1:])
            )
            assert x["leaves"] == sorted(
                {f"l{r // 8}" for r in x["ranks"]}, key=lambda n: int(n[1:])
            )


def _infos(node_order, addrs, per_node=2):
    out = []
    for nr, node in enumerate(node_order):
        for lr in range(per_node):
            out.append(LaunchedRank(nr * per_node + lr, lr, nr, node, addrs[node], 1))
    return out


ADDRS = {
    "node1": "spine.leaf1.node1",
    "node3": "spine.leaf1.node3",
    "node2": "spine.leaf2.node2",
    "node4": "spine.leaf2.node4",
}


def test_placement_summary_topology_order():
    layout = Layout(dp_shard=4, tp=2)
    s = placement_report(_infos(["node1", "node3", "node2", "node4"], ADDRS), layout)
    assert s["checks"] == {
        "node_ranks_follow_topology": True,
        "switch_paths_known": True,
        "ranks_contiguous_per_node": True,
    }
    assert [n["node"] for n in s["nodes"]] == ["node1", "node3", "node2", "node4"]
    assert all(len(g["nodes"]) == 1 for g in s["groups"]["tp"])  # tp inside a node
    assert s["groups"]["dp_shard"][0]["leaves"] == ["leaf1", "leaf2"]


def test_placement_summary_flags_name_order():
    # SLURM_NODEID order (names) interleaves the leaves: not topology order.
    s = placement_report(_infos(["node1", "node2", "node3", "node4"], ADDRS), Layout(dp_shard=8))
    assert s["checks"]["node_ranks_follow_topology"] is False


def test_bus_factors_and_prediction():
    assert bus_factor("all_reduce", 8) == pytest.approx(1.75)
    assert bus_factor("all_gather", 4) == pytest.approx(0.75)
    assert bus_factor("send_recv", 2) == 1.0
    c = load_cluster("hgx_h100_ib")
    assert predicted_busbw(c, crosses_nodes=True, crosses_leaves=False) == pytest.approx(50.0)
    assert predicted_busbw(c, crosses_nodes=False, crosses_leaves=False) == pytest.approx(450.0)
    assert predicted_busbw(None, True, True) is None


def test_wrong_collective_result_is_caught(monkeypatch):
    """A collective that returns garbage is reported with its error (one gloo process)."""
    import torch.distributed as dist

    from launch import preflight

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        import torch

        dt, err, nbytes = preflight.run_collective(
            "all_reduce", dist.group.WORLD, 1024, torch.device("cpu"), iters=1, warmup=1
        )
        assert err == 0.0 and nbytes == 4096
        real = dist.all_reduce

        def broken(t, *a, **k):
            w = real(t, *a, **k)
            t[3] += 1.0  # one wrong element
            return w

        monkeypatch.setattr(dist, "all_reduce", broken)
        _, err, _ = preflight.run_collective(
            "all_reduce", dist.group.WORLD, 1024, torch.device("cpu"), iters=1, warmup=1
        )
        assert err == 1.0
    finally:
        dist.destroy_process_group()


def test_cli_exits_1_with_a_clear_message_on_a_wrong_result(monkeypatch, capsys):
    from launch import preflight
    from tools.preflight import main

    bad = CollectiveResult(
        "tp", "all_reduce", 2, 4, 4096, 1e-3, 4.0, 7.0, None, False, False, 3.0, [5]
    )
    rep = PreflightReport(
        placement_report(_infos(["node1"], ADDRS), Layout()), [bad], None, [], "gloo", "cpu"
    )
    monkeypatch.setattr(preflight, "run_preflight", lambda *a, **k: rep)
    assert main(["--recipe", str(ROOT / "recipes" / "debug.toml")]) == 1
    err = capsys.readouterr().err
    assert "all_reduce over tp" in err and "wrong result on ranks [5]" in err


def test_recipe_layout_matches_the_loader():
    from core.errors import ConfigError
    from launch.preflight import recipe_layout
    from recipe.loader import check_recipe, load_recipe

    for sets, world in ([[], 8], [["parallel.tp=2", "parallel.pp=2"], 4], [["parallel.cp=2"], 8]):
        r = load_recipe(ROOT / "recipes" / "debug.toml", sets)
        assert recipe_layout(r, world) == check_recipe(r, world)
    r = load_recipe(ROOT / "recipes" / "llama3_70b_b200.toml")
    with pytest.raises(ConfigError) as e:
        recipe_layout(r, 32)
    assert e.value.key == "parallel.world_size"
