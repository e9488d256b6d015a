"""RL and [[adapters]] runs keep the promises training makes (runtime.steps): TensorBoard and
W&B (offline) metrics, verified checkpoints (manifest, fallback past a damaged one,
keep_latest), a stop request (what job.sbatch's SIGUSR1 trap writes) that checkpoints and
exits for the requeue, and a resumed run whose next-step losses equal an uninterrupted run's
within 1e-5; a non-finite reward fails the update in one line and leaves the last good
checkpoint as the resume point."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from runtime.metrics import read_trajectory
from tests.helpers.adapter_recipe import STEPS, adapter_weights, write_adapter_recipe
from tests.helpers.runs import ROOT, child_env, python

pytestmark = pytest.mark.slow  # three train.py runs per test: ~1-2 min on 2 loaded cores

RL_TINY = [
    "model.layers=1",
    "training.seq_len=32",
    "training.steps=4",
    "rl.prompts_per_step=3",
    "rl.group_size=2",
    "rl.max_new_tokens=3",
    "rl.sft_warmup_steps=2",
    "rl.eval_prompts=0",
    "rl.mode=sync",
    "training.local_batch_size=2",  # rows per microbatch: 6 rollouts in 3 microbatches
    "metrics.summary_skip_steps=0",
]


def train(out: Path, sets: list[str], *, recipe: str, env: dict[str, str] | None = None):
    cmd = [python(), str(ROOT / "train.py"), "--recipe", recipe,
           "--set", f"job.output_dir={out}"]  # fmt: skip
    for s in sets:
        cmd += ["--set", s]
    e = child_env()
    e.update(WANDB_MODE="offline", TITANSCALE_STOP_CHECK_S="0.001")  # check every step
    e.pop("WANDB_RUN_ID", None)
    e.update(env or {})
    return subprocess.run(cmd, cwd=ROOT, env=e, capture_output=True, text=True, timeout=900)


def ok(p: subprocess.CompletedProcess) -> None:
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]


def stop_env(tmp: Path, step: int) -> dict[str, str]:
    """The launcher's stop request arriving during step/round `step` (runtime.faults)."""
    return {"TITANSCALE_STOP_FILE": str(tmp / "stop"), "TITANSCALE_FAULT": f"stop:step={step}"}


