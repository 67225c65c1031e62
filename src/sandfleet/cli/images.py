"""``sandfleet image``: build, list, inspect and remove layers."""

from __future__ import annotations

from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from sandfleet.cli.main import _dirs, _images_opt, _state_opt, cli
from sandfleet.wire.errors import InvalidArgument

__all__ = ["image"]


@cli.group()
def image() -> None:
    """Build and manage versioned image layers."""


@image.command("build")
@click.argument("ref")
@_state_opt
@_images_opt
@click.option(
    "--debootstrap",
    "suite",
    default=None,
    metavar="SUITE",
    help="Build a Debian base layer with debootstrap (e.g. bookworm).",
)
@click.option("--package", "-p", "packages", multiple=True, help="Debian package to include.")
@click.option(
    "--mirror",
    default=None,
    help="Debian mirror (default: SANDFLEET_DEBIAN_MIRROR, then apt sources).",
)
@click.option(
    "--from-dir",
    type=click.Path(path_type=Path, exists=True, file_okay=False),
    default=None,
    help="Pack a directory as a layer.",
)
@click.option(
    "--kind",
    type=click.Choice(["base", "toolkit", "workspace", "diff"]),
    default="base",
    show_default=True,
    help="Layer kind for --from-dir.",
)
@click.option(
    "--workspace",
    "workspace_source",
    default=None,
    metavar="SOURCE",
    help="Workspace layer from an sdist path, a PyPI requirement or a git repository.",
)
def build(
    ref: str,
    state_dir: Path | None,
    images_dir: Path | None,
    suite: str | None,
    packages: tuple[str, ...],
    mirror: str | None,
    from_dir: Path | None,
    kind: str,
    workspace_source: str | None,
) -> None:
    """Build the image REF (name:tag) from exactly one source."""
    from sandfleet.images import (
        ImageStore,
        build_debootstrap,
        build_from_directory,
        build_workspace,
    )

    chosen = [s for s in (suite, from_dir, workspace_source) if s is not None]
    if len(chosen) != 1:
        raise InvalidArgument(
            "give exactly one source: --debootstrap SUITE, --from-dir DIR or --workspace SOURCE"
        )
    store = ImageStore(_dirs(state_dir, images_dir)[1])
    if suite is not None:
        manifest = build_debootstrap(store, ref, list(packages), suite=suite, mirror=mirror)
    elif from_dir is not None:
        manifest = build_from_directory(store, ref, from_dir, kind=kind)  # type: ignore[arg-type]
    else:
        assert workspace_source is not None
        manifest = build_workspace(store, ref, workspace_source)
    size = sum(layer.size for layer in manifest.layers)
    click.echo(f"built {manifest.ref}: {len(manifest.layers)} layer(s), {size / 2**20:.1f} MiB")


@image.command("ls")
@_state_opt
@_images_opt
def ls(state_dir: Path | None, images_dir: Path | None) -> None:
    """List images."""
    from sandfleet.images import ImageStore

    table = Table("image", "kind", "layers", "MiB", "source")
    for m in ImageStore(_dirs(state_dir, images_dir)[1]).list():
        table.add_row(
            m.ref,
            m.kind,
            str(len(m.layers)),
            f"{sum(x.size for x in m.layers) / 2**20:.1f}",
            m.source,
        )
    Console().print(table)


@image.command("inspect")
@click.argument("ref")
@_state_opt
@_images_opt
def inspect(ref: str, state_dir: Path | None, images_dir: Path | None) -> None:
    """Print an image's manifest as JSON."""
    from sandfleet.images import ImageStore

    click.echo(ImageStore(_dirs(state_dir, images_dir)[1]).resolve(ref).model_dump_json(indent=2))


@image.command("rm")
@click.argument("ref")
@_state_opt
@_images_opt
def rm(ref: str, state_dir: Path | None, images_dir: Path | None) -> None:
    """Remove an image's tag; its layers stay (other images may share them) until
    `sandfleet image prune` deletes those no image uses."""
    from sandfleet.images import ImageStore

    ImageStore(_dirs(state_dir, images_dir)[1]).remove(ref)
    click.echo(f"removed {ref} (`sandfleet image prune` deletes layers no image uses)")


@image.command("prune")
@_state_opt
@_images_opt
@click.option(
    "--min-age",
    "min_age_s",
    type=click.FloatRange(min=0),
    default=600.0,
    show_default=True,
    help="Keep unused layers younger than this, seconds (one being built or snapshotted"
    " is not referenced yet).",
)
def prune(state_dir: Path | None, images_dir: Path | None, min_age_s: float) -> None:
    """Delete layers no image uses (left by `image rm`, or by snapshots' images removed).

    A layer mounted by a running sandbox stays readable to it: the mount holds the file.
    """
    from sandfleet.images import ImageStore

    removed = ImageStore(_dirs(state_dir, images_dir)[1]).prune(min_age_s=min_age_s)
    for digest in removed:
        click.echo(f"deleted layer {digest}")
    click.echo(f"{len(removed)} unused layers deleted")
