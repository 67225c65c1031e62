"""A rollout pool: many episodes, one sandbox each, that survives its driver.

Every sandbox of a pool carries the labels ``job=<job>`` and
``episode=<index>``. A driver that starts a job looks for sandboxes of that job
first and re-attaches to them with ``resume_from_log=True``: the episode
function then runs again from its start, and each call it re-issues that the
sandbox's trajectory log already holds returns the logged result without
running (so a ``git apply`` or a training step is never repeated), until it
reaches the calls the previous driver never made. Episode functions must
therefore issue the same calls in the same order for the same input — what a
seeded policy or a fixed patch does.

Sandboxes stay until the whole batch is done (so a restarted driver
fast-forwards finished episodes too and gets their rewards back), then are
destroyed. Told the trainer is going away (a signal in ``pause_on``), the pool
pauses them all — frozen, they cost no CPU — and :meth:`RolloutPool.run`
raises :class:`Preempted`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import signal
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from sandfleet.sdk import AsyncClient, AsyncSandbox
from sandfleet.sdk._steps import ABANDON, Abandon
from sandfleet.wire.errors import FailedPrecondition, SandfleetError

__all__ = ["EpisodeFn", "Preempted", "RolloutPool", "RolloutStats"]

log = logging.getLogger("sandfleet.rl")

T = TypeVar("T")
R = TypeVar("R")

EpisodeFn = Callable[[AsyncSandbox, T], Awaitable[R]]
"""``episode(sandbox, item) -> result``: one rollout in its own sandbox."""

#: Label keys a pool puts on its sandboxes.
JOB_LABEL, EPISODE_LABEL = "job", "episode"


class Preempted(Exception):
    """The driver was told to go away; the job's sandboxes are paused, ready for a new driver."""


@dataclass
class RolloutStats:
    """What a pool did: sandboxes ``created`` and ``attached`` (left by an earlier
    driver of the job), creations retried after a retryable error, episodes finished."""

    created: int = 0
    attached: int = 0
    create_retries: int = 0
    finished: int = 0


