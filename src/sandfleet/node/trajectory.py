"""Each sandbox's trajectory log, kept by its node: ordered, append-only, fsync'd.

A call that carries a step number (header :data:`STEP_HEADER`) is logged. For
sandbox ``S`` with log ``L``:

- ``step`` beyond the log (``step > next``, where ``next`` is one past the
  highest step logged or running): a gap, :class:`InvalidArgument` (after a
  short grace: concurrent calls of one client may arrive out of order);
- a step the log does not hold (``step == next``, or a hole left by a call
  that failed): the call runs; once it has a result the entry is appended and
  fsync'd, and only then does the caller get the answer;
- a step the log holds: if the call's digest equals the logged one, the logged
  result is the answer (header :data:`REPLAYED_HEADER` ``1``; an exec result
  has ``replayed: true``) and nothing runs; otherwise :class:`Diverged`;
- a step still running: the call waits for it, then is one of the above.

Only calls that ended with a result are logged: a call that failed (an error,
or cancelled because its caller went away, which kills a command) leaves its
step free, so re-issuing it runs it. The log lives in
``<state>/boxes/<id>.log`` beside the box's metadata: it survives node-agent
and control-plane restarts and goes with the sandbox. Lines are
:class:`~sandfleet.wire.models.LogEntry` JSON in the order calls ended; the
index (step → op, digest, where the line is) is kept in memory.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import logging
import os
import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import Request, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from starlette.requests import ClientDisconnect

from sandfleet.wire.errors import Diverged, Internal, InvalidArgument
from sandfleet.wire.models import (
    REPLAYED_HEADER,
    STEP_HEADER,
    ExecEvent,
    ExecRequest,
    ExecResult,
    SpawnRequest,
)
from sandfleet.wire.trajectory import LOG_BYTES, cut, describe, digest, exec_fields, spawn_fields

if TYPE_CHECKING:
    from sandfleet.node.service import NodeService

__all__ = ["BoxLog", "Logged", "Trajectories", "step_of"]

log = logging.getLogger("sandfleet.node.trajectory")

#: Seconds a call whose step is past the log's end waits for the calls before it
#: (a client's concurrent calls may arrive out of order: hundreds at once through a
#: busy control plane spread over seconds) before it is a gap.
GAP_GRACE_S = float(os.environ.get("SANDFLEET_STEP_GAP_GRACE_S", "30"))
NDJSON = "application/x-ndjson"
_REPLAYED = {REPLAYED_HEADER: "1"}


@dataclass(slots=True)
class _Entry:
    """Where a logged step's line is, and what identifies its call."""

    op: str
    digest: str
    offset: int
    length: int


@dataclass(slots=True)
class _Running:
    """A step reserved by a call that runs now; ``done`` fires when it is logged or freed."""

    step: int
    done: asyncio.Future[None]


