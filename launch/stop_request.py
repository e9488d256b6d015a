"""Checkpoint and stop when the launcher asks (the job is near its Slurm time limit).

The sbatch script's SIGUSR1 trap creates the file named by ``$TITANSCALE_STOP_FILE``. All
ranks must stop after the same step (a rank that leaves alone hangs the others in their
next collective), so each check all-reduces (MAX) every rank's "the file exists" flag over
the world: one 4-byte all-reduce per check, microseconds next to a training step. After a
full checkpoint is on disk, rank 0 writes ``<stop file>.saved`` so the script knows to
requeue (and not to treat the early exit as the end of training).

`StopOnRequest` is a mixin for torchtitan's Trainer (it overrides the loop's
`should_continue_training` seam):

    class TitanscaleTrainer(StopOnRequest, Trainer): ...
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

ENV = "TITANSCALE_STOP_FILE"


class StopRequest:
    def __init__(self, path: str | None = None, every: int = 1):
        self.path = path if path is not None else os.environ.get(ENV, "")
        self.every = max(1, every)
        self._calls = 0

    @property
    def enabled(self) -> bool:
        return bool(self.path)

    def local_flag(self) -> bool:
        return bool(self.path) and os.path.exists(self.path)

    def requested(self, device: Any = None) -> bool:
        """True on every rank once any rank sees the stop file (collective: call on all)."""
        if not self.enabled:
            return False
        self._calls += 1
        if self._calls % self.every:
            return False
        import torch
        import torch.distributed as dist

        flag = self.local_flag()
        if not (dist.is_available() and dist.is_initialized()):
            return flag
        t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

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
