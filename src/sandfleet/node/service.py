"""The node agent's logic: admission, the boxes it hosts, and calls into them.

The node has the final word on admission: when it lacks room it refuses with
ResourceExhausted and the control plane tries another node. What runs inside a
box goes through the in-sandbox agent, whatever the backend.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import time
from collections.abc import AsyncIterable, AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from sandfleet.backends.base import Backend, BoxHandle, LayerSource, SandboxSpec
from sandfleet.backends.container.backend import ContainerBackend
from sandfleet.fncall.service import FnCallService
from sandfleet.guest.client import AgentClient, OutputCallback
from sandfleet.node.images import DEFAULT_CACHE_BYTES, NodeImages
from sandfleet.node.lifetimes import NodeLifetimes, Pausable
from sandfleet.node.trajectory import Trajectories
from sandfleet.wire.errors import (
    AlreadyExists,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    SandfleetError,
)
from sandfleet.wire.models import (
    ErrorInfo,
    ExecEvent,
    ExecRequest,
    ExecResult,
    FileEntry,
    ImageConfig,
    ImageManifest,
    NodeCapacity,
    NodeCreateRequest,
    NodeHeartbeat,
    OutputChunk,
    ProcessInfo,
    SandboxEvent,
    SnapshotRequest,
    SpawnRequest,
)

__all__ = ["NodeService"]

log = logging.getLogger("sandfleet.node")

#: Output events a streaming exec may hold before the command is made to wait
#: (back-pressure from a slow reader reaches the command's pipe).
STREAM_QUEUE_EVENTS = 16
#: Largest output event a streaming exec makes by merging queued chunks, bytes.
STREAM_MERGE_BYTES = 1 << 20

_Output = tuple[Literal["stdout", "stderr"], bytes]


@dataclass
class _Box:
    request: NodeCreateRequest
    config: ImageConfig
    handle: BoxHandle
    agent: AgentClient
    #: Layers it was started from (empty for an adopted box); their access
    #: lists are recorded when its first exec ends.
    layers: list[LayerSource] = field(default_factory=list)
    #: Digests of its layers, bottom first.
    digests: list[str] = field(default_factory=list)
    #: When it was created (Unix s; 0 if adopted): earlier events of its layers are not its.
    born: float = 0.0


class NodeService:
    """Hosts sandboxes on this machine through ``backends`` (kind → backend).

    Metadata of each box is kept under ``state_dir/boxes`` so a restarted node
    agent adopts the boxes that kept running.
    """

    def __init__(
        self,
        node_id: str,
        state_dir: Path,
        images_dir: Path,
        backends: dict[str, Backend],
        capacity: NodeCapacity,
        *,
        blob_stores: Sequence[str] = (),
        cache_bytes: int = DEFAULT_CACHE_BYTES,
    ) -> None:
        self.node_id = node_id
        self.images_dir = images_dir
        #: Layers: local metadata, data on demand from ``blob_stores`` (node/images.py).
        self.images = NodeImages(
            images_dir, state_dir, remotes=blob_stores, cache_bytes=cache_bytes
        )
        self.backends = backends
        self.capacity = capacity
        self._meta_dir = state_dir / "boxes"
        self._meta_dir.mkdir(parents=True, exist_ok=True)
        self._boxes: dict[str, _Box] = {}
        self._pending: dict[str, NodeCreateRequest] = {}
        self._lock = asyncio.Lock()
        #: TTLs, idle TTLs, pause state and the node's own reaper (node/lifetimes.py).
        self.lifetimes = NodeLifetimes(self, self._meta_dir)
        #: Each box's trajectory log, <id>.log beside its metadata (node/trajectory.py).
        self.trajectory = Trajectories(self._meta_dir)
        self.fncall: FnCallService | None = None
        container = backends.get("container")
        if isinstance(container, ContainerBackend):
            # Workers are boxes of the container backend, so recover() sweeps those
            # a previous node agent left (they have no metadata to be adopted by).
            self.fncall = FnCallService(node_id, self.images, container)

    # ------------------------------------------------------------------ load

    def load(self) -> NodeHeartbeat:
        reqs = [b.request for b in self._boxes.values()] + list(self._pending.values())
        return NodeHeartbeat(
            sandboxes=len(reqs),
            memory_mb_reserved=sum(r.memory_mb for r in reqs),
            cpu_reserved=sum(r.cpu for r in reqs),
        )

    def ids(self) -> list[str]:
        return sorted(self._boxes)

    # ------------------------------------------------------------------ lifecycle

    async def create(self, req: NodeCreateRequest) -> None:
        """Admit and start one sandbox. Raises ResourceExhausted when full."""
        backend = self.backends.get(req.kind)
        if backend is None:
            raise InvalidArgument(
                f"this node does not offer kind {req.kind!r}; it offers {sorted(self.backends)}"
            )
        async with self._lock:
            if req.id in self._boxes or req.id in self._pending:
                raise AlreadyExists(f"sandbox {req.id} exists on node {self.node_id}")
            load = self.load()
            if load.sandboxes >= self.capacity.max_sandboxes:
                raise ResourceExhausted(f"node {self.node_id} is full ({load.sandboxes} sandboxes)")
            if load.memory_mb_reserved + req.memory_mb > self.capacity.memory_mb:
                raise ResourceExhausted(
                    f"node {self.node_id} has {self.capacity.memory_mb - load.memory_mb_reserved}"
                    f" MiB unreserved; {req.memory_mb} MiB asked"
                )
            self._pending[req.id] = req
        born = time.time()
        try:
            layers, config = await self.images.stack(req.image, req.workspace)
            spec = SandboxSpec(
                id=req.id,
                kind=req.kind,
                layers=layers,
                cpu=req.cpu,
                memory_mb=req.memory_mb,
                pids_limit=req.pids_limit,
                disk_mb=req.disk_mb,
                env={**config.env, **req.env},
                workdir=config.workdir,
            )
            handle = await backend.create(spec)
            self.lifetimes.add(req, born)
            self._write_meta(req, config)
            self._boxes[req.id] = _Box(
                req,
                config,
                handle,
                AgentClient(handle.agent_socket),
                layers=layers,
                digests=[x.digest for x in layers],
                born=born,
            )
        finally:
            self._pending.pop(req.id, None)

    async def destroy(self, sandbox_id: str) -> None:
        box = self._box(sandbox_id)
        self._boxes.pop(sandbox_id, None)
        try:
            await self.backends[box.request.kind].destroy(sandbox_id)
        finally:
            (self._meta_dir / f"{sandbox_id}.json").unlink(missing_ok=True)
            self.lifetimes.drop(sandbox_id)
            self.trajectory.drop(sandbox_id)

    async def recover(self) -> None:
        """Adopt boxes that survived a restart; destroy those without metadata."""
        await self.images.start()  # their layers read from the on-demand daemon
        for kind, backend in self.backends.items():
            for handle in await backend.recover():
                meta = self._meta_dir / f"{handle.id}.json"
                try:
                    doc = json.loads(meta.read_text())
                    req = NodeCreateRequest.model_validate(doc["request"])
                    config = ImageConfig.model_validate(doc["config"])
                except (OSError, ValueError, KeyError):
                    log.warning("destroying %s %s: no metadata to adopt it", kind, handle.id)
                    await backend.destroy(handle.id)
                    meta.unlink(missing_ok=True)
                    continue
                self._boxes[handle.id] = _Box(req, config, handle, AgentClient(handle.agent_socket))
                paused = isinstance(backend, Pausable) and backend.paused(handle.id)
                self.lifetimes.adopt(req, meta, paused=paused)
                log.info("adopted %s %s%s", kind, handle.id, " (paused)" if paused else "")
        for meta in self._meta_dir.glob("*.json"):
            if meta.stem not in self._boxes:
                meta.unlink(missing_ok=True)
        self.lifetimes.sweep()
        self.trajectory.sweep(set(self._boxes))

    def start(self) -> None:
        """Start the reaper and the fncall pools' upkeep; call after :meth:`recover`."""
        self.lifetimes.start()
        if self.fncall is not None:
            self.fncall.start()

    async def close(self, destroy_all: bool = False) -> None:
        """Stop serving; with ``destroy_all`` every box is destroyed first.

        fncall workers hold no state worth keeping: they are always stopped.
        """
        await self.lifetimes.close()
        if self.fncall is not None:
            await self.fncall.close()
        if destroy_all:
            await asyncio.gather(
                *(self.destroy(i) for i in list(self._boxes)), return_exceptions=True
            )
        for backend in self.backends.values():
            await backend.close()
        await self.images.close(stop_daemon=not self._boxes)

    def _write_meta(self, req: NodeCreateRequest, config: ImageConfig) -> None:
        tmp = self._meta_dir / f".{req.id}.tmp"
        tmp.write_text(
            json.dumps(
                {"request": req.model_dump(mode="json"), "config": config.model_dump(mode="json")}
            )
        )
        os.replace(tmp, self._meta_dir / f"{req.id}.json")

    def backend_of(self, sandbox_id: str) -> Backend:
        """The backend hosting the box; ``NotFound`` or ``FailedPrecondition`` (being created)."""
        return self.backends[self._box(sandbox_id).request.kind]

    def _box(self, sandbox_id: str) -> _Box:
        box = self._boxes.get(sandbox_id)
        if box is None:
            if sandbox_id in self._pending:
                raise FailedPrecondition(f"sandbox {sandbox_id} is still being created; retry")
            raise NotFound(f"sandbox {sandbox_id} does not exist on node {self.node_id}")
        return box

    async def snapshot(self, sandbox_id: str, req: SnapshotRequest) -> ImageManifest:
        """Pack the box's writable layer into a ``diff`` layer and store an image over it.

        See :func:`sandfleet.images.snapshot.snapshot_sandbox` (errors included).
        """
        from sandfleet.images.snapshot import snapshot_sandbox

        box = self._box(sandbox_id)
        backend = self.backends[box.request.kind]
        return await snapshot_sandbox(self.images.store, backend, box.request, box.config, req)

    async def events(self, sandbox_id: str, since: float) -> list[SandboxEvent]:
        """What befell the data of the box's layers since ``since`` (Unix s), oldest first:
        fetch errors, and a restart of the node's on-demand daemon."""
        box = self._box(sandbox_id)
        if not box.digests:  # adopted: its stack as its image names it now
            with contextlib.suppress(SandfleetError):
                stack, _ = await self.images.stack(box.request.image, box.request.workspace)
                box.digests = [x.digest for x in stack]
        found = await self.images.events(box.digests, max(since, box.born))
        return [
            SandboxEvent(
                at=e["time"],
                kind="layer_fetch_error" if e["layer"] else "layer_daemon_restarted",
                message=e["message"],
                layer=e["layer"],
            )
            for e in found
        ]

    # ------------------------------------------------------------------ inside the box

    def _command(self, box: _Box, req: ExecRequest | SpawnRequest) -> dict[str, object]:
        """The env merge (image, sandbox, request: last wins) and default cwd of every command.

        Raises InvalidArgument for a relative or empty cwd (never a silent fallback).
        """
        if req.cwd is not None and not req.cwd.startswith("/"):
            raise InvalidArgument(
                f"cwd {req.cwd!r} is not an absolute path: give one starting with '/', or"
                " leave it unset for the image's workdir"
            )
        return {
            "env": {**box.config.env, **box.request.env, **req.env},
            "cwd": req.cwd or box.config.workdir,
        }

    async def exec(
        self,
        sandbox_id: str,
        req: ExecRequest,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
        keep_output: bool = True,
    ) -> ExecResult:
        """Run a command.

        Its status becomes ``oom`` when the sandbox's OOM killer killed a process
        while it ran and the command failed (killed, or a non-zero exit: a shell
        reports its OOM-killed child as 137). With several commands running in one
        sandbox at once, an OOM caused by another may be attributed to a failing one.

        Output chunks go to ``on_stdout``/``on_stderr`` (plain or async) as they arrive;
        with ``keep_output=False`` the result's stdout/stderr stay empty.
        """
        box = self._box(sandbox_id)
        backend = self.backends[box.request.kind]
        req = req.model_copy(update=self._command(box, req))
        ooms_before = backend.oom_kills(sandbox_id)
        result = await box.agent.exec(
            req, on_stdout=on_stdout, on_stderr=on_stderr, keep_output=keep_output
        )
        if box.layers:  # the first exec ended: what its layers read so far was start-up
            layers, box.layers = box.layers, []
            await self.images.record_access(layers)
        failed = result.status == "signaled" or (
            result.status == "exited" and result.exit_code != 0
        )
        if failed and backend.oom_kills(sandbox_id) > ooms_before:
            # Like a timeout, never an exit code that could pass for a real one.
            result = result.model_copy(
                update={"status": "oom", "exit_code": None, "signal": int(signal.SIGKILL)}
            )
        return result

    @contextlib.asynccontextmanager
    async def exec_stream(
        self, sandbox_id: str, req: ExecRequest
    ) -> AsyncIterator[AsyncIterator[ExecEvent]]:
        """Run a command as :meth:`exec` does and yield its events as they come.

        Errors before the first event (unknown sandbox, bad cwd, unknown user)
        raise here; later ones become a final ``error`` event. The last event is
        ``result`` (stdout/stderr empty: the chunks carried them) or ``error``.
        Leaving the context before the end cancels the command (the agent kills
        its process tree).
        """
        self._box(sandbox_id)
        queue: asyncio.Queue[_Output | ExecEvent | SandfleetError]
        queue = asyncio.Queue(STREAM_QUEUE_EVENTS)

        async def out(data: bytes) -> None:
            await queue.put(("stdout", data))

        async def err(data: bytes) -> None:
            await queue.put(("stderr", data))

        async def run() -> None:
            try:
                result = await self.exec(
                    sandbox_id, req, on_stdout=out, on_stderr=err, keep_output=False
                )
            except SandfleetError as exc:
                await queue.put(exc)
            except Exception as exc:  # becomes an error event, logged
                log.exception("streaming exec in %s failed", sandbox_id)
                await queue.put(Internal(f"internal error: {type(exc).__name__}: {exc}"))
            else:
                empty = result.model_copy(update={"stdout": b"", "stderr": b""})
                await queue.put(ExecEvent(type="result", result=empty))

        task = asyncio.ensure_future(run())
        try:
            first = await queue.get()
            if isinstance(first, SandfleetError):
                raise first

            async def events() -> AsyncIterator[ExecEvent]:
                item: _Output | ExecEvent | SandfleetError | None = first
                while True:
                    if item is None:
                        item = await queue.get()
                    if isinstance(item, SandfleetError):
                        info = ErrorInfo(code=item.code, message=item.message)
                        yield ExecEvent(type="error", error=info)
                        return
                    if isinstance(item, ExecEvent):
                        yield item  # the result
                        return
                    # Output the reader has not taken yet goes out as one event (up to
                    # STREAM_MERGE_BYTES): a slow reader gets fewer, larger lines.
                    kind, data = item
                    parts, size, item = [data], len(data), None
                    while size < STREAM_MERGE_BYTES and not queue.empty():
                        nxt = queue.get_nowait()
                        if not isinstance(nxt, tuple) or nxt[0] != kind:
                            item = nxt
                            break
                        parts.append(nxt[1])
                        size += len(nxt[1])
                    yield ExecEvent(type=kind, data=b"".join(parts))

            yield events()
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    # ------------------------------------------------------------------ spawned processes

    async def spawn(self, sandbox_id: str, req: SpawnRequest) -> ProcessInfo:
        """Start a background process with the same env merge and default cwd as exec."""
        box = self._box(sandbox_id)
        return await box.agent.spawn(req.model_copy(update=self._command(box, req)))

    async def list_processes(self, sandbox_id: str) -> list[ProcessInfo]:
        return await self._box(sandbox_id).agent.list_processes()

    async def get_process(self, sandbox_id: str, process_id: str) -> ProcessInfo:
        return await self._box(sandbox_id).agent.wait_process(process_id, timeout_s=0)

    async def wait_process(
        self, sandbox_id: str, process_id: str, timeout_s: float | None
    ) -> ProcessInfo:
        return await self._box(sandbox_id).agent.wait_process(process_id, timeout_s)

    async def kill_process(self, sandbox_id: str, process_id: str, sig: int) -> ProcessInfo:
        return await self._box(sandbox_id).agent.kill_process(process_id, sig)

    async def write_stdin(
        self, sandbox_id: str, process_id: str, data: AsyncIterable[bytes]
    ) -> None:
        await self._box(sandbox_id).agent.write_stdin(process_id, data)

    async def close_stdin(self, sandbox_id: str, process_id: str) -> None:
        await self._box(sandbox_id).agent.close_stdin(process_id)

    async def read_output(
        self, sandbox_id: str, process_id: str, stream: str, offset: int
    ) -> OutputChunk:
        return await self._box(sandbox_id).agent.read_output(process_id, stream, offset)

    @contextlib.asynccontextmanager
    async def follow_output(
        self, sandbox_id: str, process_id: str, stream: str, offset: int
    ) -> AsyncIterator[AsyncIterator[OutputChunk]]:
        """Yield the process's output from ``offset`` as it comes, until it has ended.

        An unknown sandbox or process raises here, before the first chunk.
        """
        agent = self._box(sandbox_id).agent
        await agent.wait_process(process_id, timeout_s=0)
        chunks = agent.follow_output(process_id, stream, offset)
        try:
            yield chunks
        finally:
            await chunks.aclose()  # type: ignore[attr-defined]

    async def remove_process(self, sandbox_id: str, process_id: str) -> None:
        await self._box(sandbox_id).agent.remove_process(process_id)

    @contextlib.asynccontextmanager
    async def read_file(
        self, sandbox_id: str, path: str, max_bytes: int | None = None
    ) -> AsyncIterator[AsyncIterator[bytes]]:
        """Yield the file's chunks; errors raise before the first chunk.

        Only regular files are read (a device such as /dev/zero or a FIFO would
        never end); with ``max_bytes`` a larger file is refused up front, and
        the stream is broken off (never silently cut) if it grows past it.
        """
        agent = self._box(sandbox_id).agent
        if max_bytes is not None:
            entry = await agent.stat(path)
            if entry.type == "file" and entry.size > max_bytes:
                raise InvalidArgument(
                    f"{path} is {entry.size} bytes, over max_bytes={max_bytes}: use download()"
                )
        # The agent refuses directories, devices and FIFOs (also behind a symlink).
        stream = agent.read_file(path).__aiter__()
        first = await anext(stream, None)

        async def chunks() -> AsyncIterator[bytes]:
            sent = 0
            pending = first
            while pending is not None:
                sent += len(pending)
                if max_bytes is not None and sent > max_bytes:
                    # Grew past the cap (or a symlink hid its size): break the
                    # stream off rather than hand back a silently cut file.
                    raise InvalidArgument(f"{path} grew past max_bytes={max_bytes}")
                yield pending
                pending = await anext(stream, None)

        yield chunks()

    async def write_file(
        self, sandbox_id: str, path: str, data: AsyncIterable[bytes], mode: int
    ) -> FileEntry:
        return await self._box(sandbox_id).agent.write_file(path, data, mode=mode)

    async def list_dir(self, sandbox_id: str, path: str) -> list[FileEntry]:
        return await self._box(sandbox_id).agent.list_dir(path)

    async def stat(self, sandbox_id: str, path: str) -> FileEntry:
        return await self._box(sandbox_id).agent.stat(path)

    async def remove(self, sandbox_id: str, path: str, recursive: bool) -> None:
        """Remove a file or (``recursive``) a tree; the sandbox's root itself is refused."""
        if os.path.normpath("/" + path.lstrip("/")) == "/":
            raise InvalidArgument("refusing to remove the sandbox's root '/': name what to remove")
        await self._box(sandbox_id).agent.remove(path, recursive=recursive)

    async def mkdir(self, sandbox_id: str, path: str, parents: bool) -> FileEntry:
        return await self._box(sandbox_id).agent.mkdir(path, parents=parents)
