"""The main demo: a batch of RL-style rollouts on a real project's test suite.

Each rollout gets its own container sandbox stacked from a Debian base image
and a workspace layer holding more-itertools' sdist (source and tests), applies
one candidate patch with ``git apply``, runs the project's own tests with
pytest and scores reward 1 when they pass, else 0. The batch is a
:class:`~sandfleet.rl.RolloutPool` job, so a driver that is stopped mid-batch
and started again finishes it by fast-forward with the same rewards.
"""

from __future__ import annotations

import re
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from sandfleet.demo.patches import TARGET, Candidate, candidates, unified_diff
from sandfleet.rl.pool import EpisodeFn, RolloutPool, RolloutStats
from sandfleet.sdk import AsyncClient, AsyncSandbox

__all__ = [
    "BASE_IMAGE",
    "BASE_PACKAGES",
    "WORKSPACE_IMAGE",
    "WORKSPACE_SOURCE",
    "RolloutResult",
    "run_batch",
]

BASE_IMAGE = "sandfleet/bookworm-python:1"
BASE_PACKAGES = ["python3", "python3-pytest", "git", "ca-certificates"]
WORKSPACE_SOURCE = "more-itertools==10.5.0"
WORKSPACE_IMAGE = "workspace/more-itertools:10.5.0"
TEST_CMD = ["python3", "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "tests"]


@dataclass(frozen=True)
class RolloutResult:
    """One episode: ``reward`` 1.0 when the project's tests pass; ``seconds`` wall time;
    ``replayed`` the calls answered from the sandbox's trajectory log (after a restart)."""

    index: int
    patch: str
    expected: float
    reward: float
    seconds: float
    detail: str
    replayed: int = 0


def _episode(original: str) -> EpisodeFn[tuple[int, Candidate], RolloutResult]:
    async def episode(sandbox: AsyncSandbox, item: tuple[int, Candidate]) -> RolloutResult:
        index, candidate = item
        start = time.perf_counter()
        # The same calls in the same order for the same candidate: a restarted
        # driver's calls are answered from the log, so none runs twice.
        await sandbox.files.write("/tmp/candidate.patch", unified_diff(original, candidate))
        applied = await sandbox.exec(["git", "apply", "/tmp/candidate.patch"], timeout_s=30)
        replayed = int(applied.replayed)
        if not applied.ok:
            reward, detail = 0.0, "patch did not apply: " + applied.stderr_text.strip()[:80]
        else:
            tests = await sandbox.exec(TEST_CMD, timeout_s=300)
            replayed += int(tests.replayed)
            reward = 1.0 if tests.ok else 0.0
            counts = re.findall(r"(\d+) (failed|passed|error)", tests.stdout_text)
            detail = ", ".join(f"{n} {what}" for n, what in counts[-2:]) or tests.status
        return RolloutResult(
            index=index,
            patch=candidate.name,
            expected=1.0 if candidate.keeps_behaviour else 0.0,
            reward=reward,
            seconds=time.perf_counter() - start,
            detail=detail,
            replayed=replayed,
        )

    return episode


async def run_batch(
    client: AsyncClient,
    *,
    rollouts: int = 32,
    concurrency: int = 8,
    kind: str = "container",
    job: str | None = None,
    on_done: Callable[[RolloutResult], None] | None = None,
    pause_on: Sequence[signal.Signals] = (),
) -> tuple[list[RolloutResult], RolloutStats]:
    """Run ``rollouts`` episodes, ``concurrency`` at a time, as one :class:`RolloutPool` job.

    Results come in rollout order. A driver started with the ``job`` of an
    earlier one that went away re-attaches to its sandboxes and fast-forwards
    (see :mod:`sandfleet.rl`). Raises :class:`~sandfleet.rl.pool.Preempted` on a
    signal in ``pause_on`` (the job's sandboxes are then paused), and the first
    SandfleetError a rollout hits after retries (the sandboxes are destroyed).
    """
    job = job or f"demo-{int(time.time())}"
    async with await client.create(
        kind=kind, image=BASE_IMAGE, workspace=WORKSPACE_IMAGE, ttl_s=300,
        labels={"job": f"{job}-probe"},
    ) as probe:  # fmt: skip
        original = (await probe.files.read(f"/workspace/{TARGET}")).decode()
    pool: RolloutPool[tuple[int, Candidate], RolloutResult] = RolloutPool(
        client,
        job=job,
        concurrency=concurrency,
        create={
            "kind": kind,
            "image": BASE_IMAGE,
            "workspace": WORKSPACE_IMAGE,
            "cpu": 1.0,
            "memory_mb": 1024,
            # A job whose driver never comes back is reclaimed.
            "ttl_s": 1800,
            "idle_ttl_s": 900,
        },
    )
    items = list(enumerate(candidates(rollouts)))
    results = await pool.run(
        items,
        _episode(original),
        pause_on=pause_on,
        on_done=(lambda _, r: on_done(r)) if on_done else None,
    )
    return results, pool.stats
