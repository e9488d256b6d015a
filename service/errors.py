"""The service's one error type: a request the client got wrong (4xx) or a state it cannot use.

`ServiceError` carries the HTTP status and a one-line message naming the field or object;
it never carries a traceback or a server path to the client. Errors inside a queued
operation fail that operation's future instead (category "user" for a 4xx `ServiceError`,
"server" otherwise).

Also here, because every layer needs them: `log_safe` (a client string made safe for a log
line: no newline can forge a record) and `scrub_paths` (a server-side exception message with
its absolute paths removed before it reaches a client).
"""

from __future__ import annotations

import re


class ServiceError(Exception):
    """A client-facing error: `status` is the HTTP code, `message` one line naming the field.

    `retry_after` (seconds) goes out as a Retry-After header (429 answers)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        field: str | None = None,
        retry_after: int | None = None,
    ):
        self.status = status
        self.field = field
        self.retry_after = retry_after
        self.message = f"{field}: {message}" if field else message
        super().__init__(self.message)


def bad_request(field: str, message: str) -> ServiceError:
    return ServiceError(400, message, field=field)


def not_found(what: str, field: str | None = None) -> ServiceError:
    """404: the same answer for an object that does not exist and for another tenant's."""
    return ServiceError(404, f"{what} not found", field=field)


_UNSAFE = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029\\]")


def log_safe(value: object, limit: int = 200) -> str:
    """A client-supplied string for a log line: control characters (newline, CR, escape ...)
    and backslashes escaped, so a value can never start a new (forged) record, and cut to
    `limit` characters."""
    s = str(value)
    if len(s) > limit:
        s = s[:limit] + "..."
    return _UNSAFE.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), s)


# An absolute path inside an exception message: a '/' that starts a word (not the '//' of a
# tinker:// URL, not inside a relative path), up to whitespace or a quote.
_PATH = re.compile(r"(?<![\w:/.~-])(?:[A-Za-z]:)?/[^\s'\"]*")


def scrub_paths(message: str, roots: tuple[str, ...] = ()) -> str:
    """An exception message for a client: the server's folders in `roots` (e.g. the storage
    root, which may hold spaces) and any other absolute path replaced by `<path>`."""
    for r in sorted(roots, key=len, reverse=True):
        if r:
            message = message.replace(r, "<path>")
    return _PATH.sub("<path>", message)
