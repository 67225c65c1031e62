"""The boundary between the VM backend and a VMM (QEMU today; Firecracker would be a sibling).

The backend (backend.py) decides *what* runs — kernel, disks, memory, whether
to boot, restore a template or resume a pause — and describes it as a
:class:`VmConfig`; a driver decides *how*: it starts the VMM process in the
given host cgroup, loads or saves guest state and stops it, behind
:class:`VmProcess`. Nothing in backend.py names a QEMU option, QMP or a
migration URI. A Firecracker driver would map ``memory_file`` + ``restore``
to its snapshot load with a file-backed (MAP_PRIVATE) memory, ``save`` to its
snapshot create, and ``agent_socket`` to its vsock-over-Unix or serial
device; it is not shipped, since it cannot run on these machines.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

__all__ = ["Accel", "Disk", "Machine", "VmConfig", "VmProcess"]

Machine = Literal["microvm", "q35"]
Accel = Literal["kvm", "tcg"]


@dataclass(frozen=True)
class Disk:
    """A raw image attached as virtio-blk; the guest finds it by ``serial``."""

    path: Path
    serial: str
    readonly: bool = True


@dataclass(frozen=True)
class VmConfig:
    """One guest as the backend wants it.

    ``memory_mb`` is guest RAM, MiB. ``memory_file``: back RAM by this file
    (``memory_shared``: writes reach it, for a template; else copy-on-write),
    or None for anonymous RAM. ``incoming``: start stopped, waiting for
    :meth:`VmProcess.restore`. ``run_dir`` is the guest's own directory on the
    host: the driver keeps its sockets, pid file, logs and the guest's serial
    console (``console.log``) there. Paths are host paths.
    """

    machine: Machine
    accel: Accel
    vcpus: int
    memory_mb: int
    kernel: Path
    initramfs: Path
    cmdline: str
    disks: list[Disk]
    run_dir: Path
    memory_file: Path | None = None
    memory_shared: bool = False
    incoming: bool = False


class VmProcess(Protocol):
    """A running VMM process (one guest), as a driver hands it to the backend.

    ``agent_socket``: the Unix socket whose byte stream is the guest's agent
    port (see mux.py). Methods raise ``Internal`` when the VMM refuses and
    ``Unavailable`` when it cannot be reached.
    """

    pid: int
    agent_socket: Path

    def alive(self) -> bool: ...

    async def wait(self) -> int | None:
        """Until the process has exited; its status when it is our child."""
        ...

    async def restore(self, state: Path, *, template: bool, timeout_s: float) -> None:
        """Load ``state`` into a VMM started with ``incoming`` and run the guest.
        ``template``: RAM comes from the config's ``memory_file`` (copy-on-write)."""
        ...

    async def save(self, state: Path, *, template: bool, timeout_s: float) -> None:
        """Write the guest's state to ``state``; the guest is stopped after it.
        ``template``: RAM stays in the shared ``memory_file``, not in ``state``."""
        ...

    async def stop_vcpus(self) -> None: ...

    async def resume(self) -> None: ...

    async def kill(self, timeout_s: float = 5.0) -> None:
        """SIGKILL the VMM and wait until it is gone."""
        ...

    async def disconnect(self) -> None:
        """Drop the control connection; the VMM runs on."""
        ...
