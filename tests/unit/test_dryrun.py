"""tools.dryrun's checks before any process group, and the memory model's pipeline terms the
dry run corrected, each against an independent reference (torch's own schedule orders,
numpy's view of the rank mesh, torchtitan's loss config). The dry runs themselves are in
tests/integration/test_dryrun_recipes.py; their figures in benchmarks/dryrun.md."""

from __future__ import annotations

import numpy as np
import pytest
import torch.distributed.pipelining.schedules as torch_schedules
from torch.distributed.pipelining.schedules import _ComputationType

from core.axes import MESH_ORDER, Layout
from core.models import model_shape
from parallel.memory import (
    deferred_weight_grads,
    held_and_deferred,
    inflight_stage_microbatches,
    zbv_order,
)
from parallel.stacks import load_stack
from parallel.workload import Workload
from tools.dryrun.cli import main as dryrun_main
from tools.dryrun.fake_world import _own_fsdp_chunks
from tools.dryrun.job import prepare
from tools.dryrun.trackers import axis_groups
from tools.reliability_report import record_case

_KIND = {
    _ComputationType.FORWARD: "F",
    _ComputationType.BACKWARD_INPUT: "I",
    _ComputationType.BACKWARD_WEIGHT: "W",
    _ComputationType.FULL_BACKWARD: "B",
}


def torch_order(name: str, p: int, m: int, v: int, rank: int) -> list[tuple[int, str, int]]:
    """torch's own per-rank action list (the schedule classes compute it without stages)."""
    cls = getattr(torch_schedules, name)
    s = cls.__new__(cls)
    s.pp_group_size, s._n_microbatches, s.n_local_stages = p, m, v
    s.num_stages = s._num_stages = p * v
    s.number_of_rounds = max(1, m // p)
    s.microbatches_per_round = m // s.number_of_rounds
    out = []
    actions = []
    for a in s._calculate_single_rank_operations(rank):
        # DualPipeV's overlapped forward + backward: the forward first, then the backward
        actions += list(a.sub_actions) if a is not None and a.sub_actions else [a]
    for a in actions:
        if a is not None:
            if name in ("ScheduleZBVZeroBubble", "ScheduleDualPipeV"):  # V: 2p-1-rank
                chunk = 0 if a.stage_index == rank else 1
            else:  # loop: stage rank + chunk x p
                chunk = a.stage_index // p
            out.append((chunk, _KIND[a.computation_type], a.microbatch_index))
    return out


def peaks(order: list[tuple[int, str, int]]) -> tuple[int, int]:
    """(most stage-microbatches between forward and weight gradient, most between input
    and weight gradient) over an order."""
    held = deferred = most_held = most_deferred = 0
    for _c, kind, _mb in order:
        if kind == "F":
            held += 1
        elif kind == "I":
            deferred += 1
        elif kind == "W":
            held, deferred = held - 1, deferred - 1
        else:  # full backward
            held -= 1
        most_held, most_deferred = max(most_held, held), max(most_deferred, deferred)
    return most_held, most_deferred


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 3), (8, 64)])
def test_zbv_order_is_torchs(p, m):
    for rank in range(p):
        assert zbv_order(p, m, rank) == torch_order("ScheduleZBVZeroBubble", p, m, 2, rank)


@pytest.mark.parametrize(
    "name,p,m,v",
    [
        ("ScheduleZBVZeroBubble", 4, 8, 2),
        ("ScheduleZBVZeroBubble", 8, 64, 2),
        ("ScheduleInterleaved1F1B", 8, 16, 2),
        ("ScheduleInterleaved1F1B", 4, 64, 2),
        ("ScheduleInterleavedZeroBubble", 8, 16, 2),
        ("ScheduleInterleavedZeroBubble", 4, 32, 4),
        ("ScheduleDualPipeV", 4, 16, 2),
        ("ScheduleDualPipeV", 8, 64, 2),
    ],
)
def test_held_and_deferred_microbatches_follow_torchs_order(name, p, m, v):
    sched = name.removeprefix("Schedule")
    w = Workload(model_shape("8B"), 2048, m, Layout(pp=p), pp_schedule=sched,
                 pp_microbatches=m, virtual_stages=v)  # fmt: skip
    for rank in range(p):
        held, deferred = peaks(torch_order(name, p, m, v, rank))
        assert inflight_stage_microbatches(w, rank) == held, (rank, held)
        assert deferred_weight_grads(w, rank) == deferred, (rank, deferred)


@pytest.mark.parametrize("name,p,m", [("ScheduleZBVZeroBubble", 4, 16),
                                      ("ScheduleZBVZeroBubble", 8, 64),
                                      ("ScheduleDualPipeV", 4, 16), ("ScheduleDualPipeV", 8, 64)])  # fmt: skip
@pytest.mark.parametrize("act,grads", [(1.0, 0.575), (1.0, 3.0), (1.0, 0.0)])
def test_joint_peak_is_torchs_orders_peak(name, p, m, act, grads):
    """What the memory model charges (held x act + deferred x grads at the worst moment)
    equals the worst moment of torch's own order."""
    w = Workload(model_shape("8B"), 2048, m, Layout(pp=p), pp_schedule=name.removeprefix("Schedule"),
                 pp_microbatches=m)  # fmt: skip
    for rank in range(p):
        held = deferred = 0
        worst = 0.0
        for _c, kind, _mb in torch_order(name, p, m, 2, rank):
            held += {"F": 1, "W": -1, "B": -1}.get(kind, 0)
            deferred += {"I": 1, "W": -1}.get(kind, 0)
            worst = max(worst, act * held + grads * deferred)
        h, d = held_and_deferred(w, rank, act, grads)
        assert act * h + grads * d == pytest.approx(worst), (rank, h, d, worst)


