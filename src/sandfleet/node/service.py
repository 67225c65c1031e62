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
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from sandfleet.backends.base import Backend, BoxHandle, SandboxSpec
from sandfleet.guest.client import AgentClient
from sandfleet.wire.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from sandfleet.wire.models import (
    ExecRequest,
    ExecResult,
    FileEntry,
    ImageConfig,
    NodeCapacity,
    NodeCreateRequest,
    NodeHeartbeat,
)

__all__ = ["NodeService"]

log = logging.getLogger("sandfleet.node")


@dataclass
class _Box:
    request: NodeCreateRequest
    config: ImageConfig
    handle: BoxHandle
    agent: AgentClient


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
    ) -> None:
        self.node_id = node_id
        self.images_dir = images_dir
        self.backends = backends
        self.capacity = capacity
        self._meta_dir = state_dir / "boxes"
        self._meta_dir.mkdir(parents=True, exist_ok=True)
        self._boxes: dict[str, _Box] = {}
        self._pending: dict[str, NodeCreateRequest] = {}
        self._lock = asyncio.Lock()

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
        try:
            from sandfleet.images import ImageStore, stack_for

            layers, config = stack_for(ImageStore(self.images_dir), req.image, req.workspace)
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
            self._write_meta(req, config)
            self._boxes[req.id] = _Box(req, config, handle, AgentClient(handle.agent_socket))
        finally:
            self._pending.pop(req.id, None)

    async def destroy(self, sandbox_id: str) -> None:
        box = self._box(sandbox_id)
        self._boxes.pop(sandbox_id, None)
        try:
            await self.backends[box.request.kind].destroy(sandbox_id)
        finally:
            (self._meta_dir / f"{sandbox_id}.json").unlink(missing_ok=True)

    async def recover(self) -> None:
        """Adopt boxes that survived a restart; destroy those without metadata."""
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
                log.info("adopted %s %s", kind, handle.id)
        for meta in self._meta_dir.glob("*.json"):
            if meta.stem not in self._boxes:
                meta.unlink(missing_ok=True)

    async def close(self, destroy_all: bool = False) -> None:
        """Stop serving; with ``destroy_all`` every box is destroyed first."""
        if destroy_all:
            await asyncio.gather(
                *(self.destroy(i) for i in list(self._boxes)), return_exceptions=True
            )
        for backend in self.backends.values():
            await backend.close()

    def _write_meta(self, req: NodeCreateRequest, config: ImageConfig) -> None:
        tmp = self._meta_dir / f".{req.id}.tmp"
        tmp.write_text(
            json.dumps(
                {"request": req.model_dump(mode="json"), "config": config.model_dump(mode="json")}
            )
        )
        os.replace(tmp, self._meta_dir / f"{req.id}.json")

    def _box(self, sandbox_id: str) -> _Box:
        box = self._boxes.get(sandbox_id)
        if box is None:
            if sandbox_id in self._pending:
                raise FailedPrecondition(f"sandbox {sandbox_id} is still being created; retry")
            raise NotFound(f"sandbox {sandbox_id} does not exist on node {self.node_id}")
        return box

    # ------------------------------------------------------------------ inside the box

    async def exec(self, sandbox_id: str, req: ExecRequest) -> ExecResult:
        """Run a command; status ``oom`` when the box's OOM counter rose and it was SIGKILLed."""
        box = self._box(sandbox_id)
        backend = self.backends[box.request.kind]
        env = {**box.config.env, **box.request.env, **req.env}
        req = req.model_copy(update={"env": env, "cwd": req.cwd or box.config.workdir})
        ooms_before = backend.oom_kills(sandbox_id)
        result = await box.agent.exec(req)
        if (
            result.status == "signaled"
            and result.signal == signal.SIGKILL
            and backend.oom_kills(sandbox_id) > ooms_before
        ):
            result = result.model_copy(update={"status": "oom"})
        return result

    @contextlib.asynccontextmanager
    async def read_file(
        self, sandbox_id: str, path: str, max_bytes: int | None = None
    ) -> AsyncIterator[AsyncIterator[bytes]]:
        """Yield the file's chunks; errors raise before the first chunk.

        Only regular files are read (a device such as /dev/zero or a FIFO would
        never end); with ``max_bytes`` a larger file is refused up front and
        one that grows meanwhile is cut at ``max_bytes``.
        """
        agent = self._box(sandbox_id).agent
        entry = await agent.stat(path)
        if entry.type in ("dir", "other"):
            what = "a directory" if entry.type == "dir" else "not a regular file (device, FIFO...)"
            raise InvalidArgument(f"{path} is {what}: only regular files can be read")
        if max_bytes is not None and entry.size > max_bytes:
            raise InvalidArgument(
                f"{path} is {entry.size} bytes, over max_bytes={max_bytes}: use download()"
            )
        stream = agent.read_file(path).__aiter__()
        first = await anext(stream, None)

        async def chunks() -> AsyncIterator[bytes]:
            left = max_bytes
            pending = first
            while pending is not None:
                if left is not None:
                    pending = pending[:left]
                    left -= len(pending)
                yield pending
                if left == 0:
                    return
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
        await self._box(sandbox_id).agent.remove(path, recursive=recursive)

    async def mkdir(self, sandbox_id: str, path: str, parents: bool) -> FileEntry:
        return await self._box(sandbox_id).agent.mkdir(path, parents=parents)
