"""The host cgroup that holds a VM's QEMU process, on v1, hybrid or v2 hosts.

The guest's own limits (memory for its processes, pids) are set inside the
guest by its init; this cgroup bounds what the QEMU process may take from the
host: memory (guest RAM plus QEMU's own overhead), CPU time (the sandbox's
``cpu`` in cores) and threads. Directories are ``<mount>/sandfleet-vm/<id>``
in every hierarchy holding one of those controllers.
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path

from sandfleet.backends.container.cgroups import CgroupLayout, remove_cgroups

__all__ = ["CPU_PERIOD_US", "VmCgroup"]

CPU_PERIOD_US = 100_000
_CONTROLLERS = ("memory", "cpu", "pids")
PARENT = "sandfleet-vm"


class VmCgroup:
    """The cgroup directories of one VM under ``layout``; nothing exists until :meth:`create`."""

    def __init__(self, layout: CgroupLayout, sandbox_id: str) -> None:
        self.layout = layout
        self.rel = f"{PARENT}/{sandbox_id}"

    def dirs(self) -> dict[str, Path]:
        """Controller → directory, for the controllers this host mounts."""
        out: dict[str, Path] = {}
        for mnt, ctrls in self.layout.v1_mounts.items():
            for c in _CONTROLLERS:
                if c in ctrls:
                    out[c] = Path(mnt) / self.rel
        if self.layout.v2_mount is not None:
            v2 = Path(self.layout.v2_mount)
            available = _read(v2 / "cgroup.controllers").split()
            for c in _CONTROLLERS:
                if c not in out and c in available:
                    out[c] = v2 / self.rel
        return out

    def create(self, memory_bytes: int, cpu: float, pids: int) -> list[Path]:
        """Make the directories and write the limits; returns the ``cgroup.procs``
        files a process must join (one per distinct directory).

        ``memory_bytes`` (no swap), ``cpu`` in cores (CFS quota over
        :data:`CPU_PERIOD_US`), ``pids`` tasks (QEMU's threads). Raises OSError.
        """
        dirs = self.dirs()
        v2 = Path(self.layout.v2_mount) if self.layout.v2_mount else None
        for ctrl, d in dirs.items():
            if v2 is not None and d.is_relative_to(v2):
                # v2: a controller reaches a child only once every ancestor enables it.
                for parent in (v2, v2 / PARENT):
                    parent.mkdir(exist_ok=True)
                    with contextlib.suppress(OSError):
                        (parent / "cgroup.subtree_control").write_text(f"+{ctrl}")
            d.mkdir(parents=True, exist_ok=True)
        quota = max(1000, math.ceil(cpu * CPU_PERIOD_US))
        for ctrl, d in dirs.items():
            v2_dir = v2 is not None and d.is_relative_to(v2)
            if ctrl == "memory":
                if v2_dir:
                    (d / "memory.max").write_text(str(memory_bytes))
                    with contextlib.suppress(OSError):
                        (d / "memory.swap.max").write_text("0")
                else:
                    (d / "memory.limit_in_bytes").write_text(str(memory_bytes))
                    with contextlib.suppress(OSError):
                        (d / "memory.memsw.limit_in_bytes").write_text(str(memory_bytes))
            elif ctrl == "cpu":
                if v2_dir:
                    (d / "cpu.max").write_text(f"{quota} {CPU_PERIOD_US}")
                else:
                    (d / "cpu.cfs_period_us").write_text(str(CPU_PERIOD_US))
                    (d / "cpu.cfs_quota_us").write_text(str(quota))
            elif ctrl == "pids":
                (d / "pids.max").write_text(str(pids))
        return sorted({d / "cgroup.procs" for d in dirs.values()})

    def remove(self) -> list[Path]:
        """Kill what is left inside and remove the directories; returns those that
        could not be removed (empty on success)."""
        return remove_cgroups(sorted(set(self.dirs().values())))


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""
