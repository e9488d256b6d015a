"""Every shipped GPU recipe runs at (within 3% of) the planner's best plan for its declared
cluster and world size, under whatever performance model is current (computed live: a change
to parallel/perf.py or the planner that moves the best plan makes this fail until the recipe
follows, or says in a comment why not and is listed in ALLOWED_GAP with that reason)."""

from __future__ import annotations

from pathlib import Path

import pytest

from parallel.cluster import load_cluster
from parallel.planner import best_plan, world_for
from recipe.loader import load_recipe
from tools.predict import predict_recipe

ROOT = Path(__file__).resolve().parents[2]
GPU_RECIPES = {"llama3_8b", "llama3_70b", "llama3_70b_h100", "llama3_70b_b200", "llama3_405b"}
# Mixture-of-experts recipes (issue 34): their planner searches ep too (a few seconds each).
MOE_GPU_RECIPES = {
    "deepseek_v3_671b",
    "qwen3_30b_a3b",
    "qwen3_235b_a22b",
    "gpt_oss_120b",
    "moonlight_16b_a3b",
    "sft_qwen3_30b_a3b_lora",  # issue 35: LoRA on attention + routed experts, EP 2
}
# (rl_qwen3_30b_a3b, like rl_llama3_8b, is not here: the planner prices pretraining layouts,
# while RL runs data parallel only with a generator copy per rank; tools.predict prices its
# post-training memory, docs/rl.md.)
TOLERANCE = 0.03
# recipe -> why it may stay further below the best (each also says so in its comment)
ALLOWED_GAP: dict[str, str] = {}


def _shipped_gpu_recipes() -> set[str]:
    names = set()
    for path in sorted((ROOT / "recipes").glob("*.toml")):
        r = load_recipe(str(path))
        if r.parallel.cluster and load_cluster(r.parallel.cluster).gpu != "cpu":
            names.add(path.stem)
    return names


def test_every_full_size_gpu_recipe_declares_its_cluster():
    assert _shipped_gpu_recipes() >= GPU_RECIPES | MOE_GPU_RECIPES


@pytest.mark.parametrize(
    "name",
    sorted(GPU_RECIPES)
    + [pytest.param(n, marks=pytest.mark.slow) for n in sorted(MOE_GPU_RECIPES)],
)
def test_recipe_within_3pct_of_planner_best(name):
    recipe = load_recipe(str(ROOT / "recipes" / f"{name}.toml"))
    assert recipe.parallel.world_size > 0, "a GPU recipe declares its world size"
    cluster, world = world_for(recipe, load_cluster(recipe.parallel.cluster), None)
    assert world == recipe.parallel.world_size
    ours, _ = predict_recipe(recipe, cluster)
    assert ours["memory_fits"], ours["memory_breakdown_gib"]
    best = best_plan(recipe, cluster, nodes=cluster.nodes)
    gap = 1 - ours["tokens_per_sec_per_gpu"] / best.tokens_per_sec_per_gpu
    if name in ALLOWED_GAP:
        pytest.skip(ALLOWED_GAP[name])
    assert gap <= TOLERANCE, (
        f"{name}: predicted {ours['tokens_per_sec_per_gpu']:,.0f} tokens/s/GPU, "
        f"{100 * gap:.1f}% below the planner's best {best.tokens_per_sec_per_gpu:,.0f} "
        f"({best.describe()}, local batch {best.local_batch_size})"
    )
