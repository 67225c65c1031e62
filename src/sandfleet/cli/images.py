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
    "--on",
    "on_ref",
    default=None,
    metavar="IMAGE",
    help="With --from-dir: put the layer on top of this image's stack (e.g. a toolkit on a base).",
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
    on_ref: str | None,
    workspace_source: str | None,
) -> None:
    """Build the image REF (name:tag) from exactly one source."""
    from sandfleet.images import (
        ImageStore,
        build_debootstrap,
        build_from_directory,
        build_workspace,
    )

    if on_ref is not None and from_dir is None:
        raise InvalidArgument("--on IMAGE goes with --from-dir only (a layer on top of IMAGE)")
    chosen = [s for s in (suite, from_dir, workspace_source) if s is not None]
    if len(chosen) != 1:
        raise InvalidArgument(
            "give exactly one source: --debootstrap SUITE, --from-dir DIR or --workspace SOURCE"
        )
    store = ImageStore(_dirs(state_dir, images_dir)[1])
    if suite is not None:
        manifest = build_debootstrap(store, ref, list(packages), suite=suite, mirror=mirror)
    elif from_dir is not None:
        manifest = build_from_directory(store, ref, from_dir, kind=kind, on=on_ref)  # type: ignore[arg-type]
    else:
        assert workspace_source is not None
        manifest = build_workspace(store, ref, workspace_source)
    size = sum(layer.size for layer in manifest.layers)
    click.echo(f"built {manifest.ref}: {len(manifest.layers)} layer(s), {size / 2**20:.1f} MiB")


@image.command("import")
@click.argument("ref")
@click.argument("path", type=click.Path(path_type=Path, exists=True))
@_state_opt
@_images_opt
def import_(ref: str, path: Path, state_dir: Path | None, images_dir: Path | None) -> None:
    """Import the image at PATH as REF (name:tag), without a Docker daemon.

    PATH is an OCI image layout or a `docker save` archive, as a directory or a
    tar (e.g. from `docker save IMAGE -o image.tar` or `skopeo copy ... oci:DIR`).
    """
    from sandfleet.images import ImageStore, import_image

    store = ImageStore(_dirs(state_dir, images_dir)[1])
    manifest = import_image(store, ref, path)
    size = sum(layer.size for layer in manifest.layers)
    click.echo(f"imported {manifest.ref}: {len(manifest.layers)} layer(s), {size / 2**20:.1f} MiB")


@image.command("ls")
@_state_opt
@_images_opt
@click.option(
    "--store",
    "store_url",
    default=None,
    metavar="URL",
    help="List the images of this blob store (http(s):// or file://) instead of the local ones.",
)
def ls(state_dir: Path | None, images_dir: Path | None, store_url: str | None) -> None:
    """List images."""
    from sandfleet.images import ImageStore

    if store_url is not None:
        from sandfleet.blobstore import open_store
        from sandfleet.blobstore.transfer import list_images

        with open_store(store_url) as store:
            manifests = list_images(store)
            where = store.url
    else:
        local = ImageStore(_dirs(state_dir, images_dir)[1])
        manifests, where = local.list(), str(local.root)
    if not manifests:  # also what a mistyped store path looks like
        click.echo(f"no images in {where}")
        return
    table = Table("image", "kind", "layers", "MiB", "source")
    for m in manifests:
        table.add_row(
            m.ref,
            m.kind,
            str(len(m.layers)),
            f"{sum(x.size for x in m.layers) / 2**20:.1f}",
            m.source,
        )
    Console().print(table)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


@image.command("push")
@click.argument("ref")
@click.argument("url")
@_state_opt
@_images_opt
def push(ref: str, url: str, state_dir: Path | None, images_dir: Path | None) -> None:
    """Copy the local image REF, with all its data, to the blob store at URL.

    Only objects the store lacks are sent; the manifest goes last, so nodes
    never see the image half there. An http(s):// store must take WebDAV PUT.
    """
    from sandfleet.blobstore import FileBlobStore, open_store, transfer

    local = FileBlobStore(_dirs(state_dir, images_dir)[1])
    with open_store(url) as remote:
        stats = transfer.push(local, remote, ref, log=click.echo)
    click.echo(
        f"pushed {ref} to {url}: {stats.copied} objects ({_mib(stats.copied_bytes)}) sent,"
        f" {stats.present} already there"
    )


@image.command("pull")
@click.argument("ref")
@click.argument("url")
@_state_opt
@_images_opt
@click.option(
    "--data",
    is_flag=True,
    help="Fetch every data chunk now, instead of on demand when a sandbox reads it.",
)
def pull(ref: str, url: str, state_dir: Path | None, images_dir: Path | None, data: bool) -> None:
    """Copy the image REF from the blob store at URL into the local store.

    Without --data only its manifest, layer records, metadata images and
    access lists are fetched (small); data chunks come on demand.
    """
    from sandfleet.blobstore import FileBlobStore, open_store, transfer

    local = FileBlobStore(_dirs(state_dir, images_dir)[1])
    with open_store(url) as remote:
        stats = transfer.pull(remote, local, ref, data=data, log=click.echo)
    click.echo(
        f"pulled {ref} from {url}: {stats.copied} objects ({_mib(stats.copied_bytes)})"
        f" fetched, {stats.present} already here"
    )


@image.command("gc")
@_state_opt
@_images_opt
@click.option(
    "--store",
    "store_url",
    default=None,
    metavar="URL",
    help="Collect this blob store (http(s):// or file://) instead of the local image store.",
)
@click.option(
    "--min-age",
    "min_age_s",
    type=click.FloatRange(min=0),
    default=600.0,
    show_default=True,
    help="Keep unreferenced objects younger than this, seconds (a push or build in"
    " progress has not written its manifest yet).",
)
def gc(
    state_dir: Path | None, images_dir: Path | None, store_url: str | None, min_age_s: float
) -> None:
    """Delete layer records, metadata, chunks and access lists no image references
    (left by `image rm`, or by removed snapshots' images).

    In the local store, layers mounted by sandboxes running on this host are kept.
    A shared store (--store) cannot know what nodes run: collect it only when no
    sandbox uses the images removed from it (their data is read on demand).
    """
    from sandfleet.blobstore import open_store, transfer
    from sandfleet.images import ImageStore

    if store_url is not None:
        with open_store(store_url) as store:
            stats = transfer.gc(store, min_age_s=min_age_s)
            url = store.url
    else:  # the local store: layers mounted by running sandboxes stay
        local = ImageStore(_dirs(state_dir, images_dir)[1])
        stats, url = local.gc(min_age_s=min_age_s), local.blobs.url
    for key in stats.deleted:
        click.echo(f"deleted {key}")
    click.echo(
        f"deleted {len(stats.deleted)} unreferenced objects ({_mib(stats.deleted_bytes)})"
        f" from {url}; kept {stats.kept}"
    )


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
    `sandfleet image gc` deletes what no image uses."""
    from sandfleet.images import ImageStore

    ImageStore(_dirs(state_dir, images_dir)[1]).remove(ref)
    click.echo(f"removed {ref} (`sandfleet image gc` deletes what no image uses)")
