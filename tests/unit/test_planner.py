"""The planner: valid, fitting, ranked plans; best_plan/apply_plan; properties over random
clusters, shuffled host orders and degrees."""

from __future__ import annotations

import copy

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from core.errors import ConfigError
from core.hardware import GPUS, PROFILE_KINDS
from parallel.cluster import Cluster, TopologySection, load_cluster
from parallel.placement import planned_rank_order
from parallel.planner import apply_plan, best_plan, plan, search
from recipe.loader import check_recipe, load_recipe

RECIPES = {
    "debug": "recipes/debug.toml",
    "8b": "recipes/llama3_8b.toml",
    "70b": "recipes/llama3_70b.toml",
    "70b_h100": "recipes/llama3_70b_h100.toml",
}


def _recipe(name, *overrides):
    return load_recipe(RECIPES[name], list(overrides))


def test_plans_for_70b_on_8_h100_nodes():
    r = _recipe("70b_h100")
    c = load_cluster("hgx_h100_ib")
    res = search(r, c)
    assert res.world_size == 64 and res.plans and res.rejected
    tps = [p.tokens_per_sec_per_gpu for p in res.plans]
    assert tps == sorted(tps, reverse=True)
    hbm = c.hbm_bytes / 2**30
    for p in res.plans:
        assert p.layout.world_size == 64
        assert p.prediction.memory.required_gib_on(c.gpu) <= hbm
        assert p.layout.tp * p.layout.cp <= 8  # inside one HGX node's NVLink
        assert p.global_batch_size == 64  # the recipe's global batch is kept
    reasons = res.reasons()
    assert reasons["memory"] > 0 and "unsupported" in reasons
    assert any("needs" in r.reason for r in res.rejected if r.reason.startswith("memory"))
    best = best_plan(r, c)
    assert best.tokens_per_sec_per_gpu == tps[0]
    assert best.cross_switch and set(best.cross_switch) == {"leaf", "spine"}
    # The 70B needs more than one node's 640 GB for weights + grads + Adam state.
    with pytest.raises(ConfigError, match="no parallel plan") as e:
        best_plan(r, c, nodes=1)
    assert e.value.key == "parallel.auto"


def test_apply_plan_gives_a_recipe_that_checks():
    r = _recipe("70b_h100", "parallel.auto=true")
    c = load_cluster("hgx_h100_ib")
    best = best_plan(r, c)
    applied = apply_plan(r, best)
    assert applied is not r and r.parallel.auto  # the original is untouched
    lay = check_recipe(applied, 64)
    assert lay == best.layout
    assert applied.training.activation_checkpoint == best.activation_checkpoint
    assert applied.training.local_batch_size == best.local_batch_size
    if lay.pp > 1:
        assert applied.parallel.pp_schedule == best.pp_schedule
        assert applied.parallel.pp_microbatches == best.microbatches


def test_unsupported_and_invalid_candidates_are_reported():
    r = _recipe("70b")
    res = search(r, load_cluster("hgx_h100_ib"), nodes=8)
    kinds = {x.reason.split(":")[0] for x in res.rejected}
    assert {"memory", "unsupported", "invalid"} <= kinds
    zb = [x for x in res.rejected if x.reason.startswith("unsupported")]
    assert all(x.activation_checkpoint != "none" for x in zb)
    for p in res.plans:
        if p.pp_schedule in ("ZBVZeroBubble", "InterleavedZeroBubble", "DualPipeV"):
            assert p.activation_checkpoint == "none"


def test_cpu_debug_recipe_plans():
    r = _recipe("debug")
    c = load_cluster("local_cpu").with_nodes(1)
    plans = plan(r, c)
    assert plans and all(p.layout.world_size == 8 for p in plans)
    assert plans[0].prediction.mfu_pct is None


