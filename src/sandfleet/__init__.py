"""sandfleet: elastic sandboxes for training and evaluating AI agents with RL.

One SDK over every isolation level: ``Client(...).create(kind="container", ...)``.
"""

from sandfleet import errors
from sandfleet.sdk import AsyncClient, AsyncSandbox, Client, Sandbox
from sandfleet.wire.errors import (
    AlreadyExists,
    DataLoss,
    DeadlineExceeded,
    Diverged,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    SandfleetError,
    Unauthenticated,
    Unavailable,
)
from sandfleet.wire.models import ExecResult, FileEntry, ImageManifest, SandboxInfo

__all__ = [
    "AlreadyExists",
    "AsyncClient",
    "AsyncSandbox",
    "Client",
    "DataLoss",
    "DeadlineExceeded",
    "Diverged",
    "ExecResult",
    "FailedPrecondition",
    "FileEntry",
    "ImageManifest",
    "Internal",
    "InvalidArgument",
    "NotFound",
    "PermissionDenied",
    "ResourceExhausted",
    "Sandbox",
    "SandboxInfo",
    "SandfleetError",
    "Unauthenticated",
    "Unavailable",
    "errors",
]