class BoxLog:
    """One sandbox's log: the file and its in-memory index."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.index: dict[int, _Entry] = {}
        self.running: dict[int, _Running] = {}
        self._marked = False
        self._top = 0  # one past the highest logged step
        self._size = 0
        self._write = asyncio.Lock()
        self._moved = asyncio.Event()
        self._load()
        self._settle_interrupted()

    def _load(self) -> None:
        """Rebuild the index from the file; a torn last line (a crash mid-append) is cut off."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return
        offset = 0
        while offset < len(data):
            end = data.find(b"\n", offset)
            if end < 0:
                break
            try:
                doc = json.loads(data[offset:end])
                step, op, dig = int(doc["step"]), str(doc["op"]), str(doc["digest"])
            except (ValueError, KeyError, TypeError):
                break
            self.index[step] = _Entry(op, dig, offset, end + 1 - offset)
            self._top = max(self._top, step + 1)
            offset = end + 1
        if offset < len(data):
            log.warning(
                "%s: cutting a torn or unreadable tail of %d bytes", self.path, len(data) - offset
            )
            with open(self.path, "r+b") as fh:
                fh.truncate(offset)
                os.fsync(fh.fileno())
        self._size = offset

    # An exec runs in the sandbox only while the node agent serving it lives: the
    # in-sandbox agent kills a command whose caller's connection is gone. So a
    # node agent that died mid-exec leaves a step whose command was killed part-way.
    # Each exec is marked in <log>.running before it runs; marks without a logged
    # result are logged at the next start as what they were: killed (SIGKILL).

    @property
    def _marks(self) -> Path:
        return self.path.with_suffix(".running")

    def mark(self, step: int, doc: dict[str, Any]) -> None:
        """Note that ``step`` (an exec; ``doc`` its LogEntry without result) runs now.

        Not fsync'd: what it guards against is the node agent's death, after
        which the kernel still has the write (a host crash takes the sandbox too).
        """
        self._write_mark({**doc, "step": step})

    def _write_mark(self, doc: dict[str, Any]) -> None:
        fd = os.open(self._marks, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, json.dumps(doc, separators=(",", ":")).encode() + b"\n")
        finally:
            os.close(fd)
        self._marked = True

    def _unmark(self, step: int) -> None:
        if not self._marked:
            return
        if self.running:
            self._write_mark({"step": step, "done": True})
        else:  # nothing runs: no mark is needed any more
            with open(self._marks, "r+b") as fh:
                fh.truncate(0)
            self._marked = False

    def _settle_interrupted(self) -> None:
        try:
            data = self._marks.read_bytes()
        except FileNotFoundError:
            return
        marks: dict[int, dict[str, Any]] = {}
        for line in data.splitlines():
            try:
                doc = json.loads(line)
                step = int(doc["step"])
            except (ValueError, KeyError, TypeError):
                continue  # a torn mark: its exec never started
            if doc.get("done"):
                marks.pop(step, None)
            else:
                marks[step] = doc
        for step, doc in sorted(marks.items()):
            if step in self.index:
                continue
            doc["result"] = {
                **ExecResult(
                    status="signaled",
                    signal=9,
                    stderr=b"sandfleet: the node agent stopped while this command ran; the"
                    b" sandbox's agent killed it (it may have run in part)\n",
                ).model_dump(mode="json"),
                "interrupted": True,
            }
            line_out = json.dumps(doc, separators=(",", ":")).encode() + b"\n"
            _append(self.path, line_out)
            self.index[step] = _Entry(str(doc["op"]), str(doc["digest"]), self._size, len(line_out))
            self._size += len(line_out)
            self._top = max(self._top, step + 1)
            log.warning("%s: step %d was interrupted by a node-agent stop", self.path, step)
        self._marks.unlink(missing_ok=True)

    @property
    def next_step(self) -> int:
        """One past the highest step logged or running."""
        if not self.running:
            return self._top
        return max(self._top, max(self.running) + 1)

    def _notify(self) -> None:
        self._moved.set()
        self._moved = asyncio.Event()

    async def begin(self, step: int) -> _Entry | _Running:
        """The logged entry of ``step``, or a reservation to run it (see the module doc)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + GAP_GRACE_S
        while True:
            entry = self.index.get(step)
            if entry is not None:
                return entry
            running = self.running.get(step)
            if running is not None:
                await asyncio.shield(running.done)
                continue
            if step <= self.next_step:
                reserved = _Running(step, loop.create_future())
                self.running[step] = reserved
                self._notify()
                return reserved
            left = deadline - loop.time()
            if left <= 0:
                raise InvalidArgument(
                    f"step {step} leaves a gap: the trajectory log of this sandbox holds steps"
                    f" up to {self.next_step - 1}, so the next call is step {self.next_step};"
                    " number calls without gaps (attach() continues after the log's end)"
                )
            moved = self._moved
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(moved.wait(), left)

    def skip(self, step: int) -> None:
        """A step its caller cancelled (maybe before it arrived): the calls after it need
        not wait for it. A call that comes for it later runs, as in any hole."""
        self._top = max(self._top, step + 1)
        self._notify()

    def abandon(self, reserved: _Running) -> None:
        """Free a step whose call the stopping node agent cut short, keeping its mark."""
        if self.running.get(reserved.step) is reserved:
            del self.running[reserved.step]
        if not reserved.done.done():
            reserved.done.set_result(None)
        self._notify()

    def release(self, reserved: _Running) -> None:
        """Free a reserved step whose call did not end with a result (or once logged)."""
        if self.running.get(reserved.step) is reserved:
            del self.running[reserved.step]
        self._unmark(reserved.step)
        if not reserved.done.done():
            reserved.done.set_result(None)
        self._notify()

    async def commit(self, reserved: _Running, doc: dict[str, Any]) -> None:
        """Append ``doc`` (a LogEntry) as the step's line, fsync'd; then the step is logged."""
        line = json.dumps(doc, separators=(",", ":")).encode() + b"\n"
        try:
            async with self._write:
                await asyncio.to_thread(_append, self.path, line)
                entry = _Entry(doc["op"], doc["digest"], self._size, len(line))
                self._size += len(line)
        except OSError as exc:
            self.release(reserved)
            raise Internal(
                f"step {reserved.step} ran but could not be written to the trajectory log"
                f" ({exc}); the log is missing it"
            ) from exc
        self.index[reserved.step] = entry
        self._top = max(self._top, reserved.step + 1)
        self.release(reserved)

    def read(self, entry: _Entry) -> dict[str, Any]:
        """The logged line of ``entry``, parsed."""
        with open(self.path, "rb") as fh:
            doc: dict[str, Any] = json.loads(os.pread(fh.fileno(), entry.length, entry.offset))
        return doc

    def export(self, start: int = 0, tail: int | None = None) -> bytes:
        """The lines of steps >= ``start`` (the last ``tail`` of them), in step order."""
        steps = sorted(s for s in self.index if s >= start)
        if tail is not None:
            steps = steps[len(steps) - tail :] if tail else []
        if not steps:
            return b""
        data = self.path.read_bytes()
        return b"".join(
            data[e.offset : e.offset + e.length] for e in (self.index[s] for s in steps)
        )


def _append(path: Path, line: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, line)
        os.fdatasync(fd)
    finally:
        os.close(fd)


class Trajectories:
    """The logs of a node's boxes, files in ``directory`` (``<id>.log``), loaded on first use."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._logs: dict[str, BoxLog] = {}

    def of(self, sandbox_id: str) -> BoxLog:
        box = self._logs.get(sandbox_id)
        if box is None:
            box = self._logs[sandbox_id] = BoxLog(self.directory / f"{sandbox_id}.log")
        return box

    def drop(self, sandbox_id: str) -> None:
        """Forget a destroyed sandbox's log and delete its file."""
        self._logs.pop(sandbox_id, None)
        (self.directory / f"{sandbox_id}.log").unlink(missing_ok=True)
        (self.directory / f"{sandbox_id}.running").unlink(missing_ok=True)

    def sweep(self, keep: set[str]) -> None:
        """Delete the logs of sandboxes other than ``keep`` (after a restart's adoption)."""
        for path in self.directory.glob("*.log"):
            if path.stem not in keep:
                self.drop(path.stem)


