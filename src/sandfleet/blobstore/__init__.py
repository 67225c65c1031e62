"""Blob stores: where layers' chunks, metadata and manifests are shared between nodes."""

from __future__ import annotations

from urllib.parse import unquote, urlparse

from sandfleet.wire.errors import InvalidArgument

from .base import DEFAULT_TIMEOUT_S, BlobStore, ObjectInfo
from .file import FileBlobStore
from .records import DEFAULT_CHUNK_SIZE, AccessList, LayerRecord, ObjectRef

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "DEFAULT_TIMEOUT_S",
    "AccessList",
    "BlobStore",
    "FileBlobStore",
    "LayerRecord",
    "ObjectInfo",
    "ObjectRef",
    "open_store",
]


def open_store(url: str, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> BlobStore:
    """The blob store at ``url``: ``file:///abs/dir``, a plain absolute path, or ``http(s)://``.

    ``timeout_s`` bounds each request to a remote store, in seconds.
    Raises :class:`InvalidArgument` for any other URL.
    """
    parsed = urlparse(url)
    if parsed.scheme == "file" and parsed.netloc in ("", "localhost"):
        return FileBlobStore(unquote(parsed.path))
    if parsed.scheme == "" and url.startswith("/"):
        return FileBlobStore(url)
    if parsed.scheme in ("http", "https") and parsed.netloc:
        from .http import HttpBlobStore

        return HttpBlobStore(url, timeout_s=timeout_s)
    raise InvalidArgument(
        f"unsupported blob store URL {url!r}: use file:///absolute/dir or http(s)://host/path"
    )
