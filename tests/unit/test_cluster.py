"""Cluster profiles, the fabric they describe, Slurm topology parsing, the peak table."""

from __future__ import annotations

import pytest

from core.errors import ConfigError
from core.hardware import gpu_kind, peak_flops
from core.hostlist import expand_hostlist
from launch.slurm import fabric_from_slurm, parse_scontrol_topology, parse_topology_addr
from parallel.cluster import CLUSTERS_DIR, load_cluster

SHIPPED = ["hgx_h100_ib", "hgx_h200_ib", "hgx_b200_ib", "gb200_nvl72", "local_cpu"]


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_profiles_load_with_contract_fields(name):
    c = load_cluster(name)
    assert c.name == name
    assert c.gpu in ("H100", "H200", "B200", "GB200", "cpu")
    assert c.nvlink_domain_gpus % c.gpus_per_node == 0
    fab = c.fabric()
    assert len(fab.hosts) == c.nodes
    assert len({h.name for h in fab.hosts}) == c.nodes
    # Hosts of one NVLink domain hold exactly nvlink_domain_gpus GPUs (full domains here).
    assert set(fab.domain_gpus.values()) <= {c.nvlink_domain_gpus}
    if c.gpu != "cpu":
        assert c.nccl.fabric == "infiniband" and c.nccl.env
        assert c.ib_gbps_per_gpu >= 400


def test_profile_specifics():
    nvl = load_cluster("gb200_nvl72")
    assert (nvl.gpus_per_node, nvl.nvlink_domain_gpus, nvl.nodes_per_domain) == (4, 72, 18)
    assert load_cluster("hgx_h200_ib").hbm_bytes > load_cluster("hgx_h100_ib").hbm_bytes
    assert load_cluster("hgx_b200_ib").nvlink_bytes_per_s == 900e9
    fab = load_cluster("hgx_h100_16n_4leaf").fabric()
    assert len({h.leaf for h in fab.hosts}) == 4 and len({h.spine for h in fab.hosts}) == 1


def _write(tmp_path, text):
    p = tmp_path / "c.toml"
    p.write_text(text)
    return p


@pytest.mark.parametrize(
    "text,key,fragment",
    [
        ('gpu = "H10"\n', "gpu", "did you mean 'H100'"),
        ("gpus_per_node = 8\nnvlink_domain_gpus = 12\n", "nvlink_domain_gpus", "whole hosts"),
        ("nodes = 0\n", "nodes", "positive"),
        ("nvlnk_gbps = 1\n", "nvlnk_gbps", "did you mean 'nvlink_gbps'"),
        ("[topology]\noversubscription = 0.5\n", "topology.oversubscription", ">= 1"),
        (
            '[topology]\nnodes_per_leaf = 2\n[[topology.switches]]\nname = "s"\nnodes = "a"\n',
            "topology.switches",
            "either",
        ),
        ('[nccl]\nfabric = "infinband"\n', "nccl.fabric", "did you mean 'infiniband'"),
        ('[nccl.env]\n"NCCL IB" = "1"\n', "nccl.env.NCCL IB", "environment variable"),
    ],
)
def test_bad_profiles_name_the_key(tmp_path, text, key, fragment):
    with pytest.raises(ConfigError) as e:
        load_cluster(_write(tmp_path, text))
    assert e.value.key == key, str(e.value)
    assert fragment in str(e.value)
    assert str(tmp_path / "c.toml") in str(e.value)


def test_unknown_profile_name_suggests():
    with pytest.raises(ConfigError, match="did you mean 'hgx_h100_ib'"):
        load_cluster("hgx_h100_lb")


