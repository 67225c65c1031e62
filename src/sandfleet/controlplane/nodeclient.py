"""HTTP calls from the control plane to node agents, errors translated once."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx

from sandfleet.wire.errors import DeadlineExceeded, Unavailable, error_from_wire

__all__ = ["NodeClients"]

_DEFAULT_TIMEOUT_S = 30.0


class NodeClients:
    """One pooled HTTP client for all node agents, authenticated with the cluster token."""

    def __init__(self, token: str | None, max_connections: int = 1024) -> None:
        headers = {"authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.AsyncClient(
            headers=headers,
            timeout=_DEFAULT_TIMEOUT_S,
            limits=httpx.Limits(
                max_connections=max_connections,
                max_keepalive_connections=min(256, max_connections),
                keepalive_expiry=30.0,
            ),
        )

    async def call(
        self,
        address: str,
        method: str,
        path: str,
        *,
        timeout_s: float | None = None,
        **kwargs: Any,
    ) -> httpx.Response:
        """Send one request to the node at ``address``; raise its error, if any."""
        async with self.stream(address, method, path, timeout_s=timeout_s, **kwargs) as resp:
            await resp.aread()
            return resp

    @asynccontextmanager
    async def stream(
        self,
        address: str,
        method: str,
        path: str,
        *,
        timeout_s: float | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[httpx.Response]:
        """Like :meth:`call` but the body is left unread for streaming."""
        url = address.rstrip("/") + path
        timeout = httpx.Timeout(timeout_s or _DEFAULT_TIMEOUT_S, connect=5.0)
        try:
            req = self._http.build_request(method, url, timeout=timeout, **kwargs)
            resp = await self._http.send(req, stream=True)
        except httpx.TimeoutException as exc:
            raise DeadlineExceeded(f"node at {address} did not answer in time: {exc}") from exc
        except httpx.TransportError as exc:
            raise Unavailable(f"node at {address} cannot be reached: {exc}") from exc
        try:
            if resp.status_code >= 400:
                await resp.aread()
                try:
                    body = resp.json()
                except ValueError:
                    body = resp.text
                raise error_from_wire(body, resp.status_code)
            yield resp
        finally:
            await resp.aclose()

    async def close(self) -> None:
        await self._http.aclose()
