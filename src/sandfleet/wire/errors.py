"""The error family shared by the SDK, the control plane and the node agent.

Codes cross the wire, not class paths: a server answers with
``{"error": {"code": "NOT_FOUND", "message": "..."}}`` and the matching HTTP
status; the SDK turns that body back into the class below. Categories follow
gRPC's status codes. Messages say what the caller should change.
"""

from __future__ import annotations

from typing import Any, ClassVar

__all__ = [
    "AlreadyExists",
    "DataLoss",
    "DeadlineExceeded",
    "Diverged",
    "FailedPrecondition",
    "Internal",
    "InvalidArgument",
    "NotFound",
    "PermissionDenied",
    "ResourceExhausted",
    "SandfleetError",
    "Unauthenticated",
    "Unavailable",
    "error_from_wire",
]


class SandfleetError(Exception):
    """Root of every error sandfleet raises on purpose.

    ``code`` is the wire code, ``http_status`` the HTTP status a server answers
    with, and ``retryable`` tells a caller whether the same request may succeed
    later unchanged (capacity, an unreachable node).
    """

    code: ClassVar[str] = "INTERNAL"
    http_status: ClassVar[int] = 500
    retryable: ClassVar[bool] = False

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def to_wire(self) -> dict[str, Any]:
        """The JSON body a server answers with: ``{"error": {"code", "message"}}``."""
        return {"error": {"code": self.code, "message": self.message}}


class Internal(SandfleetError):
    """A bug or an unexpected failure on the server; the message has details."""


class NotFound(SandfleetError, LookupError):
    """The sandbox, image, node or path does not exist (any more)."""

    code = "NOT_FOUND"
    http_status = 404


class AlreadyExists(SandfleetError):
    """Something with that name or id exists already."""

    code = "ALREADY_EXISTS"
    http_status = 409


class InvalidArgument(SandfleetError, ValueError):
    """The request is malformed or asks for something impossible."""

    code = "INVALID_ARGUMENT"
    http_status = 400


class FailedPrecondition(SandfleetError):
    """The request is valid but the system is not in a state to run it."""

    code = "FAILED_PRECONDITION"
    http_status = 412


class ResourceExhausted(SandfleetError):
    """No node has room right now; retry later or ask for less."""

    code = "RESOURCE_EXHAUSTED"
    http_status = 429
    retryable = True


class Unavailable(SandfleetError, ConnectionError):
    """A server or node could not be reached or is shutting down; retryable."""

    code = "UNAVAILABLE"
    http_status = 503
    retryable = True


class DeadlineExceeded(SandfleetError, TimeoutError):
    """The operation did not finish in the time it was given."""

    code = "DEADLINE_EXCEEDED"
    http_status = 504
    retryable = True


class PermissionDenied(SandfleetError, PermissionError):
    """The caller may not do this (or the path is not writable in the sandbox)."""

    code = "PERMISSION_DENIED"
    http_status = 403


class Unauthenticated(SandfleetError):
    """The request carried no valid token."""

    code = "UNAUTHENTICATED"
    http_status = 401


class Diverged(SandfleetError):
    """A re-issued call differs from the one the trajectory log holds at its step.

    Raised while fast-forwarding a sandbox's log (``resume_from_log``): the
    message names the step and what the log holds there. Nothing was run.
    """

    code = "DIVERGED"
    http_status = 409


class DataLoss(SandfleetError):
    """Stored data is corrupt: an object's content does not match its digest."""

    code = "DATA_LOSS"
    http_status = 500


_BY_CODE: dict[str, type[SandfleetError]] = {
    cls.code: cls
    for cls in (
        Internal,
        NotFound,
        AlreadyExists,
        InvalidArgument,
        FailedPrecondition,
        ResourceExhausted,
        Unavailable,
        DeadlineExceeded,
        PermissionDenied,
        Unauthenticated,
        Diverged,
        DataLoss,
    )
}


def error_from_wire(body: Any, http_status: int) -> SandfleetError:
    """Rebuild the error a server sent; unknown shapes become :class:`Internal`."""
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        err = body["error"]
        cls = _BY_CODE.get(str(err.get("code")), Internal)
        return cls(str(err.get("message", "")))
    # No code: a proxy, or the wrong server (a bad URL or API version). Map by status.
    by_status = {c.http_status: c for c in _BY_CODE.values() if c not in (Internal, DataLoss)}
    cls = by_status.get(http_status, Internal)
    detail = body.get("detail", body) if isinstance(body, dict) else body
    hint = "is the URL a sandfleet server?"
    return cls(f"unexpected answer (HTTP {http_status}; {hint}): {str(detail)[:500]}")
