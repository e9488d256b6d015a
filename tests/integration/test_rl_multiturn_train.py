"""train.py on recipes/rl_multiturn_debug.toml, tiny (chain_sum, three turns per episode, the
built-in generator): sync (the recipe: one forward per update) and async (the probe re-scores
each batch): every update's metrics are finite, and the trained tokens are exactly the
sampled ones (the environment's replies, also in the rows, are never counted)."""

from __future__ import annotations

import json
import math

import pytest

from runtime.metrics import read_trajectory
from tests.helpers.runs import run_train

RECIPE = "recipes/rl_multiturn_debug.toml"

# 30 warmup steps: the policy answers some turns right, so groups' rewards differ and the
# GRPO advantages (and gradients) are not all zero.
TINY = [
    "model.layers=1",
    "rl.prompts_per_step=4",
    "rl.group_size=4",
    "rl.sft_warmup_steps=30",
    "rl.eval_prompts=4",
    "rl.eval_every=2",
    "training.steps=3",
    "checkpoint.interval=0",
    "metrics.summary_skip_steps=0",
]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_multi_turn_run_trains_on_the_model_turns(tmp_path, mode):
    out = tmp_path / mode
    extra = ["rl.mode=async", "rl.max_policy_lag=1", "rl.tis_cap=2.0"] if mode == "async" else []
    run_train(out, TINY + extra, recipe=RECIPE)
    traj = read_trajectory(out / "metrics.jsonl")
    assert [r["step"] for r in traj] == [1, 2, 3]
    for r in traj:
        for k in ("loss", "grad_norm", "reward_mean", "behaviour_kl", "train_infer_kl"):
            assert math.isfinite(r[k]), (k, r)
        assert 0.0 <= r["reward_mean"] <= 1.0
        # generated_tokens counts the samples' tokens (the generator's side); trained_tokens
        # the loss mask's: equal only if no reply token is in the mask. Three turns of up to
        # 4 tokens per episode: more than one turn was sampled.
        assert r["trained_tokens"] == r["generated_tokens"] > 6
        assert r["train_infer_max_abs_diff"] < 1e-4  # float32 both sides, model tokens only
        # chain_sum ends after 3 turns (seq_len 64 holds them): 2 replies of 2-3 tokens each
        assert r["episode_turns"] == 3.0
        assert 4 * 16 <= r["env_tokens"] <= 6 * 16  # 16 episodes per update
    assert any(r["grad_norm"] > 0 for r in traj)
    with open(out / "metrics.jsonl") as f:
        evals = [e for e in map(json.loads, f) if e.get("event") == "rl_eval"]
    assert [e["step"] for e in evals] == [0, 2, 3]
    assert all(0.0 <= e["eval_reward_mean"] <= 1.0 for e in evals)
