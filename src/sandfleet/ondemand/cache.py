"""The node's chunk cache: data chunks on local disk, least recently used evicted first.

One directory per node, shared by every sandbox (and every layer: chunks are
content-addressed, so a chunk held by two layers is cached once)::

    <dir>/sha256/<hex>   one chunk, named by the sha256 of its bytes
    <dir>/tmp/           partial writes, renamed into place when complete

The index lives in memory and is rebuilt from the directory at start (oldest
modification time first, so the order survives a restart: a hit refreshes
the file's mtime, at most once a minute per chunk). The cache only stores
bytes; callers check digests before :meth:`ChunkCache.put`.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from sandfleet.blobstore.keys import digest_hex
from sandfleet.wire.errors import InvalidArgument

__all__ = ["CacheStats", "ChunkCache"]

#: Seconds between two mtime refreshes of one cached chunk.
_TOUCH_EVERY_S = 60.0
_HEX_RE = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class CacheStats:
    """``bytes`` and ``count`` held now; ``hits``, ``misses``, ``evictions`` since start."""

    bytes: int
    count: int
    max_bytes: int
    hits: int
    misses: int
    evictions: int


class ChunkCache:
    """Chunks under ``dir``, at most ``max_bytes`` bytes in all. Thread-safe.

    Raises :class:`InvalidArgument` for a negative ``max_bytes`` and ``OSError``
    if ``dir`` cannot be created.
    """

    def __init__(self, dir: Path | str, max_bytes: int) -> None:
        if max_bytes < 0:
            raise InvalidArgument(f"cache size must be >= 0 bytes, not {max_bytes}")
        self.dir = Path(dir)
        self.max_bytes = max_bytes
        self._data = self.dir / "sha256"
        self._tmp = self.dir / "tmp"
        self._lock = threading.Lock()
        #: hex -> (size in bytes, monotonic time of the last mtime refresh)
        self._index: OrderedDict[str, tuple[int, float]] = OrderedDict()
        self._bytes = self._hits = self._misses = self._evictions = 0
        self._data.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(self._tmp, ignore_errors=True)
        self._tmp.mkdir(parents=True, exist_ok=True)
        self._rebuild()

    def _rebuild(self) -> None:
        found: list[tuple[float, str, int]] = []
        for entry in os.scandir(self._data):
            if not _HEX_RE.fullmatch(entry.name):
                continue
            with contextlib.suppress(FileNotFoundError):
                st = entry.stat(follow_symlinks=False)
                found.append((st.st_mtime, entry.name, st.st_size))
        now = time.monotonic()
        with self._lock:
            for _, name, size in sorted(found):
                self._index[name] = (size, now)
                self._bytes += size
            self._evict_locked(0)

    def path(self, digest: str) -> Path:
        """The file that holds chunk ``digest`` ('sha256:<hex>'), cached or not."""
        return self._data / digest_hex(digest)

    def __contains__(self, digest: str) -> bool:
        with self._lock:
            return digest_hex(digest) in self._index

    def open(self, digest: str) -> int | None:
        """A read-only file descriptor on chunk ``digest`` (the caller closes it), or None.

        Counts a hit or a miss and makes the chunk the most recently used. The
        descriptor stays valid even if the chunk is evicted meanwhile.
        """
        hex_ = digest_hex(digest)
        touch = False
        with self._lock:
            entry = self._index.get(hex_)
            if entry is None:
                self._misses += 1
                return None
            self._index.move_to_end(hex_)
            now = time.monotonic()
            if now - entry[1] >= _TOUCH_EVERY_S:
                self._index[hex_] = (entry[0], now)
                touch = True
        try:
            fd = os.open(self._data / hex_, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:  # removed behind our back
            self.discard(digest)
            with self._lock:
                self._misses += 1
            return None
        if touch:
            with contextlib.suppress(OSError):
                os.utime(fd)
        with self._lock:
            self._hits += 1
        return fd

    def put(self, digest: str, data: bytes) -> bool:
        """Store chunk ``digest`` (already checked), evicting the least recently used.

        Returns False, storing nothing, when ``data`` alone exceeds ``max_bytes``.
        Raises ``OSError`` when the disk refuses the write.
        """
        hex_ = digest_hex(digest)
        if len(data) > self.max_bytes:
            return False
        with self._lock:
            if hex_ in self._index:
                self._index.move_to_end(hex_)
                return True
        fd, tmp = tempfile.mkstemp(prefix="chunk-", dir=self._tmp)
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
            with self._lock:
                if hex_ not in self._index:
                    self._evict_locked(len(data))
                    os.replace(tmp, self._data / hex_)
                    self._index[hex_] = (len(data), time.monotonic())
                    self._bytes += len(data)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        return True

    def discard(self, digest: str) -> None:
        """Forget chunk ``digest`` and delete its file (e.g. found corrupt)."""
        hex_ = digest_hex(digest)
        with self._lock:
            entry = self._index.pop(hex_, None)
            if entry is not None:
                self._bytes -= entry[0]
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._data / hex_)

    def _evict_locked(self, incoming: int) -> None:
        while self._index and self._bytes + incoming > self.max_bytes:
            hex_, (size, _) = self._index.popitem(last=False)
            self._bytes -= size
            self._evictions += 1
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._data / hex_)

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(
                bytes=self._bytes,
                count=len(self._index),
                max_bytes=self.max_bytes,
                hits=self._hits,
                misses=self._misses,
                evictions=self._evictions,
            )
