"""Per-op deadlines in a single-process service: the worker runs each op under a deadline
priced from the same model admission uses, and the backend's long loops check it.

The one worker thread runs every op, so an op that runs for ever holds every tenant's work
(200,000 stop strings held it 633 s). A thread cannot be killed; the loops that can run long
check cooperatively instead: the generator calls `check()` after each decoded token (one
clock read). Past its deadline the op fails with a 413 naming its price and the deadline
(category "user": the request was larger than the service runs), and the worker takes the
next op; nothing else is touched. Deadline = max(`Limits.op_deadline_min_s`,
`Limits.op_deadline_factor` x the op's priced seconds). A model resource (several processes)
has its own deadline on every rank (`tools.serve --op-timeout`, service/distributed.py) and
does not check this one: a rank leaving a collective early would hang the others.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from service.errors import ServiceError

_current = threading.local()


@dataclass
class Deadline:
    seconds: float
    priced_s: float = 0.0
    clock: Callable[[], float] = time.monotonic
    start: float = 0.0

    def __post_init__(self) -> None:
        self.start = self.clock()

    def check(self) -> None:
        if self.clock() - self.start > self.seconds:
            raise ServiceError(
                413,
                f"this request ran past its deadline of {self.seconds:.0f} s (priced at "
                f"{self.priced_s:.1f} s) and was stopped; send a smaller one (fewer samples, "
                "tokens or stop sequences)",
            )


def op_deadline(priced_s: float, *, factor: float, min_s: float) -> float:
    return max(min_s, factor * priced_s)


@contextlib.contextmanager
def running(deadline: Deadline | None) -> Iterator[None]:
    """Run the current thread's op under `deadline` (None: none)."""
    _current.deadline = deadline
    try:
        yield
    finally:
        _current.deadline = None


def check() -> None:
    """Raise if the current thread's op is past its deadline (no deadline: nothing)."""
    d = getattr(_current, "deadline", None)
    if d is not None:
        d.check()
