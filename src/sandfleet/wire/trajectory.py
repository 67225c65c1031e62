"""The trajectory log's shared rules: what a logged call is, its digest, and bounds.

The node computes each call's digest when it logs or checks a call; the SDK
computes the same digest when it fast-forwards a re-issued call from a log it
fetched, so both sides must agree byte for byte. That agreement lives here.

A call is ``(op, fields)``: ``op`` names it (:data:`OPS`) and ``fields`` are
the JSON fields that identify it. For ``write`` and ``stdin`` the content is
identified by its sha256 (``sha256``), never carried in ``fields``.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from sandfleet.wire.models import ExecRequest, SpawnRequest

__all__ = [
    "LOG_BYTES",
    "OPS",
    "cut",
    "describe",
    "digest",
    "exec_fields",
    "spawn_fields",
]

#: The calls a trajectory log records: everything that runs or changes something.
OPS = (
    "exec",
    "write",
    "remove",
    "mkdir",
    "spawn",
    "kill",
    "stdin",
    "close_stdin",
    "remove_process",
)

#: Bytes of each output (stdout, stderr) and of each content (stdin, file data)
#: a log entry keeps; beyond it, the middle is cut (head and tail kept) with a note.
LOG_BYTES = 64 * 1024


def digest(op: str, fields: dict[str, Any]) -> str:
    """The sha256 (hex) of a call: canonical JSON of ``{"op": op, **fields}``."""
    doc = json.dumps({"op": op, **fields}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(doc.encode()).hexdigest()


def exec_fields(req: ExecRequest) -> dict[str, Any]:
    """The identifying fields of an exec (plain or streamed: the same call)."""
    return req.model_dump(mode="json")


def spawn_fields(req: SpawnRequest) -> dict[str, Any]:
    return req.model_dump(mode="json")


def cut(data: bytes, limit: int = LOG_BYTES) -> tuple[bytes, int]:
    """``data`` with its middle cut to at most ``limit`` bytes; and how many were cut."""
    if len(data) <= limit:
        return data, 0
    head = limit // 2
    tail = limit - head
    return data[:head] + data[len(data) - tail :], len(data) - limit


def describe(op: str, fields: dict[str, Any]) -> str:
    """A short human description of a logged call, for error messages and reports."""
    if op in ("exec", "spawn"):
        cmd = fields.get("cmd")
        text = cmd if isinstance(cmd, str) else json.dumps(cmd)
        return f"{op} {text[:120]!s}"
    if "path" in fields:
        return f"{op} {fields['path']}"
    if "process_id" in fields:
        extra = f" signal {fields['signal']}" if op == "kill" else ""
        return f"{op} {fields['process_id']}{extra}"
    return op
