"""Node order for Slurm jobs: switch paths, hostlists, `scontrol show topology`."""

from __future__ import annotations

import random

import pytest

from core.axes import Layout
from core.hostlist import expand_hostlist, natural_key
from launch.node_order import order_nodes
from launch.topology import (
    addresses_from_scontrol_topology,
    leaf_of,
    leaf_switches_needed,
    topology_order,
)
from parallel.cluster import load_cluster
from tests.helpers.runs import ROOT
from tools.node_order import main as node_order_main


def _cluster(spines: int, leaves_per_spine: int, nodes_per_leaf: int) -> list[tuple[str, str]]:
    """(node, address) in topology order; node names deliberately unrelated to cabling."""
    out = []
    names = [f"gpu{i:03d}" for i in range(spines * leaves_per_spine * nodes_per_leaf)]
    random.Random(0).shuffle(names)
    k = 0
    for s in range(spines):
        for j in range(leaves_per_spine):
            leaf = f"leaf{s * leaves_per_spine + j}"
            # Nodes under one leaf: their names sort among themselves.
            members = sorted(names[k : k + nodes_per_leaf], key=natural_key)
            k += nodes_per_leaf
            out += [(n, f"spine{s}.{leaf}.{n}") for n in members]
    return out


@pytest.mark.parametrize("seed", range(5))
def test_topology_order_groups_leaves_whatever_the_arrival_order(seed):
    truth = _cluster(spines=2, leaves_per_spine=6, nodes_per_leaf=3)  # leaf0..leaf11
    addr = dict(truth)
    shuffled = truth[:]
    random.Random(seed).shuffle(shuffled)
    order = topology_order(shuffled)
    assert sorted(order) == sorted(addr)
    # The same order whatever order the nodes reported in: every node computes it alike.
    assert order == topology_order(sorted(truth))
    # Every leaf's nodes are consecutive (consecutive node ranks share a leaf), and so are
    # every spine's leaves.
    for level in (leaf_of, lambda a: a.split(".")[0]):
        keys = [level(addr[n]) for n in order]
        runs = [keys[0]] + [b for a, b in zip(keys, keys[1:], strict=False) if a != b]
        assert len(runs) == len(set(keys))
    # Inside a leaf, names in natural order.
    for leaf in {leaf_of(a) for a in addr.values()}:
        members = [n for n in order if leaf_of(addr[n]) == leaf]
        assert members == sorted(members, key=natural_key)


def test_duplicates_and_missing_paths():
    entries = [("node10", "node10"), ("node2", ""), ("node3", "sp.l1.node3"), ("node3", "")]
    order = topology_order(entries)
    assert sorted(order) == ["node10", "node2", "node3"]
    assert order == topology_order(list(reversed(entries)))
    assert topology_order([]) == []


def test_expand_hostlist_keeps_padding_and_order():
    assert expand_hostlist("gpu[008-010,3],cpu1") == ["gpu008", "gpu009", "gpu010", "gpu3", "cpu1"]
    assert expand_hostlist("node[1,3]") == ["node1", "node3"]
    assert expand_hostlist("") == []


SCONTROL = """\
SwitchName=leaf1 Level=0 LinkSpeed=1 Nodes=node[1,3]
SwitchName=leaf2 Level=0 LinkSpeed=1 Nodes=node[2,4]
SwitchName=spine Level=1 LinkSpeed=1 Nodes=node[1-4] Switches=leaf[1-2]
"""


def test_addresses_from_scontrol_topology():
    addrs = addresses_from_scontrol_topology(SCONTROL, ["node1", "node2", "node3", "node4", "x"])
    assert addrs == {
        "node1": "spine.leaf1.node1",
        "node2": "spine.leaf2.node2",
        "node3": "spine.leaf1.node3",
        "node4": "spine.leaf2.node4",
    }


def test_order_falls_back_to_scontrol_when_no_addresses():
    gathered = "node4\nnode2 \nnode1\nnode3\n"
    order, addrs = order_nodes(gathered, SCONTROL)
    assert order == ["node1", "node3", "node2", "node4"]
    assert addrs["node3"] == "spine.leaf1.node3"
    # The same through the profile (fabric_from_slurm reads the scontrol text).
    cluster = load_cluster(ROOT / "clusters" / "slurmlab_cpu.toml")
    order, addrs = order_nodes(gathered, SCONTROL, cluster, Layout(dp_shard=8))
    assert order == ["node1", "node3", "node2", "node4"]


def test_order_refuses_a_tp_group_across_nodes(tmp_path, capsys):
    """tp 4 on 2-process nodes cannot stay inside an NVLink domain: exit 1 before training."""
    f = tmp_path / "nodes.txt"
    f.write_text("".join(f"{n} {a}\n" for n, a in addresses_from_scontrol_topology(
        SCONTROL, ["node1", "node2", "node3", "node4"]).items()))  # fmt: skip
    args = [str(f), "--cluster", str(ROOT / "clusters" / "slurmlab_cpu.toml")]
    args += ["--recipe", str(ROOT / "recipes" / "debug.toml"), "--set", "parallel.tp=4"]
    assert node_order_main(args) == 1
    assert "node_order: error:" in capsys.readouterr().err
    assert node_order_main(args[:-2]) == 0
    assert capsys.readouterr().out.split() == ["node1", "node3", "node2", "node4"]


def test_node_order_cli(tmp_path, capsys):
    f = tmp_path / "nodes.txt"
    f.write_text("node2 spine.leaf2.node2\nnode3 spine.leaf1.node3\nnode1 spine.leaf1.node1\n")
    assert node_order_main([str(f)]) == 0
    assert capsys.readouterr().out.split() == ["node1", "node3", "node2"]


def test_leaf_switches_needed():
    assert leaf_switches_needed(8, 32) == 1
    assert leaf_switches_needed(64, 32) == 2
    assert leaf_switches_needed(65, 32) == 3
    with pytest.raises(ValueError):
        leaf_switches_needed(0, 4)


@pytest.mark.parametrize("seed", range(3))
def test_same_host_order_as_the_planner(seed):
    """Launching in topology order leaves the planner's placement nothing to permute."""
    from core.axes import Layout
    from parallel.fabric import Fabric, Host
    from parallel.placement import planned_rank_order

    truth = _cluster(spines=2, leaves_per_spine=4, nodes_per_leaf=3)  # leaf0..leaf7
    shuffled = truth[:]
    random.Random(seed).shuffle(shuffled)
    order = topology_order(shuffled)
    addr = dict(truth)
    hosts = tuple(Host(n, tuple(addr[n].split(".")[:-1]), n) for n in order)
    fabric = Fabric(hosts, gpus_per_node=4)
    world = fabric.world_size
    assert planned_rank_order(Layout(dp_shard=world // 4, tp=4), fabric) == list(range(world))
    # Launched in shuffled order instead, the planner has to permute.
    hosts = tuple(Host(n, tuple(a.split(".")[:-1]), n) for n, a in shuffled)
    fabric = Fabric(hosts, gpus_per_node=4)
    assert planned_rank_order(Layout(dp_shard=world // 4, tp=4), fabric) != list(range(world))
