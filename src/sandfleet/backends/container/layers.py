"""Node-wide, read-only EROFS mounts of layers, shared by all sandboxes.

A layer is mounted once (file-backed, through mount(2); a split layer with its
data blob as ``device=``) at ``<root>/<name>`` and serves every sandbox
stacking it. Mounts are refcounted
and kept as a cache while the node lives: the next sandbox on the same image
then pays no mount at all. :meth:`LayerCache.close` unmounts the unused ones;
mounts that survive a restart of the node agent are adopted by
:meth:`LayerCache.adopt`.

Not thread-safe: the backend calls it from one event loop, and no method
awaits, so each call is atomic there.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
from pathlib import Path

from sandfleet.backends.base import LayerSource
from sandfleet.node.mounts import (
    MNT_DETACH,
    MS_RDONLY,
    mount,
    mount_table,
    mounts_under,
    umount,
)
from sandfleet.wire.errors import Internal, NotFound, Unavailable

__all__ = ["LayerCache"]

_MS_NODEV = 0x4
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


def layer_name(layer: LayerSource) -> str:
    """The mount directory name of a layer.

    Keyed by the metadata file's real path *and* inode, so a file replaced in
    place (new inode) gets a fresh mount instead of the stale one, and by the
    data blob's path and device: two layers whose files differ only in content
    share their metadata image, and a data file served by a new FUSE mount is
    another file.
    """
    real = os.path.realpath(layer.meta)
    st = os.stat(real)
    data = ""
    if layer.data is not None:  # its device too: a restarted FUSE daemon is a new mount
        data = f"{os.path.realpath(layer.data)}\0{os.stat(layer.data).st_dev}"
    key = f"{real}\0{st.st_dev}\0{st.st_ino}\0{data}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    stem = _UNSAFE.sub("_", Path(layer.digest or real).name.removeprefix("sha256:"))[:48]
    return f"{stem}-{digest}"


class LayerCache:
    """Refcounted EROFS mounts under ``root``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._refs: dict[str, int] = {}

    def acquire(self, layer: LayerSource) -> tuple[str, Path]:
        """Mount ``layer`` if needed and take a reference; returns (name, mount point).

        Raises ``NotFound`` when a file is missing, ``Unavailable`` when the
        data blob cannot be reached (its FUSE daemon is gone) and ``Internal``
        when the kernel refuses to mount it (not an EROFS image, corrupt).
        """
        try:
            name = layer_name(layer)
        except FileNotFoundError:
            what = "layer file" if not os.path.exists(layer.meta) else "data blob"
            path = layer.meta if what == "layer file" else layer.data
            raise NotFound(f"{what} {path} does not exist on this node") from None
        except OSError as e:  # ENOTCONN: the FUSE daemon serving the data blob is gone
            raise Unavailable(f"data blob {layer.data} of a layer is unreadable: {e}") from e
        point = self.root / name
        if name not in self._refs:
            data = f"device={os.path.realpath(layer.data)}" if layer.data is not None else ""
            point.mkdir(parents=True, exist_ok=True)
            try:
                mount(os.path.realpath(layer.meta), point, "erofs", MS_RDONLY | _MS_NODEV, data)
            except OSError as e:
                with contextlib.suppress(OSError):
                    point.rmdir()
                raise Internal(
                    f"cannot mount layer {layer.digest or layer.meta} (not a valid EROFS image,"
                    f" or its data blob unreadable?): {e}"
                ) from e
            self._refs[name] = 0
        self._refs[name] += 1
        return name, point

    def take(self, name: str) -> bool:
        """Add a reference to an already mounted layer (adopted boxes); False if unknown."""
        if name not in self._refs:
            return False
        self._refs[name] += 1
        return True

    def release(self, name: str) -> None:
        """Drop one reference; the mount stays as a cache until :meth:`close`."""
        if self._refs.get(name, 0) > 0:
            self._refs[name] -= 1

    def mounted(self) -> dict[str, int]:
        """Mounted layer names and their reference counts."""
        return dict(self._refs)

    def adopt(self) -> list[str]:
        """Register layer mounts left by a previous run (refcount 0); returns their names.

        Empty directories without a mount are removed.
        """
        self.root.mkdir(parents=True, exist_ok=True)
        points = set(mounts_under(self.root))
        for entry in self.root.iterdir():
            if str(entry.resolve()) in points:
                self._refs.setdefault(entry.name, 0)
            elif entry.is_dir():
                with contextlib.suppress(OSError):
                    entry.rmdir()
        return sorted(self._refs)

    def close(self) -> list[str]:
        """Unmount every layer with no user; returns the names still in use.

        A layer still stacked in some overlay mount is kept even at refcount
        0: it belongs to a box this instance does not know (not recovered).
        """
        stacked = _overlay_lowers()
        for name, refs in list(self._refs.items()):
            if refs or str(self.root / name) in stacked:
                continue
            point = self.root / name
            try:
                umount(point)
            except OSError:
                umount(point, MNT_DETACH)  # busy only through a stray process
            with contextlib.suppress(OSError):
                point.rmdir()
            del self._refs[name]
        return sorted(self._refs)


def _overlay_lowers() -> set[str]:
    """Every lowerdir of every overlay mount on the node (this mount namespace)."""
    lowers: set[str] = set()
    for entry in mount_table():
        if entry.fstype != "overlay":
            continue
        for opt in entry.options:
            if opt.startswith("lowerdir="):
                lowers.update(p.replace("\\040", " ") for p in opt[9:].split(":"))
    return lowers
