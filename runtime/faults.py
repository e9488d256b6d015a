"""Test-only fault injection: make one rank die or hang at a chosen step, on purpose.

    TITANSCALE_FAULT="kill:rank=1:step=5"             SIGKILL rank 1 in the middle of step 5
    TITANSCALE_FAULT="hang:rank=1:step=3"             rank 1 stops answering in step 3
    TITANSCALE_FAULT="kill:rank=0:step=4:at=save"     die while the step-4 checkpoint is written
    TITANSCALE_FAULT="kill:rank=1:step=5,hang:rank=0:step=9"   several, comma-separated
    TITANSCALE_FAULT="stop:step=2"                   the launcher's stop request arrives in
                                                     step 2 (what SIGUSR1 does in job.sbatch)
    TITANSCALE_FAULT="kill:step=2:at=shard"          tools.prepare_data dies once its shard 2
                                                     is durable (step = the shard's number)
    TITANSCALE_FAULT="slow:rank=1:step=1:at=batch:seconds=0.5"   rank 1 sleeps 0.5 s in every
                                                     step from step 1 on (a straggler)

Fields: `rank` (global rank; omitted = every rank), `step` (required), `at` = `step`
(mid-step: after the batch is fetched and the token count all-reduced, before forward and
backward), `save` (after the checkpoint's data is written, before it is committed) or
`shard` (tools.prepare_data, after shard `step` of a token store is written and recorded) or
`batch` (after the step's batches are fetched, before its first collective), `seconds` (slow:
the sleep, default 1), and `restart` (the torchelastic restart count on which to fire; default 0, so a job restarted
by `torchrun --max-restarts` does not fault again). `stop` creates the file named by
$TITANSCALE_STOP_FILE (launch.stop_request), as the batch script's SIGUSR1 trap does, so
the run checkpoints and stops at its next stop check: a deterministic requeue in tests.

Unset (the normal case) costs one list test per seam. A malformed value is a ConfigError
before training (`runtime.session.prepare`). The seams are
`TitanscaleTrainer.forward_backward_step`, `runtime.step_guard.StepGuard.step` (the post-training
loops), `AtomicCheckpointManager.dcp_save` and tools.prepare_data's `on_shard`.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass

from core.launch_env import launch_env

ENV = "TITANSCALE_FAULT"
KINDS = ("kill", "hang", "stop", "slow")
POINTS = ("step", "save", "shard", "batch")


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    rank: int | None = None
    at: str = "step"
    restart: int = 0
    seconds: float = 1.0

    def matches(self, point: str, step: int, rank: int, restart: int) -> bool:
        return (
            self.at == point
            # slow fires in every step from `step` on; the others once
            and (self.step == step or (self.kind == "slow" and step > self.step))
            and self.restart == restart
            and (self.rank is None or self.rank == rank)
        )


def parse(spec: str) -> list[Fault]:
    """Parse a TITANSCALE_FAULT value; ValueError says what is wrong."""
    faults = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        kind, *fields = item.split(":")
        if kind not in KINDS:
            raise ValueError(f"fault {item!r}: kind must be one of {', '.join(KINDS)}")
        kv: dict[str, str] = {}
        for f in fields:
            k, sep, v = f.partition("=")
            if not sep or k not in ("rank", "step", "at", "restart", "seconds"):
                raise ValueError(
                    f"fault {item!r}: expected rank=, step=, at=, restart= or seconds="
                )
            kv[k] = v
        if "step" not in kv:
            raise ValueError(f"fault {item!r}: step= is required")
        try:
            seconds_ok = 0 <= float(kv.get("seconds", "1")) <= 3600  # nan fails
        except ValueError:
            seconds_ok = False
        if not seconds_ok:
            raise ValueError(f"fault {item!r}: seconds must be a number in [0, 3600]")
        at = kv.get("at", "step")
        if at not in POINTS:
            raise ValueError(f"fault {item!r}: at must be one of {', '.join(POINTS)}")
        try:
            faults.append(
                Fault(
                    kind=kind,
                    step=int(kv["step"]),
                    rank=int(kv["rank"]) if "rank" in kv else None,
                    at=at,
                    restart=int(kv.get("restart", "0")),
                    seconds=float(kv.get("seconds", "1")),
                )
            )
        except ValueError:
            raise ValueError(
                f"fault {item!r}: rank, step and restart are integers, seconds a number"
            ) from None
    return faults


_FAULTS: list[Fault] | None = None


def active() -> list[Fault]:
    """The faults of this process's environment (parsed once; ValueError if malformed)."""
    global _FAULTS
    if _FAULTS is None:
        _FAULTS = parse(os.environ.get(ENV, ""))
    return _FAULTS


def check() -> None:
    """TITANSCALE_FAULT parsed now: a malformed value is one ConfigError naming the variable
    (train.py's prepare and tools.prepare_data call this before any work)."""
    from core.errors import ConfigError

    try:
        active()
    except ValueError as e:
        raise ConfigError(str(e), file="environment", key=ENV) from None


def inject(point: str, step: int) -> None:
    """Fire the faults set for this rank, `point` and `step` (no-op when none are set)."""
    faults = _FAULTS if _FAULTS is not None else active()
    if not faults:
        return
    env = launch_env()
    rank, restart = env.rank, env.restart_count
    for f in faults:
        if not f.matches(point, step, rank, restart):
            continue
        where = {
            "step": f"in step {step}",
            "save": f"in the step-{step} checkpoint save",
            "shard": f"after token-store shard {step}",
            "batch": f"after the step-{step} batches",
        }[point]
        print(
            f"titanscale fault injection: {f.kind} rank {rank} {where}",
            file=sys.stderr,
            flush=True,
        )
        if f.kind == "kill":
            # SIGKILL: no exception handlers, no atexit, no flush, like a node losing power
            # or the OOM killer.
            os.kill(os.getpid(), signal.SIGKILL)
        if f.kind == "slow":
            time.sleep(f.seconds)
            continue
        if f.kind == "stop":
            from pathlib import Path

            from launch.stop_request import ENV as STOP_ENV

            path = os.environ.get(STOP_ENV, "")
            if path:
                Path(path).touch()
            continue
        if f.kind == "hang":
            # Stops answering without dying; sleeps in short slices so that a watchdog
            # thread can still run and report where this rank is.
            while True:
                time.sleep(0.5)
