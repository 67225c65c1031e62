"""The control plane's side of sandbox lifecycles: idle TTLs, lifetimes, pause and resume.

The control plane reaps on the same deadlines as the nodes (see
:mod:`sandfleet.node.lifetimes`); either one alone is enough to reclaim a
sandbox, so a sandbox is reclaimed whichever of the two is down.

Activity (for the idle TTL) is every call the control plane forwards to a
sandbox's node. Stamping the store on each call would cost a write per exec,
so :class:`Activity` keeps the stamps in memory and writes them to the store
on each reaper pass (every second); answers about a sandbox include the
stamps not yet written. A forwarded call also resumes a paused sandbox (its
node does it), so the record's state turns back to ``running``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Annotated, Any, Literal

from fastapi import APIRouter, Depends, Request

from sandfleet.wire.errors import InvalidArgument, NotFound, SandfleetError
from sandfleet.wire.models import (
    ErrorInfo,
    GroupRequest,
    GroupResult,
    LifetimeRequest,
    SandboxInfo,
)

if TYPE_CHECKING:
    from sandfleet.controlplane.service import ControlPlane
    from sandfleet.controlplane.store import Store

__all__ = [
    "MAX_LIFETIME_S",
    "Activity",
    "check_lifetime",
    "group",
    "lifecycle_router",
    "pause",
    "reap_idle",
    "resume",
    "set_lifetime",
]

log = logging.getLogger("sandfleet.controlplane")

#: The longest TTL or idle TTL accepted, seconds (30 days).
MAX_LIFETIME_S = 30 * 86400.0
#: States of sandboxes that exist on a node (lifecycle calls reach them).
LIVE_STATES: tuple[Literal["creating", "running", "paused"], ...] = (
    "creating",
    "running",
    "paused",
)


def check_lifetime(name: str, value: float | None) -> None:
    """Raise ``InvalidArgument`` unless ``value`` (seconds) is None or in (0, 30 days]."""
    if value is not None and not (math.isfinite(value) and 0 < value <= MAX_LIFETIME_S):
        raise InvalidArgument(
            f"{name}={value} is out of range: give 0 < {name} <= {MAX_LIFETIME_S:.0f} seconds,"
            " or None for no limit"
        )


class Activity:
    """This control plane instance's memory of calls forwarded to each sandbox."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}
        self._calls: dict[str, int] = {}
        self._unsaved: set[str] = set()
        #: Sandboxes a forwarded call resumed since they were last paused through here.
        self._resumed: set[str] = set()

    @contextlib.contextmanager
    def call(self, sandbox_id: str, resumes: bool = True) -> Iterator[None]:
        """A forwarded call: activity at start and end, never idle in between.

        ``resumes``: the node resumes a paused sandbox for it (all calls but
        reading the log and snapshots, which leave a paused sandbox paused).
        """
        self._calls[sandbox_id] = self._calls.get(sandbox_id, 0) + 1
        self.touch(sandbox_id)
        if resumes:
            self._resumed.add(sandbox_id)
        try:
            yield
        finally:
            left = self._calls[sandbox_id] - 1
            if left:
                self._calls[sandbox_id] = left
            else:
                del self._calls[sandbox_id]
            self.touch(sandbox_id)

    def touch(self, sandbox_id: str) -> None:
        self._last[sandbox_id] = time.time()
        self._unsaved.add(sandbox_id)

    def busy(self, sandbox_id: str) -> bool:
        """Whether a call to the sandbox is in flight through this instance."""
        return sandbox_id in self._calls

    def paused(self, sandbox_id: str) -> None:
        """The sandbox was just paused through this instance."""
        self._resumed.discard(sandbox_id)
        self.touch(sandbox_id)

    def forget(self, sandbox_id: str) -> None:
        self._last.pop(sandbox_id, None)
        self._unsaved.discard(sandbox_id)
        self._resumed.discard(sandbox_id)

    def overlay(self, info: SandboxInfo) -> SandboxInfo:
        """``info`` with what this instance knows and the store does not yet."""
        update: dict[str, Any] = {}
        last = self._last.get(info.id)
        if last is not None and (info.last_active_at is None or last > info.last_active_at):
            update["last_active_at"] = last
        if info.state == "paused" and info.id in self._resumed:
            update["state"] = "running"
        return info.model_copy(update=update) if update else info

    def flush(self, store: Store) -> None:
        """Write the stamps (and resumed states) not yet in the store."""
        unsaved, self._unsaved = self._unsaved, set()
        for sandbox_id in unsaved:
            info = store.get_sandbox(sandbox_id)
            if info is None or info.state not in LIVE_STATES:
                self.forget(sandbox_id)
                continue
            fresh = self.overlay(info)
            if fresh is not info:
                store.put_sandbox(fresh)
            if sandbox_id not in self._calls:
                self._last.pop(sandbox_id, None)
            if fresh.state == "running":
                self._resumed.discard(sandbox_id)


