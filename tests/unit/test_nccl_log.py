"""Reading NCCL_DEBUG=INFO logs: InfiniBand or sockets?"""

from __future__ import annotations

from launch.nccl_log import check_network, parse_nccl_log

# Lines as NCCL 2.2x prints them (host:pid:tid [dev] prefix).
IB_LOG = """\
gpu017:812:812 [0] NCCL INFO Bootstrap : Using ib0:10.10.1.17<0>
gpu017:812:812 [0] NCCL INFO NET/Plugin: Could not find: libnccl-net.so.
gpu017:812:1023 [0] NCCL INFO NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_3:1/IB [2]mlx5_4:1/IB [3]mlx5_5:1/IB ; OOB ib0:10.10.1.17<0>
gpu017:812:1023 [0] NCCL INFO Using network IB
gpu017:812:1023 [0] NCCL INFO GPU Direct RDMA Enabled for HCA 0 'mlx5_0'
gpu017:812:1023 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read
gpu017:812:1023 [0] NCCL INFO Channel 00/0 : 7[7] -> 8[0] [send] via NET/IB/0/GDRDMA
gpu017:812:1023 [0] NCCL INFO Channel 01/0 : 15[7] -> 0[0] [receive] via NET/IB/1(0)/GDRDMA
gpu017:812:1023 [0] NCCL INFO Connected all rings
"""

SOCKET_LOG = """\
gpu017:812:812 [0] NCCL INFO Failed to open libibverbs.so[.1]
gpu017:812:812 [0] NCCL INFO NET/Socket : Using [0]eth0:10.0.0.17<0>
gpu017:812:812 [0] NCCL INFO Using network Socket
gpu017:812:1023 [0] NCCL INFO Channel 00/0 : 7[7] -> 8[0] [send] via NET/Socket/0
gpu017:812:1023 [0] NCCL INFO Channel 00/0 : 15[7] -> 0[0] [receive] via NET/Socket/0
gpu017:812:1023 [0] NCCL WARN Could not find real path of /sys/class/net/eth0
"""

EFA_LOG = """\
p5-1:77:77 [0] NCCL INFO NET/OFI Selected Provider is efa (found 32 nics)
p5-1:77:77 [0] NCCL INFO Using network AWS Libfabric
p5-1:77:90 [0] NCCL INFO Channel 00/0 : 7[7] -> 8[0] [send] via NET/AWS Libfabric/0/GDRDMA
"""


def test_parse_ib_log():
    r = parse_nccl_log(IB_LOG)
    assert r.networks == ["IB"]
    assert r.ib_devices == ["mlx5_0", "mlx5_3", "mlx5_4", "mlx5_5"]
    assert r.transports["NET/IB"] == 2 and r.transports["P2P"] == 1
    assert r.gdrdma_channels == 2 and r.gdr_enabled_hcas == 1
    v = check_network(r, "infiniband")
    assert v.ok and v.level == "ok" and "NET/IB" in v.message


def test_socket_fallback_warns():
    r = parse_nccl_log(SOCKET_LOG)
    assert r.networks == ["Socket"] and r.network_channels == {"NET/Socket": 2}
    assert r.warnings == ["Could not find real path of /sys/class/net/eth0"]
    v = check_network(r, "infiniband")
    assert not v.ok and v.level == "warn"
    assert "NET/Socket" in v.message and "TCP sockets" in v.message


def test_ib_without_gpudirect_warns():
    r = parse_nccl_log(IB_LOG.replace("/GDRDMA", ""))
    v = check_network(r, "infiniband")
    assert v.ok and v.level == "warn" and "GPUDirect" in v.message


def test_efa_log_is_right_for_efa_and_wrong_for_ib():
    r = parse_nccl_log(EFA_LOG)
    assert r.network_channels == {"NET/AWS Libfabric": 1}
    assert check_network(r, "efa").ok
    v = check_network(r, "infiniband")
    assert not v.ok and "AWS Libfabric" in v.message


def test_mixed_ranks_merge_and_flag_the_socket_one():
    merged = parse_nccl_log(IB_LOG).merge(parse_nccl_log(SOCKET_LOG))
    assert merged.networks == ["IB", "Socket"]
    assert not check_network(merged, "infiniband").ok


def test_empty_log():
    r = parse_nccl_log("")
    assert not check_network(r, "infiniband").ok  # multi-node but nothing logged
    assert check_network(r, "infiniband", multi_node=False).ok
    assert check_network(r, "none").ok
