"""The blob store interface: named objects behind a URL, shared by every node.

A blob store holds what images are made of, under the keys of
:mod:`sandfleet.blobstore.keys`: image manifests, layer records, EROFS
metadata images, content-addressed data chunks and prefetch access lists.
Backends: :class:`~sandfleet.blobstore.file.FileBlobStore` (``file://``, a
directory: locally, or a mount of a distributed file system shared by all
nodes) and :class:`~sandfleet.blobstore.http.HttpBlobStore` (``http(s)://``,
reads from any static server; writes where the server takes WebDAV PUT and
DELETE).

Every method is blocking and thread-safe; callers on an event loop use a
thread. Errors are sandfleet's own: :class:`NotFound` for a missing key,
:class:`Unavailable` (retryable) for an unreachable, slow or failing store,
:class:`PermissionDenied` for a store that refuses writes, and
:class:`InvalidArgument` for a malformed key.
"""

from __future__ import annotations

import abc
import re
from dataclasses import dataclass

from sandfleet.wire.errors import InvalidArgument

__all__ = ["DEFAULT_TIMEOUT_S", "BlobStore", "ObjectInfo", "check_key"]

#: Seconds one request to a store may take before it counts as failed.
DEFAULT_TIMEOUT_S = 10.0

_KEY_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)*")


@dataclass(frozen=True)
class ObjectInfo:
    """One stored object: its key, size in bytes and modification time (Unix seconds)."""

    key: str
    size: int
    mtime: float


def check_key(key: str) -> str:
    """Return ``key`` if it is a relative path of safe segments; else :class:`InvalidArgument`."""
    if not isinstance(key, str) or not _KEY_RE.fullmatch(key) or ".." in key.split("/"):
        raise InvalidArgument(
            f"invalid blob store key {key!r}: '/'-separated segments of letters, digits and"
            " '._-', none starting with '.' (e.g. 'chunks/sha256/<hex>')"
        )
    return key


class BlobStore(abc.ABC):
    """Objects by key. Subclasses implement the six methods below."""

    #: The store's URL (``file:///...``, ``http://...``), as given.
    url: str

    @abc.abstractmethod
    def get(self, key: str) -> bytes:
        """The whole object. Raises NotFound, Unavailable."""

    @abc.abstractmethod
    def put(self, key: str, data: bytes) -> None:
        """Store ``data`` under ``key`` atomically (readers see all or nothing), replacing
        any previous object. Raises Unavailable, PermissionDenied."""

    @abc.abstractmethod
    def exists(self, key: str) -> bool:
        """Whether ``key`` is stored. Raises Unavailable."""

    @abc.abstractmethod
    def list(self, prefix: str) -> list[ObjectInfo]:
        """Every object whose key starts with ``prefix`` (a folder such as ``'chunks/'``),
        in no particular order. Raises Unavailable."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Remove ``key``; a missing key is not an error. Raises Unavailable,
        PermissionDenied."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections; the store may not be used afterwards."""

    def __enter__(self) -> BlobStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"
