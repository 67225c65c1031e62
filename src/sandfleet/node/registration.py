"""Registration with the control plane and the heartbeat loop."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable

import httpx

from sandfleet.wire.models import NodeHeartbeat, NodeRegistration

__all__ = ["HEARTBEAT_INTERVAL_S", "heartbeat_forever"]

log = logging.getLogger("sandfleet.node")

#: Seconds between heartbeats; the control plane marks a node unhealthy after ~5 missed.
HEARTBEAT_INTERVAL_S = float(os.environ.get("SANDFLEET_HEARTBEAT_INTERVAL_S", "2.0"))


async def heartbeat_forever(
    control_plane: str,
    token: str | None,
    registration: NodeRegistration,
    load: Callable[[], NodeHeartbeat],
    hosted: Callable[[], list[str]],
    interval_s: float = HEARTBEAT_INTERVAL_S,
    disown: Callable[[list[str]], Awaitable[None]] | None = None,
) -> None:
    """Register, then report load every ``interval_s`` seconds; re-register when forgotten.

    Registration reconciles both ways: the control plane closes its records of
    boxes the node no longer hosts, and answers ``unknown_sandboxes``, the
    boxes it has no record of, which ``disown`` destroys.

    Never raises except on cancellation: an unreachable control plane is logged
    and retried, so nodes and control plane can start in any order.
    """
    headers = {"authorization": f"Bearer {token}"} if token else {}
    base = control_plane.rstrip("/")
    registered = False
    async with httpx.AsyncClient(headers=headers, timeout=10.0) as http:
        while True:
            try:
                if not registered:
                    current = registration.model_copy(update={"sandboxes": hosted()})
                    r = await http.post(
                        f"{base}/v1/nodes/register", json=current.model_dump(mode="json")
                    )
                    r.raise_for_status()
                    registered = True
                    log.info("registered with the control plane at %s", base)
                    unknown = r.json().get("unknown_sandboxes") or []
                    if disown is not None and unknown:
                        await disown([str(i) for i in unknown])
                r = await http.post(
                    f"{base}/v1/nodes/{registration.node_id}/heartbeat",
                    json=load().model_dump(mode="json"),
                )
                if r.status_code == 404:
                    registered = False
                    continue
                r.raise_for_status()
            except httpx.HTTPError as exc:
                log.warning("control plane at %s: %s", base, exc)
                registered = False
            # Until registered, retry soon: the control plane may just be starting.
            await asyncio.sleep(interval_s if registered else min(interval_s, 0.5))
