"""Shared builder steps, the directory builder and the layer stack for the node agent."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from sandfleet.wire.errors import InvalidArgument, NotFound, SandfleetError
from sandfleet.wire.models import ImageConfig, ImageManifest, LayerKind

from .erofs import pack_erofs
from .refs import parse_ref
from .store import ImageStore

__all__ = ["Log", "build_from_directory", "commit_tree", "run_tool", "stack_for", "stderr_log"]

#: A progress callback: receives one human-readable line at a time.
Log = Callable[[str], None]


def stderr_log(line: str) -> None:
    """The default progress callback: ``sandfleet: <line>`` on stderr."""
    print(f"sandfleet: {line}", file=sys.stderr, flush=True)


def commit_tree(
    store: ImageStore,
    ref: str,
    tree: Path,
    scratch: Path,
    *,
    kind: LayerKind,
    config: ImageConfig,
    source: str,
    preserve_mtime: bool = False,
    all_root: bool = False,
    log: Log = stderr_log,
) -> ImageManifest:
    """Pack ``tree`` into one layer of ``kind``, store it and tag it as ``ref``.

    ``scratch`` is a directory on the store's filesystem for the temporary
    EROFS file. Returns the stored one-layer manifest. Raises what
    :func:`pack_erofs` and :meth:`ImageStore.put` raise.
    """
    name, tag = parse_ref(ref)
    t0 = time.monotonic()
    erofs = pack_erofs(
        tree, scratch / "layer.erofs", preserve_mtime=preserve_mtime, all_root=all_root
    )
    size = erofs.stat().st_size
    log(f"packed {kind} layer: {size / 1e6:.1f} MB in {time.monotonic() - t0:.1f} s")
    layer = store.add_layer(erofs, kind)
    manifest = ImageManifest(
        name=name, tag=tag, kind=kind, layers=[layer], config=config, source=source
    )
    store.put(manifest)
    log(f"stored {manifest.ref} ({layer.digest[:19]})")
    return manifest


def build_from_directory(
    store: ImageStore,
    ref: str,
    path: Path,
    kind: LayerKind = "base",
    *,
    config: ImageConfig | None = None,
    log: Log = stderr_log,
) -> ImageManifest:
    """Pack the directory ``path`` as it is (owners, modes, xattrs) into a one-layer image.

    Returns the stored manifest. Raises :class:`InvalidArgument` for a bad
    ``ref`` or ``kind``, :class:`NotFound` if ``path`` does not exist, and
    the errors of :func:`pack_erofs` (with mkfs.erofs's stderr) if packing
    fails; no temporary files stay behind.
    """
    parse_ref(ref)
    if kind not in ("base", "toolkit", "workspace", "diff"):
        raise InvalidArgument(f"invalid layer kind {kind!r}: one of base, toolkit, workspace, diff")
    path = Path(path)
    if not path.exists():
        raise NotFound(f"cannot build {ref} from {path}: no such directory")
    with store.scratch() as scratch:
        return commit_tree(
            store,
            ref,
            path,
            scratch,
            kind=kind,
            config=config or ImageConfig(),
            source=f"dir:{path.resolve()}",
            log=log,
        )


def stack_for(
    store: ImageStore, image_ref: str, workspace_ref: str | None = None
) -> tuple[list[Path], ImageConfig]:
    """The EROFS files to stack for a sandbox, bottom layer first, and its merged config.

    Image layers come first, then the workspace's. In the merged config the
    workspace's ``env`` entries override the image's and its ``workdir``
    wins when set. Note overlayfs's ``lowerdir=`` lists the *top* layer
    first: reverse the list for it.

    Raises :class:`NotFound` for an unknown reference or a missing layer
    file, and :class:`InvalidArgument` when ``image_ref`` names a workspace
    or ``workspace_ref`` names something that is not one.
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
    paths = []
    for m in manifests:
        for layer in m.layers:
            p = store.layer_path(layer.digest)
            if not p.is_file():
                raise NotFound(
                    f"layer {layer.digest} of {m.ref} is missing from {store.root}; rebuild {m.ref}"
                )
            paths.append(p)
    return paths, config


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
