"""[torchtitan]: dotted keys applied last to torchtitan's config objects, checked against
torchtitan's own dataclasses (unknown key / wrong type / torchtitan's own validation: one
line, exit 2, before any process group)."""

from __future__ import annotations

import pytest
import torch

from core.errors import ConfigError
from recipe.loader import check_recipe, load_recipe
from runtime.build import build_trainer_config, choose_kernels
from runtime.platform import Platform
from tests.helpers.runs import train_main_error

CPU = Platform(device_type="cpu", device_name="cpu", compute_capability=None, backend="gloo")


def build(overrides: list[str] = (), recipe_path=None):  # type: ignore[assignment]
    recipe = load_recipe(recipe_path, list(overrides))
    layout = check_recipe(recipe, 1)
    return build_trainer_config(
        recipe, layout, platform=CPU, kernels=choose_kernels(recipe, CPU), tokenizer_path="unused"
    )


def test_overrides_reach_torchtitans_objects_last(tmp_path):
    toml = tmp_path / "r.toml"
    toml.write_text(
        "[training]\nsteps = 10\n"
        "[torchtitan]\n"
        '"lr_scheduler.total_steps" = 20\n'  # a quoted dotted key
        "training.gc_freq = 7\n"  # TOML dotted keys (a nested table)
        "checkpoint.checksums = false\n"  # a field of titanscale's subclass
        '[torchtitan.metrics]\nsave_tb_folder = "tboard"\n'
    )
    cfg = build(["torchtitan.training.max_norm=0.5"], toml)
    assert cfg.lr_scheduler.total_steps == 20
    assert cfg.training.gc_freq == 7
    assert cfg.training.max_norm == 0.5  # over [training] max_norm: applied last
    assert cfg.checkpoint.checksums is False
    assert cfg.metrics.save_tb_folder == "tboard"
    assert cfg.training.steps == 10  # untouched keys keep the recipe's values


@pytest.mark.parametrize(
    "override, needle",
    [
        ("torchtitan.training.gc_frq=7", "did you mean 'gc_freq'"),
        ("torchtitan.trainig.steps=7", "did you mean 'training'"),
        ("torchtitan.training.gc_freq=often", "expected an integer"),
        ("torchtitan.checkpoint.async_mode=sync", "expected one of"),
        ("torchtitan.training=5", "expected a table"),
        ("torchtitan.training.steps.x=1", "not a config section"),
        ("torchtitan.checkpoint.keep_latest_k=1", "torchtitan refuses"),
    ],
)
def test_bad_overrides_are_config_errors(override, needle):
    with pytest.raises(ConfigError) as e:
        build([override])
    assert needle in str(e.value) and "torchtitan" in (e.value.key or "")
    assert "\n" not in str(e.value)


def test_unknown_key_exits_2_before_any_process_group(tmp_path, capsys):
    code, err = train_main_error(
        ["--set", f"job.output_dir={tmp_path}", "--set", "torchtitan.training.gc_frq=7"], capsys
    )
    assert code == 2
    assert len(err) == 1 and "torchtitan.training.gc_frq" in err[0] and "gc_freq" in err[0]
    assert not torch.distributed.is_initialized()
