"""A pool of fncall workers for one (image, language): sizing, queueing, replacement.

Pure bookkeeping over two callbacks (start a worker, stop one), so the policy
can be read in one place:

- a call takes an idle worker (the most recently used: its pages are warm);
- with none idle it waits in a FIFO queue of at most ``max_queue`` calls
  (beyond: ``ResourceExhausted``), and a worker is started for it if the pool
  is below ``max_workers`` — the pool grows with demand, one worker per
  waiting call;
- ``min_workers`` are kept started even when nothing runs;
- a worker idle for ``idle_s`` above the minimum is stopped;
- a worker that failed a call (died, hung, was cancelled mid-call) is stopped
  and counted in ``replaced``; the next demand starts a fresh one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from sandfleet.wire.errors import ResourceExhausted, SandfleetError, Unavailable
from sandfleet.wire.models import PoolConfig, PoolInfo

__all__ = ["Pool", "Worker"]

log = logging.getLogger("sandfleet.fncall")


@dataclass(eq=False)
class Worker:
    """One started worker box. ``conn`` is its :class:`WorkerConnection`."""

    id: str
    conn: Any
    pid: int
    limit_bytes: int | None = None
    ooms: int = 0
    calls: int = 0
    idle_since: float = field(default_factory=time.monotonic)


class Pool:
    """Workers of one (image, language). Call from one event loop."""

    def __init__(
        self,
        node_id: str,
        config: PoolConfig,
        start: Callable[[Pool], Awaitable[Worker]],
        stop: Callable[[Worker], Awaitable[None]],
    ) -> None:
        self.node_id = node_id
        self.config = config
        self._start = start
        self._stop = stop
        self.idle: list[Worker] = []
        self.busy: set[Worker] = set()
        self.starting = 0
        self.waiters: deque[asyncio.Future[Worker]] = deque()
        self.calls = 0
        self.replaced = 0
        self.rejected = 0
        self.last_error: str | None = None
        self.memory_mb: float | None = None
        self._tasks: set[asyncio.Future[None]] = set()
        self._starts: set[asyncio.Future[None]] = set()
        self._closed = False
        self._failures = 0
        self._retry_at = 0.0

    @property
    def size(self) -> int:
        return len(self.idle) + len(self.busy) + self.starting

    def info(self) -> PoolInfo:
        return PoolInfo(
            node_id=self.node_id,
            **self.config.model_dump(),
            idle=len(self.idle),
            busy=len(self.busy),
            starting=self.starting,
            queued=len(self.waiters),
            calls=self.calls,
            replaced=self.replaced,
            rejected=self.rejected,
            worker_memory_mb=self.memory_mb,
            last_error=self.last_error,
        )

    # ------------------------------------------------------------------ calls

    async def acquire(self) -> Worker:
        """A free worker, now or after waiting in the queue.

        Raises ``ResourceExhausted`` when the queue is full, ``Unavailable``
        when the pool closes, and what starting a worker raised when the pool
        has no worker and cannot start one (an image without python3, say).
        """
        if self._closed:
            raise Unavailable("the fncall pool is shutting down: retry on another node")
        if self.idle:
            worker = self.idle.pop()
            self.busy.add(worker)
            return worker
        if len(self.waiters) >= self.config.max_queue:
            self.rejected += 1
            raise ResourceExhausted(
                f"the fncall pool for {self.config.image} ({self.config.language}) is full:"
                f" {len(self.busy)} workers busy and {len(self.waiters)} calls queued"
                f" (max_workers={self.config.max_workers}, max_queue={self.config.max_queue});"
                " retry later, or raise the bounds with configure_pool"
            )
        fut: asyncio.Future[Worker] = asyncio.get_running_loop().create_future()
        self.waiters.append(fut)
        self.grow()
        try:
            return await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self.release(fut.result(), healthy=True)  # handed over as we were cancelled
            with contextlib.suppress(ValueError):
                self.waiters.remove(fut)
            raise

    def release(self, worker: Worker, healthy: bool) -> None:
        """Give a worker back after a call; an unhealthy one is stopped and replaced."""
        self.busy.discard(worker)
        if healthy and not self._closed:
            self._hand_over(worker)
            return
        if not self._closed:
            self.replaced += 1
        self._spawn(self._stop_quietly(worker))
        self.grow()

    def _hand_over(self, worker: Worker) -> None:
        while self.waiters:
            fut = self.waiters.popleft()
            if not fut.done():
                self.busy.add(worker)
                fut.set_result(worker)
                return
        worker.idle_since = time.monotonic()
        self.idle.append(worker)

    # ------------------------------------------------------------------ sizing

    def grow(self) -> None:
        """Start workers for the calls waiting, and up to ``min_workers``, within max.

        After failed starts, keeping ``min_workers`` warm waits a backoff (1 s,
        doubling to a minute): a broken image must not start a box a second.
        """
        if self._closed:
            return
        warm = self.config.min_workers - self.size
        if time.monotonic() < self._retry_at:
            warm = 0  # only calls that wait may try again before the backoff ends
        wanted = max(warm, len(self.waiters) - self.starting)
        for _ in range(min(wanted, self.config.max_workers - self.size)):
            self.starting += 1
            self._starts.add(self._spawn(self._start_one()))

    async def _start_one(self) -> None:
        try:
            worker = await self._start(self)
        except Exception as exc:
            self.starting -= 1
            self.last_error = str(exc)
            self._failures += 1
            self._retry_at = time.monotonic() + min(60.0, 2.0 ** (self._failures - 1))
            log.warning("starting a worker for %s failed: %s", self.config.image, exc)
            if not self.idle and not self.busy and not self.starting:
                # Nothing else will serve the queue: fail it rather than hang it.
                err = exc if isinstance(exc, SandfleetError) else Unavailable(str(exc))
                while self.waiters:
                    fut = self.waiters.popleft()
                    if not fut.done():
                        fut.set_exception(err)
            return
        self.starting -= 1
        self.last_error = None
        self._failures, self._retry_at = 0, 0.0
        if self._closed:
            await self._stop_quietly(worker)
            return
        self._hand_over(worker)

    def trim(self) -> None:
        """Stop workers idle for ``idle_s`` above ``min_workers`` (oldest first); top up."""
        now = time.monotonic()
        surplus = self.size - self.config.min_workers
        # idle is oldest first: workers are appended when freed and taken from the end.
        while surplus > 0 and self.idle and now - self.idle[0].idle_since >= self.config.idle_s:
            self._spawn(self._stop_quietly(self.idle.pop(0)))
            surplus -= 1
        self.grow()

    def reconfigure(self, config: PoolConfig) -> None:
        self.config = config
        while self.size > config.max_workers and self.idle:
            self._spawn(self._stop_quietly(self.idle.pop(0)))
        self.grow()

    # ------------------------------------------------------------------ shutdown

    async def close(self) -> None:
        """Fail waiting calls and stop every worker (busy ones too)."""
        self._closed = True
        while self.waiters:
            fut = self.waiters.popleft()
            if not fut.done():
                fut.set_exception(Unavailable("the fncall pool is shutting down: retry"))
        for task in self._starts:
            task.cancel()  # the backend undoes a create cut short
        workers = [*self.idle, *self.busy]
        self.idle.clear()
        self.busy.clear()
        await asyncio.gather(*(self._stop_quietly(w) for w in workers))
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def _stop_quietly(self, worker: Worker) -> None:
        try:
            await self._stop(worker)
        except Exception:
            log.exception("stopping worker %s failed", worker.id)

    def _spawn(self, coro: Awaitable[None]) -> asyncio.Future[None]:
        task = asyncio.ensure_future(coro)
        for tasks in (self._tasks, self._starts):
            task.add_done_callback(tasks.discard)
        self._tasks.add(task)
        return task