class RolloutPool(Generic[T, R]):
    """Runs episodes of one ``job`` in sandboxes of ``client``, ``concurrency`` at a time.

    ``create`` holds the arguments of :meth:`AsyncClient.create` for every
    episode (``image``, ``workspace``, ``kind``, limits, ``ttl_s``,
    ``idle_ttl_s``, ``labels``...); give a TTL so that a job whose driver never
    comes back is reclaimed. Creation is retried ``attempts`` times on
    retryable errors (``ResourceExhausted``, ``Unavailable``) with jittered
    exponential backoff. ``progress`` shows a bar on the terminal.
    """

    def __init__(
        self,
        client: AsyncClient,
        *,
        job: str,
        create: Mapping[str, Any],
        concurrency: int = 8,
        attempts: int = 6,
        progress: bool = False,
    ) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency={concurrency}: give 1 or more")
        if not job or "=" in job:
            raise ValueError(f"job {job!r}: give a non-empty label value without '='")
        self.client = client
        self.job = job
        self.create = dict(create)
        self.concurrency = concurrency
        self.attempts = attempts
        self.progress = progress
        self.stats = RolloutStats()

    # ------------------------------------------------------------------ running

    async def run(
        self,
        items: Sequence[T],
        episode: EpisodeFn[T, R],
        *,
        pause_on: Sequence[signal.Signals] = (),
        on_done: Callable[[int, R], None] | None = None,
    ) -> list[R]:
        """Run ``episode(sandbox, item)`` for every item; results in item order.

        Re-attaches to the job's sandboxes an earlier driver left. On success
        every sandbox of the job is destroyed. A signal in ``pause_on`` (say
        SIGTERM from a preemptible node's notice) pauses them and raises
        :class:`Preempted`; cancellation leaves them as they are (a new driver
        carries on). Either way the calls in flight are abandoned, not
        cancelled: they finish and are logged, and the next driver's re-issue
        of each gets its result instead of running it again. Any other error
        destroys them and is raised.
        """
        left = await self._left_by_earlier_driver()
        gate = asyncio.Semaphore(self.concurrency)
        bar = _bar() if self.progress else None
        task_id = bar.add_task("episodes", total=len(items), attached=0) if bar else None

        async def one(index: int, item: T) -> R:
            async with gate:
                sandbox = await self._sandbox(index, left.get(str(index)))
                result = await episode(sandbox, item)
            self.stats.finished += 1
            if bar is not None and task_id is not None:
                bar.update(task_id, advance=1, attached=self.stats.attached)
            if on_done is not None:
                on_done(index, result)
            return result

        # Calls in flight when the driver goes away are abandoned, not cancelled:
        # they finish and are logged, and the next driver's re-issue gets their result.
        abandon = Abandon()
        token = ABANDON.set(abandon)
        try:
            batch = asyncio.ensure_future(
                asyncio.gather(*(one(i, it) for i, it in enumerate(items)))
            )
        finally:
            ABANDON.reset(token)
        preempted = asyncio.Event()
        loop = asyncio.get_running_loop()

        def going_away() -> None:
            preempted.set()
            abandon.active = True
            batch.cancel()

        for sig in pause_on:
            loop.add_signal_handler(sig, going_away)
        try:
            with bar if bar is not None else contextlib.nullcontext():
                # Shielded: a cancelled run must mark its calls abandoned before
                # they see the cancellation (else each would stop its command).
                results = await asyncio.shield(batch)
        except asyncio.CancelledError:
            abandon.active = True
            batch.cancel()
            with contextlib.suppress(BaseException):
                await batch
            if not preempted.is_set():
                raise
            paused = await self.pause()
            raise Preempted(
                f"job {self.job}: driver told to go away; {paused} sandboxes paused for the"
                " next driver"
            ) from None
        except BaseException:
            await self.destroy()
            raise
        finally:
            for sig in pause_on:
                loop.remove_signal_handler(sig)
        await self.destroy()
        return list(results)

    async def _left_by_earlier_driver(self) -> dict[str, str]:
        """Episode index -> id of the job's sandboxes that still exist."""
        found = {}
        for info in await self.client.list(labels={JOB_LABEL: self.job}):
            episode = info.labels.get(EPISODE_LABEL)
            if episode is not None and info.state in ("creating", "running", "paused"):
                found[episode] = info.id
        return found

    async def _sandbox(self, index: int, existing: str | None) -> AsyncSandbox:
        if existing is not None:
            for attempt in range(self.attempts):
                try:
                    sandbox = await self.client.attach(existing, resume_from_log=True)
                    self.stats.attached += 1
                    return sandbox
                except FailedPrecondition:  # still being created by the earlier driver
                    await asyncio.sleep(_backoff(attempt))
            log.warning(
                "episode %d: sandbox %s never became ready; making another", index, existing
            )
        labels = {**self.create.get("labels", {}), JOB_LABEL: self.job, EPISODE_LABEL: str(index)}
        for attempt in range(self.attempts):
            try:
                sandbox = await self.client.create(**{**self.create, "labels": labels})
                self.stats.created += 1
                return sandbox
            except SandfleetError as exc:
                if not exc.retryable or attempt == self.attempts - 1:
                    raise
                self.stats.create_retries += 1
                await asyncio.sleep(_backoff(attempt))
        raise AssertionError("unreachable")

    # ------------------------------------------------------------------ the job's sandboxes

    async def pause(self) -> int:
        """Pause every sandbox of the job (frozen: memory kept, no CPU); how many."""
        result = await self.client.pause(labels={JOB_LABEL: self.job})
        return len(result.sandboxes)

    async def resume(self) -> int:
        """Resume every paused sandbox of the job (calls also resume them one by one)."""
        result = await self.client.resume(labels={JOB_LABEL: self.job})
        return len(result.sandboxes)

    async def destroy(self) -> None:
        """Destroy every sandbox of the job, in parallel; errors are logged (TTLs are the net)."""
        infos = await self.client.list(labels={JOB_LABEL: self.job})
        outcomes = await asyncio.gather(
            *(self._destroy_one(i.id) for i in infos if i.state != "destroyed"),
            return_exceptions=True,
        )
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                log.warning("job %s: a sandbox could not be destroyed: %s", self.job, outcome)

    async def _destroy_one(self, sandbox_id: str) -> None:
        sandbox = await self.client.get(sandbox_id)
        await sandbox.destroy()


def _backoff(attempt: int) -> float:
    return min(0.25 * 2**attempt, 5.0) * random.uniform(0.5, 1.5)


def _bar() -> Progress:
    return Progress(
        TextColumn("episodes"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("re-attached {task.fields[attached]}"),
    )