def step_of(request: Request) -> int | None:
    """The step the call carries (header :data:`STEP_HEADER`), or None: not logged."""
    raw = request.headers.get(STEP_HEADER)
    if raw is None:
        return None
    try:
        step = int(raw)
    except ValueError:
        step = -1
    if step < 0:
        raise InvalidArgument(f"header {STEP_HEADER} must be a step number >= 0, got {raw!r}")
    return step


# ---------------------------------------------------------------------------- output bounds


class _HeadTail:
    """Keeps the first and last bytes of a stream, at most ``limit`` in all."""

    def __init__(self, limit: int = LOG_BYTES) -> None:
        self._head_max = limit // 2
        self._tail_max = limit - self._head_max
        self._head = bytearray()
        self._tail = bytearray()
        self.total = 0

    def add(self, data: bytes) -> None:
        self.total += len(data)
        room = self._head_max - len(self._head)
        if room > 0:
            self._head += data[:room]
            data = data[room:]
        if data:
            self._tail += data
            if len(self._tail) > 2 * self._tail_max:
                del self._tail[: len(self._tail) - self._tail_max]

    def value(self) -> tuple[bytes, int]:
        tail = bytes(self._tail[-self._tail_max :]) if self._tail else b""
        kept = bytes(self._head) + tail
        return kept, self.total - len(kept)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _exec_log_result(
    result: ExecResult, out: bytes, err: bytes, out_cut: int = 0, err_cut: int = 0
) -> dict[str, Any]:
    """An exec result as logged: each output cut to :data:`LOG_BYTES`, with a note.

    ``out_cut``/``err_cut``: bytes a streamed exec's output lost already on its way here.
    """
    out, more_out = cut(out)
    err, more_err = cut(err)
    out_cut += more_out
    err_cut += more_err
    doc = result.model_dump(mode="json")
    doc.update(
        stdout=_b64(out),
        stderr=_b64(err),
        stdout_dropped=result.stdout_dropped + out_cut,
        stderr_dropped=result.stderr_dropped + err_cut,
    )
    notes = [
        f"{name}: {n} bytes cut in the log"
        for name, n in (("stdout", out_cut), ("stderr", err_cut))
        if n
    ]
    if notes:
        doc["note"] = "; ".join(notes) + f" (it keeps {LOG_BYTES} bytes of each, head and tail)"
    return doc


