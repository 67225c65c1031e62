"""The FUSE file system: one read-only file per layer, ``/<layer hex>``, its data blob.

Looking up ``/<hex>`` loads ``layers/sha256/<hex>.json`` from the local image
store (checked against the digest) the first time; the file's size is the
record's ``blob_size`` and its bytes come from :class:`Fetcher`. EROFS mounts
it with ``device=<mount>/<hex>``. Errors reach the kernel as errno: ENOENT for
an unknown layer, EROFS for a write, EIO for a chunk that could not be fetched
(the fetcher has recorded why in its events).
"""

from __future__ import annotations

import errno
import logging
import os
import re
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mfusepy

from sandfleet.blobstore.keys import layer_key
from sandfleet.blobstore.records import LayerRecord
from sandfleet.node.mounts import mount_table
from sandfleet.wire.errors import NotFound, SandfleetError

from .fetcher import Fetcher, Layer

__all__ = ["MOUNT_OPTIONS", "LayerFS", "mount"]

log = logging.getLogger(__name__)

_HEX_RE = re.compile(r"[0-9a-f]{64}")

#: Kernel read-ahead of the mount, in KiB (the kernel's default, 128, would cut every
#: sequential read into 128 KiB requests; 1 MiB requests read about twice as fast,
#: and a random read of a small file still fetches about one chunk).
READ_AHEAD_KB = 1024

#: libfuse options of the mount. ``kernel_cache``: keep the page cache across opens
#: (blobs are immutable). Long entry/attr timeouts: a layer's size never changes;
#: no negative caching: a layer pulled later must appear at once. ``max_read``:
#: requests of up to 1 MiB. ``allow_other``: EROFS mounts made in other
#: credentials (a sandbox's user namespace) may read the files.
MOUNT_OPTIONS: dict[str, Any] = {
    "ro": True,
    "allow_other": True,
    "kernel_cache": True,
    "entry_timeout": 86400,
    "attr_timeout": 86400,
    "negative_timeout": 0,
    "max_read": 1 << 20,
    "fsname": "sandfleet-ondemand",
    "subtype": "sandfleet-ondemand",
}


class LayerFS(mfusepy.Operations):
    """mfusepy operations over the layers of the local image store at ``store_root``.

    ``on_init`` is called from libfuse's init, before the kernel has its answer: it
    must not touch the mount itself (do that from a thread).
    """

    use_ns = True

    def __init__(
        self, store_root: Path | str, fetcher: Fetcher, on_init: Callable[[], None] | None = None
    ) -> None:
        self.store_root = Path(store_root)
        self.fetcher = fetcher
        self._on_init = on_init
        self._layers: dict[str, Layer] = {}
        self._lock = threading.Lock()
        self._mtime_ns = time.time_ns()

    def layer(self, hex_: str) -> Layer:
        """The layer whose digest is ``sha256:<hex_>``, loaded once.

        Raises :class:`NotFound` if the store lacks its record, :class:`DataLoss`
        if the record does not match the digest.
        """
        with self._lock:
            found = self._layers.get(hex_)
        if found is not None:
            return found
        digest = f"sha256:{hex_}"
        path = self.store_root / layer_key(digest)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise NotFound(f"layer {digest} is not in the local store {self.store_root}") from None
        layer = Layer(digest, LayerRecord.from_bytes(data, digest))
        with self._lock:
            return self._layers.setdefault(hex_, layer)

    def _lookup(self, path: str) -> Layer:
        name = path.lstrip("/")
        if not _HEX_RE.fullmatch(name):
            raise mfusepy.FuseOSError(errno.ENOENT)
        try:
            return self.layer(name)
        except SandfleetError as e:
            if not isinstance(e, NotFound):
                log.warning("layer %s: %s", name, e)
            raise mfusepy.FuseOSError(errno.ENOENT) from None
        except ValueError as e:  # a malformed record
            log.warning("layer %s: %s", name, e)
            raise mfusepy.FuseOSError(errno.ENOENT) from None

    # -- mfusepy operations --------------------------------------------------------------

    def init_with_config(self, conn_info: Any, config_3: Any) -> None:
        if conn_info is not None:
            conn_info.max_read = MOUNT_OPTIONS["max_read"]  # libfuse wants it here too
            # Readahead of several blobs at once reaches us as concurrent async reads.
            conn_info.max_background = 64
            conn_info.congestion_threshold = 48
        if self._on_init is not None:
            self._on_init()

    def getattr(self, path: str, fh: int | None = None) -> dict[str, Any]:
        times = {"st_atime": self._mtime_ns, "st_mtime": self._mtime_ns, "st_ctime": self._mtime_ns}
        if path == "/":
            return {"st_mode": stat.S_IFDIR | 0o555, "st_nlink": 2, **times}
        layer = self._lookup(path)
        size = layer.record.blob_size
        return {
            "st_mode": stat.S_IFREG | 0o444,
            "st_nlink": 1,
            "st_size": size,
            "st_blocks": (size + 511) // 512,
            **times,
        }

    def readdir(self, path: str, fh: int) -> list[str]:
        """The layers loaded so far (lookups by name work for every layer in the store)."""
        if path != "/":
            raise mfusepy.FuseOSError(errno.ENOTDIR)
        with self._lock:
            return [".", "..", *self._layers]

    def open(self, path: str, flags: int) -> int:
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_TRUNC | os.O_APPEND):
            raise mfusepy.FuseOSError(errno.EROFS)
        self._lookup(path)
        return 0

    def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
        layer = self._lookup(path)
        try:
            return self.fetcher.read(layer, offset, size)
        except (SandfleetError, OSError) as e:
            log.warning("read of %s bytes at %s from %s: %s", size, offset, layer.digest, e)
            raise mfusepy.FuseOSError(errno.EIO) from None

    def statfs(self, path: str) -> dict[str, int]:
        return {"f_bsize": 4096, "f_frsize": 4096, "f_namemax": 255}


def tune_read_ahead(mount_point: str, kb: int = READ_AHEAD_KB) -> None:
    """Set the read-ahead of the FUSE mount at ``mount_point`` (an absolute path without
    symlinks), in KiB, through sysfs. Found through mountinfo, without touching the
    mount itself, so it may run inside the file system's init. Raises LookupError if
    nothing is mounted there, ``OSError`` if sysfs refuses."""
    devs = [e.dev for e in mount_table() if e.point == mount_point and e.fstype.startswith("fuse.")]
    if not devs:
        raise LookupError(f"no FUSE file system is mounted at {mount_point}")
    dev = devs[-1]  # the last one: the top of a stack of mounts
    (Path("/sys/class/bdi") / dev / "read_ahead_kb").write_text(f"{kb}\n")


def mount(ops: LayerFS, mount_dir: Path | str, *, debug: bool = False) -> None:
    """Mount ``ops`` at ``mount_dir`` and serve until unmounted or signalled (SIGINT,
    SIGTERM, SIGHUP: libfuse unmounts and returns). Multithreaded.

    Raises ``RuntimeError`` with libfuse's status when the mount fails (libfuse
    has printed why on stderr).
    """
    mfusepy.FUSE(ops, str(mount_dir), foreground=True, debug=debug, **MOUNT_OPTIONS)
