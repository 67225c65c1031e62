"""The blocking SDK: :class:`Client` and its :class:`Sandbox` handles.

Same surface as :mod:`sandfleet.sdk.client` — same names, parameters and
defaults, methods not async — over an ``httpx.Client``: no event loop or
thread behind it. Request building, answer parsing and error translation are
shared with the async client through :mod:`sandfleet.sdk._core`. Method
docstrings are the async ones (copied at import).

Example::

    with Client() as client, client.create(image="python:3.11") as sb:
        print(sb.exec("echo hi").stdout_text)
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import os
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from types import TracebackType
from typing import Any, TypeVar

import httpx

from sandfleet.sdk import _core, _snapshot, _steps
from sandfleet.sdk.client import AsyncClient, AsyncFiles, AsyncProcess, AsyncSandbox
from sandfleet.wire.errors import (
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NotFound,
    SandfleetError,
)
from sandfleet.wire.models import (
    ExecEvent,
    ExecResult,
    FileEntry,
    GroupResult,
    ImageManifest,
    LogEntry,
    NodeInfo,
    OutputChunk,
    PoolInfo,
    ProcessInfo,
    RunResult,
    SandboxEvent,
    SandboxInfo,
)

__all__ = ["Client", "Files", "OutputCallback", "Process", "Sandbox"]

T = TypeVar("T")

OutputCallback = Callable[[bytes], None]
"""Receives output bytes as they arrive."""


class Client:
    """A connection to a sandfleet control plane, for blocking code.

    ``url``, ``token`` and ``timeout_s`` (seconds per request) as for
    :class:`AsyncClient`: unset values come from ``SANDFLEET_URL`` /
    ``SANDFLEET_TOKEN``, then ``http://127.0.0.1:7070``, no token, 30 s.
    One client holds one connection pool and may be shared between threads;
    close it with :meth:`close` or ``with``. Every failure is a
    :class:`sandfleet.wire.errors.SandfleetError`.

    Raises ``InvalidArgument`` for a malformed URL or a non-positive timeout.
    """

    def __init__(
        self, url: str | None = None, *, token: str | None = None, timeout_s: float | None = None
    ) -> None:
        self._settings = _core.Settings.resolve(url, token, timeout_s)
        self._http = httpx.Client(
            base_url=self._settings.url,
            headers=self._settings.headers(),
            timeout=self._settings.timeout_s,
            transport=httpx.HTTPTransport(
                limits=_core.POOL_LIMITS, socket_options=_core.SOCKET_OPTIONS
            ),
        )
        self._closed = False

    @property
    def url(self) -> str:
        """The control plane's base URL this client talks to."""
        return self._settings.url

    def __repr__(self) -> str:
        return f"Client(url={self.url!r})"

    def _timeout(self, request: _core.Request[Any]) -> Any:
        if self._closed:
            raise FailedPrecondition("this Client is closed; create a new one")
        timeout = self._settings.http_timeout(request.timeout_s)
        return httpx.USE_CLIENT_DEFAULT if timeout is None else timeout

    def _send(self, request: _core.Request[T], content: Any = None) -> T:
        timeout = self._timeout(request)
        with _core.translate_errors(self._settings, request):
            response = self._http.request(
                request.method,
                request.path,
                params=request.params,
                content=request.body if content is None else content,
                headers=request.headers,
                timeout=timeout,
            )
        return _core.finish(request, response.status_code, response.content)

    def _lines(self, request: _core.Request[Any]) -> Generator[bytes, None, None]:
        """The NDJSON lines of a streamed answer; closing early closes the connection."""
        timeout = self._timeout(request)
        with (
            _core.translate_errors(self._settings, request),
            self._http.stream(
                request.method,
                request.path,
                params=request.params,
                content=request.body,
                headers=request.headers,
                timeout=timeout,
            ) as response,
        ):
            if response.status_code >= 400:
                _core.check_status(response.status_code, response.read())
            lines = _core.Lines()
            for chunk in response.iter_raw():
                yield from lines.feed(chunk)
            lines.end()

    def create(
        self,
        *,
        kind: str = "container",
        image: str,
        workspace: str | None = None,
        cpu: float = 1.0,
        memory_mb: int = 512,
        pids_limit: int = 256,
        disk_mb: int = 4096,
        ttl_s: float | None = 3600.0,
        labels: Mapping[str, str] | None = None,
        env: Mapping[str, str] | None = None,
        idle_ttl_s: float | None = None,
    ) -> Sandbox:
        return _logging(
            self,
            self._send(
                _core.create_request(
                    kind=kind,
                    image=image,
                    workspace=workspace,
                    cpu=cpu,
                    memory_mb=memory_mb,
                    pids_limit=pids_limit,
                    disk_mb=disk_mb,
                    ttl_s=ttl_s,
                    labels=labels,
                    env=env,
                    idle_ttl_s=idle_ttl_s,
                )
            ),
        )

    def get(self, sandbox_id: str) -> Sandbox:
        return Sandbox(self, self._send(_core.get_request(sandbox_id)))

    def attach(self, sandbox_id: str, *, resume_from_log: bool = False) -> Sandbox:
        info = self._send(_core.get_request(sandbox_id))
        tail = None if resume_from_log else 1
        entries = self._send(_steps.log_request(sandbox_id, tail=tail))
        sandbox = Sandbox(self, info)
        if resume_from_log:
            sandbox._steps = _steps.Steps(0, entries)
        else:
            sandbox._steps = _steps.Steps(entries[-1].step + 1 if entries else 0)
        return sandbox

    def list(self, labels: Mapping[str, str] | None = None) -> builtins.list[SandboxInfo]:
        return self._send(_core.list_request(labels))

    def run(
        self,
        code: str | Sequence[str],
        *,
        kind: str = "container",
        image: str | None = None,
        language: str | None = None,
        workspace: str | None = None,
        stdin: bytes | str | None = None,
        args: Sequence[str] | None = None,
        env: Mapping[str, str] | None = None,
        files: Mapping[str, bytes | str] | None = None,
        fetch_files: Sequence[str] | None = None,
        cwd: str | None = None,
        timeout_s: float | None = None,
        compile_timeout_s: float = 30.0,
        user: str | None = None,
        cpu: float = 1.0,
        memory_mb: int | None = None,
        pids_limit: int = 256,
        disk_mb: int = 4096,
        max_output_bytes: int | None = None,
        ttl_s: float | None = 3600.0,
        labels: Mapping[str, str] | None = None,
    ) -> RunResult:
        """Run one program or command and return how it ended.

        ``kind="fncall"``: ``code`` is a program in ``language`` (python, the
        default; bash; c; cpp: compiled under ``compile_timeout_s`` first) run
        in a warm, scrubbed worker of the ``image``'s pool (default
        :data:`~sandfleet.wire.models.FNCALL_IMAGE`); ``files`` ({path: content},
        relative to the working dir /tmp) are written first, ``fetch_files``
        come back in the result's ``files``. Defaults: ``timeout_s`` 10 s,
        ``memory_mb`` 256 MiB, ``max_output_bytes`` 1 MiB per stream.

        A sandbox kind: ``code`` is a command (a list runs as is, a str through
        ``/bin/sh -c``) run in a fresh sandbox — create, exec, destroy — with
        the parameters of :meth:`create` and of exec (``env`` goes to the
        command). The sandbox is always destroyed, on success, error or
        cancellation. Defaults: ``timeout_s`` 60 s, ``memory_mb`` 512 MiB,
        ``max_output_bytes`` 16 MiB.

        Either way the result is a :class:`RunResult` with the statuses of exec
        (``exited``, ``signaled``, ``timeout``, ``oom``). All arguments are
        checked before any request.

        Raises ``InvalidArgument`` (bad arguments; fncall-only ones with a
        sandbox kind), ``NotFound`` (no such image), ``ResourceExhausted``
        (fncall: the pool's queue is full; sandbox: no node has room),
        ``FailedPrecondition`` (the image cannot run ``language``), and what
        create, exec and destroy raise.
        """
        timeout_s, memory_mb = _core.run_defaults(kind, timeout_s, memory_mb)
        if kind == "fncall":
            _core.check_not_sandbox_only(
                workspace=workspace,
                cwd=cwd,
                user=user,
                labels=labels,
                cpu=cpu != 1.0,
                pids_limit=pids_limit != 256,
                disk_mb=disk_mb != 4096,
                ttl_s=ttl_s != 3600.0,
            )
            return self._send(
                _core.fncall_request(
                    code,
                    language=language,
                    image=image,
                    stdin=stdin,
                    args=args,
                    env=env,
                    files=files,
                    fetch_files=fetch_files,
                    timeout_s=timeout_s,
                    compile_timeout_s=compile_timeout_s,
                    memory_mb=memory_mb,
                    max_output_bytes=_core.FNCALL_MAX_OUTPUT_BYTES
                    if max_output_bytes is None
                    else max_output_bytes,
                )
            )
        _core.check_not_fncall_only(
            language=language, args=args, files=files, fetch_files=fetch_files
        )
        if image is None:
            raise InvalidArgument(f"kind={kind!r} needs an image: pass image='name:tag'")
        create = _core.create_request(
            kind=kind,
            image=image,
            workspace=workspace,
            cpu=cpu,
            memory_mb=memory_mb,
            pids_limit=pids_limit,
            disk_mb=disk_mb,
            ttl_s=ttl_s,
            labels=labels,
            env=None,
        )
        body = _core.exec_body(
            code, env=env, cwd=cwd, stdin=stdin, timeout_s=timeout_s, user=user,
            max_output_bytes=_core.EXEC_MAX_OUTPUT_BYTES
            if max_output_bytes is None
            else max_output_bytes,
        )  # fmt: skip
        sandbox = _logging(self, self._send(create))
        try:
            return _core.as_run_result(sandbox._exec(body, timeout_s))
        finally:
            sandbox.destroy()

    def pause(self, *, labels: Mapping[str, str]) -> GroupResult:
        return self._send(_core.group_request("pause", labels))

    def resume(self, *, labels: Mapping[str, str]) -> GroupResult:
        return self._send(_core.group_request("resume", labels))

    def images(self) -> builtins.list[ImageManifest]:
        return self._send(_core.images_request())

    def nodes(self) -> builtins.list[NodeInfo]:
        return self._send(_core.nodes_request())

    def pools(self) -> builtins.list[PoolInfo]:
        """Every fncall pool on every node: bounds, workers by state, counters."""
        return self._send(_core.pools_request())

    def configure_pool(
        self,
        *,
        image: str | None = None,
        language: str = "python",
        min_workers: int | None = None,
        max_workers: int | None = None,
        max_queue: int | None = None,
        idle_s: float | None = None,
    ) -> builtins.list[PoolInfo]:
        """Set the bounds of the (image, language) fncall pool on every node; their states.

        Unset bounds take :class:`~sandfleet.wire.models.PoolConfig`'s defaults.
        Warm a pool before a burst with ``min_workers``. Raises ``InvalidArgument``
        (min above max, out of range) and ``NotFound`` (no such image).
        """
        return self._send(
            _core.configure_pool_request(
                image=image,
                language=language,
                min_workers=min_workers,
                max_workers=max_workers,
                max_queue=max_queue,
                idle_s=idle_s,
            )
        )

    def close(self) -> None:
        """Close the connection pool. Idempotent."""
        if not self._closed:
            self._closed = True
            self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class Sandbox:
    """A handle on one sandbox; made by :meth:`Client.create` or :meth:`Client.get`.

    ``with sandbox:`` destroys it on exit.
    """

    def __init__(self, client: Client, info: SandboxInfo) -> None:
        self._client = client
        self._info = info
        self._destroyed = False
        self._steps: _steps.Steps | None = None
        self.files = Files(self)
        """File operations inside the sandbox."""

    @property
    def id(self) -> str:
        """The sandbox's id."""
        return self._info.id

    @property
    def step(self) -> int | None:
        """The step number this handle gives its next logged call; None if it logs none.

        Handles of :meth:`Client.create` and :meth:`Client.attach` log their
        calls; those of :meth:`Client.get` do not.
        """
        return None if self._steps is None else self._steps.next

    def log(self, start: int = 0) -> builtins.list[LogEntry]:
        return self._client._send(_steps.log_request(self._sandbox_id(), start))

    def events(self, since: float = 0.0) -> builtins.list[SandboxEvent]:
        return self._client._send(_core.events_request(self._sandbox_id(), since))

    def _call(
        self,
        request: _core.Request[T],
        op: str,
        fields: _steps.Fields,
        answer: Callable[[LogEntry], T],
        content: Any = None,
    ) -> T:
        """Send a call the trajectory log records: numbered, or answered from a fetched log."""
        steps = self._steps
        if steps is None:
            return self._client._send(request, content)
        if steps.unsettled is not None:
            unsettled = steps.unsettled
            state = self._client._send(_steps.cancel_request(self.id, unsettled))
            steps.unsettled = None
            steps.settle(unsettled, state)
        step, entry = steps.take(op, fields)
        if entry is not None:
            return answer(entry)
        try:
            return self._client._send(_steps.with_step(request, step), content)
        except SandfleetError as exc:
            if exc.retryable:  # the call may still run on the node: settle as below
                self._settle(step)
            else:
                steps.undo(step)  # the node refused it and left the step free
            raise
        except BaseException:
            # Interrupted (KeyboardInterrupt): the node runs a logged call on when
            # its caller goes away; stop it, and learn whether it ended first.
            self._settle(step)
            raise

    def _settle(self, step: int) -> None:
        steps = self._steps
        assert steps is not None
        try:
            state = self._client._send(_steps.cancel_request(self.id, step))
        except Exception:  # unknown (the node is unreachable): the next call asks
            steps.unsettled = step
            return
        steps.settle(step, state)

    @property
    def info(self) -> SandboxInfo:
        """What the control plane last said about this sandbox (see :meth:`refresh`)."""
        return self._info

    def __repr__(self) -> str:
        return f"Sandbox(id={self.id!r}, kind={self._info.kind!r}, state={self._info.state!r})"

    def _sandbox_id(self) -> str:
        if self._destroyed:
            raise NotFound(f"sandbox {self.id} was destroyed through this handle; create a new one")
        return self._info.id

    def exec(
        self,
        cmd: str | Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        stdin: bytes | str | None = None,
        timeout_s: float = 60.0,
        user: str | None = None,
        max_output_bytes: int | None = _core.EXEC_MAX_OUTPUT_BYTES,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
    ) -> ExecResult:
        body = _core.exec_body(
            cmd,
            env=env,
            cwd=cwd,
            stdin=stdin,
            timeout_s=timeout_s,
            user=user,
            max_output_bytes=max_output_bytes,
        )
        if on_stdout is None and on_stderr is None:
            return self._exec(body, timeout_s)
        collected = _core.ExecCollector.for_exec(max_output_bytes, on_stdout, on_stderr)
        with contextlib.closing(self._exec_events(body, timeout_s)) as events:
            for event in events:
                callback = {"stdout": on_stdout, "stderr": on_stderr}.get(event.type)
                if callback is not None:
                    callback(event.data)
                collected.add(event)
        return collected.result()

    def exec_stream(
        self,
        cmd: str | Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        stdin: bytes | str | None = None,
        timeout_s: float = 60.0,
        user: str | None = None,
        max_output_bytes: int | None = _core.EXEC_MAX_OUTPUT_BYTES,
    ) -> Iterator[ExecEvent]:
        body = _core.exec_body(
            cmd,
            env=env,
            cwd=cwd,
            stdin=stdin,
            timeout_s=timeout_s,
            user=user,
            max_output_bytes=max_output_bytes,
        )
        with contextlib.closing(self._exec_events(body, timeout_s)) as events:
            yield from events

    def _exec(self, body: bytes, timeout_s: float) -> ExecResult:
        client = self._client
        request = _core.exec_request(client._settings, self._sandbox_id(), body, timeout_s)
        return self._call(request, "exec", _steps.exec_of(body), _steps.exec_result)

    def _exec_events(self, body: bytes, timeout_s: float) -> Generator[ExecEvent, None, None]:
        client = self._client
        request = _core.exec_stream_request(client._settings, self._sandbox_id(), body, timeout_s)
        steps, step = self._steps, -1
        if steps is not None:
            step, entry = steps.take("exec", _steps.exec_of(body))
            if entry is not None:
                yield from _steps.exec_events(entry)
                return
            request = _steps.with_step(request, step)
        ended = False
        try:
            with contextlib.closing(client._lines(request)) as lines:
                for line in lines:
                    if ended:
                        raise Internal("the exec stream went on after its result event")
                    event = _core.parse_exec_event(line)
                    ended = event.type == "result"
                    yield event
                if not ended:  # read to the end, so the connection is reused
                    raise Internal("the exec stream ended without a result event")
        except BaseException:
            if steps is not None and not ended:
                steps.undo(step)  # no result: the node left the step free
            raise

    def spawn(
        self,
        cmd: str | Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        stdin: bytes | str | None = None,
        timeout_s: float | None = None,
        user: str | None = None,
        close_stdin: bool = False,
        max_output_bytes: int = _core.SPAWN_MAX_OUTPUT_BYTES,
    ) -> Process:
        request = _core.spawn_request(
            self._sandbox_id(),
            cmd,
            env=env,
            cwd=cwd,
            stdin=stdin,
            timeout_s=timeout_s,
            user=user,
            close_stdin=close_stdin,
            max_output_bytes=max_output_bytes,
        )
        fields = _steps.spawn_of(request.body or b"")
        return Process(self, self._call(request, "spawn", fields, _steps.process_info))

    def processes(self) -> builtins.list[ProcessInfo]:
        return self._client._send(_core.processes_request(self._sandbox_id()))

    def process(self, process_id: str) -> Process:
        return Process(
            self, self._client._send(_core.process_request(self._sandbox_id(), process_id))
        )

    def refresh(self) -> SandboxInfo:
        self._info = self._client._send(_core.get_request(self._sandbox_id()))
        return self._info

    def pause(self) -> None:
        self._info = self._client._send(_core.pause_request(self._sandbox_id()))

    def resume(self) -> None:
        self._info = self._client._send(_core.resume_request(self._sandbox_id()))

    def set_lifetime(
        self, *, ttl_s: float | None = _core.KEEP, idle_ttl_s: float | None = _core.KEEP
    ) -> SandboxInfo:
        request = _core.lifetime_request(self._sandbox_id(), ttl_s, idle_ttl_s)
        self._info = self._client._send(request)
        return self._info

    def snapshot(self, image: str | None = None, exclude: Sequence[str] | None = None) -> str:
        request = _snapshot.snapshot_request(self._sandbox_id(), image, exclude)
        return self._client._send(request).ref

    def fork(self, n: int) -> builtins.list[Sandbox]:
        _snapshot.check_fork_count(n)
        client = self._client
        info = self.refresh()
        image = self.snapshot()
        requests = _snapshot.fork_requests(info, image, n)
        with ThreadPoolExecutor(max_workers=n, thread_name_prefix="sandfleet-fork") as pool:
            futures = [pool.submit(client._send, r) for r in requests]
            wait(futures)
        errors = [e for f in futures if (e := f.exception()) is not None]
        # New sandboxes: their calls are logged from step 0, like create()'s.
        made = [_logging(client, f.result()) for f in futures if f.exception() is None]
        if errors:
            for sandbox in made:
                with contextlib.suppress(Exception):
                    sandbox.destroy()
            raise _snapshot.fork_error(errors, n, image)
        return made

    def destroy(self) -> None:
        if self._destroyed:
            return
        with contextlib.suppress(NotFound):
            self._client._send(_core.destroy_request(self.id))
        self._destroyed = True

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.destroy()