def tb_tags(out: Path) -> set[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags: set[str] = set()
    for f in out.glob("tb/*/events.out.tfevents*"):
        acc = EventAccumulator(str(f))
        acc.Reload()
        tags |= set(acc.Tags()["scalars"])
    return tags


def wandb_history(out: Path) -> dict[int, dict]:
    from tests.integration.test_wandb_offline import wandb_records

    hist: dict[int, dict] = {}
    for run in out.glob("tb/*/wandb/offline-run-*"):
        for r in wandb_records(next(run.glob("run-*.wandb"))):
            if r.WhichOneof("record_type") == "history":
                items = {
                    i.key or "/".join(i.nested_key): json.loads(i.value_json)
                    for i in r.history.item
                }
                hist.setdefault(items["_step"], {}).update(items)
    return hist


def test_rl_stop_resume_metrics_and_checkpoints(tmp_path):
    recipe = "recipes/rl_debug.toml"
    sets = RL_TINY + ["checkpoint.interval=10", "metrics.tensorboard=true", "metrics.wandb=true",
                      "rl.reward=tests.integration._rl_rewards:by_length", "rl.kl_coef=0.05"]  # fmt: skip
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    ok(train(straight, sets, recipe=recipe))
    p = train(stopped, sets, recipe=recipe, env=stop_env(tmp_path, 2))
    ok(p)  # exit 0: the job script sees <stop>.saved and requeues
    assert (tmp_path / "stop.saved").read_text() == "2\n"
    assert sorted(os.listdir(stopped / "checkpoint")) == ["step-2"]
    assert (stopped / "checkpoint" / "step-2" / "manifest.json").is_file()
    assert [r["step"] for r in read_trajectory(stopped / "metrics.jsonl")] == [1, 2]
    (tmp_path / "stop").unlink()  # the requeued job's script starts without it
    ok(train(stopped, sets, recipe=recipe))
    got = {r["step"]: r for r in read_trajectory(stopped / "metrics.jsonl")}
    want = {r["step"]: r for r in read_trajectory(straight / "metrics.jsonl")}
    assert sorted(got) == sorted(want) == [1, 2, 3, 4]
    assert any(abs(r["loss"]) > 1e-6 for r in want.values())  # a real loss, not all zero
    for s in (3, 4):  # the resumed updates: the uninterrupted run's, within 1e-5
        assert abs(got[s]["loss"] - want[s]["loss"]) <= 1e-5, s
        assert abs(got[s]["reward_mean"] - want[s]["reward_mean"]) <= 1e-9, s
    assert (straight / "checkpoint" / "step-4" / "manifest.json").is_file()
    assert {"loss", "reward_mean", "grad_norm"} <= tb_tags(straight)
    hist = wandb_history(straight)
    assert {s: hist[s]["loss"] for s in (1, 2, 3, 4)} == {s: want[s]["loss"] for s in want}


def test_rl_non_finite_reward_keeps_last_good_checkpoint(tmp_path):
    out = tmp_path / "nan"
    sets = RL_TINY + [
        "checkpoint.interval=1",
        "rl.reward=tests.integration._rl_rewards:nan_after",
        "rl.on_error=fail",  # (skip: the guard drops the NaN-rewarded group and counts it)
    ]
    p = train(
        out, sets, recipe="recipes/rl_debug.toml", env={"RL_TEST_NAN_AFTER": "13"}
    )  # +1: rl.loop.check scores one task
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert p.returncode == 2 and len(errors) == 1, p.stderr[-3000:]
    assert "rl.reward: reward " in errors[0] and "returned nan" in errors[0], errors
    assert "Traceback" not in p.stderr
    ckpts = sorted(os.listdir(out / "checkpoint"))
    assert ckpts[-1] == "step-2", ckpts  # the two good updates; nothing from the third
    from runtime.checkpoint import verify_checkpoint

    assert verify_checkpoint(str(out / "checkpoint" / "step-2")) == []


def _losses(out: Path, name: str) -> dict[int, float]:
    return {
        r["step"]: r["loss"]
        for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
        if r.get("adapter") == name and "loss" in r
    }


def _final(out: Path, name: str) -> dict[str, torch.Tensor]:
    return adapter_weights(out / "adapters" / name / f"step-{STEPS[name]}")


def test_adapters_stop_fallback_resume_metrics(tmp_path):
    recipe = write_adapter_recipe(tmp_path)
    sets = ["checkpoint.interval=1", "checkpoint.keep_latest=2", "metrics.tensorboard=true",
            "metrics.wandb=true"]  # fmt: skip
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    ok(train(straight, sets, recipe=recipe))
    for name, steps in STEPS.items():  # keep_latest = 2, each with its manifest
        kept = sorted(os.listdir(straight / "adapters" / name))
        assert kept == [f"step-{steps - 1}", f"step-{steps}"], kept
        assert all((straight / "adapters" / name / k / "manifest.json").is_file() for k in kept)
    assert {"a/loss", "b/loss", "a/lr"} <= tb_tags(straight)
    hist = wandb_history(straight)
    assert hist[4]["a/loss"] == _losses(straight, "a")[4]

    p = train(stopped, sets, recipe=recipe, env=stop_env(tmp_path, 2))
    ok(p)
    assert (tmp_path / "stop.saved").read_text() == "2\n"
    summary = json.loads((stopped / "adapters_summary.json").read_text())
    assert summary["stopped"] and {n: s["steps"] for n, s in summary["adapters"].items()} == {
        "a": 2,
        "b": 2,
    }
    # Damage a's newest checkpoint: the resumed run falls back to step-1 (moving step-2
    # aside), b resumes from its step-2.
    shard = next((stopped / "adapters" / "a" / "step-2").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-7])
    (tmp_path / "stop").unlink()
    ok(train(stopped, sets, recipe=recipe))
    assert (stopped / "adapters" / "a" / "step-2.damaged").is_dir()
    for name in STEPS:
        got, want = _losses(stopped, name), _losses(straight, name)
        assert set(got) == set(want)
        assert max(abs(got[s] - want[s]) for s in want) <= 1e-5, name
        final, ref = _final(stopped, name), _final(straight, name)
        assert max((final[k] - ref[k]).abs().max().item() for k in ref) <= 1e-5, name
