"""Straggler detection: name the rank that keeps the others waiting, without a collective.

What is measured: each rank's *arrival* at the step's first collective (torchtitan's
all-reduce of the step's token count, right after the step's batches are fetched), as wall
time. Everything a rank does between the previous step's last collective and that point is
its own work (optimizer update, checkpoint, data loading, garbage collection, host
hiccups); a rank that arrives late made every other rank wait that long. Its own step time is
the step time minus the wait it did not have: own_r = step_time - (latest arrival - arrival_r).
A rank whose own time exceeds `ratio` x the median of the other ranks' for `steps` logged
steps in a row is named (metrics.jsonl `straggler_rank`, a warning in the log). Its lateness is its arrival after the
median of the other ranks'.

Cost, off the collective path: on logged steps each rank writes one small key to the job's
c10d store (a TCP message to rank 0's store, no waiting for peers) before that collective;
after the step, the metrics rank reads world_size keys (all written before the collective it
has since passed). Arrival times are wall clocks: across hosts, their NTP skew (typically
under a millisecond) adds to the lateness.

Not seen: slowness inside forward/backward (a throttled GPU) is absorbed into the collectives
that every rank waits in; with CUDA its kernels run asynchronously from the host timeline.
docs/fault_tolerance.md lists this.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any


def own_step_times(arrivals: dict[int, float], step_time_s: float) -> dict[int, float]:
    """Each rank's step time without the wait for the latest rank."""
    latest = max(arrivals.values())
    return {r: step_time_s - (latest - t) for r, t in arrivals.items()}


@dataclass
class StragglerDetector:
    """Pure: fed one logged step at a time (arrival wall time per rank, the step time)."""

    ratio: float
    steps: int
    _streak: dict[int, int] = field(default_factory=dict)
    named: int | None = None

    def observe(self, arrivals: dict[int, float], step_time_s: float) -> dict[str, Any]:
        """The metrics of one logged step: the slowest rank, its own time over the median of
        the others', and `straggler_rank` once a rank has been over the ratio for `steps`
        logged steps in a row (-1 when none)."""
        if len(arrivals) < 2 or step_time_s <= 0:
            return {}
        own = own_step_times(arrivals, step_time_s)
        slowest = max(own, key=lambda r: own[r])
        others = statistics.median(v for r, v in own.items() if r != slowest)
        ratio = own[slowest] / others if others > 0 else float("inf")
        over = self.ratio > 0 and ratio > self.ratio
        self._streak = {slowest: self._streak.get(slowest, 0) + 1} if over else {}
        named = slowest if over and self._streak[slowest] >= self.steps else None
        self.named = named
        return {
            "slowest_rank": slowest,
            "slowest_rank_ratio": round(ratio, 3) if ratio != float("inf") else 1e9,
            "slowest_rank_lateness_s": round(
                arrivals[slowest]
                - statistics.median(t for r, t in arrivals.items() if r != slowest),
                4,
            ),
            "straggler_rank": -1 if named is None else named,
        }


def _key(attempt: int, slot: int, rank: int) -> str:
    return f"titanscale/arrival/{attempt}/{slot}/{rank}"


class Arrivals:
    """Publishes this rank's arrival (logged steps only) and, on the metrics rank, reads
    every rank's. `store`: the job's c10d store (None: nothing is published or read)."""

    def __init__(
        self, store: Any, rank: int, world_size: int, attempt: int, log_every: int
    ) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.attempt = attempt
        self.log_every = log_every

    def _slot(self, step: int) -> int:
        # Two slots, alternating per logged step: a rank can publish the next logged step
        # (before its first collective) while the metrics rank still reads this one, never
        # two ahead. The store holds 2 x world_size keys at most.
        return (step // self.log_every) % 2

    def publish(self, step: int) -> None:
        if self.store is None:
            return
        try:
            key = _key(self.attempt, self._slot(step), self.rank)
            self.store.set(key, f"{step} {time.time():.6f}")
        except Exception:  # the store lives on rank 0's host; a lost store is not fatal here
            self.store = None

    def read(self, step: int) -> dict[int, float]:
        """Arrivals of `step` (ranks that published another step are left out)."""
        out: dict[int, float] = {}
        if self.store is None:
            return out
        try:
            keys = [_key(self.attempt, self._slot(step), r) for r in range(self.world_size)]
            if not self.store.check(keys):  # get would wait for a key never written
                return out
            for r, raw in enumerate(self.store.multi_get(keys)):
                s, t = raw.decode().split()
                if int(s) == step:
                    out[r] = float(t)
        except Exception:
            return {}
        return out
