"""The interface every sandbox backend implements.

A backend only knows how a box *starts, stops and is reached*: what runs inside
is the same in-sandbox agent for every stateful kind, so exec and file
operations go through :class:`sandfleet.guest.client.AgentClient` on the
endpoint the backend returns. Modelled on containerd's sandbox controller
(create, stop, status, metrics).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

__all__ = ["Backend", "BoxHandle", "BoxInit", "LayerSource", "SandboxSpec"]


@dataclass(frozen=True)
class LayerSource:
    """One read-only layer to stack: an EROFS image and, if split, its data blob.

    ``meta`` is the EROFS (metadata) image; ``data`` the file holding the
    layer's file data (``device=`` of the mount; on a node, a file of the
    on-demand FUSE filesystem), or None for a whole image. ``digest`` names
    the layer for the node (recorded with the box, e.g. for snapshots); the
    backend does not interpret it.
    """

    meta: Path
    data: Path | None = None
    digest: str = ""


@dataclass(frozen=True)
class BoxInit:
    """A PID 1 other than the in-sandbox agent, for boxes that are not sandboxes.

    fncall workers use it: their PID 1 is a zygote that forks each call. The
    box's root is then read-only (the image layers only, no writable layer);
    ``tmpfs`` maps box paths to tmpfs sizes in MiB (mode 1777), ``binds`` maps
    box paths to host files bind-mounted read-only, ``caps`` are the
    capabilities PID 1 holds. ``args[0]`` is looked up on the image's PATH.
    The listening socket still arrives as fd 3; ``ready(socket_path)`` returns
    once PID 1 answers on it (the backend bounds the wait).
    """

    args: list[str]
    ready: Callable[[Path], Awaitable[None]]
    binds: dict[str, Path] = field(default_factory=dict)
    tmpfs: dict[str, int] = field(default_factory=dict)
    caps: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class SandboxSpec:
    """A validated request, resolved to local layer files.

    ``layers`` are the read-only layers, bottom first. ``memory_mb`` in MiB, ``cpu`` in
    cores, ``disk_mb`` bounds the writable layer (None: unbounded). With
    ``init`` the box runs that instead of the agent, on a read-only root.
    """

    id: str
    kind: str
    layers: list[LayerSource]
    cpu: float
    memory_mb: int
    pids_limit: int
    disk_mb: int | None = 4096
    env: dict[str, str] = field(default_factory=dict)
    workdir: str | None = None
    init: BoxInit | None = None


@dataclass
class BoxHandle:
    """A running box: where its agent listens, plus backend-private state."""

    id: str
    agent_socket: Path
    pid: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Backend(Protocol):
    """One isolation level on one node.

    Implementations must leave nothing behind (process, mount, cgroup,
    namespace, directory) when ``create`` fails halfway or ``destroy`` runs,
    and ``destroy`` must be idempotent.
    """

    kind: str

    def capabilities(self) -> dict[str, Any]:
        """What was probed at start (cgroup version, runc version, ...)."""
        ...

    async def create(self, spec: SandboxSpec) -> BoxHandle:
        """Start a box and return once its agent answers.

        Raises ``InvalidArgument`` for impossible limits, ``ResourceExhausted``
        when the node cannot host it, ``Internal`` for anything else (after
        cleaning up).
        """
        ...

    async def destroy(self, sandbox_id: str) -> None:
        """Kill every process of the box and remove all it created. Idempotent."""
        ...

    def oom_kills(self, sandbox_id: str) -> int:
        """Processes the box's memory limit has killed so far (cgroup counter)."""
        ...

    async def recover(self) -> list[BoxHandle]:
        """Boxes that survived a restart of the node agent, to adopt them."""
        ...

    async def close(self) -> None:
        """Release node-wide resources (layer mounts); boxes are left running."""
        ...
