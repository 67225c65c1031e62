"""Async client of the in-sandbox agent, used by the node agent.

One connection per call (the agent forks a handler per connection), so calls
are independent: a hung command never delays a ping or a file read.
"""

from __future__ import annotations

import asyncio
import errno
import inspect
import os
import stat
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager, suppress
from typing import Any

from sandfleet.guest import protocol as p
from sandfleet.wire.errors import (
    DeadlineExceeded,
    Internal,
    InvalidArgument,
    SandfleetError,
    Unavailable,
)
from sandfleet.wire.models import (
    ExecRequest,
    ExecResult,
    FileEntry,
    OutputChunk,
    ProcessInfo,
    SpawnRequest,
)

__all__ = ["AgentClient", "OutputCallback", "open_socket_file"]

OutputCallback = Callable[[bytes], Awaitable[None] | None]
"""Receives output chunks as they arrive; may be a plain or an async function."""


class _Conn:
    """One connection: frame I/O, with transport failures turned into Unavailable."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def send_data(self, data: bytes | AsyncIterable[bytes]) -> None:
        """Data frames of at most CHUNK bytes, then the end frame."""
        if isinstance(data, bytes | bytearray | memoryview):
            view = memoryview(data)
            for off in range(0, len(view), p.CHUNK):
                await self.send(p.frame(p.DATA, bytes(view[off : off + p.CHUNK])))
        else:
            async for piece in data:
                view = memoryview(piece)
                for off in range(0, len(view), p.CHUNK):
                    await self.send(p.frame(p.DATA, bytes(view[off : off + p.CHUNK])))
        await self.send(p.frame(p.END))

    async def recv(self, idle_s: float | None = None) -> tuple[bytes, bytes]:
        """The next frame as ``(type, payload)``; ``idle_s`` bounds the wait, seconds."""
        async with asyncio.timeout(idle_s):
            head = await self.reader.readexactly(5)
            n = int.from_bytes(head[:4], "big")
            if n > p.MAX_FRAME:
                raise Internal(f"agent sent a {n} byte frame, over the {p.MAX_FRAME} limit")
            return head[4:5], await self.reader.readexactly(n) if n else b""


async def open_socket_file(
    path: str, limit: int = 1 << 20
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Connect to the Unix socket *file* at ``path``, never through a symlink.

    The connection goes through ``/proc/self/fd/N`` of an ``O_PATH|O_NOFOLLOW``
    descriptor: that refuses a symlink planted in the socket's place and lifts
    the 108-byte ``sun_path`` limit on deep state directories.
    """
    fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if not stat.S_ISSOCK(os.fstat(fd).st_mode):
            raise ConnectionRefusedError(errno.ECONNREFUSED, f"{path} is not a socket")
        return await asyncio.open_unix_connection(f"/proc/self/fd/{fd}", limit=limit)
    finally:
        os.close(fd)


