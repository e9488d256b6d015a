"""[training] lr_schedule / min_lr_ratio / decay_ratio: torchtitan's real scheduler, built from
a recipe, against the formula documented in docs/schedules.md, at a few steps each."""

from __future__ import annotations

import math

import pytest
import torch

from core.errors import ConfigError
from recipe.loader import load_recipe
from runtime.build import lr_scheduler_config

LR, T, W = 1e-3, 100, 10


def documented_lr(t: int, *, schedule: str, m: float, decay_ratio: float | None) -> float:
    """docs/schedules.md: the LR used by training step t (1-based)."""
    d = T - W if decay_ratio is None else min(round(T * decay_ratio), T - W)
    s = T + 1 - W - d
    if t <= W:
        return LR * t / W
    if t <= W + s:
        return LR
    p = (t - W - s) / d
    g = {"linear": 1 - p, "cosine": 0.5 * (1 + math.cos(math.pi * p)), "wsd": 1 - math.sqrt(p)}
    return LR * (m + (1 - m) * g[schedule])


def scheduler_lrs(overrides: list[str]) -> list[float]:
    recipe = load_recipe(
        None, [f"training.steps={T}", f"training.warmup_steps={W}", f"training.lr={LR}", *overrides]
    )
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    sched = lr_scheduler_config(recipe).build(optimizers=[opt], training_steps=T)
    lrs = []
    for _ in range(T):  # as torchtitan's train_step: read the LR, step the optimizer, then it
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return lrs


@pytest.mark.parametrize(
    "schedule, m, ratio, expect_ratio",
    [
        ("linear", 0.0, -1.0, None),
        ("linear", 0.1, 0.5, 0.5),
        ("cosine", 0.0, -1.0, None),
        ("cosine", 0.1, -1.0, None),
        ("wsd", 0.0, -1.0, 0.2),
        ("wsd", 0.05, 0.3, 0.3),
    ],
)
def test_schedule_matches_documented_formula(schedule, m, ratio, expect_ratio):
    lrs = scheduler_lrs(
        [
            f"training.lr_schedule={schedule}",
            f"training.min_lr_ratio={m}",
            f"training.decay_ratio={ratio}",
        ]
    )
    for t in (1, 5, W, W + 1, 40, 60, 81, 90, 95, T):
        want = documented_lr(t, schedule=schedule, m=m, decay_ratio=expect_ratio)
        assert lrs[t - 1] == pytest.approx(want, rel=1e-9, abs=1e-15), (schedule, t)
    # Shape facts independent of the formula's details:
    assert lrs[W - 1] == pytest.approx(LR)  # peak at the end of warmup
    assert min(lrs[W:]) >= LR * m - 1e-15  # never below the floor
    if schedule == "wsd":  # the peak is held until the cooldown starts
        start = T - round(T * expect_ratio)
        assert all(lr == pytest.approx(LR) for lr in lrs[W:start])
        assert lrs[start + 1] < LR


def test_cosine_midpoint_is_half_way_to_the_floor():
    lrs = scheduler_lrs(["training.lr_schedule=cosine", "training.min_lr_ratio=0.2"])
    # p = 1/2 at t = W + 1 + (T - W) / 2: cos(pi/2) = 0, so LR = lr (m + (1 - m) / 2).
    assert lrs[W + (T - W) // 2] == pytest.approx(LR * (0.2 + 0.8 / 2))


@pytest.mark.parametrize(
    "override, key",
    [
        ("training.lr_schedule=cosin", "training.lr_schedule"),
        ("training.min_lr_ratio=1.5", "training.min_lr_ratio"),
        ("training.decay_ratio=0", "training.decay_ratio"),
    ],
)
def test_bad_schedule_keys(override, key):
    with pytest.raises(ConfigError) as e:
        load_recipe(None, [override])
    assert e.value.key == key
