"""Packing a VM's writable layer into an EROFS file, from the host.

The guest keeps its overlay's upper directory on its writable disk (ext4,
``disk.img``). Once the guest has flushed its page cache (the mux's sync) and
its vCPUs are stopped (QMP ``stop`` also drains QEMU's block layer), the image
file is a consistent picture of one instant, as after a power cut. The host
then mounts it read-only (``noload``: nothing is replayed or written) through
a loop device and packs ``upper/`` exactly as the container backend packs its
own: the overlay's whiteouts and opaque directories are the same format.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

from sandfleet.backends.container.disk import attach_loop
from sandfleet.images.erofs import pack_erofs
from sandfleet.node.mounts import (
    MNT_DETACH,
    MS_NODEV,
    MS_NOEXEC,
    MS_NOSUID,
    MS_RDONLY,
    mount,
    umount,
)
from sandfleet.wire.errors import FailedPrecondition

__all__ = ["pack_disk_upper"]


def pack_disk_upper(
    disk_image: Path,
    out_file: Path,
    exclude_regex: Sequence[str] = (),
    blob_file: Path | None = None,
) -> None:
    """Pack ``upper/`` of the ext4 image ``disk_image`` into ``out_file`` (and
    ``blob_file``; see :func:`~sandfleet.images.erofs.pack_erofs`). Blocking.

    The caller keeps the guest from writing meanwhile. Raises
    ``FailedPrecondition`` when the image holds no ``upper/`` and what
    :func:`~sandfleet.images.erofs.pack_erofs` raises. Leaves no mount or loop
    device behind.
    """
    point = Path(tempfile.mkdtemp(prefix=".disk-", dir=out_file.parent))
    try:
        dev, lfd = attach_loop(disk_image)
        try:
            flags = MS_RDONLY | MS_NODEV | MS_NOSUID | MS_NOEXEC
            mount(dev, point, "ext4", flags, "noload")
        finally:
            os.close(lfd)  # the mount holds the device; autoclear frees it at umount
        try:
            upper = point / "upper"
            if not upper.is_dir():
                raise FailedPrecondition(f"{disk_image} holds no writable layer (no upper/)")
            pack_erofs(
                upper,
                out_file,
                preserve_mtime=True,
                exclude_regex=exclude_regex,
                blob_file=blob_file,
            )
        finally:
            umount(point, MNT_DETACH)
    finally:
        with contextlib.suppress(OSError):
            point.rmdir()
