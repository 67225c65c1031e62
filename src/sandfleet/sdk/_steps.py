"""Step numbers and fast-forward of a sandbox handle's trajectory log (no I/O).

A handle made by ``create`` or ``attach`` numbers its logged calls (exec,
file writes, removes, mkdirs, spawns, process kills and stdin) 0, 1, 2, ...
and sends each number in the :data:`~sandfleet.wire.models.STEP_HEADER`
header; the node logs the call under it, or answers it from its log (see
:mod:`sandfleet.node.trajectory`).

``attach(..., resume_from_log=True)`` fetches the log once and numbers from 0
again: each re-issued call whose step the fetched log holds is checked and
answered here, from the log, with no request at all (that is what makes a
fast-forward of thousands of steps take milliseconds); a call that differs
raises :class:`Diverged` naming the step. Calls past the fetched log go to the
server as usual.
"""

from __future__ import annotations

import contextvars
import dataclasses
import hashlib
import os
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from sandfleet.sdk._core import Request, _sandbox_path
from sandfleet.wire.errors import Diverged, Internal
from sandfleet.wire.models import (
    STEP_HEADER,
    ExecEvent,
    ExecRequest,
    ExecResult,
    FileEntry,
    LogEntry,
    ProcessInfo,
    SpawnRequest,
)
from sandfleet.wire.trajectory import describe, digest, exec_fields, spawn_fields

T = TypeVar("T")

Fields = Callable[[], dict[str, Any]]
"""The identifying fields of a call, computed only when a fetched log must be checked."""


class Abandon:
    """Set ``active`` before cancelling tasks that run in this context: their logged
    calls are then abandoned, not cancelled — they run on to their end on the node
    and are logged, for a later handle to pick up (see :data:`ABANDON`)."""

    active = False


#: Cancelling a task whose logged call is in flight normally stops the call on the
#: node (its command is killed: the caller meant it). Under an active
#: :class:`Abandon` the call is left to finish — what a driver going away wants,
#: since a command killed half-way and run again by its successor would have run
#: partly twice. :class:`sandfleet.rl.RolloutPool` sets one around its episodes.
ABANDON: contextvars.ContextVar[Abandon | None] = contextvars.ContextVar(
    "sandfleet_abandon", default=None
)


class Steps:
    """A handle's step counter, and the log entries it fast-forwards from."""

    def __init__(self, next_step: int = 0, logged: list[LogEntry] | None = None) -> None:
        self.next = next_step
        self._logged = {e.step: e for e in logged or ()}
        #: A cancellation being settled with the node (async handles): the next
        #: call waits for it, since it decides whether the cancelled step is free.
        self.settling: Any = None
        #: A step whose fate the node could not be asked about (it was
        #: unreachable): the next call asks first, and takes no step until it knows.
        self.unsettled: int | None = None

    def settle(self, step: int, state: str) -> None:
        """What the node said of a cancelled call's ``step``: logged (it ended
        first: the step stays taken) or free (given back)."""
        if state != "logged":
            self.undo(step)

    def take(self, op: str, fields: Fields) -> tuple[int, LogEntry | None]:
        """The call's step, and its logged entry when the fetched log answers it.

        Raises :class:`Diverged` (the step is not taken) if the fetched log holds
        another call at that step.
        """
        step = self.next
        self.next += 1
        entry = self._logged.get(step)
        if entry is None:
            return step, None
        mine = fields()
        if entry.op != op or entry.digest != digest(op, mine):
            self.undo(step)
            raise Diverged(
                f"step {step} diverged from the trajectory log: the log holds"
                f" {describe(entry.op, entry.request)} (digest {entry.digest[:12]}) there,"
                f" this call is {describe(op, mine)} (digest {digest(op, mine)[:12]});"
                " nothing was run. Re-issue the logged calls in order, or attach without"
                " resume_from_log to continue after the log's end"
            )
        del self._logged[step]  # answered once; a later call with this step asks the server
        return step, entry

    def undo(self, step: int) -> None:
        """Give ``step`` back after a call that did not end with a result (if it was the last)."""
        if self.next == step + 1:
            self.next = step


def with_step(request: Request[T], step: int) -> Request[T]:
    return dataclasses.replace(request, headers={**(request.headers or {}), STEP_HEADER: str(step)})


def _entries(content: bytes) -> list[LogEntry]:
    try:
        return [LogEntry.model_validate_json(line) for line in content.splitlines() if line]
    except ValueError as exc:
        raise Internal(f"unexpected line in a trajectory log: {str(exc)[:300]}") from None


def log_request(
    sandbox_id: str, start: int = 0, tail: int | None = None
) -> Request[list[LogEntry]]:
    params: tuple[tuple[str, str], ...] = (("start", str(start)),)
    if tail is not None:
        params += (("tail", str(tail)),)
    return Request("GET", _sandbox_path(sandbox_id, "/log"), _entries, params=params)


# ---------------------------------------------------------------------------- call fields


def exec_of(body: bytes) -> Fields:
    return lambda: exec_fields(ExecRequest.model_validate_json(body))


def spawn_of(body: bytes) -> Fields:
    return lambda: spawn_fields(SpawnRequest.model_validate_json(body))


def _sha256(data: bytes | str) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


def write_of(path: str, mode: int, data: bytes | str) -> Fields:
    return lambda: {"path": path, "mode": mode, "sha256": _sha256(data)}


def upload_of(local_path: str | os.PathLike[str], path: str, mode: int) -> Fields:
    def fields() -> dict[str, Any]:
        hasher = hashlib.sha256()
        with open(local_path, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                hasher.update(chunk)
        return {"path": path, "mode": mode, "sha256": hasher.hexdigest()}

    return fields


def stdin_of(process_id: str, data: bytes | str) -> Fields:
    return lambda: {"process_id": process_id, "sha256": _sha256(data)}


def plain(**fields: Any) -> Fields:
    return lambda: fields


# ---------------------------------------------------------------------------- logged answers


def exec_result(entry: LogEntry) -> ExecResult:
    return ExecResult.model_validate({**entry.result, "replayed": True})


def exec_events(entry: LogEntry) -> Iterator[ExecEvent]:
    """A logged exec as a streamed one: its output, then its result (output emptied)."""
    full = exec_result(entry)
    for kind, data in (("stdout", full.stdout), ("stderr", full.stderr)):
        if data:
            yield ExecEvent(type=kind, data=data)
    yield ExecEvent(type="result", result=full.model_copy(update={"stdout": b"", "stderr": b""}))


def file_entry(entry: LogEntry) -> FileEntry:
    return FileEntry.model_validate(entry.result)


def process_info(entry: LogEntry) -> ProcessInfo:
    return ProcessInfo.model_validate(entry.result)


def nothing(_: LogEntry) -> None:
    return None


def cancel_request(sandbox_id: str, step: int) -> Request[str]:
    """Stop the call running under ``step`` (see the node's ``Logged.cancel``)."""
    return Request(
        "POST", _sandbox_path(sandbox_id, f"/steps/{step}/cancel"), _state, timeout_s=60.0
    )


def _state(content: bytes) -> str:
    import json

    return str(json.loads(content).get("state", "free"))