def test_torchtitan_stack_chunks_the_loss_as_torchtitan_does():
    from recipe.model_checks import loss_chunks  # torchtitan's ChunkedLossWrapper default

    assert load_stack("torchtitan").loss_chunks == loss_chunks() > 1


@pytest.mark.parametrize("layout", [Layout(pp=2, dp_shard=2, cp=2, tp=2),
                                    Layout(dp_replicate=2, dp_shard=3, tp=2)])  # fmt: skip
def test_collectives_are_named_by_their_groups_ranks(layout):
    mesh = np.arange(layout.world_size).reshape(layout.shape())
    axes = [a.value for a in MESH_ORDER]
    for rank in range(layout.world_size):
        named = {v: k for k, v in axis_groups(layout, rank).items()}
        coord = tuple(int(c) for c in np.argwhere(mesh == rank)[0])

        def ranks_varying(*which: str, at: tuple[int, ...] = coord) -> frozenset[int]:
            idx = tuple(slice(None) if a in which else c for a, c in zip(axes, at, strict=True))
            return frozenset(int(r) for r in mesh[idx].ravel())

        for name, which in (("tp", ("tp",)), ("cp", ("cp",)), ("pp", ("pp",)),
                            ("fsdp", ("dp_shard", "cp")), ("dp_replicate", ("dp_replicate",))):  # fmt: skip
            want = ranks_varying(*which)
            if len(want) > 1:
                assert named[name] == want, (rank, name)


def test_more_nodes_grow_dp_and_keep_the_global_batch():
    job = prepare("recipes/llama3_70b_h100.toml", ["training.global_batch_size=2048"],
                         nodes=512)  # fmt: skip
    lay, tr = job.layout, job.recipe.training
    assert job.world_size == 4096 and (lay.pp, lay.cp, lay.tp, lay.dp_shard) == (8, 2, 4, 64)
    assert tr.local_batch_size * lay.dp == tr.global_batch_size == 2048
    assert job.recipe.parallel.pp_microbatches == 32  # one sequence per microbatch, as shipped
    assert job.ranks == [0, 4095]  # the first and the last pipeline rank


def test_pipeline_stage_zero_always_runs_first():
    job = prepare("recipes/llama3_70b.toml", [], ranks=[255, 100])
    assert job.ranks == [0, 100, 255]  # rank 0's forward gives the boundary metadata
    assert any("boundary" in n for n in job.notes)


def test_fewer_microbatches_keep_the_microbatch_size():
    job = prepare("recipes/llama3_70b.toml", [], microbatches=8)
    r = job.recipe
    assert r.parallel.pp_microbatches == 8 and r.training.local_batch_size == 8
    assert r.training.global_batch_size == 8 * job.layout.dp


def run_main(argv: list[str], capsys) -> tuple[int, str]:
    try:
        code = dryrun_main(argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    "argv,needles,kind",
    [
        (["--recipe", "recipes/llama3_8b.toml", "--set", "training.stepz=3"],
         ["training.stepz", "did you mean"], "unknown recipe key"),
        (["--recipe", "recipes/llama3_70b.toml", "--nodes", "3"],
         ["--nodes", "24", "32"], "world size the recipe cannot split"),
        (["--recipe", "recipes/llama3_405b.toml", "--rank", "512"],
         ["--rank", "512", "0..511"], "rank outside the world"),
        (["--recipe", "recipes/llama3_8b.toml", "--rank", "-1"],
         ["--rank", "-1"], "rank outside the world"),
        (["--recipe", "recipes/llama3_8b.toml", "--microbatches", "4"],
         ["--microbatches", "pipeline"], "microbatches without a pipeline"),
        (["--recipe", "recipes/llama3_70b.toml", "--microbatches", "65"],
         ["--microbatches", "64"], "more microbatches than the recipe"),
        (["--recipe", "recipes/llama3_8b.toml", "--cluster", "nosuch"],
         ["nosuch"], "unknown cluster profile"),
        (["--recipe", "recipes/llama3_8b.toml", "--nodes", "0"], ["--nodes"], "bad number"),
    ],
)  # fmt: skip
def test_bad_input_is_one_line_and_exit_2(argv, needles, kind, capsys):
    code, err = run_main(argv, capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    for n in needles:
        assert n in lines[0], (n, lines[0])
    record_case("tools.dryrun", kind)


def test_fsdp_chunks_made_on_demand_are_torchs():
    """The dry run's on-demand FSDP2 shards (tools.dryrun._own_fsdp_chunks) against torch's
    own `_chunk_with_empty`: the same views (size, stride, offset, values) at every index."""
    import torch
    from torch.distributed.fsdp._fully_shard._fsdp_common import _chunk_with_empty

    patched = {}

    class Patches:
        def set(self, obj, name, value):
            patched[name] = value

    _own_fsdp_chunks(Patches())
    ours_of = patched["_chunk_with_empty"]
    for n, c, dim in [
        (10, 4, 0),
        (3, 8, 0),
        (0, 4, 0),
        (7, 7, 0),
        (16, 4, 0),
        (12, 4, 1),
        (5, 512, 0),
    ]:
        t = torch.arange(n * 12).reshape(n, 12) if dim == 0 else torch.arange(36).reshape(3, 12)
        ours, theirs = ours_of(t, c, dim), _chunk_with_empty(t, c, dim)
        assert len(ours) == len(theirs) == c
        for i in range(c):
            a, b = ours[i], theirs[i]
            assert (a.shape, a.stride(), a.storage_offset()) == (
                b.shape,
                b.stride(),
                b.storage_offset(),
            )
            assert torch.equal(a, b), (n, c, dim, i)
        assert ours[-1].shape == theirs[-1].shape
