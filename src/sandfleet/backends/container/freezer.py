"""Freezing and thawing a box's cgroup: pause and resume of a container.

A frozen box keeps its memory (and its processes, sockets, files) but is never
scheduled: it costs no CPU until thawed. The freezer is driven directly, as
``runc pause``/``runc resume`` would do it, without a Go process per call:

- cgroup v1 and hybrid (runc 1.1 uses the v1 freezer whenever it is mounted):
  ``freezer.state`` of ``<freezer mount>/sandfleet/<id>``; writing ``FROZEN``
  starts freezing, the file reads ``FREEZING`` until every task is frozen, then
  ``FROZEN``. runc reads the same file, so ``runc list`` shows the box as
  ``paused`` and a restarted node agent adopts it as such.
- cgroup v2: ``cgroup.freeze`` (``1``/``0``) of ``/sys/fs/cgroup/sandfleet/<id>``;
  the ``frozen`` line of ``cgroup.events`` turns 1 once every task is frozen.

A SIGKILL reaches a frozen task only once it is thawed (v1): destroy sends the
signal first and thaws after, so a killed box runs no code of its own again.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

from sandfleet.backends.container.cgroups import CgroupLayout
from sandfleet.wire.errors import FailedPrecondition, Internal

__all__ = ["FREEZE_TIMEOUT_S", "Freezer"]

#: Seconds a freeze may take before it is undone and reported (a task stuck in
#: an uninterruptible sleep, e.g. on a hung NFS mount, cannot be frozen).
FREEZE_TIMEOUT_S = 5.0


class Freezer:
    """The freezer of the cgroups made for cgroupsPath ``/sandfleet/<id>`` on ``layout``.

    ``version`` is ``"v1"``, ``"v2"`` or ``"none"``; with none, :meth:`freeze`
    and :meth:`thaw` raise ``FailedPrecondition``.
    """

    def __init__(self, layout: CgroupLayout) -> None:
        self.layout = layout
        self.version = "none"
        self._root: Path | None = None
        v1 = next((m for m, ctrls in layout.v1_mounts.items() if "freezer" in ctrls), None)
        if v1 is not None:
            self.version, self._root = "v1", Path(v1)
        elif layout.mode == "v2" and layout.v2_mount is not None:
            self.version, self._root = "v2", Path(layout.v2_mount)

    def _dir(self, rel: str) -> Path:
        if self._root is None:
            raise FailedPrecondition(
                "this node has no cgroup freezer (no v1 freezer hierarchy, no cgroup2 root):"
                " mount one to pause sandboxes"
            )
        return self._root / rel.lstrip("/")

    def frozen(self, rel: str) -> bool:
        """Whether the cgroup is frozen or being frozen; False when it does not exist."""
        if self._root is None:
            return False
        d = self._dir(rel)
        try:
            if self.version == "v1":
                return (d / "freezer.state").read_text().strip() in ("FROZEN", "FREEZING")
            return (d / "cgroup.freeze").read_text().strip() == "1"
        except OSError:
            return False

    def _settled(self, rel: str, want_frozen: bool) -> bool:
        d = self._dir(rel)
        if self.version == "v1":
            state = (d / "freezer.state").read_text().strip()
            return state == ("FROZEN" if want_frozen else "THAWED")
        events = (d / "cgroup.events").read_text().split("\n")
        return f"frozen {int(want_frozen)}" in events

    def _write(self, rel: str, frozen: bool) -> None:
        d = self._dir(rel)
        if self.version == "v1":
            (d / "freezer.state").write_text("FROZEN" if frozen else "THAWED")
        else:
            (d / "cgroup.freeze").write_text("1" if frozen else "0")

    async def freeze(self, rel: str, timeout_s: float = FREEZE_TIMEOUT_S) -> None:
        """Freeze every task of the cgroup; returns once all are frozen.

        Raises ``Internal`` when the cgroup is missing or the freeze does not
        complete within ``timeout_s`` seconds (the cgroup is thawed again first,
        so a failed pause leaves the box running).
        """
        deadline = time.monotonic() + timeout_s
        delay = 0.0005
        try:
            self._write(rel, True)
            while not self._settled(rel, True):
                if time.monotonic() > deadline:
                    with contextlib.suppress(OSError):
                        self._write(rel, False)
                    raise Internal(
                        f"cgroup {rel} did not freeze within {timeout_s:g} s (a task in an"
                        " uninterruptible sleep?); it was left running: retry the pause"
                    )
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.02)
                if self.version == "v1":
                    # Tasks forked while freezing escape a single write (as runc does it).
                    self._write(rel, True)
        except OSError as exc:
            raise Internal(f"cannot freeze cgroup {rel}: {exc}") from exc

    async def thaw(self, rel: str, timeout_s: float = FREEZE_TIMEOUT_S) -> None:
        """Thaw the cgroup; returns once its tasks may run. A thawed cgroup is a no-op.

        Raises ``Internal`` when the cgroup is missing or stays frozen for
        ``timeout_s`` seconds.
        """
        deadline = time.monotonic() + timeout_s
        try:
            self._write(rel, False)
            while not self._settled(rel, False):
                if time.monotonic() > deadline:
                    raise Internal(f"cgroup {rel} did not thaw within {timeout_s:g} s")
                await asyncio.sleep(0.001)
        except OSError as exc:
            raise Internal(f"cannot thaw cgroup {rel}: {exc}") from exc

    def thaw_now(self, rel: str) -> None:
        """Ask the cgroup to thaw without waiting; silent when it does not exist."""
        if self._root is None:
            return
        with contextlib.suppress(OSError):
            self._write(rel, False)
