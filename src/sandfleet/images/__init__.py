"""Images: versioned EROFS layers in a content-addressed store, and their builders.

An image is a manifest naming an ordered stack of layers (bottom first); each
layer is an uncompressed, reproducible EROFS image split into metadata and a
data blob cut into content-addressed chunks (:mod:`sandfleet.blobstore`).
Builders turn a source (debootstrap, a directory, an sdist, a PyPI
requirement, a git repository) into one layer and tag it; :func:`import_image`
turns an OCI image layout or a ``docker save`` archive into a stack of layers;
:func:`stack_for` gives the node agent the layers to mount and the merged exec
config.
"""

from __future__ import annotations

from .build import build_from_directory, stack_for
from .busybox import build_busybox, busybox_tree
from .debootstrap import build_debootstrap
from .erofs import pack_erofs
from .mirror import ENV_MIRROR, resolve_mirror
from .oci import import_image
from .refs import parse_ref
from .store import ImageStore
from .workspace import build_workspace, classify_source

__all__ = [
    "ENV_MIRROR",
    "ImageStore",
    "build_busybox",
    "build_debootstrap",
    "build_from_directory",
    "build_workspace",
    "busybox_tree",
    "classify_source",
    "import_image",
    "pack_erofs",
    "parse_ref",
    "resolve_mirror",
    "stack_for",
]
