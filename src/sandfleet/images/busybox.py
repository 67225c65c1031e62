"""A tiny image of busybox-static and its applets: a second to build, for tests and benchmarks."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

from sandfleet.images.build import Log, build_from_directory, stderr_log
from sandfleet.images.store import ImageStore
from sandfleet.wire.errors import FailedPrecondition
from sandfleet.wire.models import ImageManifest

__all__ = ["build_busybox", "busybox_tree"]

_DIRS = ("bin", "sbin", "usr/bin", "usr/sbin", "tmp", "root", "etc", "proc", "sys", "dev")


def busybox_tree(root: Path) -> None:
    """Fill ``root`` with busybox, a symlink per applet, root's and nobody's passwd entries.

    Raises FailedPrecondition when busybox is not installed (Debian: busybox-static).
    """
    busybox = shutil.which("busybox")
    if busybox is None:
        raise FailedPrecondition("busybox is needed: apt-get install busybox-static")
    for d in _DIRS:
        (root / d).mkdir(parents=True, exist_ok=True)
    shutil.copy(busybox, root / "bin" / "busybox")
    listed = subprocess.run([busybox, "--list"], capture_output=True, text=True, check=True)
    for applet in listed.stdout.split():
        link = root / "bin" / applet
        if not link.exists():
            link.symlink_to("busybox")
    (root / "etc" / "passwd").write_text(
        "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534::/:/bin/false\n"
    )
    (root / "etc" / "group").write_text("root:x:0:\nnogroup:x:65534:\n")
    (root / "tmp").chmod(0o1777)


def build_busybox(store: ImageStore, ref: str, log: Log = stderr_log) -> ImageManifest:
    """Build the busybox image ``ref`` (name:tag) into ``store``; see :func:`busybox_tree`."""
    store.tmp_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=store.tmp_dir) as tmp:
        busybox_tree(Path(tmp))
        return build_from_directory(store, ref, Path(tmp), log=log)