# ---------------------------------------------------------------------- calls


async def _node_call(cp: ControlPlane, info: SandboxInfo, suffix: str, **kw: Any) -> dict[str, Any]:
    address = cp._node_address(info.node_id)
    resp = await cp.nodes.call(address, "POST", f"/v1/sandboxes/{info.id}{suffix}", **kw)
    answer: dict[str, Any] = resp.json()
    return answer


def _live(cp: ControlPlane, sandbox_id: str) -> SandboxInfo:
    info = cp.get(sandbox_id)
    if info.state not in LIVE_STATES:
        raise NotFound(f"sandbox {sandbox_id} is {info.state}: it cannot be paused or changed")
    return info


async def pause(cp: ControlPlane, sandbox_id: str) -> SandboxInfo:
    """Freeze a sandbox (memory kept, no CPU); any later call resumes it. Idempotent.

    Its hard TTL keeps running while it is paused; its idle clock stops. Raises ``NotFound``,
    ``FailedPrecondition`` (still being created; a kind that cannot pause),
    ``Unavailable`` (its node is unreachable) and ``Internal`` (the freeze did
    not complete: it was left running).
    """
    info = _live(cp, sandbox_id)
    await _node_call(cp, info, "/pause")
    cp.activity.paused(sandbox_id)
    info = info.model_copy(update={"state": "paused", "last_active_at": time.time()})
    cp.store.put_sandbox(info)
    return info


async def resume(cp: ControlPlane, sandbox_id: str) -> SandboxInfo:
    """Thaw a paused sandbox (a running one is left as it is). Errors as :func:`pause`."""
    info = _live(cp, sandbox_id)
    await _node_call(cp, info, "/resume")
    cp.activity.touch(sandbox_id)
    info = info.model_copy(update={"state": "running", "last_active_at": time.time()})
    cp.store.put_sandbox(info)
    return info


async def set_lifetime(cp: ControlPlane, sandbox_id: str, req: LifetimeRequest) -> SandboxInfo:
    """New lifetimes counted from now; fields ``req`` leaves out are kept.

    ``ttl_s``: the hard TTL ends this many seconds from now (None: no TTL);
    ``idle_ttl_s``: seconds without a call before it is reclaimed (None: never).
    Raises ``InvalidArgument`` (a value outside (0, 30 days]; neither given),
    ``NotFound``, ``Unavailable`` (its node is unreachable: nothing changed).
    """
    given = req.model_fields_set
    if not given:
        raise InvalidArgument("give ttl_s and/or idle_ttl_s (seconds; None removes the limit)")
    check_lifetime("ttl_s", req.ttl_s)
    check_lifetime("idle_ttl_s", req.idle_ttl_s)
    info = _live(cp, sandbox_id)
    body = req.model_dump(mode="json", include=given)
    answer = await _node_call(cp, info, "/lifetime", json=body)
    now = time.time()
    update: dict[str, Any] = {"last_active_at": now}
    if "ttl_s" in given:
        update["expires_at"] = now + req.ttl_s if req.ttl_s is not None else None
    if "idle_ttl_s" in given:
        update["idle_ttl_s"] = req.idle_ttl_s
    if answer.get("state") in ("running", "paused"):
        update["state"] = answer["state"]
    cp.activity.touch(sandbox_id)
    info = info.model_copy(update=update)
    cp.store.put_sandbox(info)
    return info


