"""Pre-flight check: one collective per mesh group, checked and timed, before training.

Run under torchrun with the recipe's layout (``python -m tools.preflight``; the sbatch
script runs it as its first step). For each mesh axis of degree > 1 it runs the collective
training runs on it (all-gather and reduce-scatter over dp_shard, all-reduce over
dp_replicate and tp, all-gather over cp, send/recv around the pp ring), checks every result
exactly (small-integer values in float32, so sums are exact), and reports algorithm and bus
bandwidth (nccl-tests' definitions) against what the cluster profile predicts. With NCCL it
reads each rank's NCCL_DEBUG=INFO log to confirm InfiniBand, not TCP sockets, carries the
inter-node traffic. It also gathers every rank's node and switch path into placement.json.

Wrong results exit 1; slow links and socket fallbacks warn (exit 0) unless --strict.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from core.axes import MESH_ORDER, Layout
from core.launch_env import fill_single_process, launch_env, require_launch_vars
from launch.topology import topology_order
from parallel.placement import RankPlace, group_places, plain_rank_order
from recipe.loader import recipe_degrees

# Which collective each axis carries in training.
AXIS_COLLECTIVES: dict[str, tuple[str, ...]] = {
    "dp_shard": ("all_gather", "reduce_scatter"),  # FSDP2 unshard / gradient reduce
    "dp_replicate": ("all_reduce",),  # HSDP replica gradient all-reduce
    "tp": ("all_reduce",),  # row-parallel output reduction
    "cp": ("all_gather",),  # K/V exchange (all-gather rotation)
    "pp": ("send_recv",),  # stage boundary activations
}

# A measured bus bandwidth below this fraction of the prediction is worth a warning: NCCL
# usually reaches 70-90% of link speed at large messages, so half means something is off.
SLOW_FRACTION = 0.5


def recipe_layout(recipe: Any, world_size: int) -> Layout:
    """The recipe's degrees for `world_size`, without the model checks.

    recipe.loader.check_recipe also checks the degrees against the model (heads, layers),
    which imports torchtitan's model registry: ~5 s of CPU per process, paid by every rank
    of a pre-flight that only needs the degrees. tools.launch runs the full check before
    submitting and train.py runs it again; a layout that fails here fails there too.
    """
    return recipe_degrees(recipe, world_size)


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' bus bandwidth factor: busbw = algbw x factor (n = group size)."""
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter"):
        return (n - 1) / n
    return 1.0  # send_recv


@dataclass
class LaunchedRank:
    """How the launcher started one process (what preflight gathers besides its place)."""

    rank: int
    local_rank: int
    node_rank: int
    node: str
    topology_addr: str
    pid: int
    nccl_log: str = ""

    @property
    def place(self) -> RankPlace:
        """The placement record: node, and the switch path from SLURM_TOPOLOGY_ADDR (the NVLink
        domain is taken as the node; preflight does not know the profile's domains)."""
        path = tuple(self.topology_addr.split(".")[:-1]) if self.topology_addr else ()
        return RankPlace(self.rank, self.node, self.node, path)


def launched_rank() -> LaunchedRank:
    """This process's place: Slurm's node name (emulated nodes share one hostname)."""
    env = launch_env()
    return LaunchedRank(
        rank=env.rank,
        local_rank=env.local_rank,
        node_rank=env.node_rank,
        node=env.node_name or socket.gethostname(),
        topology_addr=os.environ.get("SLURM_TOPOLOGY_ADDR", ""),
        pid=os.getpid(),
    )


