"""The guard around a post-training loop's steps: what TitanscaleTrainer gives torchtitan's.

`StepGuard` puts each step of the loops that are not torchtitan's Trainer loop ([[adapters]],
RL) under the step watchdog (runtime.watchdog, with the recipe's timeouts), the mid-step
fault seam (runtime.faults) and the stop-request / requeue path (launch.stop_request).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from runtime.watchdog import watched_step


class StepGuard:
    """The step watchdog, the mid-step fault seam and the stop-request check around a loop's
    steps (what TitanscaleTrainer gives torchtitan's loop), with the recipe's timeouts.
    `groups`: mesh name -> ranks, named in a collective-timeout diagnosis."""

    def __init__(
        self, recipe: Any, *, groups: dict[str, list[int]] | None = None, device: Any = None
    ) -> None:
        from core.launch_env import launch_env
        from launch.stop_request import StopRequest
        from recipe.loader import first_step_timeout_s
        from runtime.watchdog import StepWatchdog, default_store

        dist = torch.distributed
        on = dist.is_available() and dist.is_initialized()
        self.world = dist.get_world_size() if on else 1
        self.device = device
        self.watchdog = StepWatchdog(
            rank=dist.get_rank() if on else 0,
            world_size=self.world,
            timeout_s=recipe.job.collective_timeout_s,
            first_timeout_s=first_step_timeout_s(recipe),
            groups=groups or {"world": list(range(self.world))},
            store=default_store(),
            attempt=launch_env().restart_count,
        ).start()
        self.stop_request = StopRequest()

    @contextlib.contextmanager
    def step(self, n: int) -> Iterator[None]:
        """One step under the watchdog; the fault seam fires first (tests only)."""
        from runtime import faults

        with watched_step(self.watchdog, n, self.world):
            faults.inject("step", n)
            yield

    def stop_here(self, n: int, save: Callable[[], bool]) -> bool:
        """At a step boundary (collective when it checks: every rank, every boundary): if
        the launcher asked to stop and `save()` wrote a resumable checkpoint, record it for
        the job script (<stop file>.saved: requeue) and return True."""
        req = self.stop_request
        if not (req.enabled and req.requested(self.device)) or not save():
            return False
        req.acknowledge(n)
        return True

    def close(self) -> None:
        self.watchdog.stop()