class Process:
    """A background process in a sandbox; made by :meth:`Sandbox.spawn` or :meth:`Sandbox.process`.

    The process lives in the sandbox, not in this handle: dropping the handle
    or closing the client leaves it running. Every method raises ``NotFound``
    (the process was removed or the sandbox is gone), ``Unavailable`` and
    ``DeadlineExceeded`` besides what it names.
    """

    def __init__(self, sandbox: Sandbox, info: ProcessInfo) -> None:
        self._sandbox = sandbox
        self._info = info

    @property
    def id(self) -> str:
        """The process's id in its sandbox (``p1``, ``p2``, ...)."""
        return self._info.id

    @property
    def info(self) -> ProcessInfo:
        """What the sandbox last said about the process (see :meth:`refresh`)."""
        return self._info

    def __repr__(self) -> str:
        return f"Process(id={self.id!r}, pid={self._info.pid}, state={self._info.state!r})"

    def _sid(self) -> str:
        return self._sandbox._sandbox_id()

    def _update(self, request: _core.Request[ProcessInfo]) -> ProcessInfo:
        self._info = self._sandbox._client._send(request)
        return self._info

    def refresh(self) -> ProcessInfo:
        return self._update(_core.process_request(self._sid(), self.id))

    def wait(self, timeout_s: float | None = None) -> ProcessInfo:
        client = self._sandbox._client
        return self._update(_core.wait_request(client._settings, self._sid(), self.id, timeout_s))

    def kill(self, signal: int = 9) -> ProcessInfo:
        request = _core.kill_request(self._sid(), self.id, signal)
        fields = _steps.plain(process_id=self.id, signal=int(signal))
        self._info = self._sandbox._call(request, "kill", fields, _steps.process_info)
        return self._info

    def write_stdin(self, data: bytes | str) -> None:
        request = _core.stdin_request(self._sid(), self.id, data)
        self._sandbox._call(request, "stdin", _steps.stdin_of(self.id, data), _steps.nothing)

    def close_stdin(self) -> None:
        request = _core.close_stdin_request(self._sid(), self.id)
        fields = _steps.plain(process_id=self.id)
        self._sandbox._call(request, "close_stdin", fields, _steps.nothing)

    def read_output(self, stream: str = "stdout", offset: int = 0) -> OutputChunk:
        request = _core.read_output_request(self._sid(), self.id, stream, offset)
        return self._sandbox._client._send(request)

    def follow_output(self, stream: str = "stdout", offset: int = 0) -> Iterator[OutputChunk]:
        client = self._sandbox._client
        request = _core.follow_output_request(self._sid(), self.id, stream, offset)
        with contextlib.closing(client._lines(request)) as lines:
            for line in lines:
                yield _core.parse_chunk_line(line)

    def remove(self) -> None:
        request = _core.remove_process_request(self._sid(), self.id)
        fields = _steps.plain(process_id=self.id)
        self._sandbox._call(request, "remove_process", fields, _steps.nothing)


