"""A bad reward in a real RL run (python train.py): one line, exit 2, no NaN saved.

Before: a NaN reward trained (loss nan) and saved a checkpoint whose optimizer state was
NaN, exit 0; a reward calling sys.exit(3) ended the run with exit 3 and no line. Now, with
rl.on_error = "fail", the first bad reward stops the run: the last stderr line names the
reward and the task, the exit code is 2, and the checkpoint of the last good update holds
only finite tensors (read back with the safe DCP reader); on two ranks (tools.torchrun) where
only one rank's reward fails, the job still ends in that one line. Tiny runs (1 layer, 3
prompts x 2 samples per rank, ~40-60 s); sys.exit, other returns and "skip" are shown
through the same loop code in-process (tests/unit/test_reliability_rl_hooks.py).
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


@pytest.mark.multiproc
def test_nan_reward_on_one_rank_stops_the_run_in_one_line_with_finite_state(tmp_path):
    """Two ranks under the README's launcher (tools.torchrun); each rank scores its own
    prompts, and only rank 0's reward turns NaN (at update 2) while rank 1 goes on into the
    update's collectives. The job ends with rank 0's one line, once, and exit 2: no
    traceback from either rank or from torchrun (it printed rank 0's traceback first)."""
    reward, needle = "nan_reward", "returned nan"
    os.environ.update(RL_HOOK_BAD_AFTER=AFTER_ONE_UPDATE, RL_HOOK_BAD_RANK="0")
    try:
        p = run_train(tmp_path, TINY + [f"rl.reward={H}:{reward}", "rl.on_error=fail"],
                      recipe=RECIPE, check=False, nproc=2, launcher="tools.torchrun")  # fmt: skip
    finally:
        os.environ.pop("RL_HOOK_BAD_AFTER")
        os.environ.pop("RL_HOOK_BAD_RANK")
    lines = [ln for ln in p.stderr.strip().splitlines() if ln.strip()]
    assert p.returncode == 2, p.stderr[-3000:]
    assert len([ln for ln in lines if ln.startswith(("error:", "torchrun:"))]) == 1, lines[-10:]
    last = lines[-1]
    assert last.startswith("error: recipes/rl_debug.toml: rl.reward: reward ") and needle in last
    assert "Traceback" not in p.stderr and "on task '" in last
    ckpt = tmp_path / "checkpoint"
    assert (ckpt / "step-1").is_dir() and not (ckpt / "step-2").exists()
    sd = _tensors(ckpt / "step-1")
    assert any("exp_avg" in k for k in sd)  # the optimizer state is in it
    assert all(torch.isfinite(v).all() for v in sd.values() if v.is_floating_point())
    record_case("RL hooks", f"train.py run on 2 ranks, {reward} on rank 0 (on_error = fail)")


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
