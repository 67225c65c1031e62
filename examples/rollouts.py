"""The rollout demo as a plain SDK script, against a running `sandfleet up`.

    sandfleet up &                   # control plane + node agent on :7070
    python examples/rollouts.py      # builds the images on first use

Each of 32 rollouts gets a container sandbox (Debian base + more-itertools
workspace), applies one candidate patch, runs the project's tests and scores
reward 1 when they pass.
"""

from __future__ import annotations

import asyncio
import time

from rich.console import Console

from sandfleet import AsyncClient
from sandfleet.cli.demo import ensure_demo_images
from sandfleet.config import default_images_dir, default_state_dir
from sandfleet.demo.rollouts import RolloutResult, run_batch


async def main() -> None:
    ensure_demo_images(default_images_dir(default_state_dir()), Console())
    start = time.perf_counter()

    def report(r: RolloutResult) -> None:
        print(f"rollout {r.index:2d}  {r.patch:22s} reward {r.reward:.0f}  {r.seconds:5.1f} s")

    async with AsyncClient() as client:  # SANDFLEET_URL, else http://127.0.0.1:7070
        results = await run_batch(client, rollouts=32, concurrency=8, on_done=report)
    wall = time.perf_counter() - start
    print(
        f"{len(results)} rollouts in {wall:.1f} s, mean reward "
        f"{sum(r.reward for r in results) / len(results):.2f}"
    )


if __name__ == "__main__":
    asyncio.run(main())
