"""What a node leaves behind: the check run after tests and after the demo.

Looks for every trace a sandbox can leave on a host: its state directory,
mounts (other than the node-wide shared layer mounts), cgroups in any v1
controller or the v2 tree, runc containers, and processes still running in a
sandbox's root (a network namespace of a sandbox lives only as long as one of
those, or a mount, holds it).
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

from sandfleet.node.mounts import mounts_under

__all__ = ["CGROUP_PARENTS", "leftovers"]

#: Every sandbox's cgroup lives below one of these names in each hierarchy:
#: containers' (made by runc) and VMs' QEMU processes'.
CGROUP_PARENTS = ("sandfleet", "sandfleet-vm")
_CGROUP_ROOT = Path("/sys/fs/cgroup")


def _cgroup_dirs() -> list[Path]:
    found: list[Path] = []
    if not _CGROUP_ROOT.is_dir():
        return found
    candidates = [_CGROUP_ROOT / c for c in CGROUP_PARENTS]
    candidates += [p / c for p in _CGROUP_ROOT.iterdir() if p.is_dir() for c in CGROUP_PARENTS]
    for parent in candidates:
        if parent.is_dir():
            found += [p for p in parent.iterdir() if p.is_dir()]
    return found


def _box_pids(node_ids: list[str]) -> list[int]:
    """Processes in the cgroup of a sandbox of one of ``node_ids``.

    (A box's ``/proc/<pid>/root`` reads as ``/`` from the host after pivot_root,
    so the cgroup is what ties a process to its sandbox.)
    """
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            groups = (entry / "cgroup").read_text()
        except OSError:
            continue
        for line in groups.splitlines():
            path = line.rpartition(":")[2]
            boxed = any(f"/{c}/{p}-" in path for c in CGROUP_PARENTS for p in ("sb", "fw"))
            if boxed and any(path.endswith(f"-{n}") for n in node_ids):
                pids.append(int(entry.name))
                break
    return pids


def leftovers(state_dir: Path, *, only: set[str] | None = None) -> list[str]:
    """Describe every sandbox trace under a node's ``state_dir``; empty means clean.

    ``only`` limits the check to those sandbox ids (for tests running beside
    other sandboxes); None checks everything.
    """

    def mine(name: str) -> bool:
        return only is None or any(i in name for i in only)

    # Sandbox ids end with their node's id; node state lives in <state_dir>/nodes/<id>.
    nodes_dir = state_dir / "nodes"
    node_ids = [p.name for p in nodes_dir.iterdir()] if nodes_dir.is_dir() else []
    found: list[str] = []
    for sandboxes in state_dir.glob("**/sandboxes"):
        found += [f"state dir {p}" for p in sandboxes.iterdir() if mine(p.name)]
    if only is None:  # a template half made (failed or interrupted) is removed, never kept
        found += [f"template being made {p}" for p in state_dir.glob("**/templates/.*.tmp")]
    for point in mounts_under(state_dir):
        if "/layers/" not in point and mine(point):
            found.append(f"mount {point}")
    found += [
        f"cgroup {p}"
        for p in _cgroup_dirs()
        if mine(p.name) and any(p.name.endswith(f"-{n}") for n in node_ids)
    ]
    for runc_root in state_dir.glob("**/runc"):
        if not runc_root.is_dir():
            continue
        out = subprocess.run(
            ["runc", "--root", str(runc_root), "list", "--format", "json"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.strip()
        for c in json.loads(out or "null") or []:
            if mine(c["id"]):
                found.append(f"runc container {c['id']} ({c['status']})")
    from sandfleet.backends.container.disk import loop_devices_under

    found += [f"loop device {dev}" for dev in loop_devices_under(state_dir) if mine(str(dev))]
    found += [f"QEMU process {pid} ({name})" for pid, name in _qemu_pids(state_dir) if mine(name)]
    if only is None:
        found += [f"process {pid} in a sandbox's cgroup" for pid in _box_pids(node_ids)]
        found += [f"on-demand daemon {pid}" for pid in _daemon_pids(state_dir)]
    return found


def _argvs() -> Iterator[tuple[int, list[bytes]]]:
    """(pid, argv) of every process whose command line can be read."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                yield int(entry.name), (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue


def _daemon_pids(state_dir: Path) -> list[int]:
    """On-demand FUSE daemons (sandfleet.ondemand) serving a node under ``state_dir``."""
    prefix = os.fsencode(os.path.realpath(state_dir)) + b"/"
    return [
        pid
        for pid, argv in _argvs()
        if b"sandfleet.ondemand" in argv and any(a.startswith(prefix) for a in argv)
    ]


def _qemu_pids(state_dir: Path) -> list[tuple[int, str]]:
    """QEMU processes of a VM under ``state_dir``, with the VM's directory name."""
    found = []
    needle = str(state_dir.resolve()).encode() + b"/"
    for pid, argv in _argvs():
        if not os.path.basename(argv[0]).startswith(b"qemu-system"):
            continue
        for flag, arg in itertools.pairwise(argv):
            if flag == b"-pidfile" and arg.startswith(needle):
                name = os.path.basename(os.path.dirname(arg))
                found.append((pid, name.decode(errors="replace")))
    return found