def _bounded_command(fields: dict[str, Any], data: bytes) -> dict[str, Any]:
    """An exec/spawn request as logged: stdin over :data:`LOG_BYTES` is left out, with a note."""
    if len(data) <= LOG_BYTES:
        return fields
    return {**fields, "stdin": "", "note": f"stdin of {len(data)} bytes not kept in the log"}


def _content(fields: dict[str, Any], data: bytes, size: int, key: str) -> dict[str, Any]:
    if size <= LOG_BYTES:
        return {**fields, "size": size, key: _b64(data)}
    return {**fields, "size": size, "note": f"{key} of {size} bytes not kept in the log"}


def _dump(value: BaseModel | None) -> dict[str, Any]:
    return {} if value is None else value.model_dump(mode="json")


# ---------------------------------------------------------------------------- HTTP glue


class Logged:
    """The node's calls that carry a step: checked against, run into and answered from the log."""

    def __init__(self, svc: NodeService) -> None:
        self._svc = svc
        self._detached: dict[tuple[str, int], asyncio.Future[Response]] = {}
        self._cancelling: set[tuple[str, int]] = set()

    async def detached(self, sandbox_id: str, step: int, work: Awaitable[Response]) -> Response:
        """Run a logged call to its end even if its caller goes away.

        A caller that dies (a preempted trainer) cannot say whether it meant to
        cancel: the call runs on and is logged, and the caller's successor,
        re-issuing it, gets the logged result rather than a second run. A caller
        that does mean to cancel says so with :meth:`cancel`.
        """
        key = (sandbox_id, step)
        task = asyncio.ensure_future(work)
        self._detached[key] = task
        task.add_done_callback(lambda _: self._detached.pop(key, None))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.cancelled():  # stopped by cancel(): its caller asked for that and left
                raise ClientDisconnect() from None
            raise

    async def cancel(self, sandbox_id: str, step: int) -> str:
        """Cancel the call running under ``step`` (its command is killed); what became of it.

        ``"cancelled"``: it was stopped, the step is free; ``"logged"``: it ended
        first, its result is logged under the step; ``"free"``: no call holds
        the step. Waits for a running call that cannot be cancelled to end.
        """
        box = self._log(sandbox_id)
        key = (sandbox_id, step)
        task = self._detached.get(key)
        cancelled = False
        if task is not None and not task.done():
            self._cancelling.add(key)
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            self._cancelling.discard(key)
            cancelled = True
        if step not in box.index and step not in box.running:
            # Stopped, or never arrived (cancelled on its way): a hole the calls
            # after it must not wait for.
            box.skip(step)
            return "cancelled" if cancelled else "free"
        got = await box.begin(step)
        if isinstance(got, _Entry):
            return "logged"
        box.release(got)
        return "cancelled" if cancelled else "free"

    def _log(self, sandbox_id: str) -> BoxLog:
        self._svc._box(sandbox_id)  # NotFound / FailedPrecondition before anything else
        return self._svc.trajectory.of(sandbox_id)

    def _check(
        self, box: BoxLog, entry: _Entry, step: int, op: str, fields: dict[str, Any]
    ) -> dict[str, Any]:
        """The logged line of ``step`` if the call matches it, else Diverged."""
        doc = box.read(entry)
        if entry.op == op and entry.digest == digest(op, fields):
            return doc
        raise Diverged(
            f"step {step} diverged from the trajectory log: the log holds"
            f" {describe(entry.op, doc.get('request', {}))} (digest {entry.digest[:12]}) there,"
            f" this call is {describe(op, fields)} (digest {digest(op, fields)[:12]}); nothing"
            " was run. Re-issue the logged calls in order, or attach without resume_from_log"
            " to continue after the log's end"
        )

    @staticmethod
    def _doc(
        step: int, op: str, fields: dict[str, Any], stored: dict[str, Any], result: dict[str, Any]
    ) -> dict[str, Any]:
        return {
            "step": step,
            "op": op,
            "digest": digest(op, fields),
            "request": stored,
            "result": result,
            "at": time.time(),
        }

    async def _finish(self, box: BoxLog, reserved: _Running, doc: dict[str, Any]) -> None:
        # Shielded: a caller gone mid-fsync must not leave the line written but unindexed.
        await asyncio.shield(box.commit(reserved, doc))

    async def call(
        self,
        sandbox_id: str,
        step: int,
        op: str,
        fields: dict[str, Any],
        run: Callable[[], Awaitable[BaseModel | None]],
        *,
        stored: dict[str, Any] | None = None,
        status_code: int = 200,
    ) -> Response:
        """One logged call whose request is known up front (all but file and stdin data)."""
        box = self._log(sandbox_id)
        got = await box.begin(step)
        if isinstance(got, _Entry):
            doc = self._check(box, got, step, op, fields)
            return _answer(doc["result"], status_code, replayed=True)
        try:
            value = await run()
        except BaseException:
            box.release(got)
            raise
        await self._finish(box, got, self._doc(step, op, fields, stored or fields, _dump(value)))
        if value is None:
            return Response(status_code=status_code)
        return Response(
            value.model_dump_json(), status_code=status_code, media_type="application/json"
        )

    async def exec(
        self, sandbox_id: str, step: int, req: ExecRequest, run: Callable[[], Awaitable[ExecResult]]
    ) -> Response:
        box = self._log(sandbox_id)
        fields = exec_fields(req)
        got = await box.begin(step)
        if isinstance(got, _Entry):
            doc = self._check(box, got, step, "exec", fields)
            return _answer({**doc["result"], "replayed": True}, 200, replayed=True)
        stored = _bounded_command(fields, req.stdin)
        doc = self._doc(step, "exec", fields, stored, {})
        try:
            box.mark(step, doc)
            result = await run()
        except asyncio.CancelledError:
            if (sandbox_id, step) in self._cancelling:
                box.release(got)  # its caller asked: the step is free again
            else:
                # The node agent is stopping: its command dies with it. The mark
                # stays, and the next start logs the step as killed (never rerun).
                box.abandon(got)
            raise
        except BaseException:
            box.release(got)
            raise
        doc["result"] = _exec_log_result(result, result.stdout, result.stderr)
        await self._finish(box, got, doc)
        return Response(result.model_dump_json(), media_type="application/json")

    async def exec_stream(self, sandbox_id: str, step: int, req: ExecRequest) -> StreamingResponse:
        """A streamed exec: relayed as it comes; its result (with bounded output) is logged."""
        box = self._log(sandbox_id)
        fields = exec_fields(req)
        got = await box.begin(step)
        if isinstance(got, _Entry):
            doc = self._check(box, got, step, "exec", fields)
            lines = _replayed_events(doc["result"])
            return StreamingResponse(iter(lines), media_type=NDJSON, headers=_REPLAYED)
        reserved = got
        cm = self._svc.exec_stream(sandbox_id, req)
        try:
            events = await cm.__aenter__()
        except BaseException:
            box.release(reserved)
            raise
        stored = _bounded_command(fields, req.stdin)

        async def body() -> AsyncIterator[bytes]:
            out, err = _HeadTail(), _HeadTail()
            committing = False
            try:
                async for event in events:
                    if event.type == "stdout":
                        out.add(event.data)
                    elif event.type == "stderr":
                        err.add(event.data)
                    elif event.type == "result" and event.result is not None:
                        (o, o_cut), (e, e_cut) = out.value(), err.value()
                        logged = _exec_log_result(event.result, o, e, o_cut, e_cut)
                        committing = True
                        await self._finish(
                            box, reserved, self._doc(step, "exec", fields, stored, logged)
                        )
                    yield event.to_line()
            finally:
                if not committing:
                    box.release(reserved)
                await cm.__aexit__(None, None, None)

        return StreamingResponse(body(), media_type=NDJSON)

    async def streamed(
        self,
        sandbox_id: str,
        step: int,
        op: str,
        fields: dict[str, Any],
        data: AsyncIterable[bytes],
        run: Callable[[AsyncIterator[bytes]], Awaitable[BaseModel | None]],
        *,
        key: str,
        status_code: int = 200,
    ) -> Response:
        """A logged call with a streamed body (file write, stdin): its digest covers the
        body's sha256, known once the body is read; a replay reads it without using it."""
        box = self._log(sandbox_id)
        hasher = hashlib.sha256()
        kept = bytearray()
        size = 0

        async def hashed() -> AsyncIterator[bytes]:
            nonlocal size
            async for chunk in data:
                hasher.update(chunk)
                size += len(chunk)
                if len(kept) <= LOG_BYTES:
                    kept.extend(chunk[: LOG_BYTES + 1 - len(kept)])
                yield chunk

        got = await box.begin(step)
        if isinstance(got, _Entry):
            async for _ in hashed():
                pass
            full = {**fields, "sha256": hasher.hexdigest()}
            doc = self._check(box, got, step, op, full)
            return _answer(doc["result"], status_code, replayed=True)
        try:
            value = await run(hashed())
        except BaseException:
            box.release(got)
            raise
        full = {**fields, "sha256": hasher.hexdigest()}
        stored = _content(full, bytes(kept), size, key)
        await self._finish(box, got, self._doc(step, op, full, stored, _dump(value)))
        if value is None:
            return Response(status_code=status_code)
        return Response(
            value.model_dump_json(), status_code=status_code, media_type="application/json"
        )

    def spawn_fields(self, req: SpawnRequest) -> tuple[dict[str, Any], dict[str, Any]]:
        """The digest fields and the logged (bounded) copy of a spawn."""
        fields = spawn_fields(req)
        return fields, _bounded_command(fields, req.stdin)

    def export(self, sandbox_id: str, start: int, tail: int | None) -> Awaitable[bytes]:
        box = self._log(sandbox_id)
        return asyncio.to_thread(box.export, start, tail)


def _answer(result: dict[str, Any], status_code: int, *, replayed: bool) -> Response:
    headers = _REPLAYED if replayed else None
    if status_code == 204:
        return Response(status_code=204, headers=headers)
    return Response(
        json.dumps(result, separators=(",", ":")),
        status_code=status_code,
        media_type="application/json",
        headers=headers,
    )


def _replayed_events(result: dict[str, Any]) -> list[bytes]:
    """A logged exec result as the lines of a streamed exec: output, then the result."""
    full = ExecResult.model_validate({**result, "replayed": True})
    lines = [
        ExecEvent(type=kind, data=data).to_line()
        for kind, data in (("stdout", full.stdout), ("stderr", full.stderr))
        if data
    ]
    empty = full.model_copy(update={"stdout": b"", "stderr": b""})
    lines.append(ExecEvent(type="result", result=empty).to_line())
    return lines
