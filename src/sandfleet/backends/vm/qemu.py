"""QEMU as the VMM of the ``microvm`` and ``vm`` kinds: the driver behind driver.py.

:func:`launch` starts QEMU for a :class:`~sandfleet.backends.vm.driver.VmConfig`
and returns a :class:`QemuVm` (a ``VmProcess``: restore, save, stop, kill over
QMP). :func:`qemu_argv` renders the config for a machine type, the only place
the two kinds differ:

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

Restores and saves are QEMU migrations to and from a file (``exec:cat``:
QEMU 7.2 has no ``file:`` URI).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shlex
import signal
from pathlib import Path
from typing import Any

from qemu.qmp import QMPClient
from qemu.qmp.error import QMPError

from sandfleet.backends.vm.driver import VmConfig
from sandfleet.backends.vm.mux import bind_private
from sandfleet.wire.errors import Internal, Unavailable

__all__ = ["QemuVm", "launch", "qemu_argv"]

# It logs each refused connect as an error; a starting QEMU refuses a few by design.
logging.getLogger("qemu.qmp").setLevel(logging.CRITICAL)

#: TCG's translation cache, MiB. QEMU's default (1 GiB) grows a busy guest's
#: QEMU by hundreds of MiB; 64 MiB keeps an idle sandbox small.
TCG_TB_MIB = 64


def qemu_argv(binary: str, cfg: VmConfig, agent_fd: int, qmp_fd: int) -> list[str]:
    """The argument vector that starts ``cfg`` (QEMU 7.2 syntax). ``agent_fd``
    and ``qmp_fd`` are listening Unix sockets QEMU inherits: bound by us through
    a directory fd, a deep run directory never meets ``sun_path``'s 108 bytes."""
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
        "-chardev", f"file,id=console,path={_opt(cfg.run_dir / 'console.log')}",
        "-serial", "chardev:console",
        "-chardev", f"socket,id=agent,fd={agent_fd},server=on,wait=off",
        "-device", f"virtio-serial-{suffix},id=vser",
        "-device", "virtserialport,bus=vser.0,chardev=agent,name=sandfleet.agent",
        "-chardev", f"socket,id=qmp,fd={qmp_fd},server=on,wait=off",
        "-mon", "chardev=qmp,mode=control",
        "-pidfile", str(cfg.run_dir / "pid"),
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
    return argv


def _opt(path: Path) -> str:
    """A path inside a QEMU option string, where ``,`` must be doubled."""
    return str(path).replace(",", ",,")


async def launch(binary: str, cfg: VmConfig, *, cgroup_procs: list[Path]) -> QemuVm:
    """Start QEMU for ``cfg`` in its own session (it outlives the node agent)
    with every ``cgroup.procs`` file in ``cgroup_procs`` joined before QEMU
    exists, so all of it is charged there. Its output goes to
    ``run_dir/qemu.log``. Raises OSError when it cannot be started."""
    run = cfg.run_dir
    with contextlib.ExitStack() as stack:
        listeners = [bind_private(run / name) for name in ("serial.sock", "qmp.sock")]
        for sock in listeners:
            stack.callback(sock.close)  # QEMU holds its own copies
        fds = (listeners[0].fileno(), listeners[1].fileno())
        join = 'for f in "$@"; do [ "$f" = -- ] && break; echo $$ > "$f" || exit 125; shift; done'
        argv = ["/bin/sh", "-c", join + '; shift; exec "$@"', "sh", *map(str, cgroup_procs), "--"]
        argv += qemu_argv(binary, cfg, *fds)
        with open(run / "qemu.log", "ab") as log:
            process = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
                pass_fds=fds,
            )
    return QemuVm(process.pid, run, process)


class QemuVm:
    """A running QEMU process and its QMP connection (a :class:`VmProcess`).

    ``pid`` is QEMU's; the process runs in its own session so it outlives the
    node agent. Methods raise ``Internal`` when QEMU answers with an error and
    ``Unavailable`` when it cannot be reached.
    """

    def __init__(
        self, pid: int, run_dir: Path, process: asyncio.subprocess.Process | None = None
    ) -> None:
        self.pid = pid
        self.run_dir = run_dir
        self.qmp_socket = run_dir / "qmp.sock"
        self.agent_socket = run_dir / "serial.sock"
        #: Set when QEMU is our child (not when adopted after a restart).
        self.process = process
        self._qmp: QMPClient | None = None

    @classmethod
    def adopt(cls, run_dir: Path) -> QemuVm | None:
        """The QEMU still running for ``run_dir`` (after a node agent restart), if any:
        its pid file names it and its command line names that pid file."""
        try:
            pid = int((run_dir / "pid").read_text().strip())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except (OSError, ValueError):
            return None
        if b"\0" + str(run_dir / "pid").encode() + b"\0" not in b"\0" + cmdline:
            return None  # a recycled pid
        return cls(pid, run_dir)

    async def wait(self) -> int | None:
        if self.process is not None:
            return await self.process.wait()
        while self.alive():
            await asyncio.sleep(0.05)
        return None

    async def restore(self, state: Path, *, template: bool, timeout_s: float) -> None:
        """x-ignore-shared for a template: its RAM is the memory file, not in the stream."""
        await self.connect()
        await self.set_capabilities(x_ignore_shared=template)
        await self.migrate_in(state, timeout_s)
        await self.resume()

    async def save(self, state: Path, *, template: bool, timeout_s: float) -> None:
        await self.set_capabilities(x_ignore_shared=template)
        await self.migrate_out(state, timeout_s)

    async def stop_vcpus(self) -> None:
        """Stop the guest's vCPUs; QEMU drains and flushes its block layer first."""
        await self.command("stop")

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
