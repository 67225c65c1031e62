"""The node's image layers: local metadata, data on demand, prefetch and fetch events.

A sandbox's layers are mounted from two parts (see :mod:`sandfleet.blobstore.records`):
the EROFS metadata image, which must be in the node's image store before the
mount (pulled from the remote stores at create if the image is not there), and
the data blob, a file of the on-demand FUSE filesystem
(:mod:`sandfleet.ondemand`) that fetches chunks when they are first read.

Prefetch: the first time a layer starts on a node that has no access list for
it, the chunks read until the sandbox's first exec ended are saved as the
layer's access list (in the local store, and pushed with the image). Later,
whenever a layer with an access list is mounted, its chunks are fetched ahead
in the background.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sandfleet.backends.base import LayerSource
from sandfleet.blobstore import AccessList, BlobStore, open_store
from sandfleet.blobstore import keys as K
from sandfleet.images.build import StackLayer, stack_for
from sandfleet.images.refs import parse_ref
from sandfleet.images.store import ImageStore
from sandfleet.ondemand.client import OnDemand, OnDemandConfig
from sandfleet.ondemand.fetcher import DEFAULT_DEADLINE_S
from sandfleet.wire.errors import (
    DeadlineExceeded,
    InvalidArgument,
    NotFound,
    SandfleetError,
    Unavailable,
)
from sandfleet.wire.models import ImageConfig

__all__ = ["METADATA_DEADLINE_S", "NodeImages"]

log = logging.getLogger("sandfleet.node.images")

#: Seconds a create may spend pulling an image's metadata from the remote stores.
METADATA_DEADLINE_S = 60.0
#: Seconds a pulled tag is trusted before the node asks its blob stores whether it moved
#: (environment: SANDFLEET_MANIFEST_TTL_S).
MANIFEST_TTL_S = 30.0
#: Environment variable: seconds a chunk may take from the blob stores before
#: its read fails with EIO (default: the daemon's).
ENV_FETCH_DEADLINE = "SANDFLEET_FETCH_DEADLINE_S"
#: Default bound of the node's chunk cache, bytes.
DEFAULT_CACHE_BYTES = 20 << 30


class NodeImages:
    """Layers for the sandboxes of one node.

    ``remotes``: URLs of blob stores to pull images and fetch chunks from, in
    order (the local store is always asked first). ``cache_bytes`` bounds the
    chunk cache under ``state_dir/chunk-cache``.
    """

    def __init__(
        self,
        images_dir: Path,
        state_dir: Path,
        *,
        remotes: Sequence[str] = (),
        cache_bytes: int = DEFAULT_CACHE_BYTES,
    ) -> None:
        self.store = ImageStore(images_dir)
        self.remotes: list[BlobStore] = [open_store(url) for url in remotes]
        deadline = _env_seconds(ENV_FETCH_DEADLINE, DEFAULT_DEADLINE_S)
        self.ondemand = OnDemand(
            state_dir / "ondemand",
            OnDemandConfig(
                store_root=images_dir,
                cache_dir=state_dir / "chunk-cache",
                cache_bytes=cache_bytes,
                remotes=tuple(remotes),
                deadline_s=deadline,
            ),
        )
        self._prefetched: set[str] = set()
        self._recorded: set[str] = set()
        self._pull_lock = asyncio.Lock()
        self._node_events: list[dict[str, Any]] = []
        self._checked: dict[str, float] = {}
        self.manifest_ttl_s = _env_seconds("SANDFLEET_MANIFEST_TTL_S", MANIFEST_TTL_S, zero=True)

    async def start(self) -> None:
        """Adopt the on-demand daemon a previous node agent left, or start one.

        Raises FailedPrecondition (with the daemon's log) when FUSE cannot be mounted.
        """
        await asyncio.to_thread(self.ondemand.adopt)

    async def close(self, stop_daemon: bool) -> None:
        """Stop the daemon when asked and no layer mount uses it any more."""
        if stop_daemon:
            try:
                await asyncio.to_thread(self.ondemand.stop)
            except SandfleetError as e:  # layers still mounted (boxes kept running)
                log.info("on-demand daemon left running: %s", e)
        for remote in self.remotes:
            remote.close()

    # ------------------------------------------------------------------ stacks

    async def stack(
        self, image: str, workspace: str | None
    ) -> tuple[list[LayerSource], ImageConfig]:
        """The layers to mount for ``image`` (+ ``workspace``), bottom first, and the config.

        An image missing here is pulled (metadata only) from the remote
        stores first. Raises NotFound (no store has it), Unavailable (no
        store answered), DeadlineExceeded (pulling took longer than
        :data:`METADATA_DEADLINE_S`) and what :func:`stack_for` raises.
        """
        await self._check_daemon()
        refs = [image] + ([workspace] if workspace else [])
        if self.remotes:
            await self._refresh(refs)
        try:
            stack, config = stack_for(self.store, image, workspace)
        except NotFound:
            if not self.remotes:
                raise
            await self._pull(refs)
            stack, config = stack_for(self.store, image, workspace)
        todo = [x for x in stack if x.digest not in self._prefetched and x.record.blob_size]
        if todo:  # in the background: access lists may come from a remote store
            self._prefetched.update(x.digest for x in todo)
            asyncio.get_running_loop().run_in_executor(None, self._prefetch, todo)
        return [self.source(layer) for layer in stack], config

    async def _check_daemon(self) -> None:
        """Start the on-demand daemon again if it died.

        Layers mounted over the dead one fail their reads (EIO, or SIGBUS for
        mapped files): that is an event of every sandbox, and new sandboxes get
        fresh mounts (the backend keys mounts by the data file's device).
        """
        # Not a stat of the mount: the kernel answers that from its attribute cache.
        if self.ondemand.running():
            return
        died = time.time()
        msg = (
            "the node's on-demand daemon died: data of layers mounted before"
            f" {time.strftime('%H:%M:%S', time.gmtime(died))} UTC is unreadable in running"
            " sandboxes (EIO/SIGBUS); it was started again for new ones"
        )
        log.error(msg)
        self._node_events.append({"time": died, "layer": None, "message": msg})
        self._prefetched.clear()
        async with self._pull_lock:
            await asyncio.to_thread(self.ondemand.adopt)

    def source(self, layer: StackLayer) -> LayerSource:
        data = self.ondemand.blob_path(layer.digest) if layer.record.blob_size else None
        return LayerSource(meta=layer.meta, data=data, digest=layer.digest)

    async def _refresh(self, refs: list[str]) -> None:
        """Pull again a pulled tag that moved in the first remote holding it (checked at
        most every ``manifest_ttl_s`` per tag; an unreachable store keeps ours)."""
        from sandfleet.blobstore.transfer import pull

        now = time.monotonic()
        for ref in refs:
            last = self._checked.get(ref)
            if last is not None and now - last < self.manifest_ttl_s:
                continue
            self._checked[ref] = now
            try:
                name, tag = parse_ref(ref)
                key = K.manifest_key(name, tag)
                ours = self.store.blobs.get(key)
            except SandfleetError:
                continue  # not here yet: pulled below if needed
            for remote in self.remotes:
                try:
                    theirs = await asyncio.wait_for(asyncio.to_thread(remote.get, key), 10.0)
                except (SandfleetError, TimeoutError):
                    continue
                if theirs != ours:
                    log.info("%s moved in %s: pulling it again", ref, remote.url)
                    async with self._pull_lock:
                        await asyncio.wait_for(
                            asyncio.to_thread(pull, remote, self.store.blobs, ref),
                            METADATA_DEADLINE_S,
                        )
                break

    async def _pull(self, refs: list[str]) -> None:
        from sandfleet.blobstore.transfer import pull

        async with self._pull_lock:
            for ref in refs:
                if self.store.has_image(ref, data=False):
                    continue
                errors: list[SandfleetError] = []
                t0 = time.monotonic()
                for remote in self.remotes:
                    left = METADATA_DEADLINE_S - (time.monotonic() - t0)
                    try:
                        await asyncio.wait_for(
                            asyncio.to_thread(pull, remote, self.store.blobs, ref), left
                        )
                        break
                    except TimeoutError:
                        raise DeadlineExceeded(
                            f"pulling the metadata of {ref} from {remote.url} took over"
                            f" {METADATA_DEADLINE_S:.0f} s: check the blob store"
                        ) from None
                    except (NotFound, Unavailable) as e:
                        errors.append(e)
                else:
                    missing = all(isinstance(e, NotFound) for e in errors)
                    cls = NotFound if missing else Unavailable
                    raise cls(f"cannot pull image {ref}: " + "; ".join(map(str, errors)))

    # ------------------------------------------------------------------ prefetch

    def _prefetch(self, stack: list[StackLayer]) -> None:
        for layer in stack:
            try:
                access = self._access_list(layer.digest)
                if access is not None:
                    self.ondemand.prefetch(layer.digest, access.chunks)
            except Exception as e:  # a hint only: never fails a create
                log.warning("prefetch of %s failed: %s", layer.digest, e)

    def _access_list(self, digest: str) -> AccessList | None:
        try:
            data = self.store.blobs.get(K.access_key(digest))
        except NotFound:
            for remote in self.remotes:
                with contextlib.suppress(SandfleetError):
                    data = remote.get(K.access_key(digest))
                    self.store.blobs.put(K.access_key(digest), data)
                    break
            else:
                return None
        try:
            return AccessList.model_validate_json(data)
        except ValueError:
            return None

    async def record_access(self, layers: Sequence[LayerSource]) -> None:
        """Save the access list of each layer that has none yet (called after a
        sandbox's first exec ended: what was read until then is its start-up)."""
        for layer in layers:
            if layer.data is None or not layer.digest or layer.digest in self._recorded:
                continue
            self._recorded.add(layer.digest)
            key = K.access_key(layer.digest)
            if self.store.blobs.exists(key):
                continue
            try:
                chunks = await asyncio.to_thread(self.ondemand.access, layer.digest)
            except SandfleetError as e:
                log.warning("no access list for %s: %s", layer.digest, e)
                continue
            if chunks:
                doc = AccessList(layer=layer.digest, chunks=chunks).model_dump_json().encode()
                await asyncio.to_thread(self._save_access, key, doc)

    def _save_access(self, key: str, doc: bytes) -> None:
        """Keep the access list here and offer it to the first remote that takes writes,
        so that other nodes prefetch too (best effort: a read-only store is fine)."""
        self.store.blobs.put(key, doc)
        for remote in self.remotes:
            try:
                if not remote.exists(key):
                    remote.put(key, doc)
                return
            except SandfleetError as e:
                log.info("access list %s not shared through %s: %s", key, remote.url, e)

    # ------------------------------------------------------------------ observability

    async def events(self, digests: Sequence[str], since: float) -> list[dict[str, Any]]:
        """Fetch errors of the on-demand daemon for these layers after ``since`` (Unix s)."""
        wanted = set(digests)
        try:
            events, _ = await asyncio.to_thread(self.ondemand.events, 0)
        except SandfleetError:
            events = []
        found = [e for e in events if e.get("layer") in wanted] + self._node_events
        return sorted((e for e in found if e.get("time", 0) >= since), key=lambda e: e["time"])

    async def stats(self) -> dict[str, Any]:
        return await asyncio.to_thread(self.ondemand.stats)


def _env_seconds(name: str, default: float, *, zero: bool = False) -> float:
    """Seconds from the environment variable ``name``; InvalidArgument if not a number
    above 0 (or 0 itself, with ``zero``)."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not (value > 0 or (zero and value == 0)):
        least = "0 or more" if zero else "above 0"
        raise InvalidArgument(f"{name}={raw!r} is not a number of seconds {least} (e.g. 30)")
    return value
