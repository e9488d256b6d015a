"""Post-training jobs priced with their microbatches (parallel.memory.posttrain_memory) and
the keys their paths cannot honour, refused in one line before any process group."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from core.axes import Layout
from core.errors import ConfigError
from core.models import model_shape
from parallel.cluster import load_cluster
from recipe.loader import check_recipe, load_recipe
from runtime import budget, platform, session

GIB = 2**30


def predict(overrides=()):
    from tools.predict import predict_recipe

    recipe = load_recipe("recipes/rl_llama3_8b.toml", list(overrides))
    out, _ = predict_recipe(recipe, load_cluster("hgx_h100_ib", nodes=1))
    return out["posttrain"]


def test_rl_llama3_8b_fits_an_h100_with_its_microbatches():
    pt = predict()
    assert pt["kind"] == "rl" and pt["memory_fits"] and pt["memory_gib_per_gpu"] <= 79.2
    tokens = pt["microbatch_tokens"]
    assert tokens == 2048 and pt["microbatch_tokens_from"] == "memory model"
    s = model_shape("8B")
    br = pt["memory_breakdown_gib"]
    # Independent counts: two bfloat16 copies (generator + async probe), unsharded.
    assert br["generator_copies"] == pytest.approx(2 * s.total_params * 2 / GIB, abs=0.01)
    kv = tokens * s.n_layers * 2 * s.n_kv_heads * s.head_dim * 2
    assert br["kv_cache"] == pytest.approx(kv / GIB, abs=0.01)
    # FSDP over 8: 16 B/param sharded (fp32 weight, grad, two AdamW moments).
    assert br["states"] == pytest.approx(16 * s.total_params / 8 / GIB, rel=0.01)


def test_rl_that_does_not_fit_says_what_it_needs(monkeypatch):
    sets = ["training.microbatch_tokens=8192", "rl.generator_dtype=float32"]
    pt = predict(sets)
    assert not pt["memory_fits"] and pt["memory_gib_per_gpu"] > 120
    # train.py's check on the device (an 80 GB H100), before any process group.
    recipe = load_recipe("recipes/rl_llama3_8b.toml", sets)
    layout = check_recipe(recipe, 8)
    gpu = SimpleNamespace(is_cpu=False, device_name="H100")
    monkeypatch.setattr(platform, "device_memory_bytes", lambda p: (79.2 * GIB, "H100"))
    with pytest.raises(ConfigError) as e:
        budget.choose_microbatch_tokens(recipe, layout, gpu)
    assert e.value.key == "training.microbatch_tokens"
    # The same figure tools.predict reports (one model, two front ends).
    need = pt["memory_gib_per_gpu"]
    assert f"needs {need:.1f} GiB per GPU with 8,192-token microbatches" in str(e.value)
    assert "generator_copies 59.8" in str(e.value) and "has 79.2 GiB" in str(e.value)
    fits = load_recipe("recipes/rl_llama3_8b.toml", [])
    assert budget.choose_microbatch_tokens(fits, layout, gpu) == 2048


@pytest.mark.parametrize(
    "recipe,sets,key,text",
    [
        ("rl_debug", ["validation.enable=true"], "validation.enable", "no validator"),
        ("rl_debug", ["training.global_batch_size=16"], "training.global_batch_size", "or 128"),
        ("rl_debug", ["finetune.mode=lora"], "finetune.mode", "full policy"),
    ],
)
def test_keys_a_path_cannot_honour(recipe, sets, key, text):
    r = load_recipe(f"recipes/{recipe}.toml", sets)
    with pytest.raises(ConfigError) as e:
        session.check_posttrain_keys(r, Layout())
    assert e.value.key == key and text in str(e.value) and "\n" not in str(e.value)


def test_pretraining_refuses_a_token_budget():
    with pytest.raises(ConfigError) as e:
        check_recipe(load_recipe("recipes/debug.toml", ["training.microbatch_tokens=512"]), 1)
    assert e.value.key == "training.microbatch_tokens" and "token budget" in str(e.value)


def test_rl_refuses_model_parallel_and_accepts_its_own_batch():
    r = load_recipe("recipes/rl_debug.toml", ["training.global_batch_size=256"])
    session.check_posttrain_keys(r, Layout(dp_shard=2))  # 16 prompts x 8 samples x 2 ranks
    with pytest.raises(ConfigError) as e:
        session.check_posttrain_keys(r, Layout(dp_shard=1, tp=2))
    assert e.value.key == "parallel.tp"
