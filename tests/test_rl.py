"""sandfleet.rl: a rollout pool whose driver goes away mid-batch and comes back."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandfleet.cli.local import LocalDeployment
from sandfleet.rl import RolloutPool
from sandfleet.rl.pool import Preempted
from sandfleet.sdk import AsyncClient, AsyncSandbox
from tests.conftest import BUSYBOX_IMAGE, assert_clean

pytestmark = pytest.mark.root

CREATE = {"image": BUSYBOX_IMAGE, "memory_mb": 64, "ttl_s": 600, "idle_ttl_s": 300}


@pytest.fixture(scope="module")
def dep(tmp_path_factory: pytest.TempPathFactory, images_dir: Path) -> Iterator[LocalDeployment]:
    with LocalDeployment(tmp_path_factory.mktemp("rl") / "state", images_dir) as d:
        yield d
    assert_clean(d.state_dir)


async def episode(sandbox: AsyncSandbox, item: int) -> tuple[int, str]:
    # Three non-idempotent steps: each appends to a counter, so a second run shows.
    for k in range(3):
        await sandbox.exec(f"echo {item}-{k} >> /root/steps; sleep 0.3")
    seen = await sandbox.exec("cat /root/steps")
    return item, seen.stdout_text


def test_a_batch_interrupted_and_resumed_runs_every_command_once(dep: LocalDeployment) -> None:
    async def main() -> None:
        async with AsyncClient(dep.url) as client:
            items = list(range(6))
            first: RolloutPool[int, tuple[int, str]] = RolloutPool(
                client, job="rl-resume", create=CREATE, concurrency=3
            )
            run = asyncio.ensure_future(first.run(items, episode))
            await asyncio.sleep(1.5)  # some episodes done, some half-way
            run.cancel()  # the driver goes away without a word
            with pytest.raises(asyncio.CancelledError):
                await run
            assert first.stats.created >= 3
            left = await client.list(labels={"job": "rl-resume"})
            assert left  # kept for the next driver

            second: RolloutPool[int, tuple[int, str]] = RolloutPool(
                client, job="rl-resume", create=CREATE, concurrency=3
            )
            results = await second.run(items, episode)
            assert second.stats.attached == len(left)
            for item, steps in results:
                assert steps == "".join(f"{item}-{k}\n" for k in range(3)), steps
            assert await client.list(labels={"job": "rl-resume"}) == []

    asyncio.run(main())


def test_told_to_go_away_the_pool_pauses_its_sandboxes(dep: LocalDeployment) -> None:
    async def main() -> None:
        import os
        import signal

        async with AsyncClient(dep.url) as client:
            pool: RolloutPool[int, tuple[int, str]] = RolloutPool(
                client, job="rl-pause", create=CREATE, concurrency=2
            )
            loop = asyncio.get_running_loop()
            loop.call_later(1.0, os.kill, os.getpid(), signal.SIGUSR1)
            with pytest.raises(Preempted, match="paused"):
                await pool.run(list(range(4)), episode, pause_on=(signal.SIGUSR1,))
            infos = await client.list(labels={"job": "rl-pause"})
            # A create in flight at that moment finishes on its own; the next driver attaches.
            assert any(i.state == "paused" for i in infos), infos
            assert all(i.state in ("paused", "creating", "running") for i in infos), infos
            again: RolloutPool[int, tuple[int, str]] = RolloutPool(
                client, job="rl-pause", create=CREATE, concurrency=2
            )
            results = await again.run(list(range(4)), episode)  # calls resume them
            assert [steps.count("\n") for _, steps in results] == [3, 3, 3, 3]

    asyncio.run(main())
