"""The async SDK: :class:`AsyncClient` and its :class:`AsyncSandbox` handles.

Only I/O happens here; what is sent and how answers are read lives in
:mod:`sandfleet.sdk._core`, shared with the sync :mod:`sandfleet.sdk.sync`.

Example::

    async with AsyncClient() as client:
        async with await client.create(image="python:3.11") as sb:
            result = await sb.exec(["python", "-c", "print(1)"])
            assert result.ok and result.stdout == b"1\\n"
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import inspect
import os
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Awaitable,
    Callable,
    Coroutine,
    Mapping,
    Sequence,
)
from types import TracebackType
from typing import IO, Any, TypeVar

import httpx

from sandfleet.sdk import _core, _snapshot, _steps
from sandfleet.sdk._batch import RunBatcher
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

__all__ = ["AsyncClient", "AsyncFiles", "AsyncProcess", "AsyncSandbox", "OutputCallback"]

T = TypeVar("T")

OutputCallback = Callable[[bytes], Awaitable[None] | None]
"""Receives output bytes as they arrive; a plain or an async function."""


class AsyncClient:
    """A connection to a sandfleet control plane, for asyncio code.

    ``url`` is the control plane's base URL, ``token`` its bearer token and
    ``timeout_s`` the seconds each request may take (exec calls instead wait
    for the command's own ``timeout_s`` plus a margin). Unset values come from
    ``SANDFLEET_URL`` / ``SANDFLEET_TOKEN``, then the defaults
    (``http://127.0.0.1:7070``, no token, 30 s); see
    :meth:`sandfleet.sdk._core.Settings.resolve` for the full precedence.

    One client holds one connection pool: create it once and share it across
    tasks; close it with :meth:`close` or ``async with``. Every failure is a
    :class:`sandfleet.wire.errors.SandfleetError`: the server's errors keep
    their class (``NotFound``, ``ResourceExhausted``, ...), an unreachable
    server is ``Unavailable``, a request that takes too long ``DeadlineExceeded``.

    Raises ``InvalidArgument`` for a malformed URL or a non-positive timeout.
    """

    def __init__(
        self, url: str | None = None, *, token: str | None = None, timeout_s: float | None = None
    ) -> None:
        self._settings = _core.Settings.resolve(url, token, timeout_s)
        self._http = httpx.AsyncClient(
            base_url=self._settings.url,
            headers=self._settings.headers(),
            timeout=self._settings.timeout_s,
            transport=httpx.AsyncHTTPTransport(
                limits=_core.POOL_LIMITS, socket_options=_core.SOCKET_OPTIONS
            ),
        )
        self._closed = False
        self._background: set[asyncio.Future[Any]] = set()
        self._batcher = RunBatcher(self._send, self._lines, self._keep)

    @property
    def url(self) -> str:
        """The control plane's base URL this client talks to."""
        return self._settings.url

    def __repr__(self) -> str:
        return f"AsyncClient(url={self.url!r})"

    # ----------------------------------------------------------------- transport

    def _timeout(self, request: _core.Request[Any]) -> Any:
        if self._closed:
            raise FailedPrecondition("this AsyncClient is closed; create a new one")
        timeout = self._settings.http_timeout(request.timeout_s)
        return httpx.USE_CLIENT_DEFAULT if timeout is None else timeout

    async def _send(self, request: _core.Request[T], content: Any = None) -> T:
        timeout = self._timeout(request)
        with _core.translate_errors(self._settings, request):
            response = await self._http.request(
                request.method,
                request.path,
                params=request.params,
                content=request.body if content is None else content,
                headers=request.headers,
                timeout=timeout,
            )
        return _core.finish(request, response.status_code, response.content)

    async def _lines(self, request: _core.Request[Any]) -> AsyncGenerator[bytes, None]:
        """The NDJSON lines of a streamed answer, as they arrive.

        Closing this generator early closes the connection, which cancels the
        work on the server (a streaming exec's command is killed).
        """
        timeout = self._timeout(request)
        with _core.translate_errors(self._settings, request):
            async with self._http.stream(
                request.method,
                request.path,
                params=request.params,
                content=request.body,
                headers=request.headers,
                timeout=timeout,
            ) as response:
                if response.status_code >= 400:
                    _core.check_status(response.status_code, await response.aread())
                lines = _core.Lines()
                async for chunk in response.aiter_raw():
                    for line in lines.feed(chunk):
                        yield line
                lines.end()

    def _keep(self, future: asyncio.Future[Any]) -> None:
        """Track a cleanup task that must finish before :meth:`close` returns."""
        self._background.add(future)
        future.add_done_callback(self._background_done)

    def _background_done(self, future: asyncio.Future[Any]) -> None:
        self._background.discard(future)
        if not future.cancelled():
            future.exception()  # retrieved: a failed cleanup is left to the sandbox's TTL

    async def _destroy_shielded(self, sandbox: AsyncSandbox) -> None:
        """Destroy ``sandbox`` even if the calling task is cancelled meanwhile."""
        cleanup = asyncio.ensure_future(sandbox.destroy())
        self._keep(cleanup)
        await asyncio.shield(cleanup)

    # ----------------------------------------------------------------- sandboxes

    async def create(
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
    ) -> AsyncSandbox:
        """Create a sandbox and return its handle once it is running.

        ``kind`` is the isolation level (the only switch between kinds);
        ``image`` and ``workspace`` are ``name:tag`` references; ``cpu`` in
        cores, ``memory_mb`` in MiB, ``pids_limit`` processes, ``ttl_s`` the
        hard lifetime in seconds (None: no TTL); ``idle_ttl_s`` reclaims it
        after that many seconds without a call (None: never; a paused sandbox
        is waiting for its trainer, not idle: its idle clock stops until it
        resumes, while ``ttl_s`` keeps counting); both may be changed later with
        :meth:`AsyncSandbox.set_lifetime`. ``labels`` tag it for :meth:`list`
        and group :meth:`pause`/:meth:`resume`; ``env`` is given to every exec.

        Raises ``InvalidArgument`` (a kind not built in this release, checked
        before any request; bad limits), ``NotFound`` (no such image),
        ``ResourceExhausted`` (no node has room; retry later), ``Unavailable``.
        """
        return await self._create(
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
        )

    async def _create(self, request: _core.Request[SandboxInfo]) -> AsyncSandbox:
        sandbox = AsyncSandbox(self, await self._send(request))
        sandbox._steps = _steps.Steps()  # its calls go to its trajectory log from step 0
        return sandbox

    async def get(self, sandbox_id: str) -> AsyncSandbox:
        """A handle on an existing sandbox. Raises ``NotFound`` if it does not exist.

        Its calls are not recorded in the sandbox's trajectory log (several
        handles may share a sandbox); :meth:`attach` makes a handle that is.
        """
        return AsyncSandbox(self, await self._send(_core.get_request(sandbox_id)))

    async def attach(self, sandbox_id: str, *, resume_from_log: bool = False) -> AsyncSandbox:
        """A handle on an existing sandbox that goes on with its trajectory log.

        The handle of :meth:`create` numbers its calls that run or change
        something (exec, exec_stream, file write/upload/remove/mkdir, spawn,
        process kill/stdin/remove) 0, 1, 2, ...; the sandbox logs each with a
        digest of the request and its result (outputs cut to 64 KiB, head and
        tail), durably, surviving restarts of its node agent and of the control
        plane. Reads are not logged. A call that fails (an error, or cancelled,
        which kills a command) is not logged: re-issued, it runs.

        ``resume_from_log=False``: this handle's calls are numbered after the
        log's last step. ``resume_from_log=True`` (a trainer back after
        preemption): numbering restarts at 0 and the caller re-issues its calls
        in their original order. Each call the log holds is answered from it,
        marked replayed (``ExecResult.replayed``), and **not run again**; this
        is checked against the log fetched here once, with no request per call,
        so fast-forwarding thousands of steps takes milliseconds. The first call
        past the log's end runs. A call that differs from the logged one at its
        step raises ``Diverged`` naming the step, and nothing runs.

        Raises ``NotFound`` (no such sandbox), ``Unavailable``.
        """
        tail = None if resume_from_log else 1
        info, entries = await asyncio.gather(
            self._send(_core.get_request(sandbox_id)),
            self._send(_steps.log_request(sandbox_id, tail=tail)),
        )
        sandbox = AsyncSandbox(self, info)
        if resume_from_log:
            sandbox._steps = _steps.Steps(0, entries)
        else:
            sandbox._steps = _steps.Steps(entries[-1].step + 1 if entries else 0)
        return sandbox

    async def list(self, labels: Mapping[str, str] | None = None) -> builtins.list[SandboxInfo]:
        """The sandboxes carrying every one of ``labels`` (all sandboxes when None)."""
        return await self._send(_core.list_request(labels))

    async def run(
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
        ``memory_mb`` 256 MiB, ``max_output_bytes`` 1 MiB per stream. fncall
        calls made in the same event-loop turn (``asyncio.gather``) travel
        together as one batch request; cancelling one abandons it (it runs on
        to its ``timeout_s``; a sandbox kind's command is killed).

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
            return await self._batcher.run(
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
        creating = asyncio.ensure_future(self._create(create))
        try:
            sandbox = await asyncio.shield(creating)
        except asyncio.CancelledError:
            creating.add_done_callback(self._destroy_when_created)
            self._keep(creating)
            raise
        try:
            return _core.as_run_result(await sandbox._exec(body, timeout_s))
        finally:
            await self._destroy_shielded(sandbox)

    def _destroy_when_created(self, creating: asyncio.Future[AsyncSandbox]) -> None:
        if creating.cancelled() or creating.exception() is not None:
            return
        self._keep(asyncio.ensure_future(creating.result().destroy()))

    async def pause(self, *, labels: Mapping[str, str]) -> GroupResult:
        """Pause, in parallel, every sandbox carrying all of ``labels`` (e.g. one RL job's).

        Paused sandboxes keep their memory and use no CPU; any call on one
        resumes it. The result lists the ids paused (``sandboxes``) and, by id,
        why others could not be (``failed``); one failure never stops the rest.
        Raises ``InvalidArgument`` for empty ``labels`` (it never pauses
        every sandbox), ``Unavailable``.
        """
        return await self._send(_core.group_request("pause", labels))

    async def resume(self, *, labels: Mapping[str, str]) -> GroupResult:
        """Resume, in parallel, every sandbox carrying all of ``labels``; as :meth:`pause`."""
        return await self._send(_core.group_request("resume", labels))

    async def images(self) -> builtins.list[ImageManifest]:
        """The images the cluster can start sandboxes from."""
        return await self._send(_core.images_request())

    async def nodes(self) -> builtins.list[NodeInfo]:
        """The nodes registered with the control plane, with their load."""
        return await self._send(_core.nodes_request())

    async def pools(self) -> builtins.list[PoolInfo]:
        """Every fncall pool on every node: bounds, workers by state, counters."""
        return await self._send(_core.pools_request())

    async def configure_pool(
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
        return await self._send(
            _core.configure_pool_request(
                image=image,
                language=language,
                min_workers=min_workers,
                max_workers=max_workers,
                max_queue=max_queue,
                idle_s=idle_s,
            )
        )

    async def close(self) -> None:
        """Finish pending cleanups, then close the connection pool. Idempotent."""
        while pending := [f for f in self._background if not f.done()]:
            await asyncio.wait(pending)
        if not self._closed:
            self._closed = True
            await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()


class AsyncSandbox:
    """A handle on one sandbox; made by :meth:`AsyncClient.create` or :meth:`AsyncClient.get`.

    State lives in the sandbox, so handles are cheap and several may point at
    the same sandbox. ``async with sandbox:`` destroys it on exit.
    """

    def __init__(self, client: AsyncClient, info: SandboxInfo) -> None:
        self._client = client
        self._info = info
        self._destroyed = False
        self._steps: _steps.Steps | None = None
        self.files = AsyncFiles(self)
        """File operations inside the sandbox."""

    @property
    def id(self) -> str:
        """The sandbox's id."""
        return self._info.id

    @property
    def step(self) -> int | None:
        """The step number this handle gives its next logged call; None if it logs none.

        Handles of :meth:`AsyncClient.create` and :meth:`AsyncClient.attach`
        log their calls; those of :meth:`AsyncClient.get` do not.
        """
        return None if self._steps is None else self._steps.next

    async def log(self, start: int = 0) -> builtins.list[LogEntry]:
        """The sandbox's trajectory log from step ``start`` on, in step order.

        One :class:`~sandfleet.wire.models.LogEntry` per logged call: ``step``,
        ``op``, the request's ``digest``, bounded copies of the ``request`` and
        ``result``, and ``at`` (Unix seconds). Raises ``NotFound``, ``Unavailable``.
        """
        return await self._client._send(_steps.log_request(self._sandbox_id(), start))

    async def events(self, since: float = 0.0) -> builtins.list[SandboxEvent]:
        """What happened to the sandbox outside its commands since ``since`` (Unix s),
        oldest first: e.g. ``layer_fetch_error`` when its image's data could not be
        fetched from the blob stores. Raises ``NotFound``, ``Unavailable``."""
        return await self._client._send(_core.events_request(self._sandbox_id(), since))

    async def _call(
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
            return await self._client._send(request, content)
        while steps.settling is not None:
            await asyncio.shield(steps.settling)
        if steps.unsettled is not None:
            unsettled = steps.unsettled
            state = await self._client._send(_steps.cancel_request(self.id, unsettled))
            steps.unsettled = None
            steps.settle(unsettled, state)
        step, entry = steps.take(op, fields)
        if entry is not None:
            return answer(entry)
        try:
            return await self._client._send(_steps.with_step(request, step), content)
        except asyncio.CancelledError:
            abandon = _steps.ABANDON.get()
            if abandon is not None and abandon.active:
                raise  # left to finish and be logged, for the next driver
            # The node runs a logged call on when its caller goes away (a dead
            # trainer cannot say whether it meant to stop it): say so, and learn
            # whether the call ended first, before this handle numbers another.
            settling = asyncio.ensure_future(self._cancel_step(step))
            steps.settling = settling
            self._client._keep(settling)
            raise
        except SandfleetError as exc:
            if exc.retryable:  # the call may still run on the node: settle as above
                await self._cancel_step(step)
            else:
                steps.undo(step)  # the node refused it and left the step free
            raise

    async def _cancel_step(self, step: int) -> None:
        steps = self._steps
        assert steps is not None
        try:
            state = await self._client._send(_steps.cancel_request(self.id, step))
        except Exception:  # unknown (the node is unreachable): the next call asks
            steps.unsettled = step
            return
        finally:
            steps.settling = None
        steps.settle(step, state)

    @property
    def info(self) -> SandboxInfo:
        """What the control plane last said about this sandbox (see :meth:`refresh`)."""
        return self._info

    def __repr__(self) -> str:
        return f"AsyncSandbox(id={self.id!r}, kind={self._info.kind!r}, state={self._info.state!r})"

    def _sandbox_id(self) -> str:
        if self._destroyed:
            raise NotFound(f"sandbox {self.id} was destroyed through this handle; create a new one")
        return self._info.id

    async def exec(
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
        """Run a command and wait for it to end.

        ``cmd`` is an argv list (run directly) or a string (run by ``/bin/sh -c``);
        ``env`` is added to the sandbox's environment; ``cwd`` defaults to the
        image's workdir; ``stdin`` (str is UTF-8 encoded) is empty unless given;
        ``timeout_s`` (seconds, > 0) bounds the command, whose process group is
        then killed and the result has ``status == "timeout"``. ``user`` runs it
        as a user of the sandbox's ``/etc/passwd``: a name, a uid or
        ``"user:group"`` (None: root). ``max_output_bytes`` caps the stdout and
        stderr kept, each: the first half and the last half are kept, the middle
        is dropped and counted in ``stdout_dropped``/``stderr_dropped``; None
        means no cap and is allowed only when streaming (with callbacks); the
        result then omits the output its callback received, so nothing grows
        without bound. A non-zero exit is a result, not an error: check ``result.ok``.

        With ``on_stdout``/``on_stderr`` (functions taking ``bytes``; with
        :class:`AsyncClient` they may be async), output is streamed: each is
        called with the bytes as the command writes them, and the result still
        carries the whole ``stdout``/``stderr``. An exception from a callback
        ends the call and kills the command.

        Raises ``InvalidArgument`` (bad arguments, before any request; a missing
        ``cwd``; an unknown user), ``PermissionDenied`` (the sandbox cannot
        switch users), ``NotFound`` (the sandbox is gone), ``Unavailable``,
        ``DeadlineExceeded`` (no answer within ``timeout_s`` + a margin).
        """
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
            return await self._exec(body, timeout_s)
        collected = _core.ExecCollector.for_exec(max_output_bytes, on_stdout, on_stderr)
        async with contextlib.aclosing(self._exec_events(body, timeout_s)) as events:
            async for event in events:
                callback = {"stdout": on_stdout, "stderr": on_stderr}.get(event.type)
                if callback is not None and inspect.isawaitable(done := callback(event.data)):
                    await done
                collected.add(event)
        return collected.result()

    async def exec_stream(
        self,
        cmd: str | Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        stdin: bytes | str | None = None,
        timeout_s: float = 60.0,
        user: str | None = None,
        max_output_bytes: int | None = _core.EXEC_MAX_OUTPUT_BYTES,
    ) -> AsyncIterator[ExecEvent]:
        """Run a command and yield its output as it comes, then how it ended.

        Arguments as for :meth:`exec`. Yields :class:`ExecEvent` s: ``stdout``
        and ``stderr`` events carry ``data`` (bytes, as the command wrote them;
        their concatenation is what :meth:`exec` returns), and the last one is
        the ``result`` event, whose ``result`` has empty ``stdout``/``stderr``.
        Stopping early (``break``; ``contextlib.aclosing`` closes it at once)
        closes the connection and kills the command's process tree. Nothing is
        sent until the iteration starts.

        Raises, while iterating, what :meth:`exec` raises; a failure after the
        output began (the sandbox died) is raised instead of the result.
        """
        body = _core.exec_body(
            cmd,
            env=env,
            cwd=cwd,
            stdin=stdin,
            timeout_s=timeout_s,
            user=user,
            max_output_bytes=max_output_bytes,
        )
        async with contextlib.aclosing(self._exec_events(body, timeout_s)) as events:
            async for event in events:
                yield event

    async def _exec(self, body: bytes, timeout_s: float) -> ExecResult:
        client = self._client
        request = _core.exec_request(client._settings, self._sandbox_id(), body, timeout_s)
        return await self._call(request, "exec", _steps.exec_of(body), _steps.exec_result)

    async def _exec_events(self, body: bytes, timeout_s: float) -> AsyncGenerator[ExecEvent, None]:
        client = self._client
        request = _core.exec_stream_request(client._settings, self._sandbox_id(), body, timeout_s)
        steps, step = self._steps, -1
        if steps is not None:
            step, entry = steps.take("exec", _steps.exec_of(body))
            if entry is not None:
                for logged in _steps.exec_events(entry):
                    yield logged
                return
            request = _steps.with_step(request, step)
        ended = False
        try:
            async with contextlib.aclosing(client._lines(request)) as lines:
                async for line in lines:
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

    # ----------------------------------------------------------------- processes

    async def spawn(
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
    ) -> AsyncProcess:
        """Start a background process and return its handle at once.

        ``cmd``, ``env``, ``cwd`` and ``user`` as for :meth:`exec`. ``stdin``
        (at most 4 MiB; str is UTF-8 encoded) is written first; stdin then stays
        open for :meth:`AsyncProcess.write_stdin` unless ``close_stdin``.
        ``timeout_s`` (seconds; None: no limit) kills its process tree at the
        deadline. Each stream keeps its most recent ``max_output_bytes`` bytes,
        readable by absolute offset. The process outlives this client: find it
        again with :meth:`process` (its id) or :meth:`processes`.

        Raises ``InvalidArgument`` (bad arguments; a missing ``cwd``; an unknown
        user), ``PermissionDenied`` (the sandbox cannot switch users),
        ``FailedPrecondition`` (the sandbox is at its process limit),
        ``NotFound`` (the sandbox is gone), ``Unavailable``, ``DeadlineExceeded``.
        """
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
        return AsyncProcess(self, await self._call(request, "spawn", fields, _steps.process_info))

    async def processes(self) -> builtins.list[ProcessInfo]:
        """Every spawned process of the sandbox not yet removed, running or ended.

        The sandbox keeps the records of at most 64 ended processes (oldest go first).
        """
        return await self._client._send(_core.processes_request(self._sandbox_id()))

    async def process(self, process_id: str) -> AsyncProcess:
        """A handle on a spawned process by its id, e.g. from another client or run.

        Raises ``NotFound`` if the sandbox has no such process (or removed it).
        """
        request = _core.process_request(self._sandbox_id(), process_id)
        return AsyncProcess(self, await self._client._send(request))

    async def refresh(self) -> SandboxInfo:
        """Fetch the sandbox's current record, store it in :attr:`info` and return it."""
        self._info = await self._client._send(_core.get_request(self._sandbox_id()))
        return self._info

    async def pause(self) -> None:
        """Freeze the sandbox: its memory and processes stay, it uses no CPU. Idempotent.

        Any later call on it (exec, files, processes, ...) resumes it first,
        transparently; :meth:`resume` does so explicitly. Its TTL and idle TTL
        keep running while it is paused. Updates :attr:`info`.
        Raises ``NotFound`` (gone), ``FailedPrecondition`` (still being
        created; a kind that cannot pause), ``Unavailable`` (its node is
        unreachable), ``Internal`` (the freeze did not complete; it was left
        running: retry).
        """
        self._info = await self._client._send(_core.pause_request(self._sandbox_id()))

    async def resume(self) -> None:
        """Thaw a paused sandbox (a running one is left as it is). Errors as :meth:`pause`."""
        self._info = await self._client._send(_core.resume_request(self._sandbox_id()))

    async def set_lifetime(
        self, *, ttl_s: float | None = _core.KEEP, idle_ttl_s: float | None = _core.KEEP
    ) -> SandboxInfo:
        """Change the sandbox's lifetimes, counted from now; an argument left out is kept.

        ``ttl_s``: the hard TTL now ends this many seconds from now (None: no
        TTL); ``idle_ttl_s``: reclaimed after this many seconds without a call
        (None: never). Both in (0, 2592000] seconds (30 days). Returns (and
        stores in :attr:`info`) the new record, ``expires_at`` in Unix seconds.
        Raises ``InvalidArgument`` (neither given, out of range; before any
        request), ``NotFound`` (gone), ``Unavailable``.
        """
        request = _core.lifetime_request(self._sandbox_id(), ttl_s, idle_ttl_s)
        self._info = await self._client._send(request)
        return self._info

    async def snapshot(self, image: str | None = None, exclude: Sequence[str] | None = None) -> str:
        """Pack the sandbox's changes into a new image and return its ``name:tag``.

        The image is the sandbox's layers plus a ``diff`` layer of its writable
        layer, taken with the sandbox frozen for the copy (a consistent instant;
        it runs on after). Files added, changed, chmod'ed or deleted, symlinks
        and replaced directories all carry over; so do the sandbox's env and
        workdir. ``client.create(image=ref)`` starts sandboxes from it, and a
        snapshot of one of those stacks one more layer. ``image`` names it
        (``name:tag``; default ``snapshot/<sandbox id>:<n>``, n = 1, 2, ...).
        ``exclude`` lists glob patterns of absolute paths left out (``*``/``?``
        within a segment, a ``**`` segment spans any number): default
        :data:`~sandfleet.wire.models.SNAPSHOT_EXCLUDE` (/tmp/*, caches,
        __pycache__); ``[]`` keeps everything. A path left out is as in the
        sandbox's image.

        Raises ``InvalidArgument`` (a bad pattern or name), ``AlreadyExists``
        (that image exists: pick another name or tag), ``FailedPrecondition``
        (the sandbox is busy, e.g. in another snapshot: retry), ``NotFound``,
        ``ResourceExhausted`` (the image store's disk is full).
        """
        request = _snapshot.snapshot_request(self._sandbox_id(), image, exclude)
        return (await self._client._send(request)).ref

    async def fork(self, n: int) -> builtins.list[AsyncSandbox]:
        """``n`` new sandboxes, each an independent copy of this one's current state.

        A :meth:`snapshot` (default name and excludes), then ``n`` creates
        from it in parallel, with this sandbox's kind, limits, labels, env and
        idle TTL; each copy's TTL ends when this one's does. All or nothing:
        if any create fails, the copies made are destroyed and the first
        error is raised (same class, e.g. ``ResourceExhausted``: retry later).
        The snapshot image stays (``client.images()``). ``n``: 1 to 64.
        """
        _snapshot.check_fork_count(n)
        client = self._client
        info = await self.refresh()
        image = await self.snapshot()
        creates = [
            asyncio.ensure_future(client._create(r))
            for r in _snapshot.fork_requests(info, image, n)
        ]
        try:
            await asyncio.shield(asyncio.gather(*creates, return_exceptions=True))
        except asyncio.CancelledError:
            for create in creates:  # none may outlive a cancelled fork
                create.add_done_callback(client._destroy_when_created)
                client._keep(create)
            raise
        errors = [e for c in creates if (e := c.exception()) is not None]
        made = [c.result() for c in creates if c.exception() is None]
        if errors:
            await asyncio.gather(*(client._destroy_shielded(s) for s in made))
            raise _snapshot.fork_error(errors, n, image)
        return made

    async def destroy(self) -> None:
        """Destroy the sandbox. Idempotent: later calls, and a sandbox already gone, are no-ops."""
        if self._destroyed:
            return
        with contextlib.suppress(NotFound):
            await self._client._send(_core.destroy_request(self.id))
        self._destroyed = True

    async def __aenter__(self) -> AsyncSandbox:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._client._destroy_shielded(self)


class AsyncProcess:
    """A background process in a sandbox; made by :meth:`AsyncSandbox.spawn` or
    :meth:`AsyncSandbox.process`.

    The process lives in the sandbox, not in this handle: dropping the handle
    or closing the client leaves it running. Every method raises ``NotFound``
    (the process was removed or the sandbox is gone), ``Unavailable`` and
    ``DeadlineExceeded`` besides what it names.
    """

    def __init__(self, sandbox: AsyncSandbox, info: ProcessInfo) -> None:
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
        return f"AsyncProcess(id={self.id!r}, pid={self._info.pid}, state={self._info.state!r})"

    def _sid(self) -> str:
        return self._sandbox._sandbox_id()

    async def _update(self, request: _core.Request[ProcessInfo]) -> ProcessInfo:
        self._info = await self._sandbox._client._send(request)
        return self._info

    async def refresh(self) -> ProcessInfo:
        """Fetch the process's current record, store it in :attr:`info` and return it."""
        return await self._update(_core.process_request(self._sid(), self.id))

    async def wait(self, timeout_s: float | None = None) -> ProcessInfo:
        """Wait until the process ends, at most ``timeout_s`` seconds (None: no limit).

        Returns its record, whose ``state`` is still ``running`` if the time ran
        out first. Raises ``InvalidArgument`` for a negative ``timeout_s``.
        """
        client = self._sandbox._client
        return await self._update(
            _core.wait_request(client._settings, self._sid(), self.id, timeout_s)
        )

    async def kill(self, signal: int = 9) -> ProcessInfo:
        """Send ``signal`` (a number, default SIGKILL) to the process and all it started.

        With SIGKILL it returns once the whole tree is gone (state ``killed``).
        Raises ``InvalidArgument`` for a number outside 1-64.
        """
        request = _core.kill_request(self._sid(), self.id, signal)
        fields = _steps.plain(process_id=self.id, signal=int(signal))
        self._info = await self._sandbox._call(request, "kill", fields, _steps.process_info)
        return self._info

    async def write_stdin(self, data: bytes | str) -> None:
        """Write ``data`` (str is UTF-8 encoded) to the process's stdin.

        Returns once it is in the pipe. Raises ``FailedPrecondition`` if stdin
        was closed or the process ended.
        """
        request = _core.stdin_request(self._sid(), self.id, data)
        fields = _steps.stdin_of(self.id, data)
        await self._sandbox._call(request, "stdin", fields, _steps.nothing)

    async def close_stdin(self) -> None:
        """Close the process's stdin: it reads EOF once it has consumed what was written."""
        request = _core.close_stdin_request(self._sid(), self.id)
        fields = _steps.plain(process_id=self.id)
        await self._sandbox._call(request, "close_stdin", fields, _steps.nothing)

    async def read_output(self, stream: str = "stdout", offset: int = 0) -> OutputChunk:
        """The output of ``stream`` (``stdout``/``stderr``) from byte ``offset`` up to now.

        ``chunk.dropped`` counts bytes after ``offset`` no longer retained (the
        sandbox keeps the last ``max_output_bytes``); read on from
        ``chunk.next_offset``; ``chunk.eof``: the stream is closed and all read.
        """
        request = _core.read_output_request(self._sid(), self.id, stream, offset)
        return await self._sandbox._client._send(request)

    async def follow_output(
        self, stream: str = "stdout", offset: int = 0
    ) -> AsyncIterator[OutputChunk]:
        """Yield the output of ``stream`` from byte ``offset`` as the process writes it.

        Ends once the process has ended and all its output was yielded. Each
        chunk's ``dropped`` counts bytes lost before it to the retention bound.
        There is no time limit: stop early with ``break`` (``contextlib.aclosing``
        closes it at once); the process keeps running.
        """
        client = self._sandbox._client
        request = _core.follow_output_request(self._sid(), self.id, stream, offset)
        async with contextlib.aclosing(client._lines(request)) as lines:
            async for line in lines:
                yield _core.parse_chunk_line(line)

    async def remove(self) -> None:
        """Forget the ended process and its output.

        Raises ``FailedPrecondition`` while it runs (:meth:`kill` or :meth:`wait` first).
        """
        request = _core.remove_process_request(self._sid(), self.id)
        fields = _steps.plain(process_id=self.id)
        await self._sandbox._call(request, "remove_process", fields, _steps.nothing)


class AsyncFiles:
    """Files inside one sandbox (``sandbox.files``). Paths are absolute paths in the sandbox.

    Every method raises ``NotFound`` (no such path or sandbox),
    ``PermissionDenied`` (not writable), ``InvalidArgument`` and the transport
    errors ``Unavailable`` / ``DeadlineExceeded``.
    """

    def __init__(self, sandbox: AsyncSandbox) -> None:
        self._sandbox = sandbox

    def _send(self, request: _core.Request[T], content: Any = None) -> Coroutine[Any, Any, T]:
        return self._sandbox._client._send(request, content)

    async def read(self, path: str, max_bytes: int = _core.READ_MAX_BYTES) -> bytes:
        """The whole content of a regular file, in memory.

        Raises ``InvalidArgument`` when the file is larger than ``max_bytes``
        (default 256 MiB: use :meth:`download` for such files) or is not a
        regular file (a directory, device or FIFO), ``NotFound`` when missing.
        """
        sid = self._sandbox._sandbox_id()
        return await self._send(_core.read_request(sid, path, max_bytes))

    async def write(self, path: str, data: bytes | str, mode: int = 0o644) -> FileEntry:
        """Create or replace a file with ``data`` (str is UTF-8 encoded); ``mode`` as chmod."""
        request = _core.write_request(self._sandbox._sandbox_id(), path, mode, data)
        fields = _steps.write_of(path, mode, data)
        return await self._sandbox._call(request, "write", fields, _steps.file_entry)

    async def list(self, path: str = "/") -> builtins.list[FileEntry]:
        """The entries of a directory."""
        return await self._send(_core.list_dir_request(self._sandbox._sandbox_id(), path))

    async def stat(self, path: str) -> FileEntry:
        """One path's type, size (bytes), mode and mtime (Unix seconds)."""
        return await self._send(_core.stat_request(self._sandbox._sandbox_id(), path))

    async def remove(self, path: str, recursive: bool = False) -> None:
        """Remove a file, or a directory (non-empty ones only with ``recursive=True``)."""
        request = _core.remove_request(self._sandbox._sandbox_id(), path, recursive)
        fields = _steps.plain(path=path, recursive=bool(recursive))
        await self._sandbox._call(request, "remove", fields, _steps.nothing)

    async def mkdir(self, path: str, parents: bool = True) -> FileEntry:
        """Create a directory (and missing parents unless ``parents=False``)."""
        request = _core.mkdir_request(self._sandbox._sandbox_id(), path, parents)
        fields = _steps.plain(path=path, parents=bool(parents))
        return await self._sandbox._call(request, "mkdir", fields, _steps.file_entry)

    async def upload(
        self, local_path: str | os.PathLike[str], remote_path: str, mode: int = 0o644
    ) -> FileEntry:
        """Copy a local file into the sandbox, streamed in 1 MiB chunks.

        A local file that cannot be read raises the usual ``OSError``.
        """
        request = _core.write_request(self._sandbox._sandbox_id(), remote_path, mode)
        fields = _steps.upload_of(local_path, remote_path, mode)
        with open(local_path, "rb") as file:
            chunks = _AsyncChunks(file)
            return await self._sandbox._call(request, "write", fields, _steps.file_entry, chunks)

    async def download(self, remote_path: str, local_path: str | os.PathLike[str]) -> int:
        """Copy a file out of the sandbox, streamed in chunks; returns the bytes written.

        ``local_path`` is replaced only once the whole file has arrived; a failed
        download leaves nothing behind.
        """
        request = _core.read_request(self._sandbox._sandbox_id(), remote_path)
        client = self._sandbox._client
        if client._closed:
            raise FailedPrecondition("this AsyncClient is closed; create a new one")
        with _core.translate_errors(client._settings, request):
            async with client._http.stream(
                request.method, request.path, params=request.params
            ) as response:
                if response.status_code >= 400:
                    _core.check_status(response.status_code, await response.aread())
                with _core.PartFile(local_path) as out:
                    async for chunk in response.aiter_bytes(_core.CHUNK_BYTES):
                        await asyncio.to_thread(out.write, chunk)
        return out.size


class _AsyncChunks:
    """An open local file as an async iterator of chunks, read off the event loop."""

    def __init__(self, file: IO[bytes]) -> None:
        self._file = file

    def __aiter__(self) -> _AsyncChunks:
        return self

    async def __anext__(self) -> bytes:
        chunk = await asyncio.to_thread(self._file.read, _core.CHUNK_BYTES)
        if not chunk:
            raise StopAsyncIteration
        return chunk
