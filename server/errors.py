"""Refusals as kinds that belong to no transport; each transport maps a kind to its own status.

The kinds are the protocol's canonical statuses (the gRPC code names, which metrics and the stop line
also use), so a message and its kind read the same whichever transport carried the request.
"""

from __future__ import annotations

import enum


class ErrorKind(enum.Enum):
    INVALID_ARGUMENT = enum.auto()  # malformed: a wrong shape, datatype, name or value
    NOT_FOUND = enum.auto()  # no such model or version
    RESOURCE_EXHAUSTED = enum.auto()  # over a limit, or the queue or memory budget is full: retry later
    UNAVAILABLE = enum.auto()  # loading, unloading or shutting down: retry (elsewhere)
    DEADLINE_EXCEEDED = enum.auto()
    FAILED_PRECONDITION = enum.auto()  # the server's configuration forbids it (e.g. the model control mode)
    PERMISSION_DENIED = enum.auto()  # not from where it is allowed (shared memory from another host)
    ALREADY_EXISTS = enum.auto()  # a name already taken (a shared-memory region)
    UNIMPLEMENTED = enum.auto()  # a part of the protocol this server does not offer (CUDA shared memory)
    CANCELLED = enum.auto()  # the client went away before its request was read: its doing, not the server's
    INTERNAL = enum.auto()


# The REST transport's status for each kind (the HTTP server span's status code too).
HTTP_STATUS = {
    ErrorKind.INVALID_ARGUMENT: 400,
    ErrorKind.FAILED_PRECONDITION: 400,
    ErrorKind.PERMISSION_DENIED: 403,
    ErrorKind.NOT_FOUND: 404,
    ErrorKind.ALREADY_EXISTS: 409,
    ErrorKind.UNIMPLEMENTED: 501,
    ErrorKind.RESOURCE_EXHAUSTED: 429,
    ErrorKind.UNAVAILABLE: 503,
    ErrorKind.DEADLINE_EXCEEDED: 504,
    ErrorKind.INTERNAL: 500,
    ErrorKind.CANCELLED: 499,  # nginx's "client closed request": no one reads it, but logs and spans say so
}


# The bounds of the server's own by which it sheds load: a request refused by one is counted by it
# (mhaserve_inference_request_shed_total), apart from the refusals of requests over their own limits.
SHED_REASONS = ("queue_full", "queue_timeout", "memory", "sequences", "client_share", "receiving")

MESSAGE_AT_MOST = 2000  # characters; parameters.quoted keeps a client's values far shorter


class RequestError(Exception):
    """A request this server refuses: its kind and a message naming what was expected and what came."""

    def __init__(self, kind: ErrorKind, message: str, retry_after_s: float | None = None, shed_by: str = ""):
        if len(message) > MESSAGE_AT_MOST:  # it travels in gRPC trailers, whose size is limited
            message = f"{message[: MESSAGE_AT_MOST - 40]}... ({len(message)} characters in all)"
        super().__init__(message)
        self.kind = kind
        self.message = message
        # When a retry may succeed, where this server knows (a drain: once its port has closed): gRPC's retry
        # pushback, HTTP's Retry-After.
        self.retry_after_s = retry_after_s
        self.shed_by = shed_by  # the bound of SHED_REASONS that refused it, where the server shed load


def invalid(message: str) -> RequestError:
    return RequestError(ErrorKind.INVALID_ARGUMENT, message)


def inference_failed(error: Exception) -> RequestError:
    """A bug or a runtime failure during inference, as every transport reports it (the server keeps serving)."""
    return RequestError(ErrorKind.INTERNAL, f"inference failed: {type(error).__name__}: {error}")
