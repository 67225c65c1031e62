"""Layers' data blobs on demand: a FUSE daemon that fetches chunks as they are read.

Each layer's data blob appears as ``<mount>/<layer hex>``; the kernel mounts a
layer's EROFS metadata image with ``device=<that file>``. Chunks come from the
local store (layers built here), the node's chunk cache, or remote blob
stores. :class:`OnDemand` starts and talks to the daemon; the daemon itself
is ``python -m sandfleet.ondemand`` (importing this package does not load libfuse).
"""

from .cache import CacheStats, ChunkCache
from .client import OnDemand, OnDemandConfig
from .fetcher import DEFAULT_DEADLINE_S, DEFAULT_READAHEAD, Event, Fetcher, Layer

__all__ = [
    "DEFAULT_DEADLINE_S",
    "DEFAULT_READAHEAD",
    "CacheStats",
    "ChunkCache",
    "Event",
    "Fetcher",
    "Layer",
    "OnDemand",
    "OnDemandConfig",
]