def test_explicit_switch_list(tmp_path):
    p = _write(
        tmp_path,
        'gpu = "GB200"\nnodes = 4\ngpus_per_node = 4\nnvlink_domain_gpus = 8\n'
        '[[topology.switches]]\nname = "leafA"\nnodes = "gpu[01-02]"\n'
        '[[topology.switches]]\nname = "leafB"\nnodes = "gpu[03-04]"\n'
        '[[topology.switches]]\nname = "spine"\nswitches = "leaf[A,B]"\n'
        '[[topology.nvlink_blocks]]\nname = "rack1"\nnodes = "gpu[02-03]"\n',
    )
    with pytest.raises(ConfigError) as e:  # "leaf[A,B]" is not a numeric range
        load_cluster(p)
    assert e.value.key == "topology.switches[2].switches"
    p.write_text(p.read_text().replace('"leaf[A,B]"', '"leafA,leafB"'))
    c = load_cluster(p)
    hosts = c.fabric().hosts
    assert [h.name for h in hosts] == ["gpu01", "gpu02", "gpu03", "gpu04"]
    assert hosts[0].switch_path == ("spine", "leafA") and hosts[3].leaf == "leafB"
    assert hosts[1].nvlink_domain == hosts[2].nvlink_domain == "rack1"
    with pytest.raises(ConfigError, match="names only 4 hosts"):
        c.with_nodes(5)


def _domains(hosts) -> set[frozenset[str]]:
    """The partition of hosts into NVLink domains (names aside)."""
    by: dict[str, set[str]] = {}
    for h in hosts:
        by.setdefault(h.nvlink_domain, set()).add(h.name)
    return {frozenset(v) for v in by.values()}


def test_one_nvlink_domain_rule_for_profile_and_slurm(tmp_path):
    """Two leaves of three hosts, two-host domains: a domain never spans a leaf, so the hosts
    group as {a0,a1} {a2} {b0,b1} {b2}, whether the tree comes from the profile's switch list or
    from `scontrol show topology`, and whatever order the job's node list has."""
    p = _write(
        tmp_path,
        'gpu = "H100"\nnodes = 6\ngpus_per_node = 4\nnvlink_domain_gpus = 8\n'
        '[[topology.switches]]\nname = "leafA"\nnodes = "a[0-2]"\n'
        '[[topology.switches]]\nname = "leafB"\nnodes = "b[0-2]"\n'
        '[[topology.switches]]\nname = "spine"\nswitches = "leafA,leafB"\n',
    )
    c = load_cluster(p)
    want = {
        frozenset({"a0", "a1"}),
        frozenset({"a2"}),
        frozenset({"b0", "b1"}),
        frozenset({"b2"}),
    }
    profile = c.fabric()
    assert _domains(profile.hosts) == want
    text = (
        "SwitchName=leafA Level=0 Nodes=a[0-2]\n"
        "SwitchName=leafB Level=0 Nodes=b[0-2]\n"
        "SwitchName=spine Level=1 Nodes=a[0-2],b[0-2] Switches=leafA,leafB\n"
    )
    by_name = {h.name: h.nvlink_domain for h in profile.hosts}
    for nodelist in ("a[0-2],b[0-2]", "b[1,0,2],a[2,0,1]"):
        slurm = fabric_from_slurm(c, nodelist=nodelist, topology_text=text)
        assert _domains(slurm.hosts) == want
        assert {h.name: h.nvlink_domain for h in slurm.hosts} == by_name
    # Without a topology text, per-node addresses give the same grouping by the same rule.
    addrs = {f"{x}{i}": f"spine.leaf{x.upper()}.{x}{i}" for x in "ab" for i in range(3)}
    assert (
        _domains(fabric_from_slurm(c, nodelist="a[0-2],b[0-2]", topology_addrs=addrs).hosts) == want
    )


def test_expand_hostlist():
    assert expand_hostlist("gpu[001-003,7],cpu1") == ["gpu001", "gpu002", "gpu003", "gpu7", "cpu1"]
    assert expand_hostlist("r[1-2]n[0-1]") == ["r1n0", "r1n1", "r2n0", "r2n1"]
    assert expand_hostlist("") == []
    for bad in ("gpu[3-1]", "gpu[1-2", "gpu]1["):
        with pytest.raises(ValueError):
            expand_hostlist(bad)


TREE = """\
SwitchName=leaf1 Level=0 LinkSpeed=1 Nodes=node[1-2]
SwitchName=leaf2 Level=0 LinkSpeed=1 Nodes=node[3-4]
SwitchName=spine Level=1 LinkSpeed=1 Nodes=node[1-4] Switches=leaf[1-2]
"""


