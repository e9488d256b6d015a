"""The first-step deadline (watchdog + torchtitan's comm.init_timeout_seconds) covers
compilation: automatic 1800 s with training.compile, 300 s eager, or the recipe's value."""

from __future__ import annotations

from recipe.loader import first_step_timeout_s, load_recipe


def test_automatic_deadline_follows_compile():
    assert first_step_timeout_s(load_recipe("recipes/debug.toml")) == 300
    assert (
        first_step_timeout_s(load_recipe("recipes/debug.toml", ["training.compile=true"])) == 1800
    )
    slice_ = load_recipe("recipes/gpu_slice_70b.toml")
    assert slice_.training.compile and first_step_timeout_s(slice_) == 1800
    assert (
        first_step_timeout_s(load_recipe("recipes/debug.toml", ["job.init_timeout_s=120"])) == 120
    )


def test_trainer_config_and_watchdog_get_it():
    from runtime.build import build_trainer_config, choose_kernels
    from runtime.platform import Platform

    r = load_recipe("recipes/gpu_slice_70b.toml")
    from recipe.loader import check_recipe

    p = Platform("cuda", "NVIDIA H200", (9, 0), "nccl")
    cfg = build_trainer_config(r, check_recipe(r, 1), platform=p,
                               kernels=choose_kernels(r, p), tokenizer_path="unused")  # fmt: skip
    # runtime.trainer passes comm.init_timeout_seconds to the watchdog as its first deadline
    assert cfg.comm.init_timeout_seconds == 1800
