"""Copying images between blob stores, listing them, and collecting garbage.

An image is its manifest plus what the manifest reaches: per layer, the
layer record, the EROFS metadata image, the data chunks and (optionally) an
access list. :func:`push` and :func:`pull` copy what the destination lacks,
checking every object against its digest as it is read, and write the
manifest last, so a reader of the destination never sees an image whose
objects are missing. :func:`gc` deletes what no manifest reaches.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from pydantic import ValidationError

from sandfleet.images.refs import format_ref, parse_ref
from sandfleet.wire.errors import DataLoss, InvalidArgument, NotFound
from sandfleet.wire.models import ImageManifest

from . import keys as K
from .base import BlobStore
from .records import AccessList, LayerRecord

__all__ = ["GcStats", "TransferStats", "gc", "list_images", "pull", "push"]

Log = Callable[[str], None]

#: What gc may delete: exactly the content-addressed kinds of keys, nothing else in the store.
_COLLECTABLE = ("layers/sha256/", "metas/sha256/", "chunks/sha256/", "access/sha256/")
_COLLECTABLE_RE = re.compile(
    r"(layers|access)/sha256/[0-9a-f]{64}\.json|(metas|chunks)/sha256/[0-9a-f]{64}"
)


@dataclass
class TransferStats:
    """What a push or pull did: objects (and their bytes) copied, and objects the
    destination had already."""

    copied: int = 0
    copied_bytes: int = 0
    present: int = 0

    def _add(self, other: TransferStats) -> None:
        self.copied += other.copied
        self.copied_bytes += other.copied_bytes
        self.present += other.present


@dataclass
class GcStats:
    """What gc did: the keys it deleted and their bytes, and how many objects it kept
    (reachable from a manifest, or younger than the age guard)."""

    deleted: list[str] = field(default_factory=list)
    deleted_bytes: int = 0
    kept: int = 0


def push(
    src: BlobStore, dst: BlobStore, ref: str, *, workers: int = 8, log: Log | None = None
) -> TransferStats:
    """Copy image ``ref`` ('name[:tag]') and everything it is made of from ``src`` to ``dst``.

    Objects ``dst`` has already are not copied again; the manifest is written
    last. Raises :class:`NotFound` (naming the images ``src`` holds) for an
    unknown image, :class:`DataLoss` if an object read from ``src`` does not
    match its digest, and the stores' errors (:class:`Unavailable`,
    :class:`PermissionDenied`, ...).
    """
    return _copy_image(src, dst, ref, chunks=True, workers=workers, log=log)


def pull(
    src: BlobStore,
    dst: BlobStore,
    ref: str,
    *,
    data: bool = False,
    workers: int = 8,
    log: Log | None = None,
) -> TransferStats:
    """Copy image ``ref`` from ``src`` to ``dst``: manifest, layer records, metadata
    images and access lists; the data chunks too only with ``data`` (otherwise a
    node fetches them on demand). Checked and ordered as :func:`push`; same errors.
    """
    return _copy_image(src, dst, ref, chunks=data, workers=workers, log=log)


def list_images(store: BlobStore) -> list[ImageManifest]:
    """Every image in ``store``, sorted by ``name:tag``; unreadable manifests are skipped."""
    found = []
    for key in _manifest_keys(store):
        try:
            found.append(ImageManifest.model_validate_json(store.get(key)))
        except (NotFound, ValidationError):
            continue  # removed meanwhile, or not a manifest this version reads
    return sorted(found, key=lambda m: (m.name, m.tag))


def gc(store: BlobStore, *, min_age_s: float, in_use: Iterable[str] = ()) -> GcStats:
    """Delete the layer records, metadata images, chunks and access lists that no
    manifest reaches and that are older than ``min_age_s`` seconds.

    ``in_use``: digests of layers to keep as if a manifest named them (those
    mounted by running sandboxes).

    The age guard protects a push or build in progress, whose objects land
    before their manifest; a layer record younger than it also keeps what it
    references. Keys outside those four kinds are never touched. Raises
    :class:`DataLoss` (deleting nothing) if a manifest or a referenced layer
    record is corrupt, since what it reaches cannot be known.
    """
    if min_age_s < 0:
        raise InvalidArgument(f"min_age_s must be >= 0, got {min_age_s}")
    now = time.time()
    objects = [o for prefix in _COLLECTABLE for o in store.list(prefix) if _collectable(o.key)]
    roots: set[str] = set()
    for key in _manifest_keys(store):
        try:
            manifest = _parse_manifest(store.get(key), f"manifest {key} in {store.url}")
        except NotFound:
            continue
        roots.update(layer.digest for layer in manifest.layers)
    young = {  # layer records of a push or build not finished yet
        "sha256:" + o.key.removeprefix("layers/sha256/").removesuffix(".json")
        for o in objects
        if o.key.startswith("layers/") and now - o.mtime < min_age_s
    }
    keep: set[str] = set()
    for digest in roots | young | set(in_use):
        keep.update((K.layer_key(digest), K.access_key(digest)))
        try:
            record = LayerRecord.read(store, digest)
        except NotFound:
            continue  # a manifest naming a missing layer reaches nothing more
        except DataLoss:
            if digest in roots:
                raise
            continue  # an unreferenced record: nothing it names is needed
        keep.add(K.meta_key(record.meta.digest))
        keep.update(K.chunk_key(c) for c in record.chunks)
    stats = GcStats()
    for o in objects:
        if o.key in keep or now - o.mtime < min_age_s:
            stats.kept += 1
            continue
        store.delete(o.key)
        stats.deleted.append(o.key)
        stats.deleted_bytes += o.size
    return stats


# --------------------------------------------------------------------------- internals


def _copy_image(
    src: BlobStore, dst: BlobStore, ref: str, *, chunks: bool, workers: int, log: Log | None
) -> TransferStats:
    if workers < 1:
        raise InvalidArgument(f"workers must be >= 1, got {workers}")
    name, tag = parse_ref(ref)
    mkey = K.manifest_key(name, tag)
    try:
        manifest_bytes = src.get(mkey)
    except NotFound:
        refs = sorted(_ref_of(k) for k in _manifest_keys(src))
        there = ", ".join(refs[:20]) + (", ..." if len(refs) > 20 else "") if refs else "none"
        raise NotFound(
            f"image {format_ref(name, tag)} is not in {src.url} (images there: {there})"
        ) from None
    manifest = _parse_manifest(manifest_bytes, f"manifest of {ref} in {src.url}")
    stats = TransferStats()
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="blob-copy")
    try:
        for layer in manifest.layers:
            record = LayerRecord.read(src, layer.digest)
            # The record goes first: a young record keeps its objects from a concurrent gc.
            stats._add(_copy_if_missing(src, dst, K.layer_key(layer.digest), layer.digest))
            objects = [(K.meta_key(record.meta.digest), record.meta.digest)]
            if chunks:
                objects += [(K.chunk_key(c), c) for c in dict.fromkeys(record.chunks)]
            for one in pool.map(lambda o: _copy_if_missing(src, dst, *o), objects):
                stats._add(one)
            stats._add(_copy_access_list(src, dst, layer.digest))
            if log:
                what = f"{len(objects) - 1} chunks" if chunks else "no chunks"
                log(f"layer {layer.digest[:19]}: metadata, {what}")
    finally:  # after a failure, the copies not started yet are dropped
        pool.shutdown(wait=True, cancel_futures=True)
    if _read_or_none(dst, mkey) == manifest_bytes:
        stats.present += 1
    else:
        dst.put(mkey, manifest_bytes)
        stats.copied += 1
        stats.copied_bytes += len(manifest_bytes)
    return stats


def _copy_if_missing(src: BlobStore, dst: BlobStore, key: str, digest: str) -> TransferStats:
    """Copy the content-addressed object ``key`` unless ``dst`` has it; check its digest."""
    if dst.exists(key):
        return TransferStats(present=1)
    data = K.check_digest(src.get(key), digest, f"{key} in {src.url}")
    dst.put(key, data)
    return TransferStats(copied=1, copied_bytes=len(data))


def _copy_access_list(src: BlobStore, dst: BlobStore, layer_digest: str) -> TransferStats:
    """Copy the layer's access list if ``src`` has one and ``dst`` does not."""
    key = K.access_key(layer_digest)
    if dst.exists(key):
        return TransferStats(present=1)
    data = _read_or_none(src, key)
    if data is None:
        return TransferStats()
    try:
        access = AccessList.model_validate_json(data)
    except ValidationError as e:
        raise DataLoss(f"{key} in {src.url} is not a valid access list: {e}") from None
    if access.layer != layer_digest:
        raise DataLoss(f"{key} in {src.url} is the access list of {access.layer}, not its layer")
    dst.put(key, data)
    return TransferStats(copied=1, copied_bytes=len(data))


def _parse_manifest(data: bytes, what: str) -> ImageManifest:
    try:
        return ImageManifest.model_validate_json(data)
    except ValidationError as e:
        raise DataLoss(f"{what} is not a valid image manifest: {e}") from None


def _read_or_none(store: BlobStore, key: str) -> bytes | None:
    try:
        return store.get(key)
    except NotFound:
        return None


def _manifest_keys(store: BlobStore) -> Iterable[str]:
    return [o.key for o in store.list("manifests/") if o.key.endswith(".json")]


def _ref_of(manifest_key: str) -> str:
    """'manifests/a/b/1.json' -> 'a/b:1'."""
    name, _, tag = manifest_key.removeprefix("manifests/").removesuffix(".json").rpartition("/")
    return format_ref(name, tag)


def _collectable(key: str) -> bool:
    """Whether ``key`` is a well-formed content-addressed key gc may delete."""
    return _COLLECTABLE_RE.fullmatch(key) is not None
