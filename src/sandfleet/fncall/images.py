"""The default fncall image: Debian with the interpreters and compilers of :data:`LANGUAGES`."""

from __future__ import annotations

from pathlib import Path
from typing import TextIO

from sandfleet.wire.models import FNCALL_IMAGE

__all__ = ["FNCALL_PACKAGES", "ensure_fncall_image"]

#: python3 for the worker itself and Python calls; bash for bash calls; gcc/g++ for C/C++.
FNCALL_PACKAGES = ["python3", "bash", "gcc", "g++", "libc6-dev"]


def ensure_fncall_image(images_dir: Path, log: TextIO | None = None) -> str:
    """Build :data:`FNCALL_IMAGE` with debootstrap unless it exists (about 2 minutes, once).

    A line goes to ``log`` when it builds. Returns the image reference. Raises
    what :func:`build_debootstrap` raises (``Unavailable`` when no Debian mirror
    answers).
    """
    from sandfleet.images import ImageStore, build_debootstrap

    store = ImageStore(images_dir)
    if not store.has_image(FNCALL_IMAGE):
        if log is not None:
            print(f"building {FNCALL_IMAGE} with debootstrap (about 2 minutes, once)", file=log)
        build_debootstrap(store, FNCALL_IMAGE, FNCALL_PACKAGES)
    return FNCALL_IMAGE
