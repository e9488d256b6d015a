"""Checkpoint and stop when the launcher asks (the job is near its Slurm time limit).

The sbatch script's SIGUSR1 trap creates the file named by ``$TITANSCALE_STOP_FILE``. All
ranks must stop after the same step (a rank that leaves alone hangs the others in their
next collective), so a check all-reduces (MAX) every rank's "the file exists" flag over the
world. A check is not free on a GPU: besides the 8-byte all-reduce (tens of microseconds),
reading its result (`.item()`) makes the host wait for the step's queued GPU work, so the
next step's first kernels start late (about the host's launch lead: ~1-5 ms per check,
estimated, unverified on GPUs). So checks run every N steps, N chosen to space them about
`TITANSCALE_STOP_CHECK_S` seconds apart (default 10): at most ~5 ms per 10 s = 0.05% of the
training time, under the 0.1% budget, for any step length (measured with gloo, 2 processes on
2 loaded CPU cores: 1.0 ms per check, i.e. 0.01% at one check per 10 s, where a check every
0.3 s debug step cost 0.3%); the stop then lands at most
~10 s plus one step after the signal (the launcher signals 600 s before the time limit).
Every rank must pick the same N: each check all-reduces the seconds per step since the last
check along with the flag (MAX), and every rank derives N from that same number. The first
check is before the first step (a request that came while the job was queued).
After a full checkpoint is on disk, rank 0 writes ``<stop file>.saved`` so the script knows
to requeue (and not to treat the early exit as the end of training).

`StopOnRequest` is a mixin for torchtitan's Trainer (it overrides the loop's
`should_continue_training` seam):

    class TitanscaleTrainer(StopOnRequest, Trainer): ...
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from core.launch_env import launch_env

ENV = "TITANSCALE_STOP_FILE"


ENV_CHECK_S = "TITANSCALE_STOP_CHECK_S"
DEFAULT_CHECK_S = 10.0
MAX_EVERY = 10_000


def next_interval(seconds_per_step: float, check_s: float) -> int:
    """Steps until the next check: about `check_s` apart, at least 1 (pure; the same on every
    rank because `seconds_per_step` is the all-reduced maximum)."""
    if seconds_per_step <= 0:
        return 1
    return max(1, min(MAX_EVERY, int(check_s / seconds_per_step)))


class StopRequest:
    def __init__(self, path: str | None = None, check_s: float | None = None):
        self.path = path if path is not None else os.environ.get(ENV, "")
        if check_s is None:
            check_s = launch_env().stop_check_s
        self.check_s = check_s
        self.every = 1  # steps until the next check; the first call checks
        self._since = 0  # calls since the last check
        self._last_t: float | None = None
        self.checks = 0

    @property
    def enabled(self) -> bool:
        return bool(self.path)

    def local_flag(self) -> bool:
        return bool(self.path) and os.path.exists(self.path)

    def requested(self, device: Any = None) -> bool:
        """True on every rank once any rank sees the stop file (collective when it checks:
        call on every rank at every step boundary)."""
        if not self.enabled:
            return False
        self._since += 1
        if self._since < self.every and self._last_t is not None:
            return False
        now = time.monotonic()
        per_step = (now - self._last_t) / self._since if self._last_t is not None else 0.0
        flag = self.local_flag()
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            import torch

            t = torch.tensor([1.0 if flag else 0.0, per_step], dtype=torch.float64, device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            flag_any, per_step = bool(t[0].item()), float(t[1].item())
        else:
            flag_any = flag
        self.checks += 1
        self.every = next_interval(per_step, self.check_s)
        self._since = 0
        self._last_t = now
        return flag_any

    def acknowledge(self, step: int) -> None:
        """Rank 0 records that a resumable checkpoint of `step` is on disk."""
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
            return
        Path(self.path + ".saved").write_text(f"{step}\n")


def save_full_checkpoint(checkpointer: Any, step: int) -> bool:
    """Save a resumable checkpoint of `step` now (collective). False if checkpointing is off.

    torchtitan forces a save with ``last_step=True``, which writes weights only when
    ``last_save_model_only`` is set; that would not resume, so it is cleared for this save.
    A checkpoint already written for this step (the interval hit it) is kept as is.
    """
    if not getattr(checkpointer, "enable", False):
        return False
    folder = getattr(checkpointer, "folder", "")
    if folder and (Path(folder) / f"step-{step}").is_dir():
        checkpointer.maybe_wait_for_saving()
        return True
    prev = getattr(checkpointer, "last_save_model_only", False)
    checkpointer.last_save_model_only = False
    try:
        return bool(checkpointer.save(step, last_step=True))
    finally:
        checkpointer.last_save_model_only = prev


class StopOnRequest:
    """Trainer mixin: at a step boundary, if the launcher asked, checkpoint and leave the loop."""

    _stop_request: StopRequest | None = None
    _stop_unsaveable_logged = False

    def should_continue_training(self) -> bool:
        if not super().should_continue_training():  # type: ignore[misc]
            return False
        if self._stop_request is None:
            self._stop_request = StopRequest()
        req = self._stop_request
        if not req.enabled or not req.requested(getattr(self, "device", None)):
            return True
        from torchtitan.tools.logging import logger

        step = self.step  # type: ignore[attr-defined]
        if save_full_checkpoint(self.checkpointer, step):  # type: ignore[attr-defined]
            req.acknowledge(step)
            logger.info(f"titanscale: stop requested ({req.path}); checkpoint of step {step} saved")
            return False
        if not self._stop_unsaveable_logged:
            # Without a checkpoint, stopping early would only lose the steps since the start;
            # keep training until the time limit (the job script requeues anyway).
            logger.warning("titanscale: stop requested but checkpointing is off; continuing")
            self._stop_unsaveable_logged = True
        return True
