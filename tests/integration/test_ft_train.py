"""train.py under torchft replica groups, started by `tools.launch --local`: 2 groups x 2
gloo ranks train the debug recipe; group 1 (its torchrun and both ranks) is SIGKILLed mid-run;
group 0 keeps stepping in the same process, its step counter never going back; the launcher
restarts group 1 alone, which heals from group 0 (its first step is the live step, not 1);
both end with bit-identical shards, rank by rank (each rank's digest of its parameters and
optimizer state), the full checkpoint is an ordinary verified DCP checkpoint, and the
final held-out loss is a failure-free run's within the tolerance docs/fault_tolerance.md
states.

The arithmetic of the steps a group trains alone (the global batch shrinks to the live
groups' share, nothing is applied twice) is replayed exactly in test_torchft_gloo.py with a
tiny model; this test is the train.py path end to end (docs/fault_tolerance.md).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.helpers.runs import ROOT, child_env

STEPS = 40
# Every rank sleeps 0.5 s per step (runtime.faults' straggler seam): the restarted group
# takes about 25 s to start here, and group 0 must still be training when it comes back.
PACE = "slow:step=1:at=batch:seconds=0.5"
SETS = [
    "fault_tolerance.enabled=true",
    "fault_tolerance.replica_groups=2",
    "fault_tolerance.quorum_timeout_s=20",
    "training.seq_len=64",
    f"training.steps={STEPS}",
    "metrics.tensorboard=false",
    "metrics.summary_skip_steps=1",
    # Held-out loss at the last step, printed beside a failure-free run's (docs).
    "validation.enable=true",
    f"validation.every={STEPS}",
    "validation.steps=8",
]


# Held-out loss (8 validation batches) of a failure-free run of the same settings
# (tools.launch --local, no kill; 2026-12-05, torch 2.14.1, torchft 0.2.0, torchtitan 0.3.0):
# 8.03544 at step 1 (before any update: checks these settings still describe that run) and
# 6.03594 at step 40. A run with a kill may differ by the steps a group trained alone
# (docs/fault_tolerance.md states the bound: 3%; measured -0.5% with 21 steps alone).
VAL_STEP1 = 8.03544
VAL_FAILURE_FREE = 6.03594
VAL_TOLERANCE = 0.03


def _rows(out: Path, g: int) -> list[dict]:
    path = out / f"replica_{g}" / "metrics.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a line being written
    return rows


def _steps(rows: list[dict]) -> list[int]:
    return [r["step"] for r in rows if "step" in r and "loss" in r]


def _group_pids(token: str, group: int) -> list[int]:
    """This test's processes of replica group `group` (torchrun and its ranks), found by the
    environment the launcher gave them: nobody else's process is touched."""
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            env = (d / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"FT_TEST_TOKEN={token}".encode() in env and f"REPLICA_GROUP_ID={group}".encode() in env:
            pids.append(int(d.name))
    return pids


def _wait(cond, timeout: float, what: str, out: Path, launcher: subprocess.Popen) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end or launcher.poll() is not None:
            logs = "\n".join(
                (out / f"replica_{g}" / "torchrun.log").read_text()[-2500:]
                for g in (0, 1)
                if (out / f"replica_{g}" / "torchrun.log").exists()
            )
            raise AssertionError(f"{what}: not reached (launcher rc {launcher.poll()})\n{logs}")
        time.sleep(0.2)


@pytest.mark.multiproc
@pytest.mark.slow
def test_kill_one_replica_group_of_train_py(tmp_path):
    token = uuid.uuid4().hex
    env = child_env()
    env["FT_TEST_TOKEN"] = token
    env["TITANSCALE_FAULT"] = PACE
    cmd = [sys.executable, "-m", "tools.launch", "--local", "--recipe", "recipes/debug.toml",
           "--nproc-per-group", "2",
           "--out", str(tmp_path)] + [a for s in SETS for a in ("--set", s)]  # fmt: skip
    log = open(tmp_path / "launcher.log", "w")  # noqa: SIM115
    launcher = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
    try:
        _wait(lambda: any(s >= 2 for s in _steps(_rows(tmp_path, 1))), 240, "group 1 at step 2",
              tmp_path, launcher)  # fmt: skip
        for pid in _group_pids(token, 1):
            os.kill(pid, signal.SIGKILL)
        killed_at = max(_steps(_rows(tmp_path, 1)))
        # The launcher restarts group 1 alone; its second start trains a step.
        _wait(lambda: sum(r.get("event") == "start" for r in _rows(tmp_path, 1)) == 2
              and _steps(_rows(tmp_path, 1))[-1] > killed_at, 240, "group 1 to rejoin",
              tmp_path, launcher)  # fmt: skip
        assert launcher.wait(timeout=300) == 0, (tmp_path / "launcher.log").read_text()
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGTERM)
            launcher.wait(timeout=60)
        for g in (0, 1):
            for pid in _group_pids(token, g):
                os.kill(pid, signal.SIGKILL)

    g0, g1 = _rows(tmp_path, 0), _rows(tmp_path, 1)
    # Group 0 ran in one process from start to end, its step counter never going back.
    assert sum(r.get("event") == "start" for r in g0) == 1
    steps0 = _steps(g0)
    assert steps0 == sorted(set(steps0)) and steps0[-1] == STEPS, steps0
    # Group 1 healed from group 0: its restart went on from the live step, not step 1.
    restart = max(i for i, r in enumerate(g1) if r.get("event") == "start")
    rejoined = _steps(g1[restart:])[0]
    assert rejoined > killed_at + 1, (killed_at, rejoined)
    # Group 0 kept stepping while group 1 was down (steps it logged between the two).
    assert [s for s in steps0 if killed_at < s < rejoined]
    # Both groups end bit-identical, rank by rank.
    for r in (0, 1):
        d0, d1 = (json.loads((tmp_path / f"replica_{g}" / f"state_digest_rank{r}.json")
                             .read_text()) for g in (0, 1))  # fmt: skip
        assert d0["step"] == d1["step"] == STEPS
        assert d0 == d1, r
    # The full checkpoint (written by one group) is an ordinary verified DCP checkpoint.
    from runtime.checkpoint import verify_checkpoint

    final = tmp_path / "checkpoint" / f"step-{STEPS}"
    assert verify_checkpoint(str(final), checksums=True) == []
    # The final held-out loss is the failure-free run's within the stated tolerance.
    val = {r["step"]: r["val_loss"] for r in g0 if r.get("event") == "validation"}
    assert val[1] == pytest.approx(VAL_STEP1, abs=1e-4)
    assert val[STEPS] == pytest.approx(VAL_FAILURE_FREE, rel=VAL_TOLERANCE), val
    print(f"group 1 killed after step {killed_at}, rejoined at step {rejoined}; group 0 alone "
          f"for {rejoined - killed_at - 1} steps; held-out loss {val[STEPS]:.5f} (failure-free "
          f"{VAL_FAILURE_FREE})")  # fmt: skip
