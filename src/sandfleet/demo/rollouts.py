"""The main demo: a batch of RL-style rollouts on a real project's test suite.

Each rollout gets its own container sandbox stacked from a Debian base image
and a workspace layer holding more-itertools' sdist (source and tests), applies
one candidate patch with ``git apply``, runs the project's own tests with
pytest and scores reward 1 when they pass, else 0.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

from sandfleet.demo.patches import TARGET, Candidate, candidates, unified_diff
from sandfleet.sdk import AsyncClient
from sandfleet.wire.errors import SandfleetError

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
    """One episode: ``reward`` 1.0 when the project's tests pass; ``seconds`` wall time."""

    index: int
    patch: str
    expected: float
    reward: float
    seconds: float
    detail: str


async def _one(
    client: AsyncClient,
    index: int,
    candidate: Candidate,
    original: str,
    job: str,
    kind: str,
    attempts: int = 5,
) -> RolloutResult:
    start = time.perf_counter()
    for attempt in range(attempts):
        try:
            sandbox = await client.create(
                kind=kind,
                image=BASE_IMAGE,
                workspace=WORKSPACE_IMAGE,
                cpu=1.0,
                memory_mb=1024,
                ttl_s=900,
                labels={"job": job, "rollout": str(index)},
            )
            break
        except SandfleetError as exc:
            if not exc.retryable or attempt == attempts - 1:
                raise
            await asyncio.sleep(0.5 * 2**attempt)
    async with sandbox:
        await sandbox.files.write("/tmp/candidate.patch", unified_diff(original, candidate))
        applied = await sandbox.exec(["git", "apply", "/tmp/candidate.patch"], timeout_s=30)
        if not applied.ok:
            reward, detail = 0.0, "patch did not apply: " + applied.stderr_text.strip()[:80]
        else:
            tests = await sandbox.exec(TEST_CMD, timeout_s=300)
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
    )


async def run_batch(
    client: AsyncClient,
    *,
    rollouts: int = 32,
    concurrency: int = 8,
    kind: str = "container",
    job: str | None = None,
    on_done: Callable[[RolloutResult], None] | None = None,
) -> list[RolloutResult]:
    """Run ``rollouts`` episodes, ``concurrency`` at a time; results in rollout order.

    Raises the first SandfleetError a rollout hits after its retries; the
    sandboxes of every rollout are destroyed either way.
    """
    job = job or f"demo-{int(time.time())}"
    async with await client.create(
        kind=kind, image=BASE_IMAGE, workspace=WORKSPACE_IMAGE, ttl_s=300, labels={"job": job}
    ) as probe:
        original = (await probe.files.read(f"/workspace/{TARGET}")).decode()
    gate = asyncio.Semaphore(concurrency)

    async def guarded(i: int, c: Candidate) -> RolloutResult:
        async with gate:
            result = await _one(client, i, c, original, job, kind)
        if on_done:
            on_done(result)
        return result

    return list(await asyncio.gather(*(guarded(i, c) for i, c in enumerate(candidates(rollouts)))))
