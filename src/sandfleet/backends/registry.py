"""The backends a node offers, imported lazily so each stays optional."""

from __future__ import annotations

from pathlib import Path

from sandfleet.backends.base import Backend

__all__ = ["load_backends"]


def load_backends(node_dir: Path) -> dict[str, Backend]:
    """Backends by kind, with their state under ``node_dir/<kind>``.

    Raises FailedPrecondition (from the backend) when the host lacks what a
    backend needs, with what to install.
    """
    from sandfleet.backends.container import ContainerBackend
    from sandfleet.guest.build import agent_binary

    container = ContainerBackend(node_dir / "container", agent_binary(), node_id=node_dir.name)
    return {"container": container}
