"""Thin wrappers over mount(2) and umount2(2).

mount(8) is avoided on purpose: for file-backed EROFS it tries a loop device
first (and fails for the split metadata/data form, see DESIGN.md), and a
process per mount costs milliseconds at burst scale.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import re
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "MNT_DETACH",
    "MS_RDONLY",
    "MountEntry",
    "is_mountpoint",
    "mount",
    "mount_table",
    "mounts_under",
    "umount",
]

MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
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


@dataclass(frozen=True)
class MountEntry:
    """One line of /proc/self/mountinfo: ``dev`` ('major:minor'), the mount ``point``
    and ``source`` (unescaped), ``fstype`` and the super block's ``options`` (as the
    kernel writes them)."""

    dev: str
    point: str
    fstype: str
    source: str
    options: list[str]


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash as octal escapes (\\040)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def mount_table() -> list[MountEntry]:
    """Every mount of this mount namespace, in mountinfo's order (a mount stacked on
    another comes after it)."""
    entries = []
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as fh:
        for line in fh:
            pre, _, post = line.partition(" - ")
            head, tail = pre.split(), post.split()
            if len(head) < 5 or len(tail) < 2:
                continue
            options = tail[2].split(",") if len(tail) > 2 else []
            entries.append(
                MountEntry(head[2], _unescape(head[4]), tail[0], _unescape(tail[1]), options)
            )
    return entries


def mounts_under(prefix: str | Path) -> list[str]:
    """Mount points at or below ``prefix``, deepest first (the order to unmount in)."""
    base = os.path.realpath(prefix)
    found = {e.point for e in mount_table() if e.point == base or e.point.startswith(base + "/")}
    return sorted(found, key=len, reverse=True)


def is_mountpoint(path: str | Path) -> bool:
    """True when ``path`` is itself a mount point."""
    return os.path.realpath(path) in mounts_under(path)
