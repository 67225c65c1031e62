"""``sandfleet log``: export a sandbox's trajectory log, or replay one in a fresh sandbox.

``export`` writes the log's JSON lines (:class:`~sandfleet.wire.models.LogEntry`)
to stdout, exactly as the node keeps them, in step order. ``replay`` re-runs
each logged call of such a file, in step order, in a new sandbox of the given
image and reports every step whose result differs from the logged one (only
what a re-run can reproduce is compared: statuses, exit codes, output as the
log keeps it, file types, sizes and modes, process ids; not times or pids).
"""

from __future__ import annotations

import base64
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from sandfleet.cli.main import cli
from sandfleet.wire.errors import InvalidArgument, SandfleetError
from sandfleet.wire.models import ExecRequest, LogEntry, ProcessInfo, SpawnRequest
from sandfleet.wire.trajectory import cut, describe

__all__ = ["Difference", "compare", "log", "read_entries", "replay_entries"]

_URL = click.option("--url", default=None, help="Control plane URL (env SANDFLEET_URL).")
#: Cap on captured output of a replayed exec logged with none (a streamed one): the log
#: keeps 32 KiB of head and of tail, and this cap keeps 8 MiB of each, so they compare.
_REPLAY_CAP = 16 * 1024 * 1024


@cli.group()
def log() -> None:
    """A sandbox's trajectory log: export it as JSON lines, replay it in a fresh sandbox."""


@log.command("export")
@click.argument("sandbox_id")
@_URL
@click.option("--start", type=int, default=0, show_default=True, help="First step exported.")
def export(sandbox_id: str, url: str | None, start: int) -> None:
    """Write SANDBOX_ID's trajectory log to stdout: one JSON LogEntry per line, in step order."""
    from sandfleet.sdk import Client, _core
    from sandfleet.sdk._steps import log_request

    with Client(url) as client:
        listed = log_request(sandbox_id, start)
        raw = _core.Request(listed.method, listed.path, _core._raw, params=listed.params)
        sys.stdout.buffer.write(client._send(raw))
        sys.stdout.buffer.flush()


@log.command("replay")
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--image", required=True, help="Image of the fresh sandbox (name:tag).")
@_URL
@click.option("--kind", default="container", show_default=True)
@click.option("--memory-mb", type=int, default=512, show_default=True)
@click.option("--keep", is_flag=True, help="Keep the sandbox afterwards (its id is printed).")
def replay(file: Path, image: str, url: str | None, kind: str, memory_mb: int, keep: bool) -> None:
    """Re-run the calls of a trajectory log FILE (from `log export`) in a fresh sandbox.

    Prints each step whose result differs from the logged one; exits with
    status 1 if any does, 0 if all match.
    """
    from sandfleet.sdk import Client

    entries = read_entries(file.read_bytes())
    console = Console()
    with Client(url) as client:
        sandbox = client.create(kind=kind, image=image, memory_mb=memory_mb)
        try:
            diffs = replay_entries(sandbox, entries)
        finally:
            if not keep:
                sandbox.destroy()
    table = Table("step", "op", "call", "logged", "now", title="steps whose results differ")
    for d in diffs:
        table.add_row(str(d.step), d.op, d.call, d.logged, d.now)
    if diffs:
        console.print(table)
    kept = f" (kept: {sandbox.id})" if keep else ""
    console.print(
        f"replayed {len(entries)} steps in a fresh {image} sandbox{kept}:"
        f" {len(diffs)} differ{'s' if len(diffs) == 1 else ''}"
    )
    if diffs:
        sys.exit(1)


def read_entries(data: bytes) -> list[LogEntry]:
    """The entries of an exported log, in step order; InvalidArgument names a bad line."""
    entries = []
    for number, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        try:
            entries.append(LogEntry.model_validate_json(line))
        except ValueError as exc:
            raise InvalidArgument(f"line {number} is not a trajectory log entry: {exc}") from None
    return sorted(entries, key=lambda e: e.step)


@dataclass(frozen=True)
class Difference:
    """One step whose re-run result differs from the logged one."""

    step: int
    op: str
    call: str
    logged: str
    now: str