class Files:
    """Files inside one sandbox (``sandbox.files``). Paths are absolute paths in the sandbox.

    Every method raises ``NotFound`` (no such path or sandbox),
    ``PermissionDenied`` (not writable), ``InvalidArgument`` and the transport
    errors ``Unavailable`` / ``DeadlineExceeded``.
    """

    def __init__(self, sandbox: Sandbox) -> None:
        self._sandbox = sandbox

    def _send(self, request: _core.Request[T], content: Any = None) -> T:
        return self._sandbox._client._send(request, content)

    def read(self, path: str, max_bytes: int = _core.READ_MAX_BYTES) -> bytes:
        return self._send(_core.read_request(self._sandbox._sandbox_id(), path, max_bytes))

    def write(self, path: str, data: bytes | str, mode: int = 0o644) -> FileEntry:
        request = _core.write_request(self._sandbox._sandbox_id(), path, mode, data)
        fields = _steps.write_of(path, mode, data)
        return self._sandbox._call(request, "write", fields, _steps.file_entry)

    def list(self, path: str = "/") -> builtins.list[FileEntry]:
        return self._send(_core.list_dir_request(self._sandbox._sandbox_id(), path))

    def stat(self, path: str) -> FileEntry:
        return self._send(_core.stat_request(self._sandbox._sandbox_id(), path))

    def remove(self, path: str, recursive: bool = False) -> None:
        request = _core.remove_request(self._sandbox._sandbox_id(), path, recursive)
        fields = _steps.plain(path=path, recursive=bool(recursive))
        self._sandbox._call(request, "remove", fields, _steps.nothing)

    def mkdir(self, path: str, parents: bool = True) -> FileEntry:
        request = _core.mkdir_request(self._sandbox._sandbox_id(), path, parents)
        fields = _steps.plain(path=path, parents=bool(parents))
        return self._sandbox._call(request, "mkdir", fields, _steps.file_entry)

    def upload(
        self, local_path: str | os.PathLike[str], remote_path: str, mode: int = 0o644
    ) -> FileEntry:
        request = _core.write_request(self._sandbox._sandbox_id(), remote_path, mode)
        fields = _steps.upload_of(local_path, remote_path, mode)
        with open(local_path, "rb") as file:
            chunks = iter(functools.partial(file.read, _core.CHUNK_BYTES), b"")
            return self._sandbox._call(request, "write", fields, _steps.file_entry, chunks)

    def download(self, remote_path: str, local_path: str | os.PathLike[str]) -> int:
        request = _core.read_request(self._sandbox._sandbox_id(), remote_path)
        client = self._sandbox._client
        if client._closed:
            raise FailedPrecondition("this Client is closed; create a new one")
        with (
            _core.translate_errors(client._settings, request),
            client._http.stream(request.method, request.path, params=request.params) as response,
        ):
            if response.status_code >= 400:
                _core.check_status(response.status_code, response.read())
            with _core.PartFile(local_path) as out:
                for chunk in response.iter_bytes(_core.CHUNK_BYTES):
                    out.write(chunk)
        return out.size


def _logging(client: Client, info: SandboxInfo) -> Sandbox:
    """A handle whose calls go to the sandbox's trajectory log from step 0 (a new sandbox)."""
    sandbox = Sandbox(client, info)
    sandbox._steps = _steps.Steps()
    return sandbox


def _copy_docs(sync_cls: type, async_cls: type) -> None:
    """Give each public sync method without a docstring its async twin's."""
    for name, member in vars(sync_cls).items():
        if name.startswith("_") or not callable(member) or member.__doc__:
            continue
        member.__doc__ = getattr(async_cls, name).__doc__


_copy_docs(Client, AsyncClient)
_copy_docs(Sandbox, AsyncSandbox)
_copy_docs(Files, AsyncFiles)
_copy_docs(Process, AsyncProcess)
