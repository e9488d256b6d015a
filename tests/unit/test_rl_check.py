"""[rl] mistakes end in one ConfigError naming the key, before any process group."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from core.errors import ConfigError
from recipe.loader import load_recipe


def check(overrides):
    from rl.loop import check as rl_check

    recipe = load_recipe("recipes/rl_debug.toml", overrides)
    rl_check(SimpleNamespace(recipe=recipe))


@pytest.mark.parametrize(
    "overrides,key,text",
    [
        (["rl.env=nothing"], "rl.env", "unknown environment"),
        (["rl.env=no_such_mod_q:make"], "rl.env", "cannot import"),
        (["rl.reward=rl.envs:missing"], "rl.reward", "no callable"),
        (["rl.loss=custom", "rl.custom_loss=nocolon"], "rl.custom_loss", "module:function"),
    ],
)
def test_rl_config_errors(overrides, key, text):
    with pytest.raises(ConfigError) as e:
        check(overrides)
    assert e.value.key == key and text in str(e.value)


def test_rl_schema_errors():
    with pytest.raises(ConfigError, match="custom_loss"):
        load_recipe("recipes/rl_debug.toml", ["rl.loss=custom"])
    with pytest.raises(ConfigError, match="top_p"):
        load_recipe("recipes/rl_debug.toml", ["rl.top_p=1.5"])
    with pytest.raises(ConfigError, match="did you mean"):
        load_recipe("recipes/rl_debug.toml", ["rl.group_sise=3"])


def test_valid_recipes_pass():
    check([])
    check(["rl.env=letter_sort", "rl.reward=tests.integration._rl_rewards:flaky"])


def test_nccl_weight_sync_is_refused_on_a_cpu_machine():
    from rl.loop import check as rl_check

    recipe = load_recipe("recipes/rl_debug.toml", ["rl.generator=vllm", "rl.weight_sync=nccl"])
    cpu = SimpleNamespace(is_cpu=True)
    with pytest.raises(ConfigError, match="'nccl' needs CUDA") as e:
        rl_check(SimpleNamespace(recipe=recipe, platform=cpu, world_size=1))
    assert e.value.key == "rl.weight_sync" and "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="engine_gpus"):
        load_recipe("recipes/rl_debug.toml", ["rl.engine_gpus=6,x"])
