"""QEMU as the VMM of the ``microvm`` and ``vm`` kinds: command lines, launch, QMP.

One :class:`VmConfig` describes a guest; :func:`qemu_argv` renders it for a
machine type, which is the only place the two kinds differ:

- ``microvm``: QEMU's microvm machine, virtio-mmio devices found through ACPI
  (Debian's cloud kernel has no ``virtio_mmio.device=`` command-line support),
  no PCI, no firmware: the kernel is loaded directly.
- ``vm``: q35 with SeaBIOS and virtio-pci devices; sandfleet's kernel is
  booted through the firmware's linuxboot option ROM (``-kernel``).

Neither has a NIC (``-nodefaults``, ``-nic none``). Guest RAM is a memory
backend named ``mem`` so that a migration stream (pause, template) restores
into either a private RAM block or a file mapping; the template's clones map
its RAM file copy-on-write (``share=off``) with ``x-ignore-shared``, the
technique of Kata Containers' VM templating.

A driver for another VMM (Firecracker) would be a sibling module producing a
running :class:`Vmm` for the backend; nothing here is QEMU-agnostic on purpose.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shlex
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from qemu.qmp import QMPClient
from qemu.qmp.error import QMPError

from sandfleet.wire.errors import Internal, Unavailable

__all__ = ["Accel", "Disk", "Machine", "VmConfig", "Vmm", "qemu_argv"]

Machine = Literal["microvm", "q35"]
Accel = Literal["kvm", "tcg"]

# It logs each refused connect as an error; a starting QEMU refuses a few by design.
logging.getLogger("qemu.qmp").setLevel(logging.CRITICAL)

#: TCG's translation cache, MiB. QEMU's default (1 GiB) grows a busy guest's
#: QEMU by hundreds of MiB; 64 MiB keeps an idle sandbox small.
TCG_TB_MIB = 64


@dataclass(frozen=True)
class Disk:
    """A raw image attached as virtio-blk; the guest finds it by ``serial``."""

    path: Path
    serial: str
    readonly: bool = True


@dataclass(frozen=True)
class VmConfig:
    """Everything QEMU's command line says about one guest.

    ``memory_mb`` is guest RAM, MiB. ``memory_file``: back RAM by this file
    (``shared``: writes reach it, for a template; else copy-on-write), or None
    for anonymous RAM. ``incoming``: start paused, waiting for a migration
    stream (restore). Paths are host paths. ``agent_fd`` and ``qmp_fd`` are
    listening Unix sockets QEMU inherits (bound by the node through a directory
    fd: a deep state directory passes ``sun_path``'s 108 bytes).
    """

    machine: Machine
    accel: Accel
    vcpus: int
    memory_mb: int
    kernel: Path
    initramfs: Path
    cmdline: str
    disks: list[Disk]
    agent_fd: int
    qmp_fd: int
    console: Path
    pidfile: Path
    memory_file: Path | None = None
    memory_shared: bool = False
    incoming: bool = False
    extra: list[str] = field(default_factory=list)


def qemu_argv(binary: str, cfg: VmConfig) -> list[str]:
    """The argument vector that starts ``cfg`` (QEMU 7.2 syntax)."""
    mmio = cfg.machine == "microvm"
    machine = "microvm,acpi=on,memory-backend=mem" if mmio else "q35,memory-backend=mem"
    accel = f"tcg,tb-size={TCG_TB_MIB}" if cfg.accel == "tcg" else "kvm"
    if cfg.memory_file is None:
        mem = f"memory-backend-ram,id=mem,size={cfg.memory_mb}M"
    else:
        share = "on" if cfg.memory_shared else "off"
        mem = (
            f"memory-backend-file,id=mem,size={cfg.memory_mb}M,"
            f"mem-path={_opt(cfg.memory_file)},share={share}"
        )
    suffix = "device" if mmio else "pci"
    argv = [
        binary,
        "-nodefaults", "-no-user-config", "-nographic", "-no-reboot",
        "-machine", machine,
        "-accel", accel,
        "-cpu", "host" if cfg.accel == "kvm" else "max",
        "-smp", str(cfg.vcpus),
        "-m", f"{cfg.memory_mb}M",
        "-object", mem,
        "-kernel", str(cfg.kernel),
        "-initrd", str(cfg.initramfs),
        "-append", cfg.cmdline,
        "-nic", "none",
        "-chardev", f"file,id=console,path={_opt(cfg.console)}",
        "-serial", "chardev:console",
        "-chardev", f"socket,id=agent,fd={cfg.agent_fd},server=on,wait=off",
        "-device", f"virtio-serial-{suffix},id=vser",
        "-device", "virtserialport,bus=vser.0,chardev=agent,name=sandfleet.agent",
        "-chardev", f"socket,id=qmp,fd={cfg.qmp_fd},server=on,wait=off",
        "-mon", "chardev=qmp,mode=control",
        "-pidfile", str(cfg.pidfile),
    ]  # fmt: skip
    for i, disk in enumerate(cfg.disks):
        drive = f"if=none,id=d{i},file={_opt(disk.path)},format=raw,file.locking=off"
        if disk.readonly:
            drive += ",readonly=on"
        else:
            drive += ",discard=unmap"
        argv += ["-drive", drive, "-device", f"virtio-blk-{suffix},drive=d{i},serial={disk.serial}"]
    if cfg.incoming:
        argv += ["-incoming", "defer"]
    return argv + cfg.extra


def _opt(path: Path) -> str:
    """A path inside a QEMU option string, where ``,`` must be doubled."""
    return str(path).replace(",", ",,")


class Vmm:
    """A running QEMU process and its QMP connection.

    ``pid`` is QEMU's; the process runs in its own session so it outlives the
    node agent. Methods raise ``Internal`` when QEMU answers with an error and
    ``Unavailable`` when it cannot be reached.
    """

    def __init__(
        self, pid: int, qmp_socket: Path, process: asyncio.subprocess.Process | None = None
    ) -> None:
        self.pid = pid
        self.qmp_socket = qmp_socket
        #: Set when QEMU is our child (not when adopted after a restart).
        self.process = process
        self._qmp: QMPClient | None = None

    async def connect(self, timeout_s: float = 10.0) -> None:
        """Open QMP, retrying while QEMU creates its socket."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            client = QMPClient("sandfleet")
            try:
                # Through an O_PATH fd: the socket's path may pass sun_path's 108 bytes.
                fd = os.open(self.qmp_socket, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
                try:
                    await client.connect(f"/proc/self/fd/{fd}")
                finally:
                    os.close(fd)
                self._qmp = client
                return
            except (OSError, QMPError) as e:
                if not self.alive() or loop.time() > deadline:
                    raise Unavailable(
                        f"QEMU (pid {self.pid}) QMP socket {self.qmp_socket} did not answer: {e}"
                    ) from e
                await asyncio.sleep(0.01)

    async def command(self, name: str, **args: Any) -> Any:
        """Run one QMP command and return its answer."""
        if self._qmp is None:
            await self.connect()
        assert self._qmp is not None
        try:
            return await self._qmp.execute(name, args or None)
        except QMPError as e:
            raise Internal(f"QEMU {name} failed: {e}") from e

    async def migrate_out(self, state: Path, timeout_s: float) -> None:
        """Write the guest's device state (and RAM not ignored) to ``state``; the
        guest is stopped after it. Raises Internal when the migration fails."""
        uri = "exec:cat > " + shlex.quote(str(state))
        await self.command("migrate", uri=uri)
        await self._wait_migration(timeout_s)

    async def migrate_in(self, state: Path, timeout_s: float) -> None:
        """Load a stream written by :meth:`migrate_out` into a QEMU started with
        ``incoming``; the guest stays stopped until :meth:`resume`."""
        await self.command("migrate-incoming", uri="exec:cat " + shlex.quote(str(state)))
        await self._wait_migration(timeout_s)

    async def _wait_migration(self, timeout_s: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            info = await self.command("query-migrate")
            status = info.get("status")
            if status == "completed":
                return
            if status in ("failed", "cancelled"):
                raise Internal(f"QEMU migration {status}: {info.get('error-desc', '')}")
            if loop.time() > deadline:
                raise Internal(f"QEMU migration still {status} after {timeout_s:g} s")
            await asyncio.sleep(0.005)

    async def set_capabilities(self, **caps: bool) -> None:
        await self.command(
            "migrate-set-capabilities",
            capabilities=[{"capability": k.replace("_", "-"), "state": v} for k, v in caps.items()],
        )

    async def resume(self) -> None:
        await self.command("cont")

    def alive(self) -> bool:
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        # A zombie (our child, not yet reaped) is dead for our purposes.
        try:
            with open(f"/proc/{self.pid}/stat", encoding="ascii") as fh:
                return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    async def disconnect(self) -> None:
        if self._qmp is not None:
            with contextlib.suppress(Exception):
                await self._qmp.disconnect()
            self._qmp = None

    async def kill(self, timeout_s: float = 5.0) -> None:
        """SIGKILL QEMU and wait until it is gone (reaped, when it is our child)."""
        await self.disconnect()
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        if self.process is not None:
            # Its watcher reaps it; a waitpid of our own would leave wait() hanging.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.process.wait(), timeout_s)
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.alive() and loop.time() < deadline:
            await asyncio.sleep(0.005)
