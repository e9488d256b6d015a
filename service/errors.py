"""The service's one error type: a request the client got wrong (4xx) or a state it cannot use.

`ServiceError` carries the HTTP status and a one-line message naming the field or object;
it never carries a traceback to the client. Errors inside a queued operation fail that
operation's future instead (category "user" for a `ServiceError`, "server" otherwise).
"""

from __future__ import annotations


class ServiceError(Exception):
    """A client-facing error: `status` is the HTTP code, `message` one line naming the field."""

    def __init__(self, status: int, message: str, *, field: str | None = None):
        self.status = status
        self.field = field
        self.message = f"{field}: {message}" if field else message
        super().__init__(self.message)


def bad_request(field: str, message: str) -> ServiceError:
    return ServiceError(400, message, field=field)


def not_found(what: str) -> ServiceError:
    return ServiceError(404, f"{what} not found")
