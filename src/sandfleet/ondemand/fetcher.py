"""Bytes of layers' data blobs, chunk by chunk, from wherever a chunk is.

Sources, in order: the *origin* (``<store root>/chunks/sha256/<hex>``: chunks
of layers built on this node), the node's :class:`ChunkCache`, then each
remote blob store in turn. A chunk from the origin or the cache is checked
against its digest the first time this process uses it; a chunk from a
remote is checked before it is used or cached.

Remote fetches are single-flight (one fetch per chunk digest however many
readers wait for it), retried with exponential backoff while a store is
*unavailable*, and bounded by a deadline per chunk: a reader gets an error
after at most ``deadline_s`` seconds, never a hang. Reading chunk ``i`` for the
first time, at the end of a sequential run of ``r`` chunks, queues chunks
``i+1 .. i+min(r, readahead)`` of the same layer on a small background pool;
:meth:`Fetcher.prefetch` queues any chunks there too.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sandfleet.blobstore.base import BlobStore
from sandfleet.blobstore.keys import check_digest, chunk_key, digest_hex
from sandfleet.blobstore.records import LayerRecord
from sandfleet.wire.errors import (
    DataLoss,
    DeadlineExceeded,
    InvalidArgument,
    NotFound,
    SandfleetError,
    Unavailable,
)

from .cache import ChunkCache

__all__ = ["DEFAULT_DEADLINE_S", "DEFAULT_READAHEAD", "Event", "Fetcher", "Layer"]

#: Seconds a reader waits at most for one chunk from the remote stores.
DEFAULT_DEADLINE_S = 30.0
#: Chunks fetched ahead in the background after a chunk is first read.
DEFAULT_READAHEAD = 4
#: Seconds of the first retry's backoff; doubled per round, at most _BACKOFF_MAX_S.
_BACKOFF_S = 0.1
_BACKOFF_MAX_S = 2.0


@dataclass(frozen=True)
class Layer:
    """A layer as the fetcher needs it: its digest ('sha256:<hex>') and record."""

    digest: str
    record: LayerRecord


@dataclass(frozen=True)
class Event:
    """One failure: ``seq`` (1, 2, ...), ``time`` (Unix seconds), the layer digest,
    the chunk index, the store URL ('' when local) and a message."""

    seq: int
    time: float
    layer: str
    chunk: int
    store: str
    message: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class _Flight:
    """One remote fetch of one chunk, shared by everyone who wants that chunk."""

    layer: Layer
    index: int
    future: Future[bytes] = field(default_factory=Future)
    claimed: bool = False


class Fetcher:
    """Reads layers' blobs; see the module docstring. Thread-safe; :meth:`close` when done.

    ``origin``: the local image store root (None: no origin). ``remotes``: stores
    tried in order. ``readahead``: chunks fetched ahead (0: none). ``deadline_s``:
    seconds a chunk may take from the remotes, retries included. ``workers``:
    threads for read-ahead and prefetch; ``fetch_workers``: threads for fetches
    a reader waits for. ``max_events``: failures kept for :meth:`events`.
    """

    def __init__(
        self,
        origin: Path | str | None,
        cache: ChunkCache,
        remotes: Sequence[BlobStore] = (),
        *,
        readahead: int = DEFAULT_READAHEAD,
        deadline_s: float = DEFAULT_DEADLINE_S,
        workers: int = 4,
        fetch_workers: int = 16,
        max_events: int = 1000,
    ) -> None:
        if readahead < 0 or deadline_s <= 0 or workers < 1 or fetch_workers < 1:
            raise InvalidArgument(
                "readahead must be >= 0, deadline_s > 0 and worker counts >= 1"
                f" (got {readahead}, {deadline_s}, {workers}, {fetch_workers})"
            )
        self._origin = Path(origin) / "chunks" / "sha256" if origin is not None else None
        self.cache = cache
        self.remotes = list(remotes)
        self.readahead = readahead
        self.deadline_s = deadline_s
        self._lock = threading.Lock()
        self._inflight: dict[str, _Flight] = {}
        self._verified: set[str] = set()
        #: chunk digest -> (until, error): a chunk that failed fails again at once for
        #: a deadline's time (the kernel retries a failed read: readahead, then the page).
        self._failed: dict[str, tuple[float, SandfleetError]] = {}
        #: store url -> until: a store that let a fetch run out of time gets one
        #: attempt per fetch, no retries, until it answers again or this passes.
        self._down: dict[str, float] = {}
        self._access: dict[str, tuple[list[int], set[int]]] = {}
        self._events: deque[Event] = deque(maxlen=max_events)
        self._seq = 0
        self._counters = dict.fromkeys(
            (
                "reads",
                "read_bytes",
                "hits_origin",
                "hits_cache",
                "hits_remote",
                "remote_chunks",
                "remote_bytes",
                "background_queued",
                "errors",
            ),
            0,
        )
        self._fg = ThreadPoolExecutor(fetch_workers, thread_name_prefix="fetch")
        self._bg = ThreadPoolExecutor(workers, thread_name_prefix="readahead")
        self._closed = False

    # -- reading -----------------------------------------------------------------------

    def read(self, layer: Layer, offset: int, size: int) -> bytes:
        """Blob bytes ``[offset, offset + size)`` of ``layer`` (fewer at the end of the blob).

        Records first reads in the layer's access list and starts read-ahead.
        Raises :class:`DataLoss` (every copy corrupt), :class:`NotFound` (no
        source has the chunk), :class:`Unavailable` or :class:`DeadlineExceeded`.
        """
        rec = layer.record
        end = min(offset + size, rec.blob_size)
        if offset < 0 or size < 0:
            raise InvalidArgument(f"bad read of {size} bytes at offset {offset}")
        parts: list[bytes] = []
        pos = offset
        while pos < end:
            index, start = divmod(pos, rec.chunk_size)
            length = min(end - pos, rec.chunk_length(index) - start)
            if self._note_access(layer.digest, index):
                self._read_ahead(layer, index)
            parts.append(self._read_chunk(layer, index, start, length))
            pos += length
        data = parts[0] if len(parts) == 1 else b"".join(parts)  # b"" past the end
        self._count(reads=1, read_bytes=len(data))
        return data

    def chunk(self, layer: Layer, index: int) -> bytes:
        """The whole chunk ``index`` of ``layer`` (not a recorded read). Raises as :meth:`read`."""
        self._check_index(layer, index)
        return self._read_chunk(layer, index, 0, layer.record.chunk_length(index))

    def prefetch(self, layer: Layer, indexes: Iterable[int]) -> int:
        """Queue background fetches of chunks ``indexes`` into the cache; returns how many
        were queued (chunks local or already on their way are skipped)."""
        queued = 0
        for index in indexes:
            self._check_index(layer, index)
            queued += self._background(layer, index)
        return queued

    def _check_index(self, layer: Layer, index: int) -> None:
        if not 0 <= index < len(layer.record.chunks):
            raise InvalidArgument(
                f"chunk {index} out of range: layer {layer.digest} has"
                f" {len(layer.record.chunks)} chunks"
            )

    def _read_chunk(self, layer: Layer, index: int, start: int, length: int) -> bytes:
        digest = layer.record.chunks[index]
        for _ in range(3):  # a local copy may vanish (eviction) between the checks
            local = self._read_local(layer, index, start, length)
            if local is not None:
                return local
            data = self._wait_remote(layer, index)
            if data is not None:
                self._count(hits_remote=1)
                return data[start : start + length]
        raise Unavailable(f"chunk {index} ({digest}) of layer {layer.digest} keeps vanishing")

    def _read_local(self, layer: Layer, index: int, start: int, length: int) -> bytes | None:
        digest = layer.record.chunks[index]
        if self._origin is not None:
            try:
                fd: int | None = os.open(self._origin / digest_hex(digest), os.O_RDONLY)
            except FileNotFoundError:
                fd = None
            if fd is not None:
                data = self._read_verified(fd, layer, index, start, length, "origin")
                if data is not None:
                    self._count(hits_origin=1)
                    return data
        fd = self.cache.open(digest)
        if fd is not None:
            data = self._read_verified(fd, layer, index, start, length, "cache")
            if data is not None:
                self._count(hits_cache=1)
                return data
            self.cache.discard(digest)
        return None

    def _read_verified(
        self, fd: int, layer: Layer, index: int, start: int, length: int, where: str
    ) -> bytes | None:
        """Bytes from a local chunk file (closing ``fd``), checked once per process; None if bad."""
        digest = layer.record.chunks[index]
        try:
            if digest in self._verified:
                data = os.pread(fd, length, start)
                if len(data) == length:
                    return data
                self._verified.discard(digest)
                self._event(layer, index, "", f"{where} copy of chunk {digest} is truncated")
                return None
            whole = os.pread(fd, layer.record.chunk_length(index) + 1, 0)
        finally:
            os.close(fd)
        try:
            check_digest(whole, digest, f"{where} copy of chunk {index} of layer {layer.digest}")
        except DataLoss as e:
            self._event(layer, index, "", e.message)
            return None
        with self._lock:
            self._verified.add(digest)
        return whole[start : start + length]

    # -- remote fetches ----------------------------------------------------------------

    def _wait_remote(self, layer: Layer, index: int) -> bytes | None:
        """The chunk from a remote (waiting at most the deadline), or None if it became local."""
        with self._lock:
            failed = self._failed.get(layer.record.chunks[index])
        if failed is not None and failed[0] > time.monotonic():
            raise failed[1]
        flight = self._flight(layer, index, foreground=True)
        if flight is None:
            return None
        try:
            return flight.future.result(timeout=self.deadline_s + 1.0)
        except FutureTimeout:
            msg = (
                f"chunk {index} ({layer.record.chunks[index]}) of layer {layer.digest}: no remote"
                f" store answered within {self.deadline_s:g} s"
            )
            self._event(layer, index, "", msg)
            raise DeadlineExceeded(msg) from None

    def _flight(self, layer: Layer, index: int, *, foreground: bool) -> _Flight | None:
        """The fetch of chunk ``index``, started if needed; None if the chunk is local now."""
        digest = layer.record.chunks[index]
        with self._lock:
            if self._closed:
                raise Unavailable("the fetcher is shut down")
            flight = self._inflight.get(digest)
            if flight is None:
                # A finished flight puts its chunk in the cache before leaving _inflight.
                if digest in self.cache or self._in_origin(digest):
                    return None
                flight = self._inflight[digest] = _Flight(layer, index)
                new = True
            else:
                new = False
            run = foreground and not flight.claimed
        if new or run:
            (self._fg if foreground else self._bg).submit(self._run, flight)
        return flight

    def _in_origin(self, digest: str) -> bool:
        return self._origin is not None and (self._origin / digest_hex(digest)).is_file()

    def _run(self, flight: _Flight) -> None:
        with self._lock:
            if flight.claimed:
                return
            flight.claimed = True
        digest = flight.layer.record.chunks[flight.index]
        try:
            data = self._fetch(flight.layer, flight.index)
        except BaseException as e:
            with self._lock:
                self._inflight.pop(digest, None)
                if isinstance(e, SandfleetError):
                    self._failed[digest] = (time.monotonic() + self.deadline_s, e)
            with contextlib.suppress(InvalidStateError):  # failed by close()
                flight.future.set_exception(e)
            return
        try:
            self.cache.put(digest, data)
        except OSError as e:
            self._event(flight.layer, flight.index, "", f"caching chunk {digest}: {e}")
        with self._lock:
            self._inflight.pop(digest, None)
            self._failed.pop(digest, None)
        with contextlib.suppress(InvalidStateError):
            flight.future.set_result(data)

    def _fetch(self, layer: Layer, index: int) -> bytes:
        """Try each remote in turn, in rounds with backoff, until the deadline."""
        digest = layer.record.chunks[index]
        what = f"chunk {index} ({digest}) of layer {layer.digest}"
        if not self.remotes:
            msg = f"{what} is neither in the origin nor in the cache, and no remote store is set"
            self._event(layer, index, "", msg)
            raise NotFound(msg)
        deadline = time.monotonic() + self.deadline_s
        key = chunk_key(digest)
        backoff = _BACKOFF_S
        attempts = 0
        while True:
            retryable: list[str] = []
            missing: list[str] = []
            corrupt: list[str] = []
            all_down = True
            for store in self.remotes:
                attempts += 1
                try:
                    data = check_digest(store.get(key), digest, f"{what} from {store.url}")
                except NotFound as e:
                    missing.append(e.message)
                    continue
                except DataLoss as e:
                    self._event(layer, index, store.url, e.message)
                    corrupt.append(e.message)
                    continue
                except (SandfleetError, OSError) as e:
                    retryable.append(f"{store.url}: {e}")
                    with self._lock:
                        all_down &= self._down.get(store.url, 0.0) > time.monotonic()
                    continue
                with self._lock:
                    self._down.pop(store.url, None)
                self._count(remote_chunks=1, remote_bytes=len(data))
                return data
            left = deadline - time.monotonic()
            if not retryable or left <= backoff or all_down:
                break
            time.sleep(backoff)
            backoff = min(backoff * 2, _BACKOFF_MAX_S)
        reasons = "; ".join(corrupt + missing + retryable)
        if retryable:
            with self._lock:  # the next fetches try these once, without waiting
                until = time.monotonic() + self.deadline_s
                for store in self.remotes:
                    if any(r.startswith(f"{store.url}: ") for r in retryable):
                        self._down[store.url] = until
            msg = f"{what}: gave up after {attempts} attempts in {self.deadline_s:g} s: {reasons}"
            self._event(layer, index, "", msg)
            raise Unavailable(msg)
        msg = f"{what}: no remote store has a good copy: {reasons}"
        self._event(layer, index, "", msg)
        if corrupt:
            raise DataLoss(msg)
        raise NotFound(msg)

    # -- background --------------------------------------------------------------------

    def _read_ahead(self, layer: Layer, index: int) -> None:
        # Only on a sequential run (the chunks before were read too), and as far
        # ahead as the run is long (up to ``readahead``), as the kernel ramps its
        # own: sandboxes read a few percent of an image, scattered, and a fixed
        # window after every first read would fetch several times that.
        with self._lock:
            _, seen = self._access.get(layer.digest, ([], set()))
            run = 0
            while run < self.readahead and index - run - 1 in seen:
                run += 1
        last = min(index + run, len(layer.record.chunks) - 1)
        for i in range(index + 1, last + 1):
            self._background(layer, i)

    def _background(self, layer: Layer, index: int) -> int:
        """Start a background fetch of chunk ``index`` unless it is local or on its way."""
        digest = layer.record.chunks[index]
        with self._lock:
            if self._closed or digest in self._inflight:
                return 0
        try:
            flight = self._flight(layer, index, foreground=False)
        except Unavailable:
            return 0
        if flight is None:
            return 0
        self._count(background_queued=1)
        return 1

    # -- bookkeeping -------------------------------------------------------------------

    def _note_access(self, layer_digest: str, index: int) -> bool:
        """Record a read of chunk ``index``; True when it is the layer's first read of it."""
        with self._lock:
            order, seen = self._access.setdefault(layer_digest, ([], set()))
            if index in seen:
                return False
            seen.add(index)
            order.append(index)
            return True

    def access(self, layer_digest: str) -> list[int]:
        """Chunk indexes of the layer in the order they were first read (read-ahead excluded)."""
        with self._lock:
            entry = self._access.get(layer_digest)
            return list(entry[0]) if entry else []

    def _event(self, layer: Layer, index: int, store: str, message: str) -> None:
        with self._lock:
            self._seq += 1
            self._counters["errors"] += 1
            self._events.append(Event(self._seq, time.time(), layer.digest, index, store, message))

    def events(self, since: int = 0) -> tuple[list[Event], int]:
        """Failures with ``seq > since`` still in the ring, and the cursor for the next call."""
        with self._lock:
            return [e for e in self._events if e.seq > since], self._seq

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._counters[name] += delta

    def stats(self) -> dict[str, int]:
        """Counters since start: ``reads``/``read_bytes`` (reader requests), ``hits_origin``,
        ``hits_cache``, ``hits_remote`` (chunk pieces served per source), ``remote_chunks``/
        ``remote_bytes`` (fetched from remotes, background included), ``background_queued``,
        ``errors``, and ``inflight`` now."""
        with self._lock:
            return {**self._counters, "inflight": len(self._inflight)}

    def close(self) -> None:
        """Stop the pools; queued background fetches are dropped, running ones finish."""
        with self._lock:
            self._closed = True
            pending = list(self._inflight.values())
        self._bg.shutdown(wait=False, cancel_futures=True)
        self._fg.shutdown(wait=False, cancel_futures=True)
        for flight in pending:  # fail the readers of fetches that will never run
            with contextlib.suppress(Exception):
                flight.future.set_exception(Unavailable("the fetcher is shut down"))
        with contextlib.suppress(Exception):
            for store in self.remotes:
                store.close()
