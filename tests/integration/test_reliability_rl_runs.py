"""A bad reward in a real RL run (python train.py): one line, exit 2, no NaN saved.

Before: a NaN reward trained (loss nan) and saved a checkpoint whose optimizer state was
NaN, exit 0; a reward calling sys.exit(3) ended the run with exit 3 and no line. Now, with
rl.on_error = "fail", the first bad reward stops the run: the last stderr line names the
reward and the task, the exit code is 2, and the checkpoint of the last good update holds
only finite tensors (read back with the safe DCP reader). One tiny run (1 layer, 3 prompts x
2 samples, ~40 s); sys.exit, other returns and "skip" are shown through the same loop code
in-process (tests/unit/test_reliability_rl_hooks.py).
"""

from __future__ import annotations

import os

import pytest
import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from runtime.safe_load import SafeFileSystemReader, safe_dcp_load
from tests.helpers.runs import run_train
from tools.reliability_report import record_case

pytestmark = pytest.mark.slow  # one tiny train.py RL run: ~40 s on 2 loaded cores

RECIPE = "recipes/rl_debug.toml"
TINY = [
    "model.layers=1", "training.seq_len=32", "rl.prompts_per_step=3", "rl.group_size=2",
    "rl.max_new_tokens=3", "rl.sft_warmup_steps=0", "rl.eval_prompts=0",
    "metrics.summary_skip_steps=0", "training.steps=3", "checkpoint.interval=1",
]  # fmt: skip
H = "tests.helpers.rl_hooks"
# The check scores one task before the run, then update 1 scores 3 x 2 samples.
AFTER_ONE_UPDATE = str(1 + 3 * 2)


def _tensors(path) -> dict[str, torch.Tensor]:
    md = SafeFileSystemReader(str(path)).read_metadata().state_dict_metadata
    sd = {k: torch.empty(m.size, dtype=m.properties.dtype)
          for k, m in md.items() if isinstance(m, TensorStorageMetadata)}  # fmt: skip
    safe_dcp_load(sd, str(path))
    return sd


def _run(tmp_path, reward: str, on_error: str):
    os.environ["RL_HOOK_BAD_AFTER"] = AFTER_ONE_UPDATE
    try:
        return run_train(tmp_path, TINY + [f"rl.reward={H}:{reward}", f"rl.on_error={on_error}"],
                         recipe=RECIPE, check=False)  # fmt: skip
    finally:
        os.environ.pop("RL_HOOK_BAD_AFTER")


def test_nan_reward_stops_the_run_in_one_line_with_finite_state(tmp_path):
    reward, needle = "nan_reward", "returned nan"
    p = _run(tmp_path, reward, "fail")
    last = p.stderr.strip().splitlines()[-1]
    assert p.returncode == 2, p.stderr[-2000:]
    assert last.startswith("error: recipes/rl_debug.toml: rl.reward: reward ") and needle in last
    assert "Traceback" not in p.stderr and "on task '" in last
    ckpt = tmp_path / "checkpoint"
    assert (ckpt / "step-1").is_dir() and not (ckpt / "step-2").exists()
    sd = _tensors(ckpt / "step-1")
    assert any("exp_avg" in k for k in sd)  # the optimizer state is in it
    assert all(torch.isfinite(v).all() for v in sd.values() if v.is_floating_point())
    record_case("RL hooks", f"train.py run, {reward} (on_error = fail)")


def test_every_rollout_failing_under_skip_exits_non_zero_without_nan(tmp_path):
    """rl.on_error = "skip" and every reward raising after the check: each update is skipped
    and counted (never a NaN loss), metrics.jsonl is valid JSON, and the run exits 2 in one
    line (it was exit 0 with bare NaN in metrics.jsonl)."""
    import json

    os.environ["RL_HOOK_BAD_AFTER"] = "1"  # the check's one score passes
    try:
        p = run_train(tmp_path, TINY + [f"rl.reward={H}:raising_after", "rl.on_error=skip"],
                      recipe=RECIPE, check=False)  # fmt: skip
    finally:
        os.environ.pop("RL_HOOK_BAD_AFTER")
    last = p.stderr.strip().splitlines()[-1]
    assert p.returncode == 2, p.stderr[-2000:]
    assert last.startswith("error: recipes/rl_debug.toml: rl.on_error: every update") and (
        "Traceback" not in p.stderr
    )
    text = (tmp_path / "metrics.jsonl").read_text()
    assert "NaN" not in text and "Infinity" not in text
    recs = [json.loads(line) for line in text.splitlines() if line.strip()]
    skipped = [r for r in recs if r.get("event") == "rl_update_skipped"]
    assert [r["step"] for r in skipped] == [1, 2, 3]
    assert not [r for r in recs if "loss" in r and r.get("event") is None]
    record_case("RL hooks", "train.py run, every rollout fails (on_error = skip)")
