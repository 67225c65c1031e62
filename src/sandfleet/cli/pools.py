"""``sandfleet pools``: the fncall pools of a running deployment, and their bounds."""

from __future__ import annotations

import click
from rich.console import Console
from rich.table import Table

from sandfleet.cli.main import cli
from sandfleet.wire.models import LANGUAGES, PoolInfo

__all__ = ["pools"]


@cli.command()
@click.option("--url", default=None, help="Control plane URL (env SANDFLEET_URL).")
@click.option("--image", default=None, help="With a bound option: the pool's image.")
@click.option("--language", type=click.Choice(LANGUAGES), default="python", show_default=True)
@click.option("--min", "min_workers", type=int, default=None, help="Workers kept warm.")
@click.option("--max", "max_workers", type=int, default=None, help="Most workers.")
@click.option("--queue", "max_queue", type=int, default=None, help="Most calls waiting.")
@click.option("--idle", "idle_s", type=float, default=None, help="Seconds before a spare stops.")
def pools(
    url: str | None,
    image: str | None,
    language: str,
    min_workers: int | None,
    max_workers: int | None,
    max_queue: int | None,
    idle_s: float | None,
) -> None:
    """Show every fncall pool on every node; with --min/--max/--queue/--idle, set them first.

    Unset bounds return to their defaults when one is given.
    """
    from sandfleet.sdk import Client

    bounds = (min_workers, max_workers, max_queue, idle_s)
    with Client(url) as client:
        if any(b is not None for b in bounds):
            client.configure_pool(
                image=image,
                language=language,
                min_workers=min_workers,
                max_workers=max_workers,
                max_queue=max_queue,
                idle_s=idle_s,
            )
        Console().print(pools_table(client.pools()))


def pools_table(infos: list[PoolInfo]) -> Table:
    """One row per (node, image, language) pool."""
    columns = ["node", "image", "language", "idle", "busy", "starting", "queued", "min/max"]
    table = Table(*columns, "calls", "replaced", "rejected", "MiB/worker", "last error")
    for p in sorted(infos, key=lambda p: (p.node_id, p.image, p.language)):
        table.add_row(
            p.node_id, p.image, p.language, str(p.idle), str(p.busy), str(p.starting),
            f"{p.queued}/{p.max_queue}", f"{p.min_workers}/{p.max_workers}", str(p.calls),
            str(p.replaced), str(p.rejected),
            "-" if p.worker_memory_mb is None else f"{p.worker_memory_mb:.1f}",
            p.last_error or "",
        )  # fmt: skip
    if not infos:
        table.caption = "no pools yet: a pool starts with its first call, or with --min"
    return table
