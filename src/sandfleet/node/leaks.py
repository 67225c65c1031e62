"""What a node leaves behind: the check run after tests and after the demo.

Looks for every trace a sandbox can leave on a host: its state directory,
mounts (other than the node-wide shared layer mounts), cgroups in any v1
controller or the v2 tree, runc containers, processes running the in-sandbox
agent, and network namespaces held by such processes.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from sandfleet.node.mounts import mounts_under

__all__ = ["CGROUP_PARENT", "leftovers"]

#: Every sandbox's cgroup lives below this name in each hierarchy.
CGROUP_PARENT = "sandfleet"
_CGROUP_ROOT = Path("/sys/fs/cgroup")


def _cgroup_dirs() -> list[Path]:
    found: list[Path] = []
    if not _CGROUP_ROOT.is_dir():
        return found
    candidates = [_CGROUP_ROOT / CGROUP_PARENT]
    candidates += [p / CGROUP_PARENT for p in _CGROUP_ROOT.iterdir() if p.is_dir()]
    for parent in candidates:
        if parent.is_dir():
            found += [p for p in parent.iterdir() if p.is_dir()]
    return found


def _agent_pids(state_dir: Path) -> list[int]:
    pids = []
    marker = b"sandfleet-agent"
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if marker in cmdline or b"/.sandfleet/agent" in cmdline:
            pids.append(int(entry.name))
    return pids


def leftovers(state_dir: Path, *, only: set[str] | None = None) -> list[str]:
    """Describe every sandbox trace under a node's ``state_dir``; empty means clean.

    ``only`` limits the check to those sandbox ids (for tests running beside
    other sandboxes); None checks everything.
    """

    def mine(name: str) -> bool:
        return only is None or any(i in name for i in only)

    found: list[str] = []
    for sandboxes in state_dir.glob("**/sandboxes"):
        found += [f"state dir {p}" for p in sandboxes.iterdir() if mine(p.name)]
    for point in mounts_under(state_dir):
        if "/layers/" not in point and mine(point):
            found.append(f"mount {point}")
    found += [f"cgroup {p}" for p in _cgroup_dirs() if mine(p.name)]
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
    if only is None:
        found += [f"agent process {pid}" for pid in _agent_pids(state_dir) if pid != os.getpid()]
    return found
