"""The local image store: split EROFS layers, their chunks, and named manifests.

The store's directory has the blob store layout of
:mod:`sandfleet.blobstore.keys` (it *is* a ``file://`` blob store), so pushing
and pulling images are copies between stores::

    manifests/<name>/<tag>.json     an ImageManifest (name may contain '/')
    layers/sha256/<hex>.json        a LayerRecord: the layer's digest is its sha256
    metas/sha256/<hex>              a layer's EROFS metadata image
    chunks/sha256/<hex>             data chunks of layers built (or pulled with data) here
    access/sha256/<hex>.json        chunks read while the layer started (prefetch hints)
    tmp/                            scratch space for writes and builds

Every write goes to ``tmp/`` first and is renamed into place, so readers never
see a partial file and several processes can share one store. Layers are
immutable; tags move (``put`` replaces a tag's manifest).
"""

from __future__ import annotations

import builtins
import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import ValidationError

from sandfleet.blobstore import DEFAULT_CHUNK_SIZE, FileBlobStore, LayerRecord, ObjectRef
from sandfleet.blobstore import keys as K
from sandfleet.node import mounts
from sandfleet.wire.errors import (
    AlreadyExists,
    DataLoss,
    Internal,
    InvalidArgument,
    NotFound,
    SandfleetError,
)
from sandfleet.wire.models import ImageManifest, LayerDescriptor, LayerKind

from .refs import format_ref, parse_ref

if TYPE_CHECKING:
    from sandfleet.blobstore.transfer import GcStats

__all__ = ["ImageStore"]

_LAYER_KINDS = ("base", "toolkit", "workspace", "diff")


#: Largest chunk, bytes: each is one request and one cache entry.
MAX_CHUNK_SIZE = 64 << 20
#: Environment variable: bytes per data chunk of the layers this store packs.
ENV_CHUNK_SIZE = "SANDFLEET_CHUNK_SIZE"


