"""Sandbox ids that name their node, so data-plane calls route without a lookup.

Shape: ``sb-<12 hex>-<node_id>``, e.g. ``sb-3f9a0c21b7de-node1``. Node ids are
``[a-z0-9][a-z0-9-]{0,31}``.
"""

from __future__ import annotations

import re
import secrets

from sandfleet.wire.errors import InvalidArgument

__all__ = ["NODE_ID_RE", "new_sandbox_id", "node_of", "validate_node_id"]

NODE_ID_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,31}$")
_SANDBOX_ID_RE = re.compile(r"^sb-([0-9a-f]{12})-([a-z0-9][a-z0-9-]{0,31})$")


def validate_node_id(node_id: str) -> str:
    """Return ``node_id`` or raise InvalidArgument saying what is allowed."""
    if not NODE_ID_RE.match(node_id):
        raise InvalidArgument(
            f"node id {node_id!r} is not valid: use 1-32 characters of a-z, 0-9 and '-',"
            " starting with a letter or digit"
        )
    return node_id


def new_sandbox_id(node_id: str) -> str:
    """A fresh sandbox id placed on ``node_id`` (48 random bits)."""
    return f"sb-{secrets.token_hex(6)}-{node_id}"


def node_of(sandbox_id: str) -> str:
    """The node a sandbox id names. Raises NotFound-worthy InvalidArgument if malformed."""
    m = _SANDBOX_ID_RE.match(sandbox_id)
    if not m:
        raise InvalidArgument(
            f"{sandbox_id!r} is not a sandbox id (expected 'sb-<12 hex>-<node>', as create returns)"
        )
    return m.group(2)
