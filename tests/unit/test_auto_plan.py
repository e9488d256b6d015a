"""`[parallel] auto = true`: the planner's best plan replaces the recipe's degrees (pure)."""

from __future__ import annotations

import pytest

from core.errors import ConfigError
from recipe.loader import check_recipe, load_recipe
from runtime.platform import Platform
from runtime.session import apply_auto_plan, cluster_for_job

CPU = Platform(device_type="cpu", device_name="cpu", compute_capability=None, backend="gloo")
H100 = Platform("cuda", "NVIDIA H100 80GB HBM3", (9, 0), "nccl")


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_auto_plan_on_local_cpu(world):
    r = load_recipe(None, ["parallel.auto=true", "parallel.tp=3"])  # tp=3 is ignored
    planned, summary = apply_auto_plan(r, cluster_for_job(r, world, CPU))
    assert not planned.parallel.auto and "predicted" in summary
    layout = check_recipe(planned, world)
    assert layout.world_size == world


def test_auto_plan_70b_on_h100_nodes():
    r = load_recipe("recipes/llama3_70b_h100.toml", ["parallel.auto=true",
                                                      "parallel.cluster=hgx_h100_ib"])  # fmt: skip
    planned, _ = apply_auto_plan(r, cluster_for_job(r, 64, H100))
    layout = check_recipe(planned, 64)
    assert layout.world_size == 64 and layout.tp <= 8  # tp stays inside one 8-GPU node


def test_auto_needs_a_cluster_on_gpu():
    r = load_recipe(None, ["parallel.auto=true"])
    with pytest.raises(ConfigError) as e:
        apply_auto_plan(r, cluster_for_job(r, 8, H100))
    assert e.value.key == "parallel.cluster"


def test_partial_node_and_whole_nodes():
    r = load_recipe(None, ["parallel.cluster=hgx_h100_ib"])
    assert cluster_for_job(r, 16, H100).nodes == 2
    assert cluster_for_job(r, 2, H100).world_size == 2
    with pytest.raises(ConfigError):
        cluster_for_job(r, 12, H100)
