"""sandfleet: elastic sandboxes for training and evaluating AI agents with RL.

One SDK over every isolation level: ``Client(...).create(kind="container", ...)``.
"""

from sandfleet.sdk import AsyncClient, AsyncSandbox, Client, Sandbox
from sandfleet.wire import errors
from sandfleet.wire.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    SandfleetError,
    Unavailable,
)
from sandfleet.wire.models import ExecResult, FileEntry, ImageManifest, SandboxInfo

__all__ = [
    "AsyncClient",
    "AsyncSandbox",
    "Client",
    "DeadlineExceeded",
    "ExecResult",
    "FailedPrecondition",
    "FileEntry",
    "ImageManifest",
    "InvalidArgument",
    "NotFound",
    "PermissionDenied",
    "ResourceExhausted",
    "Sandbox",
    "SandboxInfo",
    "SandfleetError",
    "Unavailable",
    "errors",
]