class ImageStore:
    """Images on local disk under ``root`` (created on first use).

    ``chunk_size``: bytes per data chunk of layers built into it (default:
    ``SANDFLEET_CHUNK_SIZE``, else :data:`DEFAULT_CHUNK_SIZE`, 1 MiB).
    """

    def __init__(self, root: Path, chunk_size: int | None = None) -> None:
        self.root = Path(root)
        if chunk_size is None:
            raw = os.environ.get(ENV_CHUNK_SIZE) or str(DEFAULT_CHUNK_SIZE)
            chunk_size = int(raw) if raw.isdigit() else -1
        else:
            raw = str(chunk_size)
        if chunk_size <= 0 or chunk_size % 4096 or chunk_size > MAX_CHUNK_SIZE:
            raise InvalidArgument(
                f"invalid chunk size {raw!r} (argument or {ENV_CHUNK_SIZE}): a multiple of"
                f" 4096 bytes up to {MAX_CHUNK_SIZE >> 20} MiB, e.g. 1048576"
            )
        self.chunk_size = chunk_size
        self.blobs = FileBlobStore(self.root)
        self.manifests_dir = self.root / "manifests"
        self.tmp_dir = self.root / "tmp"
        for d in (self.manifests_dir, self.tmp_dir):
            d.mkdir(parents=True, exist_ok=True)

    def __repr__(self) -> str:
        return f"ImageStore({str(self.root)!r})"

    # ------------------------------------------------------------------ layers

    def add_layer(
        self,
        meta_file: Path,
        blob_file: Path,
        kind: LayerKind,
        *,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
    ) -> LayerDescriptor:
        """Store a split layer (see :func:`pack_erofs` with ``blob_file``) and describe it.

        The data blob is cut into ``chunk_size``-byte chunks (a multiple of
        4096), each stored once under its sha256 (chunks already present,
        from any layer, are not written again); the metadata image and the
        :class:`LayerRecord` are stored under theirs. Both files are consumed
        (deleted). The descriptor's ``digest`` is the record's and ``size``
        is metadata plus data, in bytes.

        Raises :class:`NotFound` if a file does not exist and
        :class:`InvalidArgument` for an unknown ``kind`` or a bad ``chunk_size``.
        """
        if kind not in _LAYER_KINDS:
            raise InvalidArgument(f"invalid layer kind {kind!r}: one of {', '.join(_LAYER_KINDS)}")
        if chunk_size <= 0 or chunk_size % 4096:
            raise InvalidArgument(
                f"invalid chunk size {chunk_size}: a positive multiple of 4096 bytes (e.g. 1048576)"
            )
        for f in (meta_file, blob_file):
            if not Path(f).is_file():
                raise NotFound(f"layer file {f} does not exist")
        try:
            chunks = []
            blob_size = 0
            with open(blob_file, "rb") as fh:
                while data := fh.read(chunk_size):
                    digest = K.sha256_digest(data)
                    key = K.chunk_key(digest)
                    if self.blobs.exists(key):
                        os.utime(self.blobs.path(key))  # fresh mtime keeps a concurrent gc away
                    else:
                        self.blobs.put(key, data)
                    chunks.append(digest)
                    blob_size += len(data)
            meta = Path(meta_file).read_bytes()
            meta_ref = ObjectRef(digest=K.sha256_digest(meta), size=len(meta))
            self._put_once(K.meta_key(meta_ref.digest), meta)
            record = LayerRecord(
                meta=meta_ref, blob_size=blob_size, chunk_size=chunk_size, chunks=chunks
            )
            digest = record.digest()
            self._put_once(K.layer_key(digest), record.to_bytes())
        finally:
            Path(meta_file).unlink(missing_ok=True)
            Path(blob_file).unlink(missing_ok=True)
        return LayerDescriptor(digest=digest, size=record.size, kind=kind)

    def _put_once(self, key: str, data: bytes) -> None:
        if self.blobs.exists(key):
            os.utime(self.blobs.path(key))
        else:
            self.blobs.put(key, data)

    def layer_record(self, digest: str) -> LayerRecord:
        """The record of layer ``digest``, checked against it.

        Raises :class:`InvalidArgument` for a malformed digest, :class:`NotFound`
        if the layer is not in this store and :class:`DataLoss` if its record is corrupt.
        """
        return LayerRecord.read(self.blobs, digest)

    def meta_path(self, record: LayerRecord) -> Path:
        """The local file of the layer's EROFS metadata image (it may be missing)."""
        return self.blobs.path(K.meta_key(record.meta.digest))

    def has_image(self, ref: str, *, data: bool = True) -> bool:
        """Whether ``ref`` is here with every layer's record and metadata (and, with
        ``data``, every chunk): False for an image pulled without data, or stored
        by a sandfleet from before split layers (rebuild it)."""
        try:
            manifest = self.resolve(ref)
            records = [self.layer_record(x.digest) for x in manifest.layers]
        except (NotFound, Internal, InvalidArgument, DataLoss):
            return False
        return all(self.meta_path(r).is_file() and (not data or self.has_data(r)) for r in records)

    def has_data(self, record: LayerRecord) -> bool:
        """Whether every chunk of the layer's data blob is in this store."""
        return all(self.blobs.exists(K.chunk_key(c)) for c in set(record.chunks))

    # ------------------------------------------------------------------ manifests

    def _manifest_path(self, name: str, tag: str) -> Path:
        return self.blobs.path(K.manifest_key(name, tag))

    def put(self, manifest: ImageManifest, *, exclusive: bool = False) -> None:
        """Store ``manifest`` under its ``name:tag``, replacing any previous one atomically.

        With ``exclusive`` an existing ``name:tag`` is never replaced:
        :class:`AlreadyExists` is raised instead (atomic too: of two writers of
        the same tag, exactly one wins).

        Raises :class:`InvalidArgument` for an invalid name or tag and
        :class:`NotFound` if one of its layers is not in the store.
        """
        path = self._manifest_path(manifest.name, manifest.tag)
        for layer in manifest.layers:
            if not self.blobs.exists(K.layer_key(layer.digest)):
                raise NotFound(
                    f"cannot store {manifest.ref}: layer {layer.digest} is not in {self.root}; "
                    "add it with ImageStore.add_layer first"
                )
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix="manifest-", suffix=".tmp", dir=self.tmp_dir)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.write(manifest.model_dump_json(indent=2))
                fh.flush()
                os.fsync(fh.fileno())
            os.chmod(tmp_name, 0o644)
            if not exclusive:
                os.replace(tmp_name, path)
                return
            try:
                os.link(tmp_name, path)  # fails if the tag exists, unlike rename
            except FileExistsError:
                raise AlreadyExists(
                    f"image {manifest.ref} already exists in {self.root}: choose another"
                    " name or tag, or remove it first (`sandfleet image rm`)"
                ) from None
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp_name)

    def resolve(self, ref: str) -> ImageManifest:
        """The manifest for ``'name[:tag]'`` (tag defaults to ``latest``).

        Raises :class:`InvalidArgument` for a malformed reference and
        :class:`NotFound` (listing the images that exist) for an unknown one.
        """
        name, tag = parse_ref(ref)
        path = self._manifest_path(name, tag)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            existing = ", ".join(sorted(m.ref for m in self.list())) or "none"
            raise NotFound(
                f"image {format_ref(name, tag)!r} not found in {self.root} "
                f"(images there: {existing}); build one with `sandfleet image build`"
            ) from None
        return _load(path, text)

    def list(self) -> list[ImageManifest]:
        """Every stored manifest, sorted by ``name:tag``; unreadable files are skipped."""
        found = []
        for path in self.manifests_dir.rglob("*.json"):
            try:
                found.append(_load(path, path.read_text(encoding="utf-8")))
            except (OSError, Internal):
                continue
        return sorted(found, key=lambda m: (m.name, m.tag))

    def remove(self, ref: str) -> ImageManifest:
        """Delete the manifest of ``ref`` and return it; its layers stay until :meth:`prune`.

        Raises :class:`NotFound` if there is no such image.
        """
        manifest = self.resolve(ref)
        self._manifest_path(manifest.name, manifest.tag).unlink(missing_ok=True)
        return manifest

    def gc(self, min_age_s: float = 3600.0) -> GcStats:
        """Delete layers, metadata, chunks and access lists no manifest references and
        that are older than ``min_age_s`` seconds; layers mounted on this host stay.

        The age guard protects objects another process has just added but not
        yet referenced from a manifest (a build or pull in progress). A layer
        whose metadata image is mounted (a running sandbox's, on this host)
        keeps its data too: its sandboxes read it on demand.
        """
        from sandfleet.blobstore.transfer import gc

        return gc(self.blobs, min_age_s=min_age_s, in_use=self._mounted_layers())

    def prune(self, min_age_s: float = 3600.0) -> builtins.list[str]:
        """:meth:`gc`, returning the keys deleted."""
        return self.gc(min_age_s).deleted

    def _mounted_layers(self) -> set[str]:
        """Digests of the layers whose metadata image from this store is mounted here."""
        metas_dir = os.path.realpath(self.root / "metas" / "sha256") + "/"
        mounted = {
            "sha256:" + e.source.removeprefix(metas_dir)
            for e in mounts.mount_table()
            if e.fstype == "erofs" and e.source.startswith(metas_dir)
        }
        if not mounted:
            return set()
        in_use = set()
        for obj in self.blobs.list("layers/sha256/"):
            digest = "sha256:" + obj.key.removeprefix("layers/sha256/").removesuffix(".json")
            with contextlib.suppress(SandfleetError, ValidationError):
                if self.layer_record(digest).meta.digest in mounted:
                    in_use.add(digest)
        return in_use

    # ------------------------------------------------------------------ scratch

    @contextlib.contextmanager
    def scratch(self, prefix: str = "build-") -> Iterator[Path]:
        """A fresh directory under ``tmp/`` (same filesystem as the layers), removed on exit.

        Anything still mounted below it (debootstrap mounts /proc and /sys in
        its target) is unmounted first; if that fails the directory is left
        in place and :class:`Internal` is raised rather than deleting through
        a mount.
        """
        path = Path(tempfile.mkdtemp(prefix=prefix, dir=self.tmp_dir))
        try:
            yield path
        finally:
            remove_tree(path)


def remove_tree(path: Path) -> None:
    """Unmount everything below ``path``, then delete it. Raises :class:`Internal` if busy."""
    for point in mounts.mounts_under(path):
        with contextlib.suppress(OSError):
            mounts.umount(point, mounts.MNT_DETACH)
    left = mounts.mounts_under(path)
    if left:
        raise Internal(f"could not unmount {', '.join(left)}; left {path} in place")
    shutil.rmtree(path, ignore_errors=True)


def _load(path: Path, text: str) -> ImageManifest:
    try:
        return ImageManifest.model_validate_json(text)
    except ValidationError as exc:
        raise Internal(f"corrupt manifest {path}: {exc}") from None