def placement_report(infos: list[LaunchedRank], layout: Layout) -> dict[str, Any]:
    """placement.json: rank -> node -> leaf switch, node order checks and each mesh group's
    spread (parallel.placement's groups, in plain rank order as init_device_mesh builds)."""
    infos = sorted(infos, key=lambda i: i.rank)
    by_node: dict[int, dict[str, Any]] = {}
    for i in infos:
        n = by_node.setdefault(
            i.node_rank,
            {
                "node_rank": i.node_rank,
                "node": i.node,
                "topology_addr": i.topology_addr,
                "ranks": [],
            },
        )
        n["ranks"].append(i.rank)
    nodes = [by_node[k] for k in sorted(by_node)]
    have_paths = all("." in n["topology_addr"] for n in nodes)
    # The planner's host order for these nodes (what tools.launch gives node ranks).
    names = [n["node"] for n in nodes]
    follows = names == topology_order([(n["node"], n["topology_addr"]) for n in nodes])
    contiguous = all(
        sorted(n["ranks"]) == list(range(min(n["ranks"]), max(n["ranks"]) + 1)) for n in nodes
    )
    places = {i.rank: i.place for i in infos}
    spread = group_places(layout, plain_rank_order(layout.world_size), places)
    groups: dict[str, Any] = {}
    for axis, gs in spread.items():
        if len(gs[0].ranks) <= 1:
            continue
        groups[axis] = [
            {"ranks": list(g.ranks), "nodes": list(g.hosts), "leaves": list(g.leaves)} for g in gs
        ]
    return {
        "world_size": len(infos),
        "layout": {a.value: layout.degree(a) for a in MESH_ORDER},
        "job_id": launch_env().slurm_job_id,
        "restart": launch_env().slurm_restart_count,
        "ranks": [
            {
                "rank": i.rank,
                "local_rank": i.local_rank,
                "node_rank": i.node_rank,
                "node": i.node,
                "topology_addr": i.topology_addr,
                "leaf": i.place.leaf,
            }
            for i in infos
        ],
        "nodes": nodes,
        "groups": groups,
        "checks": {
            "node_ranks_follow_topology": follows,
            "switch_paths_known": have_paths,
            "ranks_contiguous_per_node": contiguous,
        },
    }


@dataclass
class CollectiveResult:
    axis: str
    op: str
    group_size: int
    groups: int
    bytes: int
    seconds: float  # slowest rank, per iteration
    algbw_gbs: float  # GB/s (1e9 bytes)
    busbw_gbs: float
    predicted_busbw_gbs: float | None
    crosses_nodes: bool
    ok: bool
    max_error: float
    bad_ranks: list[int] = field(default_factory=list)


def predicted_busbw(cluster: Any, crosses_nodes: bool, crosses_leaves: bool) -> float | None:
    """GB/s a ring collective's bus bandwidth should reach: the slowest link in the ring,
    NVLink inside a node, the per-GPU network rate across nodes (divided by the leaf
    oversubscription when the group leaves its leaf). None without a profile or a rate."""
    if cluster is None:
        return None
    if crosses_nodes:
        bps = cluster.ib_gbps_per_gpu * 1e9 / 8
        if crosses_leaves:
            bps /= max(1.0, float(getattr(cluster.topology, "oversubscription", 1.0)))
    else:
        gbps = getattr(cluster, "nvlink_gbps", 0.0)
        try:
            bps = cluster.nvlink_bytes_per_s
        except Exception:  # a profile without a datasheet entry
            bps = gbps * 1e9 / 8
    return bps / 1e9 if bps > 0 else None


def _fill(t, index: int, offset: int = 0):
    """Deterministic small integers: exact in float32 after sums of thousands of ranks."""
    import torch

    k = torch.arange(offset, offset + t.numel(), device=t.device, dtype=torch.int64)
    t.copy_(((k % 7) + 1).to(t.dtype) * (index + 1))
    return t