clusters = st.builds(
    lambda gpu, gpn, dom_mult, nodes, npl, seed: (
        Cluster(
            gpu=gpu,
            nodes=nodes,
            gpus_per_node=gpn,
            # A multi-host domain only where the GPU ships in one (GB200/GB300 NVL72, H100/H200).
            nvlink_domain_gpus=gpn * (dom_mult if GPUS[gpu].max_nvlink_domain > gpn else 1),
            topology=TopologySection(nodes_per_leaf=npl),
        ),
        seed,
    ),
    gpu=st.sampled_from([k for k in PROFILE_KINDS if k != "cpu"]),
    gpn=st.sampled_from([1, 2, 4, 8]),
    dom_mult=st.sampled_from([1, 1, 2]),
    nodes=st.integers(1, 24),
    npl=st.sampled_from([0, 1, 2, 4]),
    seed=st.integers(0, 2**16),
)


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
@given(
    cs=clusters,
    recipe=st.sampled_from(["debug", "8b", "70b"]),
    seq=st.sampled_from([2048, 8192]),
    lbs=st.sampled_from([1, 2, 4]),
)
def test_plan_properties(cs, recipe, seq, lbs):
    cluster, seed = cs
    if cluster.nodes % cluster.nodes_per_domain:
        cluster = cluster.with_nodes(
            cluster.nodes_per_domain * max(1, cluster.nodes // cluster.nodes_per_domain)
        )
    r = _recipe(recipe, f"training.seq_len={seq}", f"training.local_batch_size={lbs}",
                "parallel.world_size=0")  # fmt: skip
    res = search(r, cluster)
    plans = res.plans
    world = cluster.world_size
    hbm = cluster.hbm_bytes / 2**30
    # Every candidate is either a plan or a rejection with a reason; a memory rejection
    # quotes a need above the GPU's memory.
    assert res.candidates == len(plans) + len(res.rejected)
    for x in res.rejected:
        assert x.reason.split(":")[0] in ("memory", "invalid", "unsupported"), x.reason
        if x.reason.startswith("memory"):
            assert float(x.reason.split("needs ")[1].split(" GiB")[0]) > hbm - 0.05, x.reason
    # A draw where nothing fits (70B on a few GPUs) says nothing about plans: let hypothesis
    # draw another, so each of the max_examples draws checks the properties below.
    assume(plans)
    fabric = cluster.fabric().shuffled(seed)
    for p in plans[:12]:
        lay = p.layout
        assert lay.pp * lay.dp_replicate * lay.dp_shard * lay.cp * lay.tp == world
        assert p.prediction.memory.required_gib_on(cluster.gpu) <= hbm
        order = planned_rank_order(lay, fabric)
        assert sorted(order) == list(range(world))
        # Every tp group (and cp group) inside one NVLink domain, on shuffled hosts.
        from parallel.placement import groups

        for axis in ("tp", "cp"):
            for grp in groups(lay, order)[axis]:
                assert len({fabric.host_of(rk).nvlink_domain for rk in grp}) == 1
        applied = apply_plan(r, p)
        assert check_recipe(applied, world) == lay


def test_planner_leaves_the_recipe_alone():
    r = _recipe("70b_h100")
    before = copy.deepcopy(r)
    plan(r, load_cluster("hgx_h100_ib"))
    assert r == before


@pytest.mark.parametrize(
    "recipe,cluster",
    [
        ("recipes/llama3_8b.toml", "hgx_h100_ib"),
        ("recipes/llama3_70b.toml", "hgx_h100_ib"),
        ("recipes/llama3_70b_h100.toml", "hgx_h100_ib"),
        ("recipes/llama3_70b_b200.toml", "hgx_b200_ib"),
        ("recipes/llama3_405b.toml", "hgx_h100_ib"),
    ],
)
def test_shipped_recipes_fit_their_hardware(recipe, cluster):
    """The memory model says every shipped GPU recipe's own layout fits its GPUs."""
    from parallel.perf import predict
    from parallel.workload import workload_from_recipe

    r = load_recipe(recipe)
    lay = check_recipe(r)
    c = load_cluster(cluster, nodes=lay.world_size // 8)
    p = predict(workload_from_recipe(r, lay, c), c)
    assert p.memory.required_gib_on(c.gpu) <= c.hbm_bytes / 2**30, p.memory.breakdown_gib()
    assert p.tokens_per_sec_per_gpu > 0


def _suggested(out: str, key: str) -> list[int]:
    marker = "training.global_batch_size = " if key == "batch" else "(--nodes "
    vals = []
    for line in out.splitlines():
        if marker in line:
            vals.append(int(line.split(marker)[1].split(")")[0].split(":")[0].replace(",", "")))
    return vals


def test_infeasible_plan_names_the_binding_constraint_and_a_batch_that_fits(capsys):
    """Issue 29: 70B (512 sequences per step, 80 layers) on 4,608 HGX H100 nodes: 36,864 =
    2^12 x 3^2 GPUs, so a data-parallel degree dividing 512 leaves a factor 9 to pp, which 80
    layers cannot take. The tool says so and names a global batch that fits; the search run
    here with that value finds plans whose data-parallel degree divides it."""
    from tools.plan import main

    main(["--recipe", "recipes/llama3_70b.toml", "--cluster", "hgx_h100_ib", "--nodes", "4608"])
    out = capsys.readouterr().out
    assert " 0 fit" in out
    why = next(line for line in out.splitlines() if line.startswith("nothing fits:"))
    for needle in ("36,864", "3^2", "512 sequences", "training.global_batch_size", "80 layers",
                   "pp in {9, 18, 36, 72}"):  # fmt: skip
        assert needle in why, (needle, why)
    (batch,) = _suggested(out, "batch")
    assert batch != 512
    res = search(_recipe("70b", f"training.global_batch_size={batch}"),
                 load_cluster("hgx_h100_ib"), nodes=4608)  # fmt: skip
    assert res.plans
    for p in res.plans[:20]:
        assert batch % (p.layout.dp_replicate * p.layout.dp_shard) == 0
    # The node counts it names plan too (the nearest below and above 4,608).
    nodes = _suggested(out, "nodes")
    assert nodes and any(n < 4608 for n in nodes) and any(n > 4608 for n in nodes)
    for n in nodes:
        assert search(_recipe("70b"), load_cluster("hgx_h100_ib"), nodes=n).plans


def test_out_of_memory_names_the_need_and_the_nodes_that_fit():
    """405B on two HGX H100 nodes: memory binds; the explanation quotes the smallest need
    (above the GPU's 79.2 GiB) and the nearest larger node count that fits, and the one
    checked before it (if any) does not."""
    from parallel.planner import explain_infeasible

    r = load_recipe("recipes/llama3_405b.toml", ["parallel.world_size=0"])
    c = load_cluster("hgx_h100_ib")
    why = explain_infeasible(r, c, nodes=2)
    assert why.constraint.startswith("out of memory in every layout")
    need = float(why.constraint.split("smallest need is ")[1].split(" GiB")[0])
    assert need > c.hbm_bytes / 2**30
    (s,) = why.suggestions
    assert s.key == "nodes" and s.value > 2
    assert search(r, c, nodes=s.value).plans
    # A ConfigError from parallel.auto carries the same story on one line.
    with pytest.raises(ConfigError) as e:
        best_plan(load_recipe("recipes/llama3_405b.toml", ["parallel.world_size=0",
                                                           "parallel.auto=true"]), c, nodes=2)  # fmt: skip
    assert "out of memory" in e.value.detail and f"{s.value:,} nodes" in e.value.detail
    assert "\n" not in str(e.value)
