"""Where a sandbox's cgroups live, how to read its OOM counter and sweep leftovers.

runc creates the cgroups itself from ``linux.cgroupsPath`` (cgroupfs driver,
an absolute path such as ``/sandfleet/<id>``); this module only finds them.

- v1 and hybrid: runc (1.1) creates ``<mount>/sandfleet/<id>`` in *every*
  mounted v1 hierarchy, including named ones such as ``name=systemd``, and in
  hybrid mode also in the v2 mount (``/sys/fs/cgroup/unified``), which it joins
  but sets no limits in. Limits go to the v1 files: memory.limit_in_bytes,
  memory.memsw.limit_in_bytes (swap equal to memory: no swap),
  cpu.cfs_quota_us/cpu.cfs_period_us, pids.max, devices.*.
- v2 (pure): one directory ``/sys/fs/cgroup/sandfleet/<id>``; runc enables the
  controllers in the parents' ``cgroup.subtree_control`` and writes memory.max,
  memory.swap.max (swap minus memory: 0), cpu.max and pids.max; the device
  rules become an eBPF program.

``runc delete`` removes these directories; :func:`remove_cgroups` is the
safety net when it could not (runc killed halfway, a container that failed in
init), and kills stragglers first.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CgroupLayout", "detect_layout", "remove_cgroups"]

CGROUP_ROOT = "/sys/fs/cgroup"


@dataclass(frozen=True)
class CgroupLayout:
    """The cgroup hierarchies of this node.

    ``mode`` is ``"v1"``, ``"v2"`` or ``"hybrid"``; ``v1_mounts`` maps each v1
    mount point to its controllers (or ``name=...``); ``v2_mount`` is the
    cgroup2 mount point, if any.
    """

    mode: str
    v1_mounts: dict[str, list[str]]
    v2_mount: str | None

    def dirs(self, rel: str) -> list[Path]:
        """Every directory runc creates for cgroupsPath ``rel`` (absolute, e.g. /sandfleet/x)."""
        rel = rel.lstrip("/")
        out = [Path(m) / rel for m in self.v1_mounts]
        if self.v2_mount is not None:
            out.append(Path(self.v2_mount) / rel)
        return out

    def memory_dir(self, rel: str) -> Path | None:
        """The directory holding the memory controller's files, if memory is mounted."""
        rel = rel.lstrip("/")
        for mnt, ctrls in self.v1_mounts.items():
            if "memory" in ctrls:
                return Path(mnt) / rel
        if self.mode == "v2" and self.v2_mount is not None:
            return Path(self.v2_mount) / rel
        return None

    def oom_kills(self, rel: str) -> int:
        """Processes killed by this cgroup's memory limit so far; 0 if unknown.

        v1: the ``oom_kill`` line of memory.oom_control (kernel >= 4.13);
        v2: the ``oom_kill`` line of memory.events.
        """
        d = self.memory_dir(rel)
        if d is None:
            return 0
        name = "memory.events" if self.mode == "v2" else "memory.oom_control"
        try:
            text = (d / name).read_text()
        except OSError:
            return 0
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                with contextlib.suppress(ValueError):
                    return int(value)
        return 0

    def set_memory_limit(self, rel: str, limit_bytes: int) -> None:
        """Change the memory limit (swap equal: none) of a running cgroup.

        v1 wants memory.limit_in_bytes <= memory.memsw.limit_in_bytes at every
        step, so the order depends on the direction. Raises ``OSError`` (EBUSY
        when usage is above a lower limit and cannot be reclaimed).
        """
        d = self.memory_dir(rel)
        if d is None:
            return
        value = str(limit_bytes)
        if self.mode == "v2":
            (d / "memory.max").write_text(value)
            return
        mem, memsw = d / "memory.limit_in_bytes", d / "memory.memsw.limit_in_bytes"
        has_swap = memsw.exists()
        if has_swap and limit_bytes > int(mem.read_text()):
            memsw.write_text(value)
            mem.write_text(value)
        else:
            mem.write_text(value)
            if has_swap:
                memsw.write_text(value)

    def memory_usage(self, rel: str) -> int:
        """Bytes charged to the cgroup now (page cache and tmpfs included); 0 if unknown."""
        d = self.memory_dir(rel)
        if d is None:
            return 0
        name = "memory.current" if self.mode == "v2" else "memory.usage_in_bytes"
        try:
            return int((d / name).read_text())
        except (OSError, ValueError):
            return 0


def detect_layout(mountinfo: str = "/proc/self/mountinfo") -> CgroupLayout:
    """Read the cgroup mounts below /sys/fs/cgroup and classify the node."""
    v1: dict[str, list[str]] = {}
    v2: str | None = None
    with open(mountinfo, encoding="utf-8", errors="replace") as fh:
        for line in fh:
            pre, _, post = line.partition(" - ")
            point = pre.split()[4]
            fstype, _src, opts = [*post.split(), "", "", ""][:3]
            if not (point == CGROUP_ROOT or point.startswith(CGROUP_ROOT + "/")):
                continue
            if fstype == "cgroup2":
                v2 = point
            elif fstype == "cgroup":
                # super options: "rw,memory" or "rw,name=systemd"; drop flags.
                ctrls = [
                    o
                    for o in opts.split(",")
                    if o.startswith("name=") or (o not in ("rw", "ro") and "=" not in o)
                ]
                v1[point] = ctrls
    if v1 and v2 is not None:
        mode = "hybrid"
    elif v2 is not None:
        mode = "v2"
    else:
        mode = "v1"
    return CgroupLayout(mode=mode, v1_mounts=v1, v2_mount=v2)


def _kill_members(d: Path) -> None:
    with contextlib.suppress(OSError):
        (d / "cgroup.kill").write_text("1")  # v2, kernel >= 5.14
    for name in ("cgroup.procs", "tasks"):
        try:
            pids = (d / name).read_text().split()
        except OSError:
            continue
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)


def remove_cgroups(dirs: list[Path], timeout_s: float = 2.0) -> list[Path]:
    """rmdir each directory (children first), killing member processes as needed.

    Returns the directories that could not be removed within ``timeout_s``
    seconds (empty on success); a missing directory counts as removed.
    """
    remaining = []
    for d in dirs:
        if d.is_dir():
            # Nested cgroups made inside the box (cgroup namespace) go first.
            remaining.extend(sorted((p for p in d.rglob("*") if p.is_dir()), reverse=True))
            remaining.append(d)
    deadline = time.monotonic() + timeout_s
    delay = 0.001
    while remaining:
        left = []
        for d in remaining:
            try:
                os.rmdir(d)
            except FileNotFoundError:
                pass
            except OSError as e:
                if e.errno != errno.EBUSY:
                    raise
                _kill_members(d)
                left.append(d)
        remaining = left
        if not remaining or time.monotonic() > deadline:
            break
        time.sleep(delay)
        delay = min(delay * 2, 0.05)
    return remaining