def run_collective(op: str, group, numel: int, device, iters: int, warmup: int):
    """Run `op` on `group`; returns (seconds per iteration on this rank, max abs error)."""
    import torch
    import torch.distributed as dist

    ranks = dist.get_process_group_ranks(group)
    n = len(ranks)
    me = dist.get_rank(group)
    f32 = torch.float32

    if op == "all_reduce":
        x = torch.empty(numel, dtype=f32, device=device)

        def step():
            _fill(x, me)
            dist.all_reduce(x, group=group)

        def error():
            want = _fill(torch.empty_like(x), 0) * (n * (n + 1) // 2)
            return (x - want).abs().max().item()

        nbytes = x.numel() * 4
    elif op == "all_gather":
        x = _fill(torch.empty(numel // n or 1, dtype=f32, device=device), me)
        out = torch.empty(x.numel() * n, dtype=f32, device=device)

        def step():
            dist.all_gather_into_tensor(out, x, group=group)

        def error():
            want = torch.cat([_fill(torch.empty_like(x), j) for j in range(n)])
            return (out - want).abs().max().item()

        nbytes = out.numel() * 4
    elif op == "reduce_scatter":
        m = numel // n or 1
        x = _fill(torch.empty(m * n, dtype=f32, device=device), me)
        out = torch.empty(m, dtype=f32, device=device)

        def step():
            dist.reduce_scatter_tensor(out, x, group=group)

        def error():
            want = _fill(torch.empty_like(out), 0, offset=me * m) * (n * (n + 1) // 2)
            return (out - want).abs().max().item()

        nbytes = x.numel() * 4
    elif op == "send_recv":
        x = _fill(torch.empty(numel, dtype=f32, device=device), me)
        out = torch.empty_like(x)
        nxt, prv = ranks[(me + 1) % n], ranks[(me - 1) % n]

        def step():
            ops = [dist.P2POp(dist.isend, x, nxt, group), dist.P2POp(dist.irecv, out, prv, group)]
            for w in dist.batch_isend_irecv(ops):
                w.wait()

        def error():
            want = _fill(torch.empty_like(x), (me - 1) % n)
            return (out - want).abs().max().item()

        nbytes = x.numel() * 4
    else:
        raise ValueError(op)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(warmup):
        step()
    sync()
    err = error()  # checked on a warm-up result too: a wrong first result is still wrong
    t0 = time.perf_counter()
    for _ in range(iters):
        step()
    sync()
    dt = (time.perf_counter() - t0) / max(iters, 1)
    err = max(err, error())
    return dt, err, nbytes


@dataclass
class PreflightReport:
    placement: dict[str, Any]
    results: list[CollectiveResult]
    network: dict[str, Any] | None
    warnings: list[str]
    backend: str
    device: str

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.results)

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "backend": self.backend,
            "device": self.device,
            "results": [asdict(r) for r in self.results],
            "network": self.network,
            "warnings": self.warnings,
            "placement_checks": self.placement.get("checks", {}),
        }


def format_report(rep: PreflightReport) -> str:
    lines = [
        f"pre-flight: {rep.placement['world_size']} ranks on {len(rep.placement['nodes'])} "
        f"node(s), backend {rep.backend}, device {rep.device}",
    ]
    for n in rep.placement["nodes"]:
        lines.append(
            f"  node_rank {n['node_rank']:>3}  {n['node']:<16} {n['topology_addr'] or '-':<28} "
            f"ranks {min(n['ranks'])}-{max(n['ranks'])}"
        )
    hdr = f"  {'axis':<13}{'op':<15}{'n':>4}{'MiB':>9}{'ms':>10}{'algbw':>9}{'busbw':>9}{'pred':>9}  result"
    lines.append(hdr)
    for r in rep.results:
        pred = f"{r.predicted_busbw_gbs:9.1f}" if r.predicted_busbw_gbs else f"{'-':>9}"
        res = "ok" if r.ok else f"WRONG (max error {r.max_error:g}, ranks {r.bad_ranks})"
        lines.append(
            f"  {r.axis:<13}{r.op:<15}{r.group_size:>4}{r.bytes / 2**20:9.2f}{r.seconds * 1e3:10.3f}"
            f"{r.algbw_gbs:9.2f}{r.busbw_gbs:9.2f}{pred}  {res}"
            + ("  (crosses nodes)" if r.crosses_nodes else "")
        )
    if not rep.results:
        lines.append("  (every mesh axis has degree 1: no collective to run)")
    lines.append(
        "  bandwidth in GB/s (1e9 B/s); busbw as nccl-tests; pred from the cluster profile"
    )
    if rep.network:
        lines.append(f"  network: {rep.network['level']}: {rep.network['message']}")
    for w in rep.warnings:
        lines.append(f"  warning: {w}")
    lines.append("pre-flight: " + ("OK" if rep.ok else "FAILED: a collective gave a wrong result"))
    return "\n".join(lines)


def _init_process_group(backend: str) -> None:
    import torch.distributed as dist

    require_launch_vars()
    fill_single_process(os.environ)  # plain `python -m tools.preflight`: one process
    dist.init_process_group(backend)


def _nccl_debug_to_files(out_dir: str | None, cuda: bool) -> Path | None:
    """Send this process's NCCL INFO log to out_dir/nccl (training keeps the profile's
    NCCL_DEBUG); None when there is nothing to read (CPU, no folder, or the user's own file)."""
    if not (cuda and out_dir) or "NCCL_DEBUG_FILE" in os.environ:
        return None
    nccl_dir = Path(out_dir) / "nccl"
    nccl_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("NCCL_DEBUG", "INFO")
    os.environ.setdefault("NCCL_DEBUG_SUBSYS", "INIT,NET")
    os.environ["NCCL_DEBUG_FILE"] = str(nccl_dir / "nccl-%h-%p.log")
    return nccl_dir


def _measure(
    layout: Layout,
    placement: dict[str, Any],
    cluster: Any,
    device: Any,
    *,
    size_bytes: int,
    iters: int,
) -> list[CollectiveResult]:
    """Each axis's collectives over its mesh groups: slowest rank's time, exact results."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    cuda = device.type == "cuda"
    world = dist.get_world_size()
    names = tuple(a.value for a in MESH_ORDER)
    mesh = init_device_mesh(device.type, layout.shape(), mesh_dim_names=names)
    numel = max(size_bytes // 4, 1)
    results: list[CollectiveResult] = []
    for axis in MESH_ORDER:
        n = layout.degree(axis)
        if n <= 1:
            continue
        group = mesh[axis.value].get_group()
        for op in AXIS_COLLECTIVES[axis.value]:
            dt, err, nbytes = run_collective(
                op, group, numel, device, iters, warmup=2 if cuda else 1
            )
            stats = torch.tensor([dt, err], dtype=torch.float64, device=device)
            dist.all_reduce(stats, op=dist.ReduceOp.MAX)
            # Ranks with wrong results, for the message.
            bad = torch.zeros(world, dtype=torch.float64, device=device)
            bad[dist.get_rank()] = float(err > 0)
            dist.all_reduce(bad)
            slow_dt, max_err = float(stats[0]), float(stats[1])
            # The slowest group decides the time: does any group of this axis leave its
            # node, or its leaf switch?
            ginfo = placement["groups"][axis.value]
            crosses = any(len(g["nodes"]) > 1 for g in ginfo)
            crosses_leaves = any(len(g["leaves"]) > 1 for g in ginfo)
            algbw = nbytes / slow_dt / 1e9 if slow_dt > 0 else 0.0
            results.append(
                CollectiveResult(
                    axis=axis.value,
                    op=op,
                    group_size=n,
                    groups=world // n,
                    bytes=nbytes,
                    seconds=slow_dt,
                    algbw_gbs=algbw,
                    busbw_gbs=algbw * bus_factor(op, n),
                    predicted_busbw_gbs=predicted_busbw(cluster, crosses, crosses_leaves),
                    crosses_nodes=crosses,
                    ok=max_err == 0.0,
                    max_error=max_err,
                    bad_ranks=[int(i) for i in torch.nonzero(bad.cpu()).flatten().tolist()],
                )
            )
    return results


def placement_warnings(
    placement: dict[str, Any], results: list[CollectiveResult], *, cuda: bool, cluster: Any
) -> list[str]:
    """Node order, rank contiguity, tp over the network, and slow links (GPU only)."""
    warnings: list[str] = []
    checks = placement["checks"]
    if len(placement["nodes"]) > 1 and not checks["node_ranks_follow_topology"]:
        warnings.append(
            "node ranks do not follow the switch order (launched without tools.launch's node "
            "order?): mesh groups may span more leaf switches than needed"
        )
    if not checks["ranks_contiguous_per_node"]:
        warnings.append("a node's ranks are not consecutive: tp groups may leave NVLink")
    for g in placement["groups"].get("tp", []):
        if len(g["nodes"]) > 1:
            warnings.append(
                f"tp group {g['ranks']} spans nodes {g['nodes']}: tensor parallel over the network"
            )
            break
    if cuda and cluster is not None:
        for r in results:
            if r.predicted_busbw_gbs and r.busbw_gbs < SLOW_FRACTION * r.predicted_busbw_gbs:
                warnings.append(
                    f"{r.op} over {r.axis}: bus bandwidth {r.busbw_gbs:.1f} GB/s is below "
                    f"{SLOW_FRACTION:.0%} of the profile's {r.predicted_busbw_gbs:.1f} GB/s"
                )
    return warnings


def _network_check(nccl_dir: Path | None, cluster: Any, multi_node: bool) -> dict[str, Any]:
    """Every rank's NCCL log, merged: did InfiniBand (not TCP sockets) carry the traffic?"""
    import torch.distributed as dist

    from launch.nccl_log import check_network, parse_nccl_log

    path = ""
    if nccl_dir is not None:
        host = socket.gethostname()
        path = str(nccl_dir / f"nccl-{host}-{os.getpid()}.log")
    text = Path(path).read_text(errors="replace") if path and Path(path).exists() else ""
    reports: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(reports, parse_nccl_log(text))
    merged = reports[0]
    for r in reports[1:]:
        merged = merged.merge(r)
    fabric = getattr(getattr(cluster, "nccl", None), "fabric", "infiniband")
    verdict = check_network(merged, fabric, multi_node=multi_node)
    return {
        "ok": verdict.ok,
        "level": verdict.level,
        "message": verdict.message,
        "networks": merged.networks,
        "ib_devices": merged.ib_devices,
        "network_channels": dict(merged.network_channels),
        "gdrdma_channels": merged.gdrdma_channels,
    }


def run_preflight(
    layout: Layout,
    cluster: Any = None,
    *,
    out_dir: str | None = None,
    size_bytes: int | None = None,
    iters: int | None = None,
) -> PreflightReport:
    """Every rank calls this; rank 0 returns the full report (others a partial one).

    Steps: NCCL logging, the process group, where every rank runs (placement.json), the
    collectives of each mesh axis, warnings, the NCCL network check, the report files."""
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    backend = "nccl" if cuda else "gloo"
    nccl_dir = _nccl_debug_to_files(out_dir, cuda)
    me = launched_rank()
    if cuda:
        torch.cuda.set_device(me.local_rank)
    _init_process_group(backend)
    device = torch.device("cuda", me.local_rank) if cuda else torch.device("cpu")
    world = dist.get_world_size()
    if layout.world_size != world:
        raise RuntimeError(
            f"layout {layout.describe()} is for {layout.world_size} ranks, not {world}"
        )

    infos: list[Any] = [None] * world
    dist.all_gather_object(infos, me)
    placement = placement_report(infos, layout)
    results = _measure(
        layout,
        placement,
        cluster,
        device,
        size_bytes=size_bytes if size_bytes is not None else (256 * 2**20 if cuda else 2**20),
        iters=iters if iters is not None else (20 if cuda else 3),
    )
    warnings = placement_warnings(placement, results, cuda=cuda, cluster=cluster)
    network = None
    if cuda:
        network = _network_check(nccl_dir, cluster, multi_node=len(placement["nodes"]) > 1)
        if network["level"] == "warn":
            warnings.append(network["message"])

    rep = PreflightReport(placement, results, network, warnings, backend, str(device))
    if dist.get_rank() == 0 and out_dir:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "placement.json").write_text(json.dumps(placement, indent=1) + "\n")
        (out / "preflight.json").write_text(json.dumps(rep.to_json(), indent=1) + "\n")
    dist.barrier()
    dist.destroy_process_group()
    return rep
