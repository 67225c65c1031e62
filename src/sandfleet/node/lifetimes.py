"""A node's own lifecycle of its boxes: TTLs, idle TTLs, pause and resume.

Every node reaps its boxes on its own deadlines, whether or not a control
plane is reachable: a client that died without a word, a control plane that
is down or restarted, or a node agent restarted in between never leaves a
box running past its TTL. The deadlines of box ``<id>`` live in
``state/boxes/<id>.lifetime`` (JSON, written atomically), beside the box's
metadata, so a restarted node agent goes on where its predecessor stopped.

Activity is any call the node serves on a box (exec, files, processes, ...,
pause and lifetime changes too): :class:`ActivityMiddleware` stamps the box's
``last_active_at`` when a call starts and when it ends, and counts calls in
flight, so a long command never counts as idle. ``last_active_at`` is
written to disk at most every :data:`FLUSH_INTERVAL_S`; a node agent killed
meanwhile forgets at most that much activity.

Pause freezes the box with the cgroup freezer (see
:mod:`sandfleet.backends.container.freezer`); any call on a paused box resumes
it first, transparently, except the lifecycle calls themselves (pause,
resume, lifetime, info, destroy).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from fastapi import APIRouter, Depends
from starlette.types import ASGIApp, Receive, Scope, Send

from sandfleet.wire.errors import FailedPrecondition, InvalidArgument, NotFound, SandfleetError
from sandfleet.wire.models import ErrorInfo, LifetimeRequest, NodeCreateRequest, WireModel
from sandfleet.wire.server import token_checker

if TYPE_CHECKING:
    from sandfleet.node.service import NodeService

__all__ = [
    "FLUSH_INTERVAL_S",
    "MAX_LIFETIME_S",
    "REAP_INTERVAL_S",
    "ActivityMiddleware",
    "BoxLifetime",
    "NodeLifetimes",
    "Pausable",
    "check_lifetime",
    "lifecycle_router",
]

log = logging.getLogger("sandfleet.node")

#: Seconds between two passes of the node's reaper.
REAP_INTERVAL_S = float(os.environ.get("SANDFLEET_NODE_REAP_INTERVAL_S", "0.5"))
#: Seconds between two writes of a busy box's ``last_active_at``.
FLUSH_INTERVAL_S = 1.0
#: The longest TTL or idle TTL accepted, seconds (30 days).
MAX_LIFETIME_S = 30 * 86400.0

SUFFIX = ".lifetime"
_PATH_RE = re.compile(r"^/v1/sandboxes/([^/]+)(/.*)?$")
#: Calls that do not resume a paused box (suffixes after /v1/sandboxes/<id>): a
#: snapshot packs a paused box as it is, and its log is read from the node's disk.
_LIFECYCLE_SUFFIXES = frozenset(
    {"", "/pause", "/resume", "/lifetime", "/snapshot", "/log", "/events"}
)


@runtime_checkable
class Pausable(Protocol):
    """A backend that can freeze its boxes (the container backend)."""

    async def pause(self, sandbox_id: str) -> None: ...

    async def resume(self, sandbox_id: str) -> None: ...

    def paused(self, sandbox_id: str) -> bool: ...


def check_lifetime(name: str, value: float | None) -> None:
    """Raise ``InvalidArgument`` unless ``value`` (seconds) is None or in (0, 30 days]."""
    if value is not None and not (math.isfinite(value) and 0 < value <= MAX_LIFETIME_S):
        raise InvalidArgument(
            f"{name}={value} is out of range: give 0 < {name} <= {MAX_LIFETIME_S:.0f} seconds,"
            " or None for no limit"
        )


@dataclass
class BoxLifetime:
    """When one box is reclaimed. Times are Unix seconds, durations seconds.

    ``expires_at``: the hard TTL's end (None: none); ``idle_ttl_s``: reclaimed
    that long after ``last_active_at`` with no call in flight (None: never).
    """

    expires_at: float | None
    idle_ttl_s: float | None
    last_active_at: float
    paused: bool = False
    calls: int = 0
    saved_at: float = 0.0
    dirty: bool = False

    def doc(self) -> dict[str, Any]:
        return {
            "expires_at": self.expires_at,
            "idle_ttl_s": self.idle_ttl_s,
            "last_active_at": self.last_active_at,
        }

    def due(self, now: float) -> str | None:
        """Why the box must go now ("TTL", "idle TTL"), or None."""
        if self.expires_at is not None and now >= self.expires_at:
            return "TTL"
        if (
            self.idle_ttl_s is not None
            and self.calls == 0
            and not self.paused  # paused: waiting for its trainer, not idle
            and now - self.last_active_at >= self.idle_ttl_s
        ):
            return "idle TTL"
        return None


class NodeLifetimes:
    """The deadlines and pause state of the boxes of ``service``, and their reaper."""

    def __init__(self, service: NodeService, meta_dir: Path) -> None:
        self._service = service
        self._dir = meta_dir
        self._boxes: dict[str, BoxLifetime] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._task: asyncio.Task[None] | None = None
        #: Boxes this node reclaimed on its own deadlines, by reason.
        self.reaped: dict[str, int] = {"TTL": 0, "idle TTL": 0}

    # ------------------------------------------------------------------ records

    def _path(self, sandbox_id: str) -> Path:
        return self._dir / f"{sandbox_id}{SUFFIX}"

    def _save(self, sandbox_id: str, life: BoxLifetime) -> None:
        tmp = self._dir / f".{sandbox_id}{SUFFIX}.tmp"
        tmp.write_text(json.dumps(life.doc()))
        os.replace(tmp, self._path(sandbox_id))
        life.saved_at = time.monotonic()
        life.dirty = False

    def add(self, req: NodeCreateRequest, now: float) -> BoxLifetime:
        """Start the clocks of a new box created at ``now`` (Unix seconds); saved at once."""
        life = BoxLifetime(
            expires_at=now + req.ttl_s if req.ttl_s is not None else None,
            idle_ttl_s=req.idle_ttl_s,
            last_active_at=now,
        )
        self._save(req.id, life)
        self._boxes[req.id] = life
        return life

    def adopt(self, req: NodeCreateRequest, meta: Path, paused: bool) -> BoxLifetime:
        """The clocks of a box a previous node agent left running (or paused).

        Read from its ``.lifetime`` file; without one (a node agent killed
        between writing the metadata and it) they restart from the metadata
        file's time, which is when the box was created.
        """
        try:
            doc = json.loads(self._path(req.id).read_text())
            life = BoxLifetime(
                expires_at=doc["expires_at"],
                idle_ttl_s=doc["idle_ttl_s"],
                last_active_at=float(doc["last_active_at"]),
            )
        except (OSError, ValueError, KeyError, TypeError):
            born = meta.stat().st_mtime if meta.exists() else time.time()
            life = BoxLifetime(
                expires_at=born + req.ttl_s if req.ttl_s is not None else None,
                idle_ttl_s=req.idle_ttl_s,
                last_active_at=born,
            )
            self._save(req.id, life)
        life.paused = paused
        self._boxes[req.id] = life
        return life

    def drop(self, sandbox_id: str) -> None:
        """Forget a destroyed box and remove its file."""
        self._boxes.pop(sandbox_id, None)
        self._locks.pop(sandbox_id, None)
        self._path(sandbox_id).unlink(missing_ok=True)

    def sweep(self) -> None:
        """Remove ``.lifetime`` files of boxes this node does not host (after recover)."""
        for path in self._dir.glob(f"*{SUFFIX}"):
            if path.name[: -len(SUFFIX)] not in self._boxes:
                path.unlink(missing_ok=True)
        for tmp in self._dir.glob(f".*{SUFFIX}.tmp"):
            tmp.unlink(missing_ok=True)

    def get(self, sandbox_id: str) -> BoxLifetime:
        """The clocks of a box; ``NotFound`` if this node does not host it."""
        life = self._boxes.get(sandbox_id)
        if life is None:
            raise NotFound(f"sandbox {sandbox_id} does not exist on node {self._service.node_id}")
        return life

    def known(self, sandbox_id: str) -> bool:
        return sandbox_id in self._boxes

    def state(self, sandbox_id: str) -> dict[str, Any]:
        """What the lifecycle endpoints answer: state and clocks of the box."""
        life = self.get(sandbox_id)
        return {"state": "paused" if life.paused else "running", **life.doc()}

    # ------------------------------------------------------------------ activity

    @contextlib.contextmanager
    def activity(self, sandbox_id: str) -> Iterator[None]:
        """Mark a call on the box: active at start and at end, never idle in between."""
        life = self._boxes.get(sandbox_id)
        if life is None:
            yield
            return
        life.calls += 1
        life.last_active_at = time.time()
        life.dirty = True
        try:
            yield
        finally:
            life.calls -= 1
            life.last_active_at = time.time()
            life.dirty = True

    def set_lifetime(self, sandbox_id: str, req: LifetimeRequest) -> BoxLifetime:
        """Apply new lifetimes from now: fields ``req`` sets are changed, others kept.

        ``ttl_s`` (seconds from now; None: no hard TTL), ``idle_ttl_s`` (None:
        none). Raises ``InvalidArgument`` for a value outside (0, 30 days] and
        for a request setting neither, ``NotFound`` for an unknown box.
        """
        given = req.model_fields_set
        if not given:
            raise InvalidArgument("give ttl_s and/or idle_ttl_s (seconds; None removes the limit)")
        check_lifetime("ttl_s", req.ttl_s)
        check_lifetime("idle_ttl_s", req.idle_ttl_s)
        life = self.get(sandbox_id)
        now = time.time()
        if "ttl_s" in given:
            life.expires_at = now + req.ttl_s if req.ttl_s is not None else None
        if "idle_ttl_s" in given:
            life.idle_ttl_s = req.idle_ttl_s
        life.last_active_at = now
        self._save(sandbox_id, life)
        return life

    # ------------------------------------------------------------------ pause

    def _pausable(self, sandbox_id: str) -> Pausable:
        backend = self._service.backend_of(sandbox_id)
        if not isinstance(backend, Pausable):
            raise FailedPrecondition(
                f"sandbox {sandbox_id} is of a kind that cannot be paused on this node"
            )
        return backend

    def _lock(self, sandbox_id: str) -> asyncio.Lock:
        return self._locks.setdefault(sandbox_id, asyncio.Lock())

    async def pause(self, sandbox_id: str) -> None:
        """Freeze the box: its memory stays, it uses no CPU. Idempotent.

        Its hard TTL keeps running; its idle clock stops (a paused box waits
        for its trainer) and starts again at resume. Raises ``NotFound``
        (unknown box), ``FailedPrecondition`` (still being created, or a kind
        that cannot pause) and ``Internal`` (the freeze did not complete; the
        box was left running).
        """
        backend = self._pausable(sandbox_id)
        life = self.get(sandbox_id)
        async with self._lock(sandbox_id):
            await backend.pause(sandbox_id)
            life.paused = True
        log.debug("sandbox %s paused", sandbox_id)

    async def resume(self, sandbox_id: str) -> None:
        """Thaw a paused box; a running box is left as it is. Errors as :meth:`pause`."""
        life = self.get(sandbox_id)
        if not life.paused:
            return
        backend = self._pausable(sandbox_id)
        async with self._lock(sandbox_id):
            if life.paused:
                await backend.resume(sandbox_id)
                life.paused = False
                life.last_active_at = time.time()  # the idle clock starts again
                life.dirty = True
                log.debug("sandbox %s resumed", sandbox_id)

    async def disown(self, sandbox_ids: list[str]) -> None:
        """Destroy boxes the control plane has no record of (told at registration).

        Boxes being created are not in the list the node registers with, so
        they are never among these.
        """
        for sandbox_id in sandbox_ids:
            if not self.known(sandbox_id):
                continue
            log.warning("destroying %s: the control plane has no record of it", sandbox_id)
            try:
                await self._service.destroy(sandbox_id)
            except NotFound:
                pass
            except SandfleetError as exc:  # the next registration tries again
                log.warning("could not destroy %s: %s", sandbox_id, exc)

    # ------------------------------------------------------------------ reaper

    async def reap_once(self, now: float | None = None) -> int:
        """Destroy the boxes past their TTL or idle TTL; how many were destroyed."""
        now = time.time() if now is None else now
        due = [(sid, why) for sid, life in self._boxes.items() if (why := life.due(now))]

        async def reap(sandbox_id: str, why: str) -> bool:
            try:
                await self._service.destroy(sandbox_id)
            except NotFound:
                return False  # destroyed meanwhile
            except SandfleetError as exc:
                log.warning("could not reclaim %s (%s reached): %s", sandbox_id, why, exc)
                return False
            self.reaped[why] += 1
            log.info("sandbox %s reclaimed by node: %s reached", sandbox_id, why)
            return True

        done = await asyncio.gather(*(reap(sid, why) for sid, why in due))
        self.flush()
        return sum(done)

    def flush(self, force: bool = False) -> None:
        """Write the clocks that changed (at most every FLUSH_INTERVAL_S, unless ``force``)."""
        limit = time.monotonic() - FLUSH_INTERVAL_S
        for sid, life in list(self._boxes.items()):
            if life.dirty and (force or life.saved_at <= limit):
                try:
                    self._save(sid, life)
                except OSError as exc:
                    log.warning("could not save the lifetime of %s: %s", sid, exc)

    async def _reap_forever(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.reap_once()
            except Exception:
                log.exception("the node's reaper failed")

    def start(self, interval_s: float = REAP_INTERVAL_S) -> None:
        """Start the reaper (every ``interval_s`` seconds) on the running loop."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._reap_forever(interval_s))

    async def close(self) -> None:
        """Stop the reaper and save every clock that changed."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self.flush(force=True)


class ActivityMiddleware:
    """ASGI middleware of the node app: every authorized call on a known box is activity,
    and all but the lifecycle calls resume a paused box before they are served.

    Requests without the cluster ``token`` pass through untouched (the routes
    refuse them), so they neither keep a box alive nor wake it.
    """

    def __init__(self, app: ASGIApp, lifetimes: NodeLifetimes, token: str | None) -> None:
        self.app = app
        self.lifetimes = lifetimes
        self._auth = f"Bearer {token}".encode() if token else None

    def _authorized(self, scope: Scope) -> bool:
        if self._auth is None:
            return True
        return any(k == b"authorization" and v == self._auth for k, v in scope["headers"])

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        match = _PATH_RE.match(scope["path"]) if scope["type"] == "http" else None
        if match is None or not self.lifetimes.known(match[1]) or not self._authorized(scope):
            await self.app(scope, receive, send)
            return
        sandbox_id, suffix = match[1], match[2] or ""
        with self.lifetimes.activity(sandbox_id):
            if suffix not in _LIFECYCLE_SUFFIXES:
                try:
                    await self.lifetimes.resume(sandbox_id)
                except SandfleetError as exc:
                    await _error(send, exc)
                    return
            await self.app(scope, receive, send)


async def _error(send: Send, exc: SandfleetError) -> None:
    body = json.dumps(exc.to_wire()).encode()
    await send(
        {
            "type": "http.response.start",
            "status": exc.http_status,
            "headers": [(b"content-type", b"application/json")],
        }
    )
    await send({"type": "http.response.body", "body": body})


class BoxIds(WireModel):
    """Boxes of one node a group pause or resume acts on (the control plane picks them)."""

    ids: list[str]


def lifecycle_router(lifetimes: NodeLifetimes, token: str | None) -> APIRouter:
    """``POST /v1/sandboxes/{id}/pause``, ``/resume`` and ``/lifetime`` on the node.

    Each answers the box's ``state`` (``running``/``paused``), ``expires_at``,
    ``idle_ttl_s`` and ``last_active_at`` (Unix seconds). ``POST
    /v1/sandboxes/pause`` and ``/resume`` with :class:`BoxIds` act on many at
    once, in parallel, in one request (a control plane's group operation) and
    answer ``{"done": [ids], "failed": {id: {"code", "message"}}}``.
    """
    router = APIRouter(prefix="/v1/sandboxes", dependencies=[Depends(token_checker(token))])

    async def many(req: BoxIds, pause: bool) -> dict[str, Any]:
        done: list[str] = []
        failed: dict[str, ErrorInfo] = {}

        async def one(sandbox_id: str) -> None:
            with lifetimes.activity(sandbox_id):
                try:
                    await (lifetimes.pause if pause else lifetimes.resume)(sandbox_id)
                except SandfleetError as exc:
                    failed[sandbox_id] = ErrorInfo(code=exc.code, message=exc.message)
                else:
                    done.append(sandbox_id)

        await asyncio.gather(*(one(i) for i in dict.fromkeys(req.ids)))
        return {"done": done, "failed": {k: v.model_dump() for k, v in failed.items()}}

    @router.post("/pause")
    async def pause_many(req: BoxIds) -> dict[str, Any]:
        return await many(req, pause=True)

    @router.post("/resume")
    async def resume_many(req: BoxIds) -> dict[str, Any]:
        return await many(req, pause=False)

    @router.post("/{sandbox_id}/pause")
    async def pause(sandbox_id: str) -> dict[str, Any]:
        await lifetimes.pause(sandbox_id)
        return lifetimes.state(sandbox_id)

    @router.post("/{sandbox_id}/resume")
    async def resume(sandbox_id: str) -> dict[str, Any]:
        await lifetimes.resume(sandbox_id)
        return lifetimes.state(sandbox_id)

    @router.post("/{sandbox_id}/lifetime")
    async def lifetime(sandbox_id: str, req: LifetimeRequest) -> dict[str, Any]:
        lifetimes.set_lifetime(sandbox_id, req)
        return lifetimes.state(sandbox_id)

    return router
