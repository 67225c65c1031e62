"""``sandfleet demo rollouts``: the main job, end to end on real input."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from sandfleet.cli.main import _dirs, _images_opt, _state_opt, cli

__all__ = ["demo", "ensure_demo_images"]


def ensure_demo_images(images_dir: Path, console: Console) -> None:
    """Build the demo's base and workspace images unless they exist (about 90 s once)."""
    from sandfleet.demo.rollouts import BASE_IMAGE, BASE_PACKAGES, WORKSPACE_IMAGE, WORKSPACE_SOURCE
    from sandfleet.images import ImageStore, build_debootstrap, build_workspace
    from sandfleet.wire.errors import NotFound

    store = ImageStore(images_dir)
    try:
        store.resolve(BASE_IMAGE)
    except NotFound:
        console.print(f"building {BASE_IMAGE} with debootstrap (about a minute, once)")
        build_debootstrap(store, BASE_IMAGE, BASE_PACKAGES)
    try:
        store.resolve(WORKSPACE_IMAGE)
    except NotFound:
        console.print(f"building {WORKSPACE_IMAGE} from PyPI's sdist of {WORKSPACE_SOURCE}")
        build_workspace(store, WORKSPACE_IMAGE, WORKSPACE_SOURCE)


@cli.group()
def demo() -> None:
    """Demonstrations on real input."""


@demo.command()
@_state_opt
@_images_opt
@click.option("--url", default=None, help="Use a running control plane instead of an embedded one.")
@click.option("--rollouts", default=32, show_default=True)
@click.option("--concurrency", default=8, show_default=True)
@click.option("--kind", default="container", show_default=True)
def rollouts(
    state_dir: Path | None,
    images_dir: Path | None,
    url: str | None,
    rollouts: int,
    concurrency: int,
    kind: str,
) -> None:
    """Run a batch of RL rollouts: patch more-itertools, run its tests, score 1 or 0."""
    from sandfleet.cli.local import LocalDeployment
    from sandfleet.demo.rollouts import RolloutResult, run_batch
    from sandfleet.node.leaks import leftovers
    from sandfleet.sdk import AsyncClient

    console = Console()
    state, images = _dirs(state_dir, images_dir)
    ensure_demo_images(images, console)
    deployment = None if url else LocalDeployment(state / "demo", images).start()
    progress = Progress(
        TextColumn("rollouts"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("reward sum {task.fields[rewards]:.0f}"),
        console=console,
    )

    async def go() -> list[RolloutResult]:
        task = progress.add_task("rollouts", total=rollouts, rewards=0.0)
        total = 0.0

        def done(r: RolloutResult) -> None:
            nonlocal total
            total += r.reward
            progress.update(task, advance=1, rewards=total)

        async with AsyncClient(url or (deployment.url if deployment else None)) as client:
            return await run_batch(
                client, rollouts=rollouts, concurrency=concurrency, kind=kind, on_done=done
            )

    start = time.perf_counter()
    try:
        with progress:
            results = asyncio.run(go())
    finally:
        if deployment:
            deployment.stop()
    wall = time.perf_counter() - start

    table = Table("rollout", "patch", "expected", "reward", "seconds", "tests")
    for r in results:
        style = "green" if r.reward == r.expected else "red"
        table.add_row(
            str(r.index),
            r.patch,
            f"{r.expected:.0f}",
            f"[{style}]{r.reward:.0f}[/]",
            f"{r.seconds:.1f}",
            r.detail,
        )
    console.print(table)
    agree = sum(r.reward == r.expected for r in results)
    console.print(
        f"{len(results)} rollouts in {wall:.1f} s: {len(results) / wall * 60:.1f} rollouts/min,"
        f" mean reward {sum(r.reward for r in results) / len(results):.2f},"
        f" {agree}/{len(results)} rewards match the patch labels"
    )
    if deployment:
        left = leftovers(deployment.state_dir)
        if left:
            console.print("[red]left behind on the node:[/]\n  " + "\n  ".join(left))
            sys.exit(1)
        console.print(
            "node clean: no sandbox process, mount, cgroup, runc container or state dir left"
        )
