"""Shared builder steps, the directory builder and the layer stack for the node agent."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from sandfleet.blobstore import LayerRecord
from sandfleet.wire.errors import InvalidArgument, NotFound, SandfleetError
from sandfleet.wire.models import ImageConfig, ImageManifest, LayerKind

from .erofs import pack_erofs
from .refs import parse_ref
from .store import ImageStore

__all__ = [
    "Log",
    "StackLayer",
    "build_from_directory",
    "commit_layers",
    "run_tool",
    "stack_for",
    "stderr_log",
]

#: A progress callback: receives one human-readable line at a time.
Log = Callable[[str], None]


def stderr_log(line: str) -> None:
    """The default progress callback: ``sandfleet: <line>`` on stderr."""
    print(f"sandfleet: {line}", file=sys.stderr, flush=True)


def commit_layers(
    store: ImageStore,
    ref: str,
    trees: Sequence[Path],
    scratch: Path,
    *,
    kind: LayerKind,
    config: ImageConfig,
    source: str,
    preserve_mtime: bool = False,
    all_root: bool = False,
    log: Log = stderr_log,
    on: ImageManifest | None = None,
) -> ImageManifest:
    """Pack each of ``trees`` (bottom first) into a layer of ``kind`` and tag the stack as ``ref``.

    With ``on``, the new layers go on top of that image's layers (its objects
    are shared, not copied). Whiteouts (character devices 0/0) and opaque directories
    (``trusted.overlay.opaque=y``) in a tree are kept as they are, so an upper
    layer can hide files of the layers below it. ``scratch`` is a directory
    on the store's filesystem for temporary files. Returns the stored
    manifest. Raises :class:`InvalidArgument` for no trees, and what
    :func:`pack_erofs` and :meth:`ImageStore.put` raise.
    """
    name, tag = parse_ref(ref)
    if not trees:
        raise InvalidArgument(f"cannot build {ref}: no layers given")
    layers = list(on.layers) if on is not None else []
    for i, tree in enumerate(trees):
        t0 = time.monotonic()
        out = scratch / f"layer-{i}"
        out.mkdir()
        meta, blob = out / "meta.erofs", out / "data.blob"
        pack_erofs(tree, meta, blob_file=blob, preserve_mtime=preserve_mtime, all_root=all_root)
        size = meta.stat().st_size + blob.stat().st_size
        log(f"packed {kind} layer: {size / 1e6:.1f} MB in {time.monotonic() - t0:.1f} s")
        layers.append(store.add_layer(meta, blob, kind, chunk_size=store.chunk_size))
    manifest = ImageManifest(
        name=name, tag=tag, kind=kind, layers=layers, config=config, source=source
    )
    store.put(manifest)
    log(f"stored {manifest.ref} ({len(layers)} layer(s), top {layers[-1].digest[:19]})")
    return manifest


def build_from_directory(
    store: ImageStore,
    ref: str,
    path: Path,
    kind: LayerKind = "base",
    *,
    config: ImageConfig | None = None,
    log: Log = stderr_log,
    on: str | None = None,
) -> ImageManifest:
    """Pack the directory ``path`` as it is (owners, modes, xattrs) into a layer and tag it.

    Alone it is a one-layer image; with ``on`` (an image reference) the layer
    goes on top of that image's stack (e.g. a ``toolkit`` layer on a ``base``),
    whose config it inherits unless ``config`` is given. Returns the stored
    manifest. Raises :class:`InvalidArgument` for a bad ``ref`` or ``kind``,
    :class:`NotFound` if ``path`` or the ``on`` image does not exist, and
    the errors of :func:`pack_erofs` (with mkfs.erofs's stderr) if packing
    fails; no temporary files stay behind.
    """
    parse_ref(ref)
    if kind not in ("base", "toolkit", "workspace", "diff"):
        raise InvalidArgument(f"invalid layer kind {kind!r}: one of base, toolkit, workspace, diff")
    path = Path(path)
    if not path.exists():
        raise NotFound(f"cannot build {ref} from {path}: no such directory")
    below = store.resolve(on) if on is not None else None
    if config is None:
        config = below.config if below is not None else ImageConfig()
    source = f"dir:{path.resolve()}" + (f" on {below.ref}" if below is not None else "")
    with store.scratch() as scratch:
        return commit_layers(
            store,
            ref,
            [path],
            scratch,
            kind=kind,
            config=config,
            source=source,
            log=log,
            on=below,
        )


@dataclass(frozen=True)
class StackLayer:
    """One layer of a sandbox's stack: its digest, record and local metadata image."""

    digest: str
    record: LayerRecord
    meta: Path


def stack_for(
    store: ImageStore, image_ref: str, workspace_ref: str | None = None
) -> tuple[list[StackLayer], ImageConfig]:
    """The layers to stack for a sandbox, bottom layer first, and its merged config.

    Image layers come first, then the workspace's. In the merged config the
    workspace's ``env`` entries override the image's and its ``workdir``
    wins when set. Note overlayfs's ``lowerdir=`` lists the *top* layer
    first: reverse the list for it. Only metadata must be local: data chunks
    are fetched on demand.

    Raises :class:`NotFound` for an unknown reference or a layer whose record
    or metadata is not in the store, and :class:`InvalidArgument` when
    ``image_ref`` names a workspace or ``workspace_ref`` names something that
    is not one.
    """
    image = store.resolve(image_ref)
    if image.kind == "workspace":
        raise InvalidArgument(
            f"{image.ref} is a workspace, not an image to boot; pass it as the workspace "
            "and an OS image (e.g. one built with debootstrap) as the image"
        )
    manifests = [image]
    config = image.config.model_copy(deep=True)
    if workspace_ref is not None:
        ws = store.resolve(workspace_ref)
        if ws.kind != "workspace":
            raise InvalidArgument(f"{ws.ref} is a {ws.kind} image, not a workspace")
        manifests.append(ws)
        config = ImageConfig(
            env={**config.env, **ws.config.env}, workdir=ws.config.workdir or config.workdir
        )
    stack: list[StackLayer] = []
    for m in manifests:
        for layer in m.layers:
            if any(x.digest == layer.digest for x in stack):
                continue  # a workspace built on its image (`--on`) repeats its layers
            try:
                record = store.layer_record(layer.digest)
            except NotFound:
                raise NotFound(
                    f"layer {layer.digest} of {m.ref} is missing from {store.root}; rebuild"
                    f" {m.ref} or pull it again (`sandfleet image pull`)"
                ) from None
            meta = store.meta_path(record)
            if not meta.is_file():
                raise NotFound(
                    f"metadata of layer {layer.digest} of {m.ref} is missing from {store.root};"
                    f" pull {m.ref} again (`sandfleet image pull`)"
                )
            stack.append(StackLayer(layer.digest, record, meta))
    return stack, config


def run_tool(
    cmd: Sequence[str],
    what: str,
    error: type[SandfleetError],
    *,
    hint: str = "",
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
) -> str:
    """Run ``cmd``; return its stdout, or raise ``error`` with its stderr's tail and ``hint``."""
    try:
        proc = subprocess.run(
            list(cmd), capture_output=True, text=True, env=env, cwd=cwd, check=False
        )
    except FileNotFoundError:
        raise error(f"{what}: {cmd[0]} is not installed") from None
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
        raise error(
            f"{what} failed (exit {proc.returncode}): {tail}" + (f"; {hint}" if hint else "")
        )
    return proc.stdout
