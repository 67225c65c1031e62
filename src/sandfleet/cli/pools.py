"""``sandfleet pools``: the fncall pools of a running deployment, and their bounds."""

from __future__ import annotations

import click
from rich.console import Console
from rich.table import Column, Table

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
    """One row per (node, image, language) pool; narrow enough for 80 columns.

    See the table's caption for the columns.
    """
    errors = any(p.last_error for p in infos)
    table = Table(
        Column("pool", overflow="fold", min_width=18),
        *("workers", "queue", "bounds", "calls (replaced, refused)", "MiB"),
    )
    if errors:
        table.add_column("last error")
    for p in sorted(infos, key=lambda p: (p.node_id, p.image, p.language)):
        row = [
            f"{p.image}\n{p.language} [dim]{p.node_id}[/]",
            f"{p.idle}/{p.busy}/{p.starting}",
            f"{p.queued}/{p.max_queue}",
            f"{p.min_workers}..{p.max_workers}",
            f"{p.calls} ({p.replaced}, {p.rejected})",
            "-" if p.worker_memory_mb is None else f"{p.worker_memory_mb:.0f}",
        ]
        table.add_row(*row, *([p.last_error or ""] if errors else []))
    table.caption = (
        "workers: idle/busy/starting; queue: waiting/max; bounds: min..max workers;\n"
        "replaced: workers replaced after a failure; refused: calls refused, queue full;"
        " MiB: memory of an idle worker"
        if infos
        else "no pools yet: a pool starts with its first call, or with --min"
    )
    return table
