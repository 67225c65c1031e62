"""The error family as ``sandfleet.errors`` (defined in :mod:`sandfleet.wire.errors`)."""

from sandfleet.wire.errors import *  # noqa: F403
from sandfleet.wire.errors import __all__ as __all__
