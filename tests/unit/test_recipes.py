"""Tier 1: every shipped recipe loads, validates against its declared world size, and builds
its model on the meta device (no weights allocated) with the parameter count we expect."""

from __future__ import annotations

import pytest
import torch

from core.models import model_shape
from recipe.loader import check_recipe, effective_shape, load_recipe
from tests.helpers.runs import ROOT

RECIPES = sorted((ROOT / "recipes").glob("*.toml"))


def test_recipes_exist():
    names = {p.stem for p in RECIPES}
    assert {
        "debug",
        "llama3_8b",
        "llama3_70b",
        "llama3_70b_h100",
        "llama3_70b_b200",
        "llama3_405b",
    } <= names


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_recipe_validates(path):
    recipe = load_recipe(path)
    layout = check_recipe(recipe, recipe.parallel.world_size or None)
    if recipe.parallel.world_size:
        assert layout.world_size == recipe.parallel.world_size
    shape = model_shape(recipe.model.flavor, recipe.model.family)
    assert shape.n_heads % layout.tp == 0


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_recipe_builds_on_meta_device(path):
    """Build torchtitan's model config as train.py would, on meta: shapes, not memory."""
    from runtime.build import build_trainer_config, choose_kernels
    from runtime.platform import Platform

    recipe = load_recipe(path)
    layout = check_recipe(recipe, recipe.parallel.world_size or None)
    platform = Platform(device_type="cuda", device_name="NVIDIA H100 80GB HBM3",
                        compute_capability=(9, 0), backend="nccl")  # fmt: skip
    cfg = build_trainer_config(
        recipe,
        layout,
        platform=platform,
        kernels=choose_kernels(recipe, platform),
        tokenizer_path="unused",
    )
    par = cfg.parallelism
    assert (
        par.pipeline_parallel_degree
        * par.data_parallel_replicate_degree
        * par.data_parallel_shard_degree
        * par.context_parallel_degree
        * par.tensor_parallel_degree
    ) == layout.world_size
    with torch.device("meta"):
        model = cfg.model_spec.model.build()
    # Base weights = the shape's count; LoRA adapters (finetune.mode = "lora") on top, as
    # the memory model counts them.
    n = sum(p.numel() for name, p in model.named_parameters() if ".lora_" not in name)
    assert n == effective_shape(recipe).total_params
    if recipe.finetune.mode == "lora":
        from parallel.workload import Workload, lora_fields

        w = Workload(shape=effective_shape(recipe), seq_len=8, local_batch_size=1,
                     **lora_fields(recipe))  # fmt: skip
        n_lora = sum(p.numel() for name, p in model.named_parameters() if ".lora_" in name)
        assert n_lora == w.lora_params_per_layer * effective_shape(recipe).n_layers
    assert all(p.is_meta for p in model.parameters())
