"""The ``microvm`` and ``vm`` backends: one QEMU process per sandbox.

Layout under ``state_dir``::

    disk-templates/            formatted ext4 images, one per disk size
    templates/<key>/           a booted guest saved once per (machine, image, size):
        mem                    its RAM (clones map it copy-on-write)
        state                  its device state (QEMU migration stream)
        disk.img               its writable disk as the guest left it (synced)
    sandboxes/<id>/            one VM
        vm.json                how it was started (the record recover and resume use)
        disk.img               its writable disk (ext4 of disk_mb MiB, sparse)
        paused.state           while paused: its RAM and device state; no QEMU runs
        qmp.sock, serial.sock  QEMU's QMP and virtio-serial (agent) sockets
        agent.sock             the mux's socket: AgentClient talks to the guest through it
        console.log, qemu.log  the guest's serial console; QEMU's own output
        pid, ready             QEMU's pid; written once create succeeded

A sandbox starts either by booting the guest (kernel, initramfs, the image's
EROFS layers as read-only virtio-blk disks, see guest.py and init.sh) or,
with templates on (the default), by restoring the template of its
(machine, image, size): the first create of a key boots the template and
saves it, every create restores it with a fresh copy of its disk. The QEMU
process runs in its own session (it outlives the node agent, like a runc
container) and in a host cgroup bounding its memory, CPU time and threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import math
import os
import shutil
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from sandfleet.backends.base import BoxHandle, SandboxSpec
from sandfleet.backends.container.cgroups import detect_layout
from sandfleet.backends.container.disk import DiskImages, sparse_copy
from sandfleet.backends.limits import (
    DISK_MIN_MB,
    ID_RE,
    PIDS_MAX,
    PIDS_MIN,
    NodeLimits,
    host_memory_mb,
    log_tail,
    validate_spec,
)
from sandfleet.backends.threads import settled
from sandfleet.backends.vm.accel import AccelInfo, tcg_kernel_args
from sandfleet.backends.vm.cgroup import VmCgroup
from sandfleet.backends.vm.driver import Disk, Machine, VmConfig, VmProcess
from sandfleet.backends.vm.guest import GuestArtifacts
from sandfleet.backends.vm.mux import AgentMux, Hello
from sandfleet.backends.vm.qemu import QemuVm, launch
from sandfleet.backends.vm.snapshot import pack_disk_upper
from sandfleet.guest.client import AgentClient
from sandfleet.wire.errors import (
    AlreadyExists,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    SandfleetError,
)

__all__ = ["VmBackend"]

#: Guest RAM beyond the sandbox's memory_mb: the guest kernel, its page tables
#: and the agent live outside the sandbox's cgroup inside the guest, MiB.
GUEST_OVERHEAD_MB = 96
#: What the QEMU process may use beyond guest RAM (TCG's 64 MiB translation
#: cache, device emulation, the migration buffers of a pause), MiB.
QEMU_OVERHEAD_MB = 192
#: QEMU's threads (vCPUs, I/O workers, migration).
QEMU_PIDS = 256
#: A writable disk of ``disk_mb=None`` ("unbounded"): sparse, so only what is written costs.
DEFAULT_DISK_MB = 16384
#: Templates kept per backend; the least recently used beyond this are deleted.
MAX_TEMPLATES = 16
#: virtio-mmio devices a microvm can use: QEMU offers 24 slots, but the 24th's
#: interrupt never reaches the guest (measured). One is the agent's port.
MICROVM_MAX_DISKS = 22


@dataclass
class _Record:
    """What vm.json holds: enough to restore, resume, adopt or destroy the VM."""

    id: str
    machine: Machine
    accel: str
    vcpus: int
    cpu: float
    memory_mb: int
    cmdline: str
    disks: list[dict[str, Any]]
    template: str | None = None
    paused: bool = False
    #: Digests of the layers it was started from, bottom first (for snapshots).
    digests: list[str] | None = None

    def disk_list(self) -> list[Disk]:
        return [Disk(Path(d["path"]), d["serial"], d["readonly"]) for d in self.disks]


@dataclass
class _Box:
    id: str
    dir: Path
    record: _Record | None = None
    vmm: VmProcess | None = None
    mux: AgentMux | None = None
    handle: BoxHandle | None = None


class VmBackend:
    """Sandboxes as QEMU guests (kind ``"microvm"`` or ``"vm"``) on this node.

    ``machine`` is QEMU's machine (``microvm`` or ``q35``), ``artifacts`` the
    guest kernel and initramfs, ``accel`` what the probe found (kvm or tcg),
    ``qemu`` the qemu-system-x86_64 binary. ``boot_timeout_s`` bounds a cold
    boot until the agent answers (TCG boots in seconds, more under load);
    ``templates``: create by restoring a saved guest (False: boot every one).
    ``min_free_mb`` as for the container backend.
    """

    def __init__(
        self,
        state_dir: Path,
        kind: str,
        *,
        machine: Machine,
        artifacts: GuestArtifacts,
        accel: AccelInfo,
        qemu: str,
        boot_timeout_s: float = 120.0,
        templates: bool = True,
        min_free_mb: int = 1024,
    ) -> None:
        self.kind = kind
        self.state_dir = Path(os.path.abspath(state_dir))
        self.machine: Machine = machine
        self.artifacts = artifacts
        self.accel = accel
        self.qemu = qemu
        self.boot_timeout_s = boot_timeout_s
        self.templates_on = templates
        self.min_free_mb = min_free_mb
        self.sandboxes_dir = self.state_dir / "sandboxes"
        self.templates_dir = self.state_dir / "templates"
        for d in (self.sandboxes_dir, self.templates_dir):
            d.mkdir(parents=True, exist_ok=True)
        self.disks = DiskImages(self.state_dir / "disk-templates")
        self.cgroups = detect_layout()
        self._boxes: dict[str, _Box] = {}
        self._busy: set[str] = set()
        self._template_locks: dict[str, asyncio.Lock] = {}
        self._memory_max_mb = host_memory_mb()
        self._cpu_max = float(os.cpu_count() or 1)
        st = os.statvfs(self.state_dir)
        self._disk_max_mb = st.f_blocks * st.f_frsize >> 20

    def capabilities(self) -> dict[str, Any]:
        """Machine, accelerator (and why), kernel version and limit ranges."""
        return {
            "kind": self.kind,
            "machine": self.machine,
            "accel": self.accel.name,
            "accel_reason": self.accel.reason,
            "kernel": self.artifacts.kernel_version,
            "templates": self.templates_on,
            "memory_mb_max": self._memory_max_mb,
            "cpu_max": self._cpu_max,
            "pids_limit_range": [PIDS_MIN, PIDS_MAX],
            "disk_mb_range": [DISK_MIN_MB, self._disk_max_mb],
        }

    # ------------------------------------------------------------------ create

    def _validate(self, spec: SandboxSpec) -> None:
        validate_spec(
            spec, self.kind, NodeLimits(self._memory_max_mb, self._cpu_max, self._disk_max_mb)
        )
        if spec.init is not None:
            raise InvalidArgument(f"a {self.kind} runs the in-sandbox agent only (no custom init)")
        disks = 1 + sum(2 if x.data is not None else 1 for x in spec.layers)
        if self.machine == "microvm" and disks > MICROVM_MAX_DISKS:
            raise InvalidArgument(
                f"the image has {len(spec.layers)} layers, {disks - 1} disks with their data:"
                f" a microvm attaches at most {MICROVM_MAX_DISKS - 1} (plus its writable disk);"
                " squash the image's layers, or use kind='vm'"
            )
        for layer in spec.layers:
            for path in (layer.meta, layer.data):
                if path is not None and not path.exists():
                    raise NotFound(f"layer file {path} does not exist")

    async def create(self, spec: SandboxSpec) -> BoxHandle:
        """Start a VM and return once its agent answers.

        Raises ``InvalidArgument`` for a malformed id or limits outside the
        ranges of :meth:`capabilities`, ``AlreadyExists``, ``ResourceExhausted``
        when the node's disk is short, ``NotFound`` for a missing layer file
        and ``Internal`` for anything else (with the guest console's tail).
        Everything done so far is undone first.
        """
        self._validate(spec)
        if spec.id in self._busy or spec.id in self._boxes:
            raise AlreadyExists(f"sandbox {spec.id} already exists on this node")
        box_dir = self.sandboxes_dir / spec.id
        if box_dir.exists():
            raise AlreadyExists(
                f"sandbox {spec.id} already exists on this node (leftover {box_dir}; destroy it)"
            )
        disk_mb = spec.disk_mb if spec.disk_mb is not None else DEFAULT_DISK_MB
        st = os.statvfs(self.state_dir)
        free_mb = (st.f_bavail * st.f_frsize >> 20) - self.min_free_mb
        if free_mb <= 0 or (spec.disk_mb is not None and spec.disk_mb > free_mb):
            raise ResourceExhausted(
                f"the node's disk has {max(free_mb, 0)} MiB free after a {self.min_free_mb} MiB"
                f" reserve ({self.state_dir}); disk_mb={spec.disk_mb} asked"
            )
        self._busy.add(spec.id)
        box = _Box(id=spec.id, dir=box_dir)
        try:
            try:
                box_dir.mkdir(parents=True)
                return await self._start(spec, box, disk_mb)
            except BaseException as e:
                tail = log_tail(box_dir / "console.log") or log_tail(box_dir / "qemu.log")
                cleanup = ""
                try:
                    await self._teardown(box)
                except Exception as te:
                    cleanup = f"\ncleanup failed too: {te}"
                if isinstance(e, SandfleetError) and not isinstance(e, Internal) and not cleanup:
                    raise
                if isinstance(e, Exception):
                    msg = f"creating {self.kind} {spec.id} failed: {e}{cleanup}"
                    if tail:
                        msg += f"\n--- guest console tail ---\n{tail}"
                    raise Internal(msg) from e
                raise
        finally:
            self._busy.discard(spec.id)

    def _layer_disks(self, spec: SandboxSpec) -> list[Disk]:
        disks = []
        for i, layer in enumerate(spec.layers):
            disks.append(Disk(layer.meta, f"sfl{i}m"))
            data = layer.data
            if (data is None or data.stat().st_size == 0) and _erofs_extra_devices(layer.meta):
                # A split layer without file data (an unchanged snapshot): the guest's
                # EROFS (6.1) still wants the device its superblock names, and QEMU
                # refuses a disk of 0 sectors.
                data = self._empty_blob()
            if data is not None:
                disks.append(Disk(data, f"sfl{i}d"))
        return disks

    def _empty_blob(self) -> Path:
        path = self.state_dir / "empty.blob"
        if not path.exists():
            tmp = path.with_name(f".empty.blob.{os.getpid()}")
            tmp.write_bytes(bytes(4096))
            os.replace(tmp, path)
        return path

    def _cmdline(self, spec: SandboxSpec) -> str:
        args = [
            "console=ttyS0", "quiet", "loglevel=3", "panic=-1",
            # Debian turns on zeroing every page at allocation: costly under
            # emulation, and the guest is one sandbox.
            "init_on_alloc=0",
            f"sandfleet.layers={len(spec.layers)}",
            f"sandfleet.memory_mb={spec.memory_mb}",
            f"sandfleet.pids={spec.pids_limit}",
        ]  # fmt: skip
        if self.accel.name == "tcg":
            args += tcg_kernel_args()
        return " ".join(args)

    def _template_key(self, spec: SandboxSpec, vcpus: int, disk_mb: int) -> str:
        ident = {
            "machine": self.machine,
            "accel": self.accel.name,
            "guest": self.artifacts.key,
            "layers": [[x.digest, str(x.meta), str(x.data)] for x in spec.layers],
            "vcpus": vcpus,
            "memory_mb": spec.memory_mb,
            "pids": spec.pids_limit,
            "disk_mb": disk_mb,
        }
        return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:24]

    async def _start(self, spec: SandboxSpec, box: _Box, disk_mb: int) -> BoxHandle:
        vcpus = max(1, math.ceil(spec.cpu))
        layer_disks = self._layer_disks(spec)
        own_disk = box.dir / "disk.img"
        template: Path | None = None
        if self.templates_on:
            template = await self._template(spec, vcpus, disk_mb, layer_disks)
            await asyncio.to_thread(sparse_copy, template / "disk.img", own_disk, disk_mb << 20)
        else:
            await asyncio.to_thread(
                sparse_copy, self.disks.template(disk_mb), own_disk, disk_mb << 20
            )
        record = _Record(
            id=spec.id,
            machine=self.machine,
            accel=self.accel.name,
            vcpus=vcpus,
            cpu=spec.cpu,
            memory_mb=spec.memory_mb + GUEST_OVERHEAD_MB,
            cmdline=self._cmdline(spec),
            disks=[asdict(d) | {"path": str(d.path)} for d in [*layer_disks, _rw(own_disk)]],
            template=template.name if template else None,
            digests=[x.digest for x in spec.layers],
        )
        box.record = record
        _write_json(box.dir / "vm.json", asdict(record))
        await self._launch(box, record.cpu, restore_from=template)
        (box.dir / "ready").write_text("")
        assert box.vmm is not None
        box.handle = BoxHandle(
            id=spec.id,
            agent_socket=box.dir / "agent.sock",
            pid=box.vmm.pid,
            extra={"dir": str(box.dir), "template": record.template, "accel": self.accel.name},
        )
        self._boxes[spec.id] = box
        return box.handle

    def _config(
        self,
        box_dir: Path,
        record: _Record,
        *,
        memory_file: Path | None,
        shared: bool,
        incoming: bool,
    ) -> VmConfig:
        return VmConfig(
            machine=record.machine,
            accel="kvm" if record.accel == "kvm" else "tcg",
            vcpus=record.vcpus,
            memory_mb=record.memory_mb,
            kernel=self.artifacts.kernel,
            initramfs=self.artifacts.initramfs,
            cmdline=record.cmdline,
            disks=record.disk_list(),
            run_dir=box_dir,
            memory_file=memory_file,
            memory_shared=shared,
            incoming=incoming,
        )

    async def _launch(
        self,
        box: _Box,
        cpu: float,
        *,
        restore_from: Path | None = None,
        resume_from: Path | None = None,
        template_build: bool = False,
    ) -> None:
        """Start the VM of ``box`` (boot, template restore, or resume of a pause)
        in its host cgroup and connect the agent mux; returns once the guest's
        agent answered."""
        assert box.record is not None
        rec = box.record
        if restore_from is not None:
            cfg = self._config(
                box.dir, rec, memory_file=restore_from / "mem", shared=False, incoming=True
            )
        elif resume_from is not None:
            cfg = self._config(box.dir, rec, memory_file=None, shared=False, incoming=True)
        else:
            mem = box.dir / "mem" if template_build else None
            cfg = self._config(box.dir, rec, memory_file=mem, shared=template_build, incoming=False)
        procs = await asyncio.to_thread(
            VmCgroup(self.cgroups, box.id).create,
            (rec.memory_mb + QEMU_OVERHEAD_MB) << 20,
            cpu,
            QEMU_PIDS,
        )
        vmm = box.vmm = await launch(self.qemu, cfg, cgroup_procs=procs)
        deadline = time.monotonic() + self.boot_timeout_s
        state = restore_from / "state" if restore_from is not None else resume_from
        if state is not None:
            restoring = vmm.restore(
                state, template=restore_from is not None, timeout_s=self.boot_timeout_s
            )
            await self._exited_or(box, restoring)
        box.mux = AgentMux()
        left = max(1.0, deadline - time.monotonic())
        hello = Hello.now(box.id)
        await self._exited_or(
            box,
            box.mux.start(vmm.agent_socket, box.dir / "agent.sock", hello=hello, timeout_s=left),
        )
        await self._exited_or(box, AgentClient(box.dir / "agent.sock").ping())

    async def _exited_or(self, box: _Box, step: Any) -> Any:
        """Await ``step`` unless QEMU exits first, or the step fails because it did:
        then Internal with QEMU's log and the guest console's tail (init says there
        what it could not do), never a retryable error."""
        assert box.vmm is not None
        task = asyncio.ensure_future(step)
        exited = asyncio.ensure_future(box.vmm.wait())
        try:
            done, _ = await asyncio.wait({task, exited}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            task.cancel()
            exited.cancel()
            raise
        if task in done and (task.cancelled() or task.exception() is None):
            exited.cancel()
            return task.result()
        if task in done:
            # A failed step (e.g. the port closed): give QEMU a moment to show it exited.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(exited), 2.0)
            if not exited.done():
                exited.cancel()
                return task.result()  # QEMU runs on: the step's own error
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        console = log_tail(box.dir / "console.log", 800)
        raise Internal(
            f"QEMU exited with status {exited.result()} while starting {box.id}"
            f"{_log_hint(box.dir / 'qemu.log')}"
            + (f"\n--- guest console tail ---\n{console}" if console else "")
        )

    # ------------------------------------------------------------------ templates

    async def _template(
        self, spec: SandboxSpec, vcpus: int, disk_mb: int, layer_disks: list[Disk]
    ) -> Path:
        """The template directory of this spec's key, booted and saved on first use."""
        key = self._template_key(spec, vcpus, disk_mb)
        final = self.templates_dir / key
        lock = self._template_locks.setdefault(key, asyncio.Lock())
        async with lock:
            if (final / "state").exists():
                os.utime(final)  # least recently used goes first
                return final
            work = self.templates_dir / f".{key}.tmp"
            await asyncio.to_thread(shutil.rmtree, work, True)
            work.mkdir()
            box = _Box(id=f"template-{key[:12]}", dir=work)
            disk = work / "disk.img"
            await asyncio.to_thread(sparse_copy, self.disks.template(disk_mb), disk, disk_mb << 20)
            box.record = _Record(
                id=box.id,
                machine=self.machine,
                accel=self.accel.name,
                vcpus=vcpus,
                cpu=float(vcpus),
                memory_mb=spec.memory_mb + GUEST_OVERHEAD_MB,
                cmdline=self._cmdline(spec),
                disks=[asdict(d) | {"path": str(d.path)} for d in [*layer_disks, _rw(disk)]],
            )
            try:
                await self._launch(box, float(vcpus), template_build=True)
                assert box.mux is not None and box.vmm is not None
                await box.mux.quiesce(timeout_s=30)
                await box.vmm.save(work / "state", template=True, timeout_s=120)
            except BaseException:
                await self._stop_vm(box)
                await asyncio.to_thread(shutil.rmtree, work, True)
                raise
            await self._stop_vm(box)
            for name in ("serial.sock", "qmp.sock", "agent.sock", "pid", "vm.json"):
                (work / name).unlink(missing_ok=True)
            os.replace(work, final)
            await asyncio.to_thread(self._trim_templates)
            return final

    def _trim_templates(self) -> None:
        kept = sorted(
            (p for p in self.templates_dir.iterdir() if not p.name.startswith(".")),
            key=lambda p: p.stat().st_mtime,
            reverse=True,
        )
        # Clones map a template's RAM file; deleting it leaves their mapping intact.
        for old in kept[MAX_TEMPLATES:]:
            shutil.rmtree(old, ignore_errors=True)

    # ------------------------------------------------------------------ destroy

    async def destroy(self, sandbox_id: str) -> None:
        """Kill the VM's QEMU and remove all it created. Idempotent.

        Raises ``InvalidArgument`` for a malformed id and ``Internal`` when
        something could not be removed.
        """
        if not ID_RE.match(sandbox_id):
            raise InvalidArgument(f"sandbox id {sandbox_id!r} is malformed")
        while sandbox_id in self._busy:
            await asyncio.sleep(0.005)
        box = self._boxes.pop(sandbox_id, None) or _Box(
            id=sandbox_id, dir=self.sandboxes_dir / sandbox_id
        )
        self._busy.add(sandbox_id)
        try:
            await self._teardown(box)
        finally:
            self._busy.discard(sandbox_id)

    async def _stop_vm(self, box: _Box) -> list[str]:
        """Stop the mux and QEMU and remove its cgroup; returns what is left."""
        if box.mux is not None:
            await box.mux.close()
            box.mux = None
        if box.vmm is None:
            box.vmm = QemuVm.adopt(box.dir)
        if box.vmm is not None:
            await box.vmm.kill()
            box.vmm = None
        stuck = await asyncio.to_thread(VmCgroup(self.cgroups, box.id).remove)
        return [f"cgroup {d} busy" for d in stuck]

    async def _teardown(self, box: _Box) -> None:
        problems = await self._stop_vm(box)
        if box.dir.exists() and not problems:
            await asyncio.to_thread(shutil.rmtree, box.dir, True)
            if box.dir.exists():
                problems.append(f"could not remove {box.dir}")
        if problems:
            raise Internal(f"destroying sandbox {box.id} left: " + "; ".join(problems))

    # ------------------------------------------------------------------ pause

    def _running(self, sandbox_id: str) -> _Box:
        box = self._boxes.get(sandbox_id)
        if box is None or box.record is None:
            if sandbox_id in self._busy:
                raise FailedPrecondition(f"sandbox {sandbox_id} is being created or destroyed")
            raise NotFound(f"sandbox {sandbox_id} does not exist on this node")
        return box

    async def pause(self, sandbox_id: str) -> None:
        """Save the VM's memory and device state to disk and stop its QEMU. Idempotent.

        Raises ``NotFound``, ``FailedPrecondition`` while calls are in flight in
        it (a call cannot survive its QEMU; pause once they ended) or while it
        is being created, and ``Internal`` when saving fails (the VM is then
        left running).
        """
        box = self._running(sandbox_id)
        assert box.record is not None
        if box.record.paused:
            return
        assert box.mux is not None and box.vmm is not None
        self._busy.add(sandbox_id)
        try:
            await self._quiesce(box)
            state = box.dir / "paused.state"
            try:
                await box.vmm.save(state, template=False, timeout_s=300)
            except BaseException:
                state.unlink(missing_ok=True)
                with contextlib.suppress(SandfleetError):
                    await box.vmm.resume()
                    await box.mux.reconnect(Hello.now(box.id))
                raise
            box.record.paused = True
            box.record.template = None  # its RAM is in paused.state now
            _write_json(box.dir / "vm.json", asdict(box.record))
            await self._stop_vm(box)
            (box.dir / "pid").unlink(missing_ok=True)
        finally:
            self._busy.discard(sandbox_id)

    async def resume(self, sandbox_id: str) -> None:
        """Start the VM again from its saved state; idempotent. Errors as :meth:`pause`."""
        box = self._running(sandbox_id)
        assert box.record is not None
        if not box.record.paused:
            return
        self._busy.add(sandbox_id)
        try:
            state = box.dir / "paused.state"
            await self._launch(box, box.record.cpu, resume_from=state)
            box.record.paused = False
            _write_json(box.dir / "vm.json", asdict(box.record))
            state.unlink(missing_ok=True)
            if box.handle is not None and box.vmm is not None:
                box.handle.pid = box.vmm.pid
        except BaseException:
            await self._stop_vm(box)
            raise
        finally:
            self._busy.discard(sandbox_id)

    async def _quiesce(self, box: _Box) -> None:
        """Have the guest drop its (idle) channels and flush its disks; the mux
        accepts no call until it is reconnected."""
        assert box.mux is not None
        if box.mux.active_channels():
            # A call lives in QEMU's memory and on its sockets: it cannot be saved.
            raise FailedPrecondition(
                f"sandbox {box.id} has {box.mux.active_channels()} calls in flight; a"
                f" {self.kind} is saved to disk and its QEMU stopped, which no call survives:"
                " retry once they ended"
            )
        await box.mux.quiesce(timeout_s=30)

    async def snapshot(
        self, sandbox_id: str, meta_file: Path, blob_file: Path, exclude_regex: Sequence[str] = ()
    ) -> list[str] | None:
        """Pack the VM's writable layer into a split EROFS layer (see snapshot.py).

        The guest flushes its disks and its vCPUs stop while the host reads the
        disk image; a paused VM is read as it is. Returns the digests of the
        layers it was started from, bottom first. Raises ``NotFound``,
        ``FailedPrecondition`` (being created, destroyed or paused/resumed;
        calls in flight) and what :func:`pack_disk_upper` raises.
        """
        box = self._running(sandbox_id)
        assert box.record is not None
        if sandbox_id in self._busy:
            raise FailedPrecondition(
                f"sandbox {sandbox_id} is being created, destroyed, paused or snapshotted:"
                " retry later"
            )
        self._busy.add(sandbox_id)
        try:
            if box.record.paused:
                await settled(pack_disk_upper, box.dir / "disk.img", meta_file, exclude_regex,
                               blob_file)  # fmt: skip
            else:
                assert box.mux is not None and box.vmm is not None
                await self._quiesce(box)
                try:
                    await box.vmm.stop_vcpus()
                    try:
                        await settled(pack_disk_upper, box.dir / "disk.img", meta_file,
                                       exclude_regex, blob_file)  # fmt: skip
                    finally:
                        await box.vmm.resume()
                finally:
                    await box.mux.reconnect(Hello.now(box.id))
        finally:
            self._busy.discard(sandbox_id)
        return box.record.digests

    def paused(self, sandbox_id: str) -> bool:
        box = self._boxes.get(sandbox_id)
        return bool(box and box.record and box.record.paused)

    def oom_kills(self, sandbox_id: str) -> int:
        """Always 0: the guest's agent reports OOM kills with each exec's result."""
        return 0

    def handle(self, sandbox_id: str) -> BoxHandle:
        box = self._boxes.get(sandbox_id)
        if box is None or box.handle is None:
            raise NotFound(f"sandbox {sandbox_id} does not exist on this node")
        return box.handle

    # ------------------------------------------------------------------ restart

    async def recover(self) -> list[BoxHandle]:
        """Adopt VMs that survived a restart of the node agent; destroy the rest.

        Adopted: a ``ready`` VM whose QEMU still runs (its mux is reconnected)
        or that is paused (no QEMU). Half-made templates are removed.
        """
        for tmp in self.templates_dir.glob(".*.tmp"):
            # A template being built when the node agent died: its QEMU runs on.
            await self._stop_vm(_Box(id=f"template-{tmp.name[1:13]}", dir=tmp))
            shutil.rmtree(tmp, ignore_errors=True)
        handles = []
        for box_dir in sorted(self.sandboxes_dir.iterdir()):
            sid = box_dir.name
            if sid in self._boxes or sid in self._busy or not ID_RE.match(sid):
                continue
            box = _Box(id=sid, dir=box_dir)
            try:
                doc = json.loads((box_dir / "vm.json").read_text())
                box.record = _Record(**doc)
            except (OSError, ValueError, TypeError):
                box.record = None
            adopted = False
            if box.record is not None and (box_dir / "ready").exists():
                if box.record.paused:
                    adopted = True
                else:
                    box.vmm = QemuVm.adopt(box_dir)
                    if box.vmm is not None:
                        box.mux = AgentMux()
                        try:
                            await box.mux.start(
                                box.vmm.agent_socket, box_dir / "agent.sock",
                                hello=Hello.now(sid), timeout_s=10,
                            )  # fmt: skip
                            adopted = True
                        except SandfleetError:
                            adopted = False
            if not adopted:
                await self._teardown(box)
                continue
            box.handle = BoxHandle(
                id=sid,
                agent_socket=box_dir / "agent.sock",
                pid=box.vmm.pid if box.vmm else None,
                extra={"dir": str(box_dir), "adopted": True},
            )
            self._boxes[sid] = box
            handles.append(box.handle)
        return handles

    async def close(self) -> None:
        """Stop relaying; the VMs keep running (see :meth:`recover`)."""
        for box in self._boxes.values():
            if box.mux is not None:
                await box.mux.close()
                box.mux = None
            if box.vmm is not None:
                await box.vmm.disconnect()
        self._boxes.clear()


# ---------------------------------------------------------------------- helpers


def _erofs_extra_devices(meta: Path) -> int:
    """The ``extra_devices`` count of an EROFS superblock (offset 1024; the field
    at +86, le16, per erofs_fs.h); 0 when unreadable."""
    try:
        with open(meta, "rb") as fh:
            fh.seek(1024)
            sb = fh.read(88)
    except OSError:
        return 0
    if len(sb) < 88 or sb[:4] != b"\xe2\xe1\xf5\xe0":
        return 0
    return int.from_bytes(sb[86:88], "little")


def _rw(path: Path) -> Disk:
    return Disk(path, "sfdisk", readonly=False)


def _write_json(path: Path, doc: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)


def _log_hint(path: Path) -> str:
    tail = log_tail(path, 500)
    return f": {tail}" if tail else ""
