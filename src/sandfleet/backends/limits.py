"""What every backend checks of a request the same way: ids, limits, environment.

One place, so that a container and a VM refuse the same request with the same
words (the conformance suite holds every kind to the same errors).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from sandfleet.backends.base import SandboxSpec
from sandfleet.wire.errors import Internal, InvalidArgument

__all__ = [
    "CPU_MIN",
    "DISK_MIN_MB",
    "ID_RE",
    "MEMORY_MIN_MB",
    "PIDS_MAX",
    "PIDS_MIN",
    "NodeLimits",
    "host_memory_mb",
    "log_tail",
    "validate_spec",
]

ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
MEMORY_MIN_MB = 16
PIDS_MIN, PIDS_MAX = 8, 65536
CPU_MIN = 0.01
#: The smallest writable layer: ext4 needs a few hundred KiB of metadata.
DISK_MIN_MB = 4


@dataclass(frozen=True)
class NodeLimits:
    """The upper ends of the ranges on this node: MiB of memory, cores, MiB of disk."""

    memory_max_mb: int
    cpu_max: float
    disk_max_mb: int


def validate_spec(spec: SandboxSpec, kind: str, limits: NodeLimits) -> None:
    """Raise ``InvalidArgument`` (saying the allowed range) for a malformed id, a
    kind other than ``kind``, no layer, limits out of range or an environment
    variable that cannot be passed."""
    if not ID_RE.match(spec.id):
        raise InvalidArgument(
            f"sandbox id {spec.id!r} must match {ID_RE.pattern} (letters, digits, _.-)"
        )
    if spec.kind != kind:
        raise InvalidArgument(f"the {kind} backend cannot create kind {spec.kind!r}")
    if not spec.layers:
        raise InvalidArgument(f"a {kind} needs at least one layer")
    if not MEMORY_MIN_MB <= spec.memory_mb <= limits.memory_max_mb:
        raise InvalidArgument(
            f"memory_mb={spec.memory_mb} out of range: "
            f"{MEMORY_MIN_MB}..{limits.memory_max_mb} MiB on this node"
        )
    if not CPU_MIN <= spec.cpu <= limits.cpu_max:
        raise InvalidArgument(
            f"cpu={spec.cpu} out of range: {CPU_MIN}..{limits.cpu_max:g} cores on this node"
        )
    if not PIDS_MIN <= spec.pids_limit <= PIDS_MAX:
        raise InvalidArgument(f"pids_limit={spec.pids_limit} out of range: {PIDS_MIN}..{PIDS_MAX}")
    if spec.disk_mb is not None and not DISK_MIN_MB <= spec.disk_mb <= limits.disk_max_mb:
        raise InvalidArgument(
            f"disk_mb={spec.disk_mb} out of range: {DISK_MIN_MB}..{limits.disk_max_mb} MiB "
            "on this node"
        )
    for k, v in spec.env.items():
        if not k or "=" in k or "\0" in k or "\0" in v:
            raise InvalidArgument(
                f"environment variable {k!r}: names must be non-empty without '=' or NUL, "
                "values without NUL"
            )


def host_memory_mb() -> int:
    """MemTotal of this host, MiB. Raises ``Internal`` if /proc/meminfo lacks it."""
    with open("/proc/meminfo", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) // 1024
    raise Internal("MemTotal missing from /proc/meminfo")


def log_tail(path: Path, limit: int = 2000) -> str:
    """The last ``limit`` bytes of a log file as text; empty if it cannot be read."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - limit))
            return fh.read().decode("utf-8", errors="replace").strip()
    except OSError:
        return ""
