"""The one error type for bad input (recipes, cluster profiles, --set overrides, claims files).

Every tool catches `ConfigError` at its entry point, prints the message and exits with
code 2 (`exit_on_config_error`), before any process group starts. The message always names
the file and the dotted key (or the file position for TOML syntax errors).
"""

from __future__ import annotations

import contextlib
import difflib
import os
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator
from functools import wraps
from typing import Any, TypeVar

from core.atomic import write_text_atomic

EXIT_BAD_INPUT = 2
# Set by tools.torchrun for the ranks it starts: a rank hands its one-line message over as a
# file in this folder instead of printing it, and the wrapper prints each distinct one once.
HANDOVER_DIR_ENV = "TITANSCALE_ERROR_DIR"
HANDOVER_PID_ENV = "TITANSCALE_ERROR_DIR_PID"  # the wrapper's pid: only its own children


class ConfigError(ValueError):
    """Bad user input: names the file and the dotted key, and says what was expected."""

    def __init__(self, message: str, *, file: str | None = None, key: str | None = None):
        self.file = file
        self.key = key
        self.detail = message
        where = ""
        if file:
            where += f"{file}: "
        if key:
            where += f"{key}: "
        # One line, always: a file name, key or value from user input may hold a newline
        # (a TOML key "FOO\n", a path), which would otherwise split the message.
        super().__init__(one_line(where + message))


def _handover_dir() -> str | None:
    """The hand-over folder when this process's parent is the tools.torchrun that set it
    (a grandchild inherits the variables but is not the wrapper's rank), else None."""
    folder = os.environ.get(HANDOVER_DIR_ENV)
    if not folder or os.environ.get(HANDOVER_PID_ENV) != str(os.getppid()):
        return None
    return folder


def hand_over(line: str) -> bool:
    """Under tools.torchrun (this process's parent set HANDOVER_DIR_ENV): write the message
    for the wrapper to print once; False (print it yourself) anywhere else or if that fails."""
    folder = _handover_dir()
    if folder is None:
        return False
    rank = os.environ.get("RANK", "")
    rank = rank if rank.isdigit() else "x"
    try:
        write_text_atomic(os.path.join(folder, f"rank-{rank}-{os.getpid()}.txt"), line + "\n")
    except OSError:
        return False
    return True


def reported_elsewhere(wait_s: float = 1.0) -> bool:
    """Under tools.torchrun: True when another rank of the job has handed over its one-line
    message (a bad input or a failed user hook found mid-run). This rank's own failure is
    then that rank's consequence (a collective whose peer exited: gloo's "Connection closed
    by peer"), and its traceback would bury the one line. Polls up to `wait_s` (the peer
    writes its message before it exits, so it is normally there at once)."""
    import time

    folder = _handover_dir()
    if folder is None:
        return False
    mine = f"-{os.getpid()}.txt"
    end = time.monotonic() + wait_s
    while True:
        try:
            if any(n.startswith("rank-") and not n.endswith(mine) for n in os.listdir(folder)):
                return True
        except OSError:
            return False
        if time.monotonic() >= end:
            return False
        time.sleep(0.05)


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """A ' (did you mean 'x'?)' hint, or '' when nothing is close."""
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def one_line(text: str) -> str:
    """`text` with every non-printable character (newline, NUL, U+2028 ...) escaped."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def shown(value: str, limit: int = 60) -> str:
    """A user's value as it may appear in a one-line message: repr (newlines, NULs and line
    separators escaped), cut to `limit` characters."""
    r = repr(value)  # escapes every non-printable character, U+2028 and U+0085 included
    return r if len(r) <= limit else r[: limit - 4] + "...'"


F = TypeVar("F", bound=Callable[..., Any])


def exit_on_config_error(fn: F) -> F:
    """Decorate a CLI `main`: a ConfigError becomes one line on stderr and exit code 2.
    Under tools.torchrun, any other exception on a rank after another rank handed over its
    one line (`reported_elsewhere`) exits 2 quietly too: the job ends in that one line
    (tools.torchrun prints it once), not in this rank's traceback of the broken collective."""

    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except ConfigError as e:
            line = f"error: {e}"
            if not hand_over(line):
                print(line, file=sys.stderr)
            raise SystemExit(EXIT_BAD_INPUT) from None
        except Exception:
            if reported_elsewhere():
                raise SystemExit(EXIT_BAD_INPUT) from None
            raise

    return wrapper  # type: ignore[return-value]


@contextlib.contextmanager
def held_stderr() -> Iterator[None]:
    """Hold everything written to stderr (file descriptor 2: Python warnings, torch's import-
    time log lines, C++ messages) while bad input may still be found. On success it is written
    out afterwards, in order; on a ConfigError it is dropped, so the user's stderr holds only
    our one line. Cost: a temporary file for the import and check phase (a few KB).
    Any other exception writes it out too (context for the traceback)."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):  # no usable fd 2: nothing to hold
        yield
        return
    with tempfile.TemporaryFile() as hold:
        os.dup2(hold.fileno(), 2)
        replay = True
        try:
            yield
        except ConfigError:
            replay = False
            raise
        finally:
            with contextlib.suppress(OSError, ValueError):
                sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            if replay:
                hold.seek(0)
                while chunk := hold.read(1 << 16):
                    os.write(2, chunk)
