"""What a layer is made of, as stored: the layer record and its access list.

A layer is an EROFS image split in two (``mkfs.erofs --blobdev``): a small
metadata image (inodes, directories, chunk indexes), fetched whole and kept on
every node that mounts the layer, and a data blob, cut into fixed-size
content-addressed chunks fetched on demand. The record ties them together;
its own sha256 is the layer's digest.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from sandfleet.wire.errors import DataLoss, NotFound

from .keys import check_digest, layer_key, sha256_digest

if TYPE_CHECKING:
    from .base import BlobStore

__all__ = ["DEFAULT_CHUNK_SIZE", "AccessList", "LayerRecord", "ObjectRef"]

#: Bytes per data chunk unless an image is built otherwise (1 MiB: DSec-scale
#: images hold 4-12 GB, so a few thousand objects per layer, each one request).
DEFAULT_CHUNK_SIZE = 1 << 20


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ObjectRef(_Frozen):
    """A content-addressed object: ``digest`` ('sha256:<hex>') and ``size`` in bytes."""

    digest: str
    size: int = Field(ge=0)


class LayerRecord(_Frozen):
    """One layer: its metadata image and its data blob's chunks, in order.

    Chunk ``i`` holds blob bytes ``[i * chunk_size, min((i + 1) * chunk_size,
    blob_size))``; the last one may be shorter. Identical chunks have one
    digest, so a store keeps them once however many layers hold them.
    """

    format: str = "sandfleet.layer.v1"
    meta: ObjectRef
    blob_size: int = Field(ge=0, description="Bytes in the data blob.")
    chunk_size: int = Field(gt=0, description="Bytes per chunk (a multiple of 4096).")
    chunks: list[str] = Field(default_factory=list, description="Chunk digests, in blob order.")

    def to_bytes(self) -> bytes:
        """The stored form; :meth:`digest` is the sha256 of exactly these bytes."""
        return self.model_dump_json().encode()

    def digest(self) -> str:
        return sha256_digest(self.to_bytes())

    @classmethod
    def from_bytes(cls, data: bytes, digest: str | None = None) -> LayerRecord:
        """Parse a stored record; with ``digest``, check it first (DataLoss if it differs).

        Raises pydantic's ValidationError for a malformed record.
        """
        if digest is not None:
            check_digest(data, digest, f"layer record {digest}")
        return cls.model_validate_json(data)

    @classmethod
    def read(cls, store: BlobStore, digest: str) -> LayerRecord:
        """The record of layer ``digest`` in ``store``, checked against the digest.

        Raises :class:`NotFound` (not in the store), :class:`DataLoss` (corrupt or
        malformed), :class:`InvalidArgument` (a malformed digest), Unavailable.
        """
        key = layer_key(digest)
        try:
            data = store.get(key)
        except NotFound:
            raise NotFound(f"layer {digest} is not in the store {store.url}") from None
        try:
            return cls.from_bytes(data, digest)
        except ValidationError as e:
            raise DataLoss(f"{key} in {store.url} is not a valid layer record: {e}") from None

    def chunk_length(self, index: int) -> int:
        """Bytes in chunk ``index`` (the last chunk may be short)."""
        return min(self.chunk_size, self.blob_size - index * self.chunk_size)

    @property
    def size(self) -> int:
        """Bytes of the whole layer: metadata plus data."""
        return self.meta.size + self.blob_size


class AccessList(_Frozen):
    """Chunks of one layer read while a sandbox on it started, in first-read order."""

    layer: str
    chunks: list[int] = Field(default_factory=list, description="Chunk indexes.")
