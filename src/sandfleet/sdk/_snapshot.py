"""Snapshot and fork, the part that does no I/O (shared by the async and sync SDK).

``sandbox.snapshot()`` is one request; ``sandbox.fork(n)`` is a snapshot
followed by ``n`` creates from it, sent in parallel by the I/O layer, which
destroys the ones made when any fails (all or nothing).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

from sandfleet.sdk import _core
from sandfleet.wire.errors import InvalidArgument, SandfleetError
from sandfleet.wire.models import CreateSandboxRequest, ImageManifest, SandboxInfo, SnapshotRequest

__all__ = ["MAX_FORKS", "SNAPSHOT_TIMEOUT_S", "fork_error", "fork_requests", "snapshot_request"]

#: Seconds a snapshot call may take (the control plane gives the node 900 s).
SNAPSHOT_TIMEOUT_S = 930.0
#: At most this many copies per :meth:`fork` call.
MAX_FORKS = 64


def snapshot_request(
    sandbox_id: str, image: str | None, exclude: Sequence[str] | None
) -> _core.Request[ImageManifest]:
    """``POST /v1/sandboxes/{id}/snapshot``; the answer is the new image's manifest.

    Raises ``InvalidArgument`` when ``image`` is not a str or ``exclude`` not a
    list of str (a plain str is refused: it would read as one pattern per
    character); the server checks the name and the patterns themselves.
    """
    if image is not None and not isinstance(image, str):
        raise InvalidArgument(f"image must be 'name:tag' or None, got {image!r}")
    if isinstance(exclude, str | bytes):
        raise InvalidArgument(f"exclude must be a list of patterns, e.g. [{exclude!r}]")
    body = _core._build(
        SnapshotRequest, image=image, exclude=None if exclude is None else list(exclude)
    )
    return _core.Request(
        "POST",
        _core._sandbox_path(sandbox_id, "/snapshot"),
        _core._model(ImageManifest),
        body=body.model_dump_json().encode(),
        headers=_core.JSON_HEADERS,
        timeout_s=SNAPSHOT_TIMEOUT_S,
    )


def check_fork_count(n: int) -> None:
    """Raise ``InvalidArgument`` unless ``n`` is an int in 1..:data:`MAX_FORKS`."""
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_FORKS:
        raise InvalidArgument(f"fork(n): n must be an int from 1 to {MAX_FORKS}, got {n!r}")


def fork_requests(
    info: SandboxInfo, image: str, n: int, now: float | None = None
) -> list[_core.Request[SandboxInfo]]:
    """``n`` creates of sandboxes like ``info`` (kind, limits, labels, idle TTL) from ``image``.

    The env needs no copying: the snapshot's image carries the sandbox's.
    Each copy ends when the source would: its ``ttl_s`` is what is left of the
    source's (at least 1 s; None when the source has no TTL).
    """
    check_fork_count(n)
    ttl_s = None
    if info.expires_at is not None:
        now = time.time() if now is None else now
        ttl_s = max(1.0, math.ceil(info.expires_at - now))
    body = (
        _core._build(
            CreateSandboxRequest,
            kind=info.kind,
            image=image,
            cpu=info.cpu,
            memory_mb=info.memory_mb,
            pids_limit=info.pids_limit,
            disk_mb=info.disk_mb,
            ttl_s=ttl_s,
            idle_ttl_s=info.idle_ttl_s,
            labels=dict(info.labels),
        )
        .model_dump_json()
        .encode()
    )
    request = _core.Request(
        "POST", "/v1/sandboxes", _core._model(SandboxInfo), body=body, headers=_core.JSON_HEADERS
    )
    return [request] * n


def fork_error(errors: list[BaseException], n: int, image: str) -> BaseException:
    """The error ``fork`` raises when some of its ``n`` creates failed (the rest destroyed).

    Of the same class as the first failure (so ``retryable`` and ``except
    ResourceExhausted`` still work), saying how many failed.
    """
    first = errors[0]
    if not isinstance(first, SandfleetError):
        return first
    return type(first)(
        f"fork: {len(errors)} of {n} copies could not be created, so none was kept (the"
        f" others were destroyed; the snapshot {image} stays); first error: {first.message}"
    )
