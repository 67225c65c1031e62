"""What the control plane needs from its state store.

The control plane is stateless apart from this store, so several instances
can share one (SQLite for one host, PostgreSQL for several).
"""

from __future__ import annotations

from typing import Any, Protocol

from sandfleet.wire.models import NodeInfo, SandboxInfo, SandboxState

__all__ = ["Store"]


class Store(Protocol):
    def put_node(self, node: NodeInfo) -> None:
        """Insert or replace a node record."""
        ...

    def patch_node(self, node_id: str, fields: dict[str, Any]) -> NodeInfo | None:
        """Update some fields of a node record in one transaction; None if unknown."""
        ...

    def get_node(self, node_id: str) -> NodeInfo | None: ...

    def list_nodes(self) -> list[NodeInfo]: ...

    def put_sandbox(self, sandbox: SandboxInfo) -> None:
        """Insert or replace a sandbox record."""
        ...

    def get_sandbox(self, sandbox_id: str) -> SandboxInfo | None: ...

    def set_sandbox_state(
        self, sandbox_id: str, state: SandboxState, ended: str | None = None
    ) -> None:
        """Set the record's state; with ``ended``, also why it ended and when (now)."""
        ...

    def delete_sandbox(self, sandbox_id: str) -> None: ...

    def list_sandboxes(
        self,
        *,
        labels: dict[str, str] | None = None,
        node_id: str | None = None,
        states: tuple[SandboxState, ...] = ("creating", "running", "paused"),
    ) -> list[SandboxInfo]:
        """Sandboxes in ``states`` whose labels include every pair in ``labels``."""
        ...

    def expired_sandboxes(self, now: float) -> list[SandboxInfo]:
        """Live sandboxes whose ``expires_at`` (Unix seconds) is before ``now``."""
        ...

    def close(self) -> None: ...
