"""A rank that stops answering ends the job, with a message naming it and its groups.

Collectives already time out (`job.collective_timeout_s`, set on every process group), but
their errors say only "Timed out waiting 5000ms for recv operation" on the ranks that
waited, and the launcher then blames the rank that raised first. The watchdog adds who:

- The training loop marks each `train_step` begin and end. A daemon thread per rank
  notices a step running longer than max(timeout, STEP_SLACK x the longest step so far)
  (the first step of a process gets `job.init_timeout_s`: compilation, first
  collectives) and looks at where the main thread is. Its innermost frames under `torch/distributed` mean "waiting for peers";
  anything else means "this rank is not answering" (a hang in our code, a data read, a
  kernel that never finishes...).
- It publishes that report in the job's c10d store, which needs no collective.
- A rank that is not answering logs the diagnosis and exits with `EXIT_HUNG` (os._exit:
  its main thread cannot be trusted to unwind). A rank waiting in a collective lets the
  collective time out and raise; `TitanscaleTrainer` turns that error into a
  `RankTimeoutError` whose message is the diagnosis. If the collective never raises
  (a backend that ignores timeouts), the thread exits the process after twice the timeout.

A rank whose interpreter is frozen (no thread runs) posts nothing; the others name it as
"sent no report". Cost when healthy: two attribute writes per step and a thread waking
every `min(1 s, timeout / 10)`.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from torchtitan.tools.logging import logger

EXIT_HUNG = 3
# A step may run this many times the longest step seen so far (when that is above the
# collective timeout): a job whose healthy steps take minutes (large gradient accumulation)
# is not killed, and a hung rank is still named, by the others' reports, when the
# collectives time out.
STEP_SLACK = 4
_COLLECTIVE_DIRS = (os.sep + os.path.join("torch", "distributed") + os.sep,)


class RankTimeoutError(RuntimeError):
    """A collective timed out; the message names the rank(s) that stopped answering."""


def looks_like_timeout(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "timed out" in text or "timeout" in text


def main_thread_location(depth: int = 4) -> tuple[str, bool]:
    """(where the main thread is, as 'file:line fn <- ...', whether it waits for peers)."""
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    frames: list[Any] = []
    while frame is not None and len(frames) < 12:
        frames.append(frame)
        frame = frame.f_back
    if not frames:
        return "unknown", False
    waiting = any(any(d in f.f_code.co_filename for d in _COLLECTIVE_DIRS) for f in frames[:depth])

    def short(f) -> str:
        name = f.f_code.co_filename
        for marker in ("site-packages" + os.sep, os.getcwd() + os.sep):
            if marker in name:
                name = name.split(marker, 1)[1]
        return f"{name}:{f.f_lineno} {f.f_code.co_name}"

    return " <- ".join(short(f) for f in frames[:depth]), waiting


class StepWatchdog:
    """Per-rank step watchdog; see the module docstring."""

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        timeout_s: float,
        first_timeout_s: float,
        groups: dict[str, list[int]] | None = None,
        store: Any = None,
        attempt: int = 0,
        grace_s: float | None = None,
        exit_fn: Callable[[int], None] = os._exit,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = float(timeout_s)
        self.first_timeout_s = float(first_timeout_s)
        self.groups = groups or {}
        self.store = store
        self.attempt = attempt
        # How long to wait for the other ranks' reports before concluding.
        self.grace_s = grace_s if grace_s is not None else min(10.0, max(2.0, timeout_s / 2))
        self.exit_fn = exit_fn
        self._step: int | None = None
        self._began = 0.0
        self._completed = 0
        self._longest = 0.0
        self._reported_step: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.last_message: str | None = None

    # --- main thread

    def begin(self, step: int) -> None:
        self._began = time.monotonic()
        self._step = step

    def end(self) -> None:
        if self._completed > 0:  # the first step (compilation, warmup) says nothing
            self._longest = max(self._longest, time.monotonic() - self._began)
        self._step = None
        self._completed += 1

    def disarm(self) -> None:
        """The step ended abnormally (an exception is on its way): stop watching it."""
        self._step = None

    def collective_failed(self, step: int, exc: BaseException) -> str:
        """Main thread, on a collective timeout: publish "I was waiting", return the diagnosis."""
        self._step = None  # disarm: this thread is busy explaining, not hung
        first = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
        rec = {"rank": self.rank, "step": step, "waiting": True, "where": f"collective: {first}"}
        self._store_set(self._key(self.rank), json.dumps(rec))
        return self.diagnose(step)

    def start(self) -> StepWatchdog:
        poll = min(1.0, max(0.05, self.timeout_s / 10))
        self._thread = threading.Thread(
            target=self._run, args=(poll,), name="titanscale-watchdog", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    # --- the thread

    def deadline_s(self) -> float:
        if self._completed == 0:
            return self.first_timeout_s
        return max(self.timeout_s, STEP_SLACK * self._longest)

    def _run(self, poll: float) -> None:
        while not self._stop.wait(poll):
            step = self._step
            if step is None:
                continue
            ran = time.monotonic() - self._began
            limit = self.deadline_s()
            if ran <= limit:
                continue
            if self._reported_step != step:
                self._reported_step = step
                waiting = self._report(step, ran, limit)
                if not waiting:
                    self._die(step)
                    return
            elif ran > 2 * limit + self.grace_s:
                # Waiting in a collective that never times out: end it here.
                self._die(step)
                return

    def _report(self, step: int, ran: float, limit: float) -> bool:
        where, waiting = main_thread_location()
        rec = {"rank": self.rank, "step": step, "ran_s": round(ran, 1), "where": where}
        rec["waiting"] = waiting
        self._store_set(self._key(self.rank), json.dumps(rec))
        state = "waits for its peers in a collective" if waiting else "is not answering"
        logger.error(
            f"titanscale watchdog: rank {self.rank} has been in step {step} for {ran:.1f} s "
            f"(timeout {limit:.0f} s) and {state}; main thread at {where}"
        )
        return waiting

    def _die(self, step: int) -> None:
        msg = self.diagnose(step)
        self.last_message = msg
        logger.error(msg)
        print(msg, file=sys.stderr, flush=True)
        self.exit_fn(EXIT_HUNG)

    # --- the diagnosis (either thread)

    def _key(self, rank: int) -> str:
        return f"titanscale/watchdog/{self.attempt}/{rank}"

    def _store_set(self, key: str, value: str) -> None:
        if self.store is None:
            return
        try:
            self.store.set(key, value)
        except Exception as e:  # the store lives on rank 0's host; it may be gone
            logger.warning(f"titanscale watchdog: cannot publish report: {e}")

    def _reports(self, wait_s: float) -> dict[int, dict[str, Any]]:
        """Reports of all ranks, waiting up to `wait_s` for missing ones."""
        reports: dict[int, dict[str, Any]] = {}
        if self.store is None:
            return reports
        end = time.monotonic() + wait_s
        while True:
            for r in range(self.world_size):
                if r in reports:
                    continue
                try:
                    if self.store.check([self._key(r)]):
                        reports[r] = json.loads(self.store.get(self._key(r)))
                except Exception:
                    pass
            if len(reports) == self.world_size or time.monotonic() >= end:
                return reports
            time.sleep(0.2)

    def diagnose(self, step: int | None = None, wait_s: float | None = None) -> str:
        """One line: who stopped answering and where, who waited, in which groups."""
        reports = self._reports(self.grace_s if wait_s is None else wait_s)
        stuck = {r: rep for r, rep in reports.items() if not rep.get("waiting")}
        silent = [r for r in range(self.world_size) if r not in reports and r != self.rank]
        culprits = sorted([*stuck, *silent])
        waiting = sorted(r for r, rep in reports.items() if rep.get("waiting"))
        step_s = f" in step {step}" if step is not None else ""
        ranks_s = ", ".join(map(str, culprits))
        if not culprits:
            head = f"titanscale: a collective timed out{step_s}; every rank waits for its peers"
        else:
            details = [
                f"rank {r} at {' <- '.join(stuck[r]['where'].split(' <- ')[:2])}"
                if r in stuck
                else f"rank {r} sent no report (dead or frozen)"
                for r in culprits
            ]
            head = f"titanscale: rank {ranks_s} stopped answering{step_s} ({'; '.join(details)})"
        if waiting:
            head += f"; rank {', '.join(map(str, waiting))} waited for it in a collective"
        groups = [
            f"{name} {ranks}"
            for name, ranks in sorted(self.groups.items())
            if any(r in ranks for r in culprits) or not culprits
        ]
        if groups:
            head += f"; groups with rank {ranks_s or self.rank}: " + ", ".join(groups)
        key = "job.init_timeout_s" if self._completed == 0 else "job.collective_timeout_s"
        return head + f"; timeout {self.deadline_s():.0f} s ({key})"


def default_store() -> Any:
    """The job's c10d store (rank 0's TCPStore), or None outside a process group."""
    try:
        import torch.distributed as dist

        if not dist.is_initialized():
            return None
        return dist.distributed_c10d._get_default_store()
    except Exception:
        return None


@contextlib.contextmanager
def watched_step(watchdog: Any, n: int, world_size: int) -> Iterator[None]:
    """Mark step `n` for the watchdog; a collective timeout on several ranks becomes a
    RankTimeoutError naming the rank that stopped answering (runtime.watchdog)."""
    watchdog.begin(n)
    try:
        yield
    except Exception as e:
        watchdog.disarm()  # an exception is on its way: not a hang
        if world_size > 1 and looks_like_timeout(e):
            msg = watchdog.collective_failed(n, e)
            logger.error(msg)
            raise RankTimeoutError(msg) from e
        raise
    watchdog.end()
