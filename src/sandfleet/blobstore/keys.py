"""Where each kind of object lives in a blob store, and digests.

Layout (the same in a local image store and in any shared store)::

    manifests/<name>/<tag>.json      ImageManifest: a named stack of layers
    layers/sha256/<hex>.json         LayerRecord; <hex> is the sha256 of these bytes
    metas/sha256/<hex>               EROFS metadata image of a layer
    chunks/sha256/<hex>              one chunk of a layer's data blob
    access/sha256/<layer hex>.json   AccessList: chunks read while the layer started
"""

from __future__ import annotations

import hashlib
import re

from sandfleet.wire.errors import DataLoss, InvalidArgument

__all__ = [
    "access_key",
    "check_digest",
    "chunk_key",
    "digest_hex",
    "layer_key",
    "manifest_key",
    "meta_key",
    "sha256_digest",
]

_DIGEST_RE = re.compile(r"sha256:([0-9a-f]{64})")


def digest_hex(digest: str) -> str:
    """The 64 hex digits of ``'sha256:<hex>'``; :class:`InvalidArgument` if malformed."""
    m = _DIGEST_RE.fullmatch(digest) if isinstance(digest, str) else None
    if not m:
        raise InvalidArgument(f"invalid digest {digest!r}: expected 'sha256:<64 hex>'")
    return m.group(1)


def sha256_digest(data: bytes) -> str:
    """``'sha256:<hex>'`` of ``data``."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


def check_digest(data: bytes, digest: str, what: str) -> bytes:
    """Return ``data`` if its sha256 is ``digest``; else raise :class:`DataLoss` naming ``what``."""
    got = sha256_digest(data)
    if got != digest:
        raise DataLoss(f"{what}: content has digest {got}, expected {digest} (corrupt store?)")
    return data


def chunk_key(digest: str) -> str:
    return f"chunks/sha256/{digest_hex(digest)}"


def meta_key(digest: str) -> str:
    return f"metas/sha256/{digest_hex(digest)}"


def layer_key(digest: str) -> str:
    return f"layers/sha256/{digest_hex(digest)}.json"


def access_key(layer_digest: str) -> str:
    return f"access/sha256/{digest_hex(layer_digest)}.json"


def manifest_key(name: str, tag: str) -> str:
    from sandfleet.images.refs import validate_name, validate_tag

    return f"manifests/{validate_name(name)}/{validate_tag(tag)}.json"
