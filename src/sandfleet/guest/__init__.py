"""The in-sandbox agent: a static C binary run as PID 1 of every sandbox, and its client.

``agent.c`` is built by the package's own build (``setup.py``) into
``_bin/sandfleet-agent``; :func:`agent_binary` finds (or builds) it.
:class:`AgentClient` is the node's async client; the wire format is in
:mod:`sandfleet.guest.protocol`.
"""

from __future__ import annotations

from pathlib import Path

from sandfleet.guest.client import AgentClient, OutputCallback

__all__ = ["AgentClient", "OutputCallback", "agent_binary"]


def agent_binary() -> Path:
    """See :func:`sandfleet.guest.build.agent_binary`."""
    # imported here so `python -m sandfleet.guest.build` runs without a runpy warning
    from sandfleet.guest.build import agent_binary as find

    return find()
