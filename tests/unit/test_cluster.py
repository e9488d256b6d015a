"""Cluster profiles, the fabric they describe, Slurm topology parsing, the peak table."""

from __future__ import annotations

import pytest

from core.errors import ConfigError
from core.hardware import gpu_kind, peak_flops
from core.hostlist import expand_hostlist
from launch.slurm import fabric_from_slurm, parse_scontrol_topology, parse_topology_addr
from parallel.cluster import CLUSTERS_DIR, load_cluster

SHIPPED = ["hgx_h100_ib", "hgx_h200_ib", "hgx_b200_ib", "gb200_nvl72", "hgx_b300_ib",
           "gb300_nvl72", "local_cpu"]  # fmt: skip


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_profiles_load_with_contract_fields(name):
    c = load_cluster(name)
    assert c.name == name
    assert c.gpu in ("H100", "H200", "B200", "GB200", "B300", "GB300", "cpu")
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
    # GB300 NVL72 (issue 29's profile): 4 GPUs per compute tray, 72 per NVLink domain, one
    # 800 Gb/s ConnectX-8 per GPU; HGX B300: 8 per host, 800 Gb/s per GPU.
    gb300 = load_cluster("gb300_nvl72")
    assert (gb300.gpu, gb300.gpus_per_node, gb300.nvlink_domain_gpus) == ("GB300", 4, 72)
    assert gb300.nodes_per_domain == 18 and gb300.net_bytes_per_s == 100e9
    b300 = load_cluster("hgx_b300_ib")
    assert (b300.gpu, b300.gpus_per_node, b300.nvlink_domain_gpus) == ("B300", 8, 8)
    # "288 GB" class parts: more memory than B200's 180 GB, as torch would report it.
    assert 250 < b300.hbm_bytes / 2**30 < gb300.hbm_bytes / 2**30 < 268
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


def test_blackwell_nvfp4_peaks():
    # Dense NVFP4, NVIDIA's dgxc-benchmarking "Peak Theoretical Throughput" table (TFLOPS).
    for kind, tflops in (("B200", 9000), ("GB200", 9800), ("B300", 13500), ("GB300", 14700)):
        assert peak_flops(kind, "nvfp4") == tflops * 1e12, kind
    assert peak_flops("B300", "fp8") == 4500e12 and peak_flops("GB300", "bf16") == 2500e12
    for hopper in ("H100", "H200", "H800", "H200_NVL"):
        assert peak_flops(hopper, "nvfp4") is None and peak_flops(hopper, "mxfp8") is None
    assert gpu_kind("NVIDIA B300 SXM6 AC") == "B300" and gpu_kind("NVIDIA GB300") == "GB300"
    assert gpu_kind("NVIDIA H800") == "H800" and gpu_kind("NVIDIA H200 NVL") == "H200_NVL"


def test_every_gpu_of_the_table_is_a_profile_kind(tmp_path):
    """Each kind of core.hardware.GPUS loads as a profile and is priced (a peak for every GPU,
    its memory as the fit bound)."""
    from core.hardware import GPUS
    from parallel.perf import predict
    from parallel.workload import workload_from_recipe
    from recipe.loader import check_recipe, load_recipe

    recipe = load_recipe("llama3_8b", ["parallel.world_size=0", "parallel.dp_shard=-1"])
    for kind, spec in GPUS.items():
        if kind == "cpu":
            continue
        c = load_cluster(_write(tmp_path, f'gpu = "{kind}"\nnodes = 2\ngpus_per_node = 8\n'))
        assert c.gpu == kind and c.hbm_bytes == spec.hbm_gib * 2**30
        layout = check_recipe(recipe, c.world_size)
        pred = predict(workload_from_recipe(recipe, layout, c), c)
        assert pred.tokens_per_sec_per_gpu > 0 and pred.mfu_pct is not None, kind


@pytest.mark.parametrize(
    "gpu,gpn,domain,ok",
    [
        ("GB300", 4, 72, True),  # NVL72
        ("GB300", 4, 144, False),  # two racks are two domains
        ("B300", 8, 16, False),  # HGX B300: one 8-GPU NVSwitch tray
        ("B300", 8, 8, True),
        ("H100", 8, 256, True),  # H100 NVLink Switch System
        ("H800", 8, 16, False),
        ("H100_PCIE", 8, 8, True),  # a host of PCIe cards (the profile's link speed: PCIe)
        ("H100_PCIE", 8, 16, False),
    ],
)
def test_nvlink_domain_bound_per_gpu(tmp_path, gpu, gpn, domain, ok):
    text = f'gpu = "{gpu}"\nnodes = 18\ngpus_per_node = {gpn}\nnvlink_domain_gpus = {domain}\n'
    path = _write(tmp_path, text)
    if ok:
        assert load_cluster(path).nvlink_domain_gpus == domain
    else:
        with pytest.raises(ConfigError) as e:
            load_cluster(path)
        assert e.value.key == "nvlink_domain_gpus" and f"{gpu} ships in domains" in str(e.value)


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
