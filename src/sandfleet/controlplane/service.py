"""The control plane's logic: nodes, placement, sandbox records, routing, TTLs.

It never holds a sandbox's live state (the node does); what it keeps is in the
store, so it can restart, or run as several instances, without losing any.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import json
import logging
import math
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from sandfleet.controlplane.ids import new_sandbox_id, node_of, validate_node_id
from sandfleet.controlplane.lifetimes import LIVE_STATES, Activity, check_lifetime, reap_idle
from sandfleet.controlplane.nodeclient import NodeClients
from sandfleet.controlplane.placement import Infeasible, NodeLoad, Placed, place
from sandfleet.controlplane.store import Store
from sandfleet.wire.errors import (
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    SandfleetError,
    Unavailable,
)
from sandfleet.wire.models import (
    BUILT_KINDS,
    KINDS,
    CreateSandboxRequest,
    ImageManifest,
    NodeCreateRequest,
    NodeHeartbeat,
    NodeInfo,
    NodeRegistered,
    NodeRegistration,
    PoolConfig,
    PoolInfo,
    RunRequest,
    RunResult,
    SandboxInfo,
)

__all__ = ["ControlPlane", "validate_create"]

log = logging.getLogger("sandfleet.controlplane")

#: A node is unhealthy after this many seconds without a heartbeat.
NODE_TIMEOUT_S = 10.0
#: How many nodes one create may try before giving up with ResourceExhausted.
MAX_PLACEMENT_ATTEMPTS = 4
#: Seconds the list of nodes offering fncall is reused before the store is read again.
FNCALL_NODES_TTL_S = 1.0
#: Seconds a node may take beyond a call's own time limits.
FNCALL_MARGIN_S = 15.0
#: Connections to nodes for fncall calls (per control plane).
FNCALL_CONNECTIONS = 64


def validate_create(req: CreateSandboxRequest) -> None:
    """Raise InvalidArgument naming the field and the allowed range."""
    if req.kind == "fncall":
        raise InvalidArgument(
            "kind 'fncall' has no sandboxes to create: its calls are stateless, use"
            " POST /v1/run (client.run(code, kind='fncall'))"
        )
    if req.kind not in BUILT_KINDS:
        raise InvalidArgument(
            f"kind {req.kind!r} is not available in this release; available kinds:"
            f" {', '.join(BUILT_KINDS)} (all kinds: {', '.join(KINDS)})"
        )
    if not math.isfinite(req.cpu) or not 0.01 <= req.cpu <= 256:
        raise InvalidArgument(f"cpu={req.cpu} is out of range: give 0.01 to 256 cores")
    if not 16 <= req.memory_mb <= 1024 * 1024:
        raise InvalidArgument(f"memory_mb={req.memory_mb} is out of range: give 16 to 1048576 MiB")
    if not 8 <= req.pids_limit <= 65536:
        raise InvalidArgument(f"pids_limit={req.pids_limit} is out of range: give 8 to 65536")
    if not 16 <= req.disk_mb <= 1024 * 1024:
        raise InvalidArgument(f"disk_mb={req.disk_mb} is out of range: give 16 to 1048576 MiB")
    check_lifetime("ttl_s", req.ttl_s)
    check_lifetime("idle_ttl_s", req.idle_ttl_s)
    if len(req.labels) > 64:
        raise InvalidArgument(f"{len(req.labels)} labels given: at most 64")
    for key, value in req.labels.items():
        if not key or len(key) > 63 or "=" in key:
            raise InvalidArgument(f"label key {key!r} is not valid: 1-63 characters, no '='")
        if len(value) > 256:
            raise InvalidArgument(
                f"label {key!r} has a value of {len(value)} characters: at most 256"
            )
    for key, value in req.env.items():
        if not key or "=" in key or "\0" in key:
            raise InvalidArgument(f"env name {key!r} is not valid: no '=' or NUL, not empty")
        if "\0" in value:
            raise InvalidArgument(f"env {key!r} has a NUL byte in its value: remove it")
    env_bytes = sum(len(k.encode()) + len(v.encode()) + 2 for k, v in req.env.items())
    if env_bytes > 256 * 1024:
        raise InvalidArgument(f"env is {env_bytes} bytes: at most 262144 (pass data as files)")


@dataclass
class _InFlight:
    sandboxes: int = 0
    cpu: float = 0.0
    memory_mb: int = 0


class ControlPlane:
    """Stateless service over a :class:`Store`; ``images_dir`` is the shared image store."""

    def __init__(
        self, store: Store, images_dir: Path, token: str | None, *, pulls_images: bool = False
    ) -> None:
        self.store = store
        self.images_dir = images_dir
        #: Nodes pull images from blob stores: one missing here may still exist.
        self.pulls_images = pulls_images
        self.nodes = NodeClients(token)
        # fncall calls get a pool of their own, bounded: httpcore scans every
        # pooled connection on each request, which with a connection per call in
        # flight cost a third of the control plane's CPU at hundreds of calls/s.
        self.fncall_http = NodeClients(token, max_connections=FNCALL_CONNECTIONS)
        self._in_flight: dict[str, _InFlight] = {}
        self._addresses: dict[str, str] = {}
        self._rng = random.Random()
        self._reaper: asyncio.Task[None] | None = None
        #: Calls forwarded through this instance, for idle TTLs (controlplane/lifetimes.py).
        self.activity = Activity()
        #: Nodes that registered with this instance (and so were reconciled with it).
        self._registered: set[str] = set()
        #: Creates a node refused (capacity or unreachable) and placement retried elsewhere.
        self.refusals = 0
        self._fncall_cache: builtins.list[NodeInfo] = []
        self._fncall_at = -math.inf
        self._fncall_turn = 0

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self._reaper = asyncio.get_running_loop().create_task(self._reap_forever())

    async def close(self) -> None:
        if self._reaper:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        await self.nodes.close()
        await self.fncall_http.close()
        self.store.close()

    # ------------------------------------------------------------------ nodes

    def register_node(self, reg: NodeRegistration) -> NodeRegistered:
        """Record the node; reconcile both ways when it lists the sandboxes it hosts.

        Records of sandboxes it no longer hosts are closed; the answer's
        ``unknown_sandboxes`` are those it hosts with no live record here, for
        the node to destroy.
        """
        validate_node_id(reg.node_id)
        old = self.store.get_node(reg.node_id)
        info = NodeInfo(**reg.model_dump(exclude={"sandboxes"}), last_heartbeat=time.time())
        unknown: builtins.list[str] = []
        if reg.sandboxes is not None:
            unknown = self._reconcile(reg.node_id, set(reg.sandboxes))
        if old is not None:
            info = info.model_copy(
                update={
                    "sandboxes": old.sandboxes,
                    "memory_mb_reserved": old.memory_mb_reserved,
                    "cpu_reserved": old.cpu_reserved,
                }
            )
        self.store.put_node(info)
        self._addresses[reg.node_id] = reg.address
        self._registered.add(reg.node_id)
        log.info("node %s registered at %s", reg.node_id, reg.address)
        return NodeRegistered(**info.model_dump(), unknown_sandboxes=unknown)

    def _reconcile(self, node_id: str, hosted: set[str]) -> builtins.list[str]:
        """Close records of sandboxes the node no longer hosts (it restarted without them,
        or reclaimed them on its own deadlines); return those it hosts that have no live
        record here (created behind this store's back, or destroyed while it was away).

        Creates that were in flight on it died with its previous process.
        """
        recorded = self.store.list_sandboxes(node_id=node_id, states=LIVE_STATES)
        for info in recorded:
            if info.id not in hosted:
                self.store.set_sandbox_state(info.id, "destroyed", ended="gone from its node")
                self.activity.forget(info.id)
                log.info("sandbox %s is gone from node %s: record closed", info.id, node_id)
        unknown = sorted(hosted - {info.id for info in recorded})
        for sandbox_id in unknown:
            log.warning("node %s hosts %s, which has no record: destroyed", node_id, sandbox_id)
        return unknown

    def heartbeat(self, node_id: str, hb: NodeHeartbeat) -> NodeInfo:
        if node_id not in self._registered:
            # This instance has not reconciled with the node yet (it just started):
            # NotFound makes the node register again, listing what it hosts.
            raise NotFound(f"node {node_id!r} is not registered with this control plane; register")
        node = self.store.patch_node(node_id, {**hb.model_dump(), "last_heartbeat": time.time()})
        if node is None:
            raise NotFound(f"node {node_id!r} is not registered; register it first")
        return node

    def list_nodes(self) -> list[NodeInfo]:
        now = time.time()
        return [
            n.model_copy(update={"healthy": now - n.last_heartbeat < NODE_TIMEOUT_S})
            for n in self.store.list_nodes()
        ]

    def _node_address(self, node_id: str) -> str:
        # Cached: the data path must not query the store per call. Registration
        # refreshes it; an unreachable node drops it (see forward).
        address = self._addresses.get(node_id)
        if address is None:
            node = self.store.get_node(node_id)
            if node is None:
                raise NotFound(f"node {node_id!r} is not registered (the sandbox's node is gone)")
            address = self._addresses[node_id] = node.address
        return address

    # ------------------------------------------------------------------ images

    def list_images(self) -> list[ImageManifest]:
        from sandfleet.images import ImageStore

        return ImageStore(self.images_dir).list()

    def _check_images(self, req: CreateSandboxRequest) -> None:
        """Refuse an image the shared store lacks, unless nodes pull from blob stores
        (then the node that gets the sandbox pulls it, or says it has none)."""
        from sandfleet.images import ImageStore

        if self.pulls_images:
            return
        images = ImageStore(self.images_dir)
        images.resolve(req.image)
        if req.workspace is not None:
            images.resolve(req.workspace)

    # ------------------------------------------------------------------ sandboxes

    def _loads(self) -> list[NodeLoad]:
        loads = []
        for n in self.list_nodes():
            extra = self._in_flight.get(n.node_id, _InFlight())
            loads.append(
                NodeLoad(
                    node_id=n.node_id,
                    kinds=tuple(n.kinds),
                    healthy=n.healthy,
                    max_sandboxes=n.capacity.max_sandboxes,
                    cpu=n.capacity.cpu,
                    memory_mb=n.capacity.memory_mb,
                    sandboxes=n.sandboxes + extra.sandboxes,
                    cpu_reserved=n.cpu_reserved + extra.cpu,
                    memory_mb_reserved=n.memory_mb_reserved + extra.memory_mb,
                )
            )
        return loads

    async def create(self, req: CreateSandboxRequest) -> SandboxInfo:
        """Place and create a sandbox; retries other nodes when one refuses for capacity."""
        validate_create(req)
        self._check_images(req)
        refused: set[str] = set()
        last_error: SandfleetError | None = None
        for _ in range(MAX_PLACEMENT_ATTEMPTS):
            decision = place(
                self._loads(),
                kind=req.kind,
                cpu=req.cpu,
                memory_mb=req.memory_mb,
                exclude=frozenset(refused),
                rng=self._rng,
            )
            if isinstance(decision, Infeasible):
                raise InvalidArgument(decision.reason)
            if not isinstance(decision, Placed):
                if last_error is not None:
                    break
                raise ResourceExhausted(f"{decision.reason}; retry later or ask for less")
            try:
                return await self._create_on(decision.node_id, req)
            except (ResourceExhausted, Unavailable) as exc:
                refused.add(decision.node_id)
                self.refusals += 1
                last_error = exc
                log.info("node %s refused a create: %s", decision.node_id, exc)
        # Capacity somewhere: ResourceExhausted; only unreachable nodes or stores: Unavailable.
        cls = Unavailable if isinstance(last_error, Unavailable) else ResourceExhausted
        raise cls(f"{len(refused)} node(s) refused the sandbox (last: {last_error}); retry later")

    async def _create_on(self, node_id: str, req: CreateSandboxRequest) -> SandboxInfo:
        node = self.store.get_node(node_id)
        assert node is not None
        sandbox_id = new_sandbox_id(node_id)
        now = time.time()
        info = SandboxInfo(
            id=sandbox_id,
            kind=req.kind,
            node_id=node_id,
            state="creating",
            image=req.image,
            workspace=req.workspace,
            cpu=req.cpu,
            memory_mb=req.memory_mb,
            pids_limit=req.pids_limit,
            disk_mb=req.disk_mb,
            labels=req.labels,
            created_at=now,
            expires_at=now + req.ttl_s if req.ttl_s is not None else None,
            idle_ttl_s=req.idle_ttl_s,
            last_active_at=now,
        )
        self.store.put_sandbox(info)
        flight = self._in_flight.setdefault(node_id, _InFlight())
        flight.sandboxes += 1
        flight.cpu += req.cpu
        flight.memory_mb += req.memory_mb
        try:
            body = NodeCreateRequest(id=sandbox_id, **req.model_dump())
            resp = await self.nodes.call(
                node.address,
                "POST",
                "/v1/sandboxes",
                json=body.model_dump(mode="json"),
                timeout_s=120.0,
            )
            # The node's load as of this create: fresher than its last heartbeat.
            load = NodeHeartbeat.model_validate(resp.json()["load"])
            self.store.patch_node(node_id, load.model_dump())
        except BaseException:
            self.store.delete_sandbox(sandbox_id)
            raise
        finally:
            flight.sandboxes -= 1
            flight.cpu -= req.cpu
            flight.memory_mb -= req.memory_mb
        info = info.model_copy(update={"state": "running"})
        self.store.put_sandbox(info)
        return info

    def get(self, sandbox_id: str) -> SandboxInfo:
        node_of(sandbox_id)
        info = self.store.get_sandbox(sandbox_id)
        if info is None or info.state == "destroyed":
            raise NotFound(_gone(sandbox_id, info))
        return self.activity.overlay(info)

    def list(self, labels: dict[str, str] | None = None) -> list[SandboxInfo]:
        found = self.store.list_sandboxes(labels=labels, states=LIVE_STATES)
        return [self.activity.overlay(info) for info in found]

    async def destroy(self, sandbox_id: str, reason: str = "destroyed") -> None:
        """Destroy a sandbox; ``reason`` is kept as its record's ``ended`` ("TTL", ...)."""
        info = self.get(sandbox_id)
        self.store.set_sandbox_state(sandbox_id, "destroying")
        address = self._node_address(info.node_id)
        # NotFound: the node no longer has it, so the record is all that is left.
        with contextlib.suppress(NotFound):
            await self.nodes.call(address, "DELETE", f"/v1/sandboxes/{sandbox_id}")
        self.store.set_sandbox_state(sandbox_id, "destroyed", ended=reason)
        self.activity.forget(sandbox_id)

    # ------------------------------------------------------------------ data plane

    @contextlib.asynccontextmanager
    async def forward(
        self,
        sandbox_id: str,
        method: str,
        suffix: str,
        timeout_s: float | None = None,
        **kw: Any,
    ) -> AsyncIterator[httpx.Response]:
        """Send a call for ``sandbox_id`` to its node; yields the unread response."""
        node_id = node_of(sandbox_id)
        try:
            # A call is activity (idle TTL) and resumes a paused sandbox on its node.
            with self.activity.call(
                sandbox_id, resumes=suffix not in ("/snapshot", "/log", "/events")
            ):
                async with self.nodes.stream(
                    self._node_address(node_id),
                    method,
                    f"/v1/sandboxes/{sandbox_id}{suffix}",
                    timeout_s=timeout_s,
                    **kw,
                ) as resp:
                    yield resp
        except Unavailable:
            self._addresses.pop(node_id, None)
            raise
        except NotFound as exc:
            if "does not exist on node" not in exc.message:
                raise  # a path or process inside the sandbox, not the sandbox
            # Say why it is gone, when the record knows.
            raise NotFound(_gone(sandbox_id, self.store.get_sandbox(sandbox_id))) from None

    # ------------------------------------------------------------------ fncall

    def _fncall_nodes(self) -> builtins.list[NodeInfo]:
        # Cached for a second: the store is not read on every one of thousands of calls.
        now = time.monotonic()
        if now - self._fncall_at > FNCALL_NODES_TTL_S:
            self._fncall_cache = [n for n in self.list_nodes() if n.healthy and "fncall" in n.kinds]
            self._fncall_at = now
        if not self._fncall_cache:
            raise Unavailable(
                "no healthy node offers kind 'fncall': start a node agent (sandfleet up) and retry"
            )
        return self._fncall_cache

    def _fncall_turns(self) -> builtins.list[str]:
        """Addresses of the fncall nodes, starting with the next one in turn."""
        nodes = self._fncall_nodes()
        self._fncall_turn += 1
        k = self._fncall_turn % len(nodes)
        return [n.address for n in nodes[k:] + nodes[:k]]

    @contextlib.asynccontextmanager
    async def run_batch(self, body: bytes) -> AsyncIterator[httpx.Response]:
        """Hand a batch of fncall calls (a :class:`RunBatchRequest` as JSON) to one node.

        Yields the node's unread NDJSON answer (see :class:`RunBatchLine`). A
        node refusing the whole batch (full, unreachable) passes it to the next.
        """
        try:
            calls = json.loads(body).get("calls") or []
            bound = max(
                float(c.get("timeout_s", 10)) + float(c.get("compile_timeout_s", 30)) for c in calls
            )
        except (ValueError, TypeError, AttributeError):
            bound = 3600.0  # malformed: the node says what is wrong
        last: SandfleetError | None = None
        for address in self._fncall_turns():
            try:
                async with self.fncall_http.stream(
                    address,
                    "POST",
                    "/v1/run/batch",
                    content=body,
                    headers={"content-type": "application/json"},
                    timeout_s=min(bound, 7200.0) + FNCALL_MARGIN_S,
                ) as resp:
                    yield resp
                    return
            except (ResourceExhausted, Unavailable) as exc:
                last = exc
        assert last is not None
        raise last

    async def run_raw(self, body: bytes) -> bytes:
        """Hand one fncall call (a :class:`RunRequest` as JSON) to a node; its answer's JSON.

        The body is passed on unparsed (the node validates it) apart from its
        time limits, which bound the wait. Nodes are taken in turn; one whose
        pool is full (``ResourceExhausted``) passes the call to the next.
        Raises what the node raises, ``Unavailable`` when no node offers fncall.
        """
        try:
            doc = json.loads(body)
            bound = float(doc.get("timeout_s", 10)) + float(doc.get("compile_timeout_s", 30))
        except (ValueError, TypeError, AttributeError):
            bound = 3600.0  # malformed: the node says what is wrong
        last: SandfleetError | None = None
        for address in self._fncall_turns():
            try:
                resp = await self.fncall_http.call(
                    address,
                    "POST",
                    "/v1/run",
                    content=body,
                    headers={"content-type": "application/json"},
                    timeout_s=min(bound, 7200.0) + FNCALL_MARGIN_S,
                )
                return resp.content
            except (ResourceExhausted, Unavailable) as exc:
                last = exc
        assert last is not None
        raise last

    async def run(self, req: RunRequest) -> RunResult:
        """Run one fncall call on some node (see :meth:`run_raw`)."""
        answer = await self.run_raw(req.model_dump_json().encode())
        return RunResult.model_validate_json(answer)

    async def pools(self) -> builtins.list[PoolInfo]:
        """Every fncall pool on every healthy node."""
        found: builtins.list[PoolInfo] = []
        for node in self._fncall_nodes():
            resp = await self.nodes.call(node.address, "GET", "/v1/pools")
            found += [PoolInfo.model_validate(p) for p in resp.json()["pools"]]
        return found

    async def configure_pool(self, config: PoolConfig) -> builtins.list[PoolInfo]:
        """Apply ``config`` to the pool on every healthy node; their new states."""
        infos = []
        for node in self._fncall_nodes():
            resp = await self.nodes.call(
                node.address, "PUT", "/v1/pools", json=config.model_dump(mode="json")
            )
            infos.append(PoolInfo.model_validate(resp.json()))
        return infos

    # ------------------------------------------------------------------ TTL

    async def reap_once(self) -> int:
        """Destroy sandboxes past their TTL or idle TTL; returns how many were reclaimed.

        Activity stamps kept in memory are written to the store first.
        """
        self.activity.flush(self.store)
        reaped = await reap_idle(self)
        for info in self.store.expired_sandboxes(time.time()):
            try:
                await self.destroy(info.id, reason="TTL")
                reaped += 1
                log.info("sandbox %s reclaimed: TTL expired", info.id)
            except SandfleetError as exc:
                log.warning("could not reclaim %s: %s", info.id, exc)
        return reaped

    async def _reap_forever(self, interval_s: float = 1.0) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.reap_once()
            except Exception:
                log.exception("TTL reaper failed")


def _gone(sandbox_id: str, info: SandboxInfo | None) -> str:
    """Why a sandbox cannot be found, as far as its record says."""
    if info is None:
        return f"sandbox {sandbox_id} does not exist (destroyed long ago, or never created)"
    if info.state != "destroyed":
        return (
            f"sandbox {sandbox_id} is gone from its node {info.node_id} (reclaimed there on its"
            " own deadline, or lost with a node restart)"
        )
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(info.ended_at or 0))
    why = {
        "TTL": "its TTL ended",
        "idle TTL": "its idle TTL ended (no call for idle_ttl_s)",
        "gone from its node": "its node no longer had it",
        "destroyed": "it was destroyed",
    }.get(info.ended or "destroyed", info.ended or "it was destroyed")
    return f"sandbox {sandbox_id} no longer exists: {why}, at {when}"