async def group(
    cp: ControlPlane, labels: dict[str, str], op: Literal["pause", "resume"]
) -> GroupResult:
    """Pause or resume every live sandbox carrying all ``labels``, in parallel.

    One request per node (``POST /v1/sandboxes/pause`` or ``/resume`` with the
    ids), all nodes at once; each node acts on its boxes in parallel. Never
    raises for one sandbox's or one node's failure: those are in ``failed`` by id.
    """
    by_node: dict[str, list[SandboxInfo]] = {}
    for info in cp.store.list_sandboxes(labels=labels, states=LIVE_STATES):
        by_node.setdefault(info.node_id, []).append(info)
    result = GroupResult()

    async def on_node(node_id: str, infos: list[SandboxInfo]) -> None:
        try:
            resp = await cp.nodes.call(
                cp._node_address(node_id),
                "POST",
                f"/v1/sandboxes/{op}",
                json={"ids": [i.id for i in infos]},
                timeout_s=60.0,
            )
            answer = resp.json()
        except SandfleetError as exc:
            for info in infos:
                result.failed[info.id] = ErrorInfo(code=exc.code, message=exc.message)
            return
        for sandbox_id, err in answer.get("failed", {}).items():
            result.failed[sandbox_id] = ErrorInfo.model_validate(err)
        done = set(answer.get("done", []))
        now = time.time()
        for info in infos:
            if info.id not in done:
                continue
            if op == "pause":
                cp.activity.paused(info.id)
            else:
                cp.activity.touch(info.id)
            state: Literal["paused", "running"] = "paused" if op == "pause" else "running"
            cp.store.put_sandbox(info.model_copy(update={"state": state, "last_active_at": now}))
            result.sandboxes.append(info.id)

    await asyncio.gather(*(on_node(n, infos) for n, infos in by_node.items()))
    result.sandboxes.sort()
    return result


async def reap_idle(cp: ControlPlane, now: float | None = None) -> int:
    """Destroy live sandboxes idle for longer than their idle TTL; how many were."""
    now = time.time() if now is None else now
    reaped = 0
    for info in cp.store.list_sandboxes(states=LIVE_STATES):
        if info.idle_ttl_s is None or info.state == "paused" or cp.activity.busy(info.id):
            continue  # paused: its idle clock stops until it is resumed
        last = cp.activity.overlay(info).last_active_at or info.created_at
        if now - last < info.idle_ttl_s:
            continue
        try:
            await cp.destroy(info.id, reason="idle TTL")
            reaped += 1
            log.info("sandbox %s reclaimed: idle TTL reached", info.id)
        except SandfleetError as exc:
            log.warning("could not reclaim idle %s: %s", info.id, exc)
    return reaped


# ---------------------------------------------------------------------- HTTP


async def _cp_of(request: Request) -> ControlPlane:
    # async: FastAPI runs a plain-def dependency in a thread, a hop per request.
    cp: ControlPlane = request.app.state.cp
    return cp


# Module level: FastAPI resolves string annotations in the module's globals, where
# ControlPlane is not (it imports this module).
CP = Annotated[Any, Depends(_cp_of)]


def lifecycle_router(dependencies: list[Any]) -> APIRouter:
    """The control plane's lifecycle endpoints under ``/v1/sandboxes``.

    ``POST /pause`` and ``/resume`` (a :class:`GroupRequest`) → :class:`GroupResult`;
    ``POST /{id}/pause``, ``/{id}/resume`` and ``/{id}/lifetime`` (a
    :class:`LifetimeRequest`) → the sandbox's :class:`SandboxInfo`.
    """
    router = APIRouter(prefix="/v1/sandboxes", dependencies=dependencies)

    @router.post("/pause")
    async def pause_group(req: GroupRequest, cp: CP) -> GroupResult:
        return await group(cp, req.labels, "pause")

    @router.post("/resume")
    async def resume_group(req: GroupRequest, cp: CP) -> GroupResult:
        return await group(cp, req.labels, "resume")

    @router.post("/{sandbox_id}/pause")
    async def pause_one(sandbox_id: str, cp: CP) -> SandboxInfo:
        return await pause(cp, sandbox_id)

    @router.post("/{sandbox_id}/resume")
    async def resume_one(sandbox_id: str, cp: CP) -> SandboxInfo:
        return await resume(cp, sandbox_id)

    @router.post("/{sandbox_id}/lifetime")
    async def lifetime(sandbox_id: str, req: LifetimeRequest, cp: CP) -> SandboxInfo:
        return await set_lifetime(cp, sandbox_id, req)

    return router
