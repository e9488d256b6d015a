"""A SIGALRM deadline around a call that must answer (the bug under test was a hang)."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def alarm_guard(seconds: float) -> Iterator[None]:
    """Raise TimeoutError in the main thread when the body runs longer than `seconds`."""

    def boom(*_):
        raise TimeoutError(f"no answer within {seconds} s (a hang)")

    old = signal.signal(signal.SIGALRM, boom)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
