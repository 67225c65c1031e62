"""``sandfleet demo rollouts``: the main job, end to end on real input."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from sandfleet.cli.main import _dirs, _images_opt, _state_opt, cli
from sandfleet.demo.rollouts import RolloutResult, run_batch

__all__ = ["demo", "ensure_demo_images"]


def ensure_demo_images(images_dir: Path, console: Console) -> None:
    """Build the demo's base and workspace images unless they exist (about 90 s once)."""
    from sandfleet.demo.rollouts import BASE_IMAGE, BASE_PACKAGES, WORKSPACE_IMAGE, WORKSPACE_SOURCE
    from sandfleet.images import ImageStore, build_debootstrap, build_workspace

    store = ImageStore(images_dir)
    if not store.has_image(BASE_IMAGE):
        console.print(f"building {BASE_IMAGE} with debootstrap (about a minute, once)")
        build_debootstrap(store, BASE_IMAGE, BASE_PACKAGES)
    if not store.has_image(WORKSPACE_IMAGE):
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
@click.option("--job", default=None, help="Job id; a driver given an earlier one's job resumes it.")
@click.option(
    "--preempt",
    is_flag=True,
    help="Stop the driver mid-batch (SIGTERM: its sandboxes are paused), start it again, and "
    "check that the batch finishes by fast-forward with the same rewards.",
)
@click.option(
    "--results",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="Also append each finished rollout to this file as a JSON line.",
)
def rollouts(
    state_dir: Path | None,
    images_dir: Path | None,
    url: str | None,
    rollouts: int,
    concurrency: int,
    kind: str,
    job: str | None,
    preempt: bool,
    results: Path | None,
) -> None:
    """Run a batch of RL rollouts: patch more-itertools, run its tests, score 1 or 0."""
    from sandfleet.cli.local import LocalDeployment
    from sandfleet.node.leaks import leftovers

    console = Console()
    state, images = _dirs(state_dir, images_dir)
    if url is None:  # a running deployment has its images (or says it lacks them)
        ensure_demo_images(images, console)
    deployment = None if url else LocalDeployment(state / "demo", images).start()
    base = url or (deployment.url if deployment else "")
    start = time.perf_counter()
    try:
        if preempt:
            done = _preempted_batch(console, base, rollouts, concurrency, kind, state)
        else:
            done = _batch(console, base, rollouts, concurrency, kind, job, results)
    finally:
        if deployment:
            deployment.stop()
    wall = time.perf_counter() - start
    _report(console, done, wall)
    if deployment:
        left = leftovers(deployment.state_dir)
        if left:
            console.print("[red]left behind on the node:[/]\n  " + "\n  ".join(left))
            sys.exit(1)
        console.print(
            "node clean: no sandbox process, mount, cgroup, runc container or state dir left"
        )


#: Exit status of a driver that was told to go away and paused its sandboxes.
PREEMPTED_EXIT = 75


def _batch(
    console: Console,
    url: str,
    rollouts: int,
    concurrency: int,
    kind: str,
    job: str | None,
    results: Path | None,
) -> list[RolloutResult]:
    """One driver: the batch with a progress bar; on SIGTERM it pauses and exits 75."""
    from sandfleet.rl.pool import Preempted
    from sandfleet.sdk import AsyncClient

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

        def on_done(r: RolloutResult) -> None:
            nonlocal total
            total += r.reward
            progress.update(task, advance=1, rewards=total)
            if results is not None:
                with results.open("a") as fh:
                    fh.write(json.dumps(dataclasses.asdict(r)) + "\n")

        async with AsyncClient(url) as client:
            done, _ = await run_batch(
                client, rollouts=rollouts, concurrency=concurrency, kind=kind, job=job,
                on_done=on_done, pause_on=(signal.SIGTERM,),
            )  # fmt: skip
            return done

    try:
        with progress:
            return asyncio.run(go())
    except Preempted as exc:
        console.print(f"[yellow]preempted[/]: {exc}")
        sys.exit(PREEMPTED_EXIT)


def _preempted_batch(
    console: Console, url: str, rollouts: int, concurrency: int, kind: str, state: Path
) -> list[RolloutResult]:
    """Run the batch in a driver process, stop it mid-batch, start it again, compare."""
    job = f"demo-{secrets.token_hex(4)}"
    work = Path(tempfile.mkdtemp(prefix="preempt-", dir=state))
    first, second = work / "first.jsonl", work / "second.jsonl"

    def driver(results: Path) -> subprocess.Popen[bytes]:
        cmd = [
            sys.executable, "-m", "sandfleet.cli", "demo", "rollouts", "--url", url,
            "--job", job, "--rollouts", str(rollouts), "--concurrency", str(concurrency),
            "--kind", kind, "--results", str(results),
        ]  # fmt: skip
        return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    try:
        console.print(f"driver 1 of job {job}: stopped once a third of the rollouts are done")
        proc = driver(first)
        while _count(first) < max(1, rollouts // 3) and proc.poll() is None:
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)  # the trainer is told it is going away
        _, err = proc.communicate(timeout=120)
        if proc.returncode != PREEMPTED_EXIT:
            raise click.ClickException(
                f"driver 1 ended with {proc.returncode}, not {PREEMPTED_EXIT}:"
                f" {err.decode()[-2000:]}"
            )
        before = _load(first)
        console.print(
            f"driver 1 stopped after {len(before)}/{rollouts} rollouts; its sandboxes are paused"
        )
        console.print("driver 2: same job, re-attaches and fast-forwards")
        proc = driver(second)
        _, err = proc.communicate(timeout=1800)
        if proc.returncode != 0:
            raise click.ClickException(f"driver 2 failed: {err.decode()[-2000:]}")
        after = _load(second)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    same = sum(after[i].reward == r.reward for i, r in before.items() if i in after)
    replayed = sum(r.replayed for r in after.values())
    console.print(
        f"driver 2 finished {len(after)} rollouts; {replayed} commands answered from the"
        f" trajectory logs; {same}/{len(before)} rollouts finished by driver 1 got the same"
        " reward again"
    )
    if same != len(before) or len(after) != rollouts:
        raise click.ClickException("the resumed batch differs from the interrupted one")
    return [after[i] for i in sorted(after)]


def _count(path: Path) -> int:
    try:
        return sum(1 for _ in path.open())
    except OSError:
        return 0


def _load(path: Path) -> dict[int, RolloutResult]:
    out = {}
    with path.open() as fh:
        for line in fh:
            r = RolloutResult(**json.loads(line))
            out[r.index] = r
    return out


def _report(console: Console, results: list[RolloutResult], wall: float) -> None:
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
