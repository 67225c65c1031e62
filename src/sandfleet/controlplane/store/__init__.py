"""The control plane's state store: an interface and its SQLite default."""

from sandfleet.controlplane.store.base import Store
from sandfleet.controlplane.store.sql import SqlStore

__all__ = ["SqlStore", "Store"]