class AgentClient:
    """Talks to one ``sandfleet-agent`` over its Unix socket.

    ``margin_s`` (seconds) is added to an exec's own timeout to get the
    client-side deadline, so a dead or hung agent never hangs the caller.
    ``io_timeout_s`` (seconds) bounds every wait for the next frame of a
    non-exec call. Paths are the agent's own view (inside the sandbox).

    Every method raises :class:`Unavailable` when the socket is gone, nobody
    listens, or the agent dies mid-call, and :class:`DeadlineExceeded` when the
    agent stops answering.
    """

    def __init__(
        self,
        socket_path: str | os.PathLike[str],
        *,
        margin_s: float = 10.0,
        io_timeout_s: float = 60.0,
    ) -> None:
        self.socket_path = os.fspath(socket_path)
        self.margin_s = margin_s
        self.io_timeout_s = io_timeout_s

    def __repr__(self) -> str:
        return f"AgentClient({self.socket_path!r})"

    @asynccontextmanager
    async def _connect(self, op: str) -> AsyncIterator[_Conn]:
        try:
            reader, writer = await open_socket_file(self.socket_path)
        except FileNotFoundError as exc:
            raise Unavailable(
                f"agent socket {self.socket_path} does not exist: the agent is not running "
                "(or the sandbox is gone)"
            ) from exc
        except ConnectionRefusedError as exc:
            raise Unavailable(
                f"nothing listens on agent socket {self.socket_path}: the agent has exited"
            ) from exc
        except OSError as exc:
            raise Unavailable(f"cannot connect to agent socket {self.socket_path}: {exc}") from exc
        try:
            yield _Conn(reader, writer)
        except SandfleetError:
            raise
        except TimeoutError as exc:
            raise DeadlineExceeded(
                f"agent on {self.socket_path} stopped answering during {op} "
                f"(nothing for {self.io_timeout_s} s); it may be hung"
            ) from exc
        except (asyncio.IncompleteReadError, ConnectionError, OSError) as exc:
            raise Unavailable(
                f"agent on {self.socket_path} closed the connection during {op} before "
                f"answering: it died or was killed ({exc.__class__.__name__})"
            ) from exc
        finally:
            writer.close()
            with suppress(OSError):
                await writer.wait_closed()

    @staticmethod
    def _unexpected(op: str, ftype: bytes) -> Internal:
        return Internal(f"agent answered {op} with an unexpected frame {ftype!r}")

    async def ping(self) -> dict[str, Any]:
        """``{"version": str, "pid": int}`` of the agent (pid 1 when it is PID 1)."""
        async with self._connect("ping") as conn:
            await conn.send(p.frame(p.OP_PING))
            ftype, payload = await conn.recv(self.io_timeout_s)
            if ftype != p.OK:
                raise self._unexpected("ping", ftype)
            fields = p.decode_fields(payload)
            return {"version": fields["v"].decode(), "pid": int(fields["p"])}

    async def wait_ready(self, timeout_s: float) -> None:
        """Retry connecting and pinging until the agent answers.

        Raises :class:`DeadlineExceeded` if it does not within ``timeout_s`` seconds.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        delay = 0.005
        last: Exception | None = None
        while (remaining := deadline - loop.time()) > 0:
            try:
                async with asyncio.timeout(min(remaining, 2.0)):
                    await self.ping()
                return
            except (Unavailable, TimeoutError) as exc:
                last = exc
            await asyncio.sleep(max(0.0, min(delay, deadline - loop.time())))
            delay = min(delay * 2, 0.1)
        raise DeadlineExceeded(
            f"agent on {self.socket_path} did not answer within {timeout_s} s "
            f"(last error: {last or 'none'})"
        )

    async def exec(
        self,
        req: ExecRequest,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
        keep_output: bool = True,
    ) -> ExecResult:
        """Run ``req`` and return how it ended.

        With ``keep_output=False`` the result carries no stdout/stderr: a caller
        streaming through the callbacks need not hold the whole output too.

        ``status`` is ``exited``, ``signaled`` or ``timeout``, or ``oom`` when the
        agent runs with ``--oom-events`` (a VM; elsewhere the node decides that
        from cgroup counters). Output chunks go to the
        callbacks as they arrive; past ``max_output_bytes / 2`` the middle of a
        stream is dropped and the tail arrives just before the command's end.

        Raises :class:`InvalidArgument` for a missing or non-directory cwd and
        unpassable arguments, :class:`DeadlineExceeded` if the agent gives no
        answer within ``req.timeout_s + margin_s`` seconds, :class:`Unavailable`
        if it cannot be reached or dies.
        """
        head = p.encode_exec(req)
        limit = req.timeout_s + self.margin_s
        out, err = bytearray(), bytearray()
        async with self._connect("exec") as conn:
            await conn.send(head)
            # stdin goes concurrently: a command that never reads it must not
            # stop us from reading its output
            sender = asyncio.create_task(conn.send_data(req.stdin))
            try:
                async with asyncio.timeout(limit) as cm:
                    while True:
                        ftype, payload = await conn.recv()
                        if ftype in (p.STDOUT, p.STDERR):
                            if keep_output:
                                (out if ftype == p.STDOUT else err).extend(payload)
                            cb = on_stdout if ftype == p.STDOUT else on_stderr
                            if cb is not None and inspect.isawaitable(res := cb(payload)):
                                await res
                        elif ftype == p.RESULT:
                            return p.decode_result(payload, bytes(out), bytes(err))
                        elif ftype == p.ERROR:
                            raise p.decode_error(payload, in_exec=True)
                        else:
                            raise self._unexpected("exec", ftype)
            except TimeoutError as exc:
                if cm.expired():
                    raise DeadlineExceeded(
                        f"agent on {self.socket_path} gave no result within {limit:.1f} s "
                        f"(command timeout {req.timeout_s} s + {self.margin_s} s margin); "
                        "the agent may be hung"
                    ) from exc
                raise
            finally:
                sender.cancel()
                await asyncio.gather(sender, return_exceptions=True)

    async def read_file(self, path: str) -> AsyncIterator[bytes]:
        """Yield the contents of ``path`` in chunks of at most 256 KiB.

        Raises :class:`NotFound`, :class:`PermissionDenied`, :class:`InvalidArgument`
        (a directory) on the first iteration. Close early with ``contextlib.aclosing``.
        """
        async with self._connect("read_file") as conn:
            await conn.send(p.frame(p.OP_READ, p.encode_fields([p.path_field(path)])))
            while True:
                ftype, payload = await conn.recv(self.io_timeout_s)
                if ftype == p.DATA:
                    yield payload
                elif ftype == p.END:
                    return
                elif ftype == p.ERROR:
                    raise p.decode_error(payload)
                else:
                    raise self._unexpected("read_file", ftype)

    async def write_file(
        self, path: str, data: bytes | AsyncIterable[bytes], mode: int = 0o644
    ) -> FileEntry:
        """Write ``data`` to ``path`` atomically (temp file + rename); ``mode`` in octal bits.

        The parent directory must exist. Raises :class:`NotFound` (no parent),
        :class:`InvalidArgument` (a directory), :class:`PermissionDenied`,
        :class:`FailedPrecondition` (disk full).
        """
        fields = [p.path_field(path), (b"M", (mode & 0o7777).to_bytes(4, "big"))]
        async with self._connect("write_file") as conn:
            await conn.send(p.frame(p.OP_WRITE, p.encode_fields(fields)))
            await conn.send_data(data)
            return await self._entry(conn, "write_file", path)

    async def list_dir(self, path: str) -> list[FileEntry]:
        """Entries of directory ``path`` (without ``.`` and ``..``), not sorted."""
        entries: list[FileEntry] = []
        async with self._connect("list_dir") as conn:
            await conn.send(p.frame(p.OP_LIST, p.encode_fields([p.path_field(path)])))
            while True:
                ftype, payload = await conn.recv(self.io_timeout_s)
                if ftype == p.ENTRY:
                    entries.append(p.decode_entry(payload, None, parent=path))
                elif ftype == p.END:
                    return entries
                elif ftype == p.ERROR:
                    raise p.decode_error(payload)
                else:
                    raise self._unexpected("list_dir", ftype)

    async def stat(self, path: str) -> FileEntry:
        """``lstat`` of ``path``: a symlink is reported as such, not followed."""
        async with self._connect("stat") as conn:
            await conn.send(p.frame(p.OP_STAT, p.encode_fields([p.path_field(path)])))
            return await self._entry(conn, "stat", path)

    async def remove(self, path: str, recursive: bool = False) -> None:
        """Remove a file, symlink or empty directory; a whole tree with ``recursive``.

        Raises :class:`NotFound` if ``path`` does not exist and
        :class:`InvalidArgument` for a non-empty directory without ``recursive``.
        """
        fields = [p.path_field(path), (b"R", bytes([int(recursive)]))]
        async with self._connect("remove") as conn:
            await conn.send(p.frame(p.OP_REMOVE, p.encode_fields(fields)))
            ftype, payload = await conn.recv(self.io_timeout_s)
            if ftype == p.ERROR:
                raise p.decode_error(payload)
            if ftype != p.OK:
                raise self._unexpected("remove", ftype)

    async def mkdir(self, path: str, parents: bool = True, mode: int = 0o755) -> FileEntry:
        """Create directory ``path`` (and missing parents with ``parents``).

        With ``parents`` an existing directory is fine; without it, it is an
        :class:`InvalidArgument`.
        """
        fields = [
            p.path_field(path),
            (b"R", bytes([int(parents)])),
            (b"M", (mode & 0o7777).to_bytes(4, "big")),
        ]
        async with self._connect("mkdir") as conn:
            await conn.send(p.frame(p.OP_MKDIR, p.encode_fields(fields)))
            return await self._entry(conn, "mkdir", path)

    # ------------------------------------------------------------------ spawned processes

    async def _process(self, conn: _Conn, op: str, idle_s: float | None) -> ProcessInfo:
        ftype, payload = await conn.recv(idle_s)
        if ftype == p.PROCESS:
            return p.decode_process(payload)
        if ftype == p.ERROR:
            raise p.decode_error(payload, in_exec=op == "spawn")
        raise self._unexpected(op, ftype)

    async def _ok(self, conn: _Conn, op: str) -> None:
        ftype, payload = await conn.recv(self.io_timeout_s)
        if ftype == p.ERROR:
            raise p.decode_error(payload)
        if ftype != p.OK:
            raise self._unexpected(op, ftype)

    async def spawn(self, req: SpawnRequest) -> ProcessInfo:
        """Start a background process and return at once (state ``running``).

        It outlives this connection; address it by ``info.id``. Raises
        :class:`InvalidArgument` (bad cwd, unknown user), :class:`PermissionDenied`
        (the sandbox cannot switch users), :class:`FailedPrecondition` (process limit).
        """
        head = p.encode_spawn(req)
        async with self._connect("spawn") as conn:
            await conn.send(head)
            await conn.send_data(req.stdin)
            return await self._process(conn, "spawn", self.io_timeout_s)

    async def list_processes(self) -> list[ProcessInfo]:
        """Every spawned process not yet removed, running or finished, by id."""
        out: list[ProcessInfo] = []
        async with self._connect("list_processes") as conn:
            await conn.send(p.frame(p.OP_PROC_LIST))
            while True:
                ftype, payload = await conn.recv(self.io_timeout_s)
                if ftype == p.PROCESS:
                    out.append(p.decode_process(payload))
                elif ftype == p.END:
                    return out
                elif ftype == p.ERROR:
                    raise p.decode_error(payload)
                else:
                    raise self._unexpected("list_processes", ftype)

    async def wait_process(self, process_id: str, timeout_s: float | None = None) -> ProcessInfo:
        """Block until the process ends, or ``timeout_s`` seconds pass (then its
        state is still ``running``). Raises :class:`NotFound` for an unknown id."""
        limit = None if timeout_s is None else timeout_s + self.margin_s
        async with self._connect("wait_process") as conn:
            await conn.send(p.proc_op(p.OP_PROC_WAIT, process_id, p.timeout_ms(timeout_s)))
            return await self._process(conn, "wait_process", limit)

    async def kill_process(self, process_id: str, signal: int = 9) -> ProcessInfo:
        """Send ``signal`` to the process and everything it started (also jobs it
        left behind after ending). With SIGKILL the answer comes once all are gone."""
        if not 1 <= signal <= 64:
            raise InvalidArgument(f"signal is {signal}: give a signal number from 1 to 64")
        async with self._connect("kill_process") as conn:
            await conn.send(
                p.proc_op(p.OP_PROC_KILL, process_id, [(b"g", signal.to_bytes(8, "big"))])
            )
            return await self._process(conn, "kill_process", self.io_timeout_s)

    async def write_stdin(self, process_id: str, data: bytes | AsyncIterable[bytes]) -> None:
        """Write ``data`` to the process's stdin; returns once it is in the pipe.

        Raises :class:`FailedPrecondition` if stdin is closed or the process ended.
        """
        async with self._connect("write_stdin") as conn:
            await conn.send(p.proc_op(p.OP_PROC_STDIN, process_id))
            # the answer may come early (an error): read it while sending
            sender = asyncio.create_task(conn.send_data(data))
            try:
                await self._ok(conn, "write_stdin")
            finally:
                if not sender.done():
                    sender.cancel()
                await asyncio.gather(sender, return_exceptions=True)

    async def close_stdin(self, process_id: str) -> None:
        """Close the process's stdin (it reads EOF once earlier input is consumed)."""
        async with self._connect("close_stdin") as conn:
            await conn.send(p.proc_op(p.OP_PROC_CLOSE_STDIN, process_id))
            await self._ok(conn, "close_stdin")

    async def read_output(
        self, process_id: str, stream: str = "stdout", offset: int = 0
    ) -> OutputChunk:
        """The output retained from ``offset`` up to now.

        ``dropped`` counts bytes after ``offset`` lost to the retention bound;
        continue from ``next_offset``.
        """
        fields = [p.stream_field(stream), p.offset_field(offset)]
        data = bytearray()
        first: OutputChunk | None = None
        last: OutputChunk | None = None
        async with self._connect("read_output") as conn:
            await conn.send(p.proc_op(p.OP_PROC_OUTPUT, process_id, fields))
            while True:
                ftype, payload = await conn.recv(self.io_timeout_s)
                if ftype == p.OUTPUT:
                    last = p.decode_output(payload)
                    first = first or last
                    data += last.data
                elif ftype == p.END:
                    break
                elif ftype == p.ERROR:
                    raise p.decode_error(payload)
                else:
                    raise self._unexpected("read_output", ftype)
        if first is None or last is None:
            raise Internal("agent answered read_output without any output frame")
        return OutputChunk(
            data=bytes(data),
            offset=first.offset,
            next_offset=last.next_offset,
            dropped=first.dropped,
            eof=last.eof,
        )

    async def follow_output(
        self,
        process_id: str,
        stream: str = "stdout",
        offset: int = 0,
        timeout_s: float | None = None,
    ) -> AsyncIterator[OutputChunk]:
        """Yield output from ``offset`` as it comes, until the process has ended
        and all its output up to then was yielded, or ``timeout_s`` passes.

        Each chunk's ``dropped`` counts bytes lost before it (a slow reader
        falls behind the retention bound). Close early with ``contextlib.aclosing``.
        """
        fields = [
            p.stream_field(stream),
            p.offset_field(offset),
            (b"f", b"\x01"),
            *p.timeout_ms(timeout_s),
        ]
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s + self.margin_s
        async with self._connect("follow_output") as conn:
            await conn.send(p.proc_op(p.OP_PROC_OUTPUT, process_id, fields))
            while True:
                # bound each wait, not the whole body: a timeout scope must not
                # stay open across a yield
                left = None if deadline is None else max(0.0, deadline - loop.time())
                ftype, payload = await conn.recv(left)
                if ftype == p.OUTPUT:
                    chunk = p.decode_output(payload)
                    if chunk.data or chunk.dropped:
                        yield chunk
                elif ftype == p.END:
                    return
                elif ftype == p.ERROR:
                    raise p.decode_error(payload)
                else:
                    raise self._unexpected("follow_output", ftype)

    async def remove_process(self, process_id: str) -> None:
        """Forget a finished process and its output. Raises :class:`FailedPrecondition`
        while it runs (kill or wait first) and :class:`NotFound` for an unknown id."""
        async with self._connect("remove_process") as conn:
            await conn.send(p.proc_op(p.OP_PROC_REMOVE, process_id))
            await self._ok(conn, "remove_process")

    async def _entry(self, conn: _Conn, op: str, path: str) -> FileEntry:
        ftype, payload = await conn.recv(self.io_timeout_s)
        if ftype == p.ENTRY:
            return p.decode_entry(payload, path)
        if ftype == p.ERROR:
            raise p.decode_error(payload)
        raise self._unexpected(op, ftype)