def replay_entries(sandbox: Any, entries: list[LogEntry]) -> list[Difference]:
    """Re-run ``entries`` in order in ``sandbox`` (a sync :class:`Sandbox`); their differences."""
    diffs = []
    for entry in entries:
        call = describe(entry.op, entry.request)
        if "note" in entry.request:
            why = f"not replayable: {entry.request['note']}"
            diffs.append(Difference(entry.step, entry.op, call, "-", why))
            continue
        try:
            now = _rerun(sandbox, entry)
        except SandfleetError as exc:
            diffs.append(Difference(entry.step, entry.op, call, "a result", f"{exc.code}: {exc}"))
            continue
        fields = compare(entry.op, entry.result, now)
        if fields:
            logged = "; ".join(f"{key}={value}" for key, value, _ in fields)
            got = "; ".join(f"{key}={value}" for key, _, value in fields)
            diffs.append(Difference(entry.step, entry.op, call, logged, got))
    return diffs


def _rerun(sandbox: Any, entry: LogEntry) -> dict[str, Any]:
    """Run ``entry``'s call again; its result as the log would keep it."""
    from sandfleet.sdk import _core, _steps

    req = entry.request
    sid = sandbox.id
    if entry.op == "exec":
        command = ExecRequest.model_validate(req)
        if command.max_output_bytes is None:
            command = command.model_copy(update={"max_output_bytes": _REPLAY_CAP})
        result = sandbox._exec(command.model_dump_json().encode(), command.timeout_s)
        out, err = cut(result.stdout)[0], cut(result.stderr)[0]
        return {**result.model_dump(mode="json"), "stdout": _b64(out), "stderr": _b64(err)}
    if entry.op == "write":
        data = base64.b64decode(req["content"])
        return dict(sandbox.files.write(req["path"], data, req["mode"]).model_dump(mode="json"))
    if entry.op == "mkdir":
        return dict(sandbox.files.mkdir(req["path"], req["parents"]).model_dump(mode="json"))
    if entry.op == "remove":
        sandbox.files.remove(req["path"], req["recursive"])
        return {}
    if entry.op == "spawn":
        body = SpawnRequest.model_validate(req).model_dump_json().encode()
        request = _core.Request(
            "POST",
            _core._sandbox_path(sid, "/processes"),
            ProcessInfo.model_validate_json,
            body=body,
            headers=_core.JSON_HEADERS,
        )
        info = sandbox._call(request, "spawn", _steps.spawn_of(body), _steps.process_info)
        return dict(info.model_dump(mode="json"))
    pid = req["process_id"]
    if entry.op == "kill":
        request = _core.kill_request(sid, pid, req["signal"])
        fields = _steps.plain(process_id=pid, signal=req["signal"])
        return dict(
            sandbox._call(request, "kill", fields, _steps.process_info).model_dump(mode="json")
        )
    if entry.op == "stdin":
        data = base64.b64decode(req["data"])
        sandbox._call(
            _core.stdin_request(sid, pid, data), "stdin", _steps.stdin_of(pid, data), _steps.nothing
        )
        return {}
    if entry.op == "close_stdin":
        closing = _core.close_stdin_request(sid, pid)
        sandbox._call(closing, "close_stdin", _steps.plain(process_id=pid), _steps.nothing)
        return {}
    if entry.op == "remove_process":
        removing = _core.remove_process_request(sid, pid)
        sandbox._call(removing, "remove_process", _steps.plain(process_id=pid), _steps.nothing)
        return {}
    raise InvalidArgument(f"step {entry.step}: unknown op {entry.op!r}")


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


#: What a re-run can reproduce, by op (times, pids and mtimes are left out).
_COMPARED = {
    "exec": ("status", "exit_code", "signal", "stdout", "stderr"),
    "write": ("type", "size", "mode"),
    "mkdir": ("type", "mode"),
    "spawn": ("id", "command"),
    "kill": ("state", "exit_code", "signal"),
}


def compare(op: str, logged: dict[str, Any], now: dict[str, Any]) -> list[tuple[str, str, str]]:
    """``(field, logged, now)`` for each compared field that differs."""
    out = []
    for key in _COMPARED.get(op, ()):
        if logged.get(key) != now.get(key):
            out.append((key, _show(key, logged.get(key)), _show(key, now.get(key))))
    return out


def _show(key: str, value: Any) -> str:
    if key in ("stdout", "stderr") and isinstance(value, str):
        text = base64.b64decode(value).decode("utf-8", errors="replace")
        return json.dumps(text[:80] + ("…" if len(text) > 80 else ""))
    return json.dumps(value)