def test_scontrol_topology_and_nodelist_order():
    topo = parse_scontrol_topology(TREE)
    assert topo.switches[2] == ("spine", ("node1", "node2", "node3", "node4"), ("leaf1", "leaf2"))
    c = load_cluster("hgx_h100_ib")
    fab = fabric_from_slurm(c, nodelist="node[3,1,4,2]", topology_text=TREE)
    assert [h.name for h in fab.hosts] == ["node3", "node1", "node4", "node2"]
    assert [h.switch_path for h in fab.hosts] == [
        ("spine", "leaf2"),
        ("spine", "leaf1"),
        ("spine", "leaf2"),
        ("spine", "leaf1"),
    ]
    assert fab.world_size == 32


def test_topology_addr_per_node_and_blocks():
    c = load_cluster("gb200_nvl72")
    addrs = {f"n{i}": f"core.leaf{i // 2}.n{i}" for i in range(4)}
    fab = fabric_from_slurm(c, nodelist="n[0-3]", topology_addrs=addrs)
    assert fab.hosts[3].switch_path == ("core", "leaf1")
    blocks = "BlockName=b1 BlockIndex=0 Nodes=n[0-1] BlockSize=2\nBlockName=b2 Nodes=n[2-3]\n"
    fab = fabric_from_slurm(c, nodelist="n[0-3]", topology_text=blocks)
    assert [h.nvlink_domain for h in fab.hosts] == ["b1", "b1", "b2", "b2"]
    assert parse_topology_addr("s.l.n1", "switch.switch.node") == (("s", "l"), "n1")
    with pytest.raises(ConfigError, match="pattern"):
        parse_topology_addr("s.n1", "switch.switch.node")
    with pytest.raises(ConfigError, match="names node"):
        fabric_from_slurm(c, nodelist="n0", topology_addrs={"n0": "s.l.other"})
    with pytest.raises(ConfigError, match="no SwitchName"):
        parse_scontrol_topology("Nothing here\n")


def test_peak_table():
    assert peak_flops("H100", "bf16") == 989e12 and peak_flops("H200", "fp8") == 1979e12
    assert peak_flops("B200", "bf16") == 2250e12 and peak_flops("B200", "mxfp8") == 4500e12
    assert peak_flops("GB200", "bf16") == 2500e12 and peak_flops("GB200", "fp8") == 4900e12
    assert peak_flops("NVIDIA H100 80GB HBM3", "fp8_rowwise") == 1979e12
    assert peak_flops("NVIDIA H100 PCIe") == 756e12
    assert peak_flops("NVIDIA H100", "mxfp8") is None  # no block-scaled tensor cores
    assert peak_flops("cpu") is None and peak_flops("Some Future GPU") is None
    assert gpu_kind("NVIDIA GB200") == "GB200" and gpu_kind("NVIDIA B200") == "B200"
    assert gpu_kind("NVIDIA H200") == "H200"


def test_every_profile_file_is_tested():
    names = {p.stem for p in CLUSTERS_DIR.glob("*.toml")}
    assert set(SHIPPED) <= names
    for n in names:
        load_cluster(n)


def test_profiles_leave_torchtitans_own_environment_alone():
    """torchtitan's init_distributed overwrites some variables (with a warning on every run when
    they are set): TORCH_NCCL_ASYNC_ERROR_HANDLING=3 and the flight-recorder ones. A profile that
    sets one only produces that warning, so none does. The names come from torchtitan's source."""
    import inspect
    import re

    from torchtitan.distributed import utils

    src = inspect.getsource(utils.init_distributed)
    overwritten = set(re.findall(r'^\s*\w+ = "(TORCH_[A-Z_]+)"', src, re.M))
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" in overwritten, sorted(overwritten)
    for path in sorted(CLUSTERS_DIR.glob("*.toml")):
        c = load_cluster(path)
        assert not overwritten & set(c.nccl.env), (path.name, sorted(overwritten & set(c.nccl.env)))
