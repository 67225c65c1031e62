"""Thin wrappers over mount(2) and umount2(2).

mount(8) is avoided on purpose: for file-backed EROFS it tries a loop device
first (and fails for the split metadata/data form, see DESIGN.md), and a
process per mount costs milliseconds at burst scale.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from pathlib import Path

__all__ = ["MNT_DETACH", "MS_RDONLY", "is_mountpoint", "mount", "mounts_under", "umount"]

MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MNT_DETACH = 0x2

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mount.argtypes = [
    ctypes.c_char_p,
    ctypes.c_char_p,
    ctypes.c_char_p,
    ctypes.c_ulong,
    ctypes.c_char_p,
]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]


def mount(
    source: str | Path, target: str | Path, fstype: str, flags: int = 0, data: str = ""
) -> None:
    """mount(2). Raises ``OSError`` with the kernel's errno and the arguments."""
    rc = _libc.mount(
        os.fsencode(source), os.fsencode(target), fstype.encode(), flags, data.encode() or None
    )
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount -t {fstype} {source} {target} ({data}): {os.strerror(err)}")


def umount(target: str | Path, flags: int = 0) -> None:
    """umount2(2); a target that is not mounted (EINVAL) or gone (ENOENT) is not an error."""
    rc = _libc.umount2(os.fsencode(target), flags)
    if rc != 0:
        err = ctypes.get_errno()
        if err in (22, 2):  # EINVAL: not a mount point; ENOENT: already gone
            return
        raise OSError(err, f"umount {target}: {os.strerror(err)}")


def mounts_under(prefix: str | Path) -> list[str]:
    """Mount points at or below ``prefix``, deepest first (the order to unmount in)."""
    base = os.path.realpath(prefix)
    found: list[str] = []
    with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as fh:
        for line in fh:
            point = line.split()[4].replace("\\040", " ")
            if point == base or point.startswith(base + "/"):
                found.append(point)
    return sorted(set(found), key=len, reverse=True)


def is_mountpoint(path: str | Path) -> bool:
    """True when ``path`` is itself a mount point."""
    return os.path.realpath(path) in mounts_under(path)
