"""The pool's policy, on workers that are plain objects: sizing, queue, failures."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from sandfleet.fncall.pool import Pool, Worker
from sandfleet.wire.errors import FailedPrecondition, ResourceExhausted, Unavailable
from sandfleet.wire.models import PoolConfig


class Fleet:
    """Starts workers after ``delay_s``; ``fail`` makes starts raise it."""

    def __init__(self, delay_s: float = 0.01) -> None:
        self.delay_s = delay_s
        self.started: list[Worker] = []
        self.stopped: list[Worker] = []
        self.fail: Exception | None = None
        self._ids = itertools.count()

    async def start(self, _pool: Pool) -> Worker:
        await asyncio.sleep(self.delay_s)
        if self.fail is not None:
            raise self.fail
        worker = Worker(id=f"w{next(self._ids)}", conn=None, pid=0)
        self.started.append(worker)
        return worker

    async def stop(self, worker: Worker) -> None:
        self.stopped.append(worker)


def make(fleet: Fleet, **bounds: object) -> Pool:
    return Pool("n1", PoolConfig(**bounds), fleet.start, fleet.stop)  # type: ignore[arg-type]


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0.02)


def test_min_workers_start_at_once_and_a_call_takes_an_idle_one() -> None:
    async def run() -> None:
        fleet = Fleet()
        pool = make(fleet, min_workers=2, max_workers=4)
        pool.grow()
        await settle()
        assert len(pool.idle) == 2 and pool.starting == 0
        worker = await pool.acquire()
        assert worker in pool.busy and len(pool.idle) == 1
        pool.release(worker, healthy=True)
        assert pool.idle[-1] is worker  # the most recently used goes first next time
        await pool.close()
        assert len(fleet.stopped) == 2

    asyncio.run(run())


def test_pool_grows_with_demand_up_to_max_and_queues_the_rest() -> None:
    async def run() -> None:
        fleet = Fleet()
        pool = make(fleet, min_workers=0, max_workers=3, max_queue=100)
        calls = [asyncio.ensure_future(pool.acquire()) for _ in range(5)]
        await settle()
        assert len(fleet.started) == 3  # one per waiting call, never past max
        done = [c for c in calls if c.done()]
        assert len(done) == 3 and len(pool.waiters) == 2
        for c in done:
            pool.release(c.result(), healthy=True)
        await settle()
        assert all(c.done() for c in calls) and len(fleet.started) == 3
        for c in calls[3:]:
            pool.release(c.result(), healthy=True)
        await pool.close()

    asyncio.run(run())


def test_a_full_queue_is_resource_exhausted_and_counted() -> None:
    async def run() -> None:
        pool = make(Fleet(delay_s=10), min_workers=0, max_workers=1, max_queue=2)
        waiting = [asyncio.ensure_future(pool.acquire()) for _ in range(2)]
        await asyncio.sleep(0)
        with pytest.raises(ResourceExhausted, match=r"full.*max_queue=2.*configure_pool"):
            await pool.acquire()
        assert pool.info().rejected == 1 and pool.info().queued == 2
        await pool.close()
        for w in waiting:
            with pytest.raises(Unavailable):
                await w

    asyncio.run(run())


def test_a_start_that_fails_fails_the_queue_instead_of_hanging_it() -> None:
    async def run() -> None:
        fleet = Fleet()
        fleet.fail = FailedPrecondition("no python3 in the image")
        pool = make(fleet, min_workers=0, max_workers=2)
        with pytest.raises(FailedPrecondition, match="python3"):
            await asyncio.wait_for(pool.acquire(), 5)
        assert pool.info().last_error == "no python3 in the image"
        fleet.fail = None  # the next call tries again
        worker = await asyncio.wait_for(pool.acquire(), 5)
        assert pool.info().last_error is None
        pool.release(worker, healthy=True)
        await pool.close()

    asyncio.run(run())


def test_an_unhealthy_worker_is_stopped_and_replaced() -> None:
    async def run() -> None:
        fleet = Fleet()
        pool = make(fleet, min_workers=1, max_workers=1)
        pool.grow()
        first = await pool.acquire()
        pool.release(first, healthy=False)
        await settle()
        assert fleet.stopped == [first]
        assert pool.info().replaced == 1 and len(pool.idle) == 1 and pool.idle[0] is not first
        await pool.close()

    asyncio.run(run())


def test_idle_workers_above_min_are_trimmed_oldest_first() -> None:
    async def run() -> None:
        fleet = Fleet()
        pool = make(fleet, min_workers=1, max_workers=3, idle_s=0.05)
        held = [await pool.acquire() for _ in range(3)]
        for w in held:
            pool.release(w, healthy=True)
        await asyncio.sleep(0.1)
        pool.trim()
        await settle()
        assert len(pool.idle) == 1 and pool.idle[0] is held[-1]
        assert fleet.stopped == held[:2]
        await pool.close()

    asyncio.run(run())


def test_a_cancelled_waiter_leaves_the_queue_and_loses_no_worker() -> None:
    async def run() -> None:
        fleet = Fleet(delay_s=0.05)
        pool = make(fleet, min_workers=0, max_workers=1)
        call = asyncio.ensure_future(pool.acquire())
        await asyncio.sleep(0.01)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        assert not pool.waiters
        await settle()
        assert len(pool.idle) == 1  # the worker started for it is kept for the next call
        await pool.close()

    asyncio.run(run())


def test_reconfigure_stops_idle_workers_beyond_the_new_max() -> None:
    async def run() -> None:
        fleet = Fleet()
        pool = make(fleet, min_workers=3, max_workers=3)
        pool.grow()
        await settle()
        pool.reconfigure(PoolConfig(min_workers=1, max_workers=1))
        await settle()
        assert pool.size == 1 and len(fleet.stopped) == 2
        await pool.close()

    asyncio.run(run())


def test_a_broken_image_is_not_restarted_every_second() -> None:
    async def run() -> None:
        fleet = Fleet()
        fleet.fail = FailedPrecondition("no python3 in the image")
        pool = make(fleet, min_workers=1, max_workers=2)
        attempts = 0

        async def counting(p: Pool) -> Worker:
            nonlocal attempts
            attempts += 1
            return await fleet.start(p)

        pool._start = counting
        for _ in range(10):  # ten upkeep rounds in quick succession
            pool.trim()
            await asyncio.sleep(0.05)
        assert attempts <= 2, attempts  # the first, then the backoff (1 s, 2 s, ...)
        await pool.close()

    asyncio.run(run())
