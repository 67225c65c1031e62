"""Split layers of an image store, for tests that mount them without a node.

On a node a layer's data blob is a file of the on-demand FUSE filesystem;
here it is reassembled from the store's chunks into a plain file.
"""

from __future__ import annotations

from pathlib import Path

from sandfleet.backends.base import LayerSource
from sandfleet.blobstore import LayerRecord
from sandfleet.blobstore import keys as K
from sandfleet.images import ImageStore
from sandfleet.node import mounts

__all__ = ["blob_from_chunks", "layer_source", "mount_split", "store_keys"]


def blob_from_chunks(store: ImageStore, record: LayerRecord, out: Path) -> Path:
    """Write the layer's data blob, its chunks concatenated in order, to ``out``."""
    with open(out, "wb") as fh:
        for i, digest in enumerate(record.chunks):
            data = K.check_digest(store.blobs.get(K.chunk_key(digest)), digest, f"chunk {i}")
            assert len(data) == record.chunk_length(i), (i, len(data))
            fh.write(data)
    assert out.stat().st_size == record.blob_size
    return out


def layer_source(store: ImageStore, digest: str, scratch: Path) -> LayerSource:
    """Layer ``digest`` of ``store`` as a backend mounts it (blob reassembled under ``scratch``)."""
    record = store.layer_record(digest)
    blob = blob_from_chunks(store, record, scratch / f"{K.digest_hex(digest)}.blob")
    return LayerSource(meta=store.meta_path(record), data=blob, digest=digest)


def mount_split(meta: Path, blob: Path | None, point: Path) -> None:
    """Mount an EROFS image read-only at ``point``; a split one with its blob as ``device=``."""
    data = f"device={blob}" if blob is not None else ""
    mounts.mount(meta, point, "erofs", mounts.MS_RDONLY, data)


def store_keys(store: ImageStore, prefix: str) -> list[str]:
    """The keys under ``prefix`` ('layers/', 'metas/', 'chunks/', ...) in the store, sorted."""
    return sorted(o.key for o in store.blobs.list(prefix))
