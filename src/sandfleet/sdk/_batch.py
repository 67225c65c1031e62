"""Coalescing of concurrent fncall calls into batch requests, for the async client.

Calls made in the same turn of the event loop (``asyncio.gather`` of many
``run`` calls, a rollout pool's tasks) leave as one ``POST /v1/run/batch``;
each call's result is handed over as soon as its line arrives. A lone call
goes as a plain ``POST /v1/run``, so a caller alone waits for nothing.
Why: every HTTP request costs each hop (SDK, control plane, node) about
half a millisecond of CPU here, more than the call itself in a warm worker.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from sandfleet.sdk import _core
from sandfleet.wire.errors import Internal, SandfleetError, error_from_wire
from sandfleet.wire.models import RunBatchLine, RunResult

__all__ = ["RunBatcher"]

#: Calls per batch request; more in one turn leave as several batches.
BATCH_CALLS = 256
#: Requests in flight before new calls wait to leave together (under load, calls
#: that finish one by one would otherwise each start a request of their own) ...
MAX_IN_FLIGHT = 4
#: ... but never longer than this, seconds: a slow call holding a slot must not hold others.
LINGER_S = 0.002

_Pending = tuple[_core.Request[RunResult], "asyncio.Future[RunResult]"]


class RunBatcher:
    """Sends the ``run`` calls of one event-loop turn together.

    ``send`` performs a single request; ``lines`` streams a request's NDJSON
    lines; ``keep`` registers a background task the client waits for on close.
    """

    def __init__(
        self,
        send: Callable[[_core.Request[RunResult]], Awaitable[RunResult]],
        lines: Callable[[_core.Request[Any]], AsyncIterator[bytes]],
        keep: Callable[[asyncio.Future[Any]], None],
    ) -> None:
        self._send = send
        self._lines = lines
        self._keep = keep
        self._pending: list[_Pending] = []
        self._in_flight = 0
        self._scheduled = False
        self._timer: asyncio.TimerHandle | None = None

    async def run(self, request: _core.Request[RunResult]) -> RunResult:
        """The call's result. Cancelling the caller stops the call on the server once
        every call sharing its request is cancelled too; until then it runs to its end."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[RunResult] = loop.create_future()
        self._pending.append((request, fut))
        if not self._scheduled:
            self._scheduled = True
            if self._in_flight < MAX_IN_FLIGHT:
                loop.call_soon(self._flush)
            else:
                self._timer = loop.call_later(LINGER_S, self._flush)
        return await fut

    def _flush(self) -> None:
        self._scheduled = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        pending, self._pending = self._pending, []
        for i in range(0, len(pending), BATCH_CALLS):
            chunk = pending[i : i + BATCH_CALLS]
            work = self._one(*chunk[0]) if len(chunk) == 1 else self._many(chunk)
            self._in_flight += 1
            task = asyncio.ensure_future(work)
            task.add_done_callback(self._request_done)
            self._keep(task)
            futs = [fut for _, fut in chunk]
            for fut in futs:
                fut.add_done_callback(functools.partial(_abandon, task, futs))

    def _request_done(self, _: asyncio.Future[None]) -> None:
        self._in_flight -= 1
        if self._pending and (not self._scheduled or self._timer is not None):
            # Calls that waited for a slot leave now, together.
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    async def _one(self, request: _core.Request[RunResult], fut: asyncio.Future[RunResult]) -> None:
        try:
            result = await self._send(request)
        except BaseException as exc:  # handed to the caller, whatever it is
            if not fut.done():
                fut.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
        else:
            if not fut.done():
                fut.set_result(result)

    async def _many(self, chunk: list[_Pending]) -> None:
        body = b'{"calls":[' + b",".join(req.body or b"{}" for req, _ in chunk) + b"]}"
        timeout_s = max(req.timeout_s or 0.0 for req, _ in chunk) or None
        batch: _core.Request[Any] = _core.Request(
            "POST", "/v1/run/batch", _core.no_answer, body=body, headers=_core.JSON_HEADERS,
            timeout_s=timeout_s,
        )  # fmt: skip
        failure: SandfleetError | None = None
        try:
            async for line in self._lines(batch):
                try:
                    doc = RunBatchLine.model_validate_json(line)
                except ValueError as exc:
                    raise Internal(f"unexpected line in a batch answer: {str(exc)[:300]}") from None
                if doc.index is None or not 0 <= doc.index < len(chunk):
                    err = doc.error.model_dump() if doc.error else None
                    raise error_from_wire({"error": err}, 500)
                fut = chunk[doc.index][1]
                if fut.done():
                    continue
                if doc.result is not None:
                    fut.set_result(doc.result)
                else:
                    err = doc.error.model_dump() if doc.error else None
                    fut.set_exception(error_from_wire({"error": err}, 500))
        except SandfleetError as exc:
            failure = exc
        finally:
            for _, fut in chunk:
                if not fut.done():
                    fut.set_exception(
                        failure or Internal("the batch answer ended without this call's result")
                    )


def _abandon(
    request: asyncio.Future[None],
    futs: list[asyncio.Future[RunResult]],
    _: asyncio.Future[RunResult],
) -> None:
    """Once every caller of a request has been cancelled, cancel the request: its
    connection closes and the server stops the calls (a queued call leaves the queue,
    a running one is killed with its worker)."""
    if not request.done() and all(f.cancelled() for f in futs):
        request.cancel()
