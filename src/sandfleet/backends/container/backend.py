"""The ``container`` backend: runc + overlayfs over shared EROFS layer mounts.

Layout under ``state_dir``::

    runc/                      runc --root, ours alone
    layers/<name>/             read-only EROFS mounts, shared, refcounted
    disk-templates/            formatted ext4 images, one per disk size (node-wide)
    sandboxes/<id>/            the OCI bundle
        config.json            written by :func:`bundle.oci_config`
        sandbox.json           what teardown and recover need (layer names)
        disk.img               the writable layer's filesystem: ext4 of disk_mb MiB,
                               sparse, on a loop device (see disk.py)
        disk/                  its mount: upper/ and work/ of the overlay
        rootfs/                the overlay mount
        ready                  written once create succeeded: recover adopts only these
        agent.sock             the agent's socket: bound here by the node, handed to
                               the box as fd 3; no path to it exists inside the box
        log                    runc's and the agent's stdout/stderr
        pid                    runc --pid-file

A box is started with ``runc run -d`` whose stdio is the log file: runc hands
its stdio to the container, so a pipe would never reach EOF. It is stopped by
SIGKILL to its PID 1 (the kernel then kills the rest of its PID namespace)
followed by ``runc delete --force``: ~10 ms instead of ~110 ms for runc's
freeze-kill-thaw on a running container.

The bundle directory is the record of a box: it is made before anything else
and removed only once everything else is gone, so a create or destroy cut
short (even by SIGKILL of the node agent) leaves a bundle that ``recover``
finds and finishes destroying.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import re
import resource
import shutil
import signal
import socket
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from sandfleet.backends.base import BoxHandle, BoxInit, SandboxSpec
from sandfleet.backends.container.bundle import AGENT_LISTEN_FD, oci_config
from sandfleet.backends.container.cgroups import CgroupLayout, detect_layout, remove_cgroups
from sandfleet.backends.container.disk import DiskImages
from sandfleet.backends.container.freezer import Freezer
from sandfleet.backends.container.layers import LayerCache
from sandfleet.backends.container.netns import ensure_loopback_up_async
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
from sandfleet.node.mounts import MNT_DETACH, mount, mounts_under, umount
from sandfleet.wire.errors import (
    AlreadyExists,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    SandfleetError,
)

__all__ = ["ContainerBackend"]

T = TypeVar("T")

CPU_OVERCOMMIT = 1  # a quota beyond the node's cores would limit nothing: refuse it


def _filesystems() -> set[str]:
    with open("/proc/filesystems", encoding="ascii") as fh:
        return {line.split()[-1] for line in fh if line.strip()}


@dataclass
class _Box:
    id: str
    bundle: Path
    layers: list[str] = field(default_factory=list)
    pid: int | None = None
    pidfd: int | None = None
    handle: BoxHandle | None = None


class ContainerBackend:
    """Sandboxes as runc containers on this node (kind ``"container"``).

    ``state_dir`` holds everything this backend creates (see the module
    docstring); ``agent_binary`` is the static in-sandbox agent, bind-mounted
    read-only into every box; ``runc`` is the runc executable.
    ``agent_timeout_s`` bounds the wait for the agent's first answer, seconds.
    ``node_id``, when given, lets ``recover`` also remove cgroups of this
    node's sandboxes (ids ``sb-<12 hex>-<node_id>``) that have no bundle.
    ``min_free_mb``: creates are refused (``ResourceExhausted``) while the
    filesystem of ``state_dir`` has less free space than this, MiB: writable
    layers are sparse, so their limits may add up to more than the disk.
    Raises ``InvalidArgument`` when ``state_dir`` contains ``:`` or ``,``
    (overlayfs option separators), ``Internal`` when the agent binary is
    missing or runc does not run, and ``FailedPrecondition`` when the host
    lacks what disk limits need (e2fsprogs, loop devices).

    Call from one event loop; ``create`` and ``destroy`` of different ids may
    run concurrently.
    """

    kind = "container"

    def __init__(
        self,
        state_dir: Path,
        agent_binary: Path,
        runc: str = "runc",
        *,
        agent_timeout_s: float = 5.0,
        node_id: str | None = None,
        min_free_mb: int = 1024,
    ) -> None:
        self.state_dir = Path(os.path.abspath(state_dir))
        if any(c in str(self.state_dir) for c in ":,"):
            raise InvalidArgument(f"state_dir {state_dir} must not contain ':' or ','")
        self.agent_binary = Path(os.path.abspath(agent_binary))
        if not self.agent_binary.is_file():
            raise Internal(f"agent binary {agent_binary} does not exist")
        self.runc = shutil.which(runc) or runc
        self.agent_timeout_s = agent_timeout_s
        self.node_id = node_id
        self.min_free_mb = min_free_mb
        self.runc_root = self.state_dir / "runc"
        self.sandboxes_dir = self.state_dir / "sandboxes"
        for d in (self.runc_root, self.sandboxes_dir):
            d.mkdir(parents=True, exist_ok=True)
        os.chmod(self.runc_root, 0o700)
        self.layers = LayerCache(self.state_dir / "layers")
        self.layers.adopt()
        self.disks = DiskImages(self.state_dir / "disk-templates")
        self.cgroups: CgroupLayout = detect_layout()
        self.freezer = Freezer(self.cgroups)
        self._boxes: dict[str, _Box] = {}
        self._busy: set[str] = set()  # ids with a create or destroy in flight
        self._memory_max_mb = host_memory_mb()
        self._cpu_max = float((os.cpu_count() or 1) * CPU_OVERCOMMIT)
        st = os.statvfs(self.state_dir)
        self._disk_max_mb = st.f_blocks * st.f_frsize >> 20
        # runc applies RLIMIT_NOFILE after dropping CAP_SYS_RESOURCE, so it
        # cannot exceed our own hard limit.
        self._nofile = min(65536, resource.getrlimit(resource.RLIMIT_NOFILE)[1])
        self._overlay_volatile = True
        self._caps = self._probe()

    # ------------------------------------------------------------------ probing

    def _probe(self) -> dict[str, Any]:
        import subprocess

        version = "unknown"
        libseccomp = "unknown"
        try:
            out = subprocess.run(
                [self.runc, "--version"], capture_output=True, text=True, timeout=10, check=True
            ).stdout
            for line in out.splitlines():
                key, _, value = line.partition(" version ")
                if key == "runc":
                    version = value.strip()
                elif line.startswith("libseccomp:"):
                    libseccomp = line.split(":", 1)[1].strip()
        except (OSError, subprocess.SubprocessError) as e:
            raise Internal(f"runc ({self.runc}) does not run: {e}") from e
        fs = _filesystems()
        return {
            "kind": self.kind,
            "cgroup_mode": self.cgroups.mode,
            "runc_version": version,
            "libseccomp": libseccomp,
            "overlayfs": "overlay" in fs,
            # erofs may be a module not loaded yet; mount(2) loads it on demand.
            "erofs": "erofs" in fs or _module_available("erofs"),
            "memory_mb_max": self._memory_max_mb,
            "cpu_max": self._cpu_max,
            "pids_limit_range": [PIDS_MIN, PIDS_MAX],
            "disk_mb_range": [DISK_MIN_MB, self._disk_max_mb],
        }

    def capabilities(self) -> dict[str, Any]:
        """What was probed at start: cgroup mode (v1/v2/hybrid), runc and
        libseccomp versions, overlayfs/erofs availability, limit ranges."""
        return dict(self._caps)

    # ------------------------------------------------------------------ create

    def _validate(self, spec: SandboxSpec) -> None:
        validate_spec(
            spec, self.kind, NodeLimits(self._memory_max_mb, self._cpu_max, self._disk_max_mb)
        )

    async def create(self, spec: SandboxSpec) -> BoxHandle:
        """Start a box and return once its agent answers.

        Raises ``InvalidArgument`` for a malformed id or limits outside the
        ranges in :meth:`capabilities` (memory_mb 16..host MiB, cpu
        0.01..4x host cores, pids_limit 8..65536, disk_mb 4..size of the
        state dir's filesystem; None: that size), ``AlreadyExists`` for an id
        in use, ``ResourceExhausted`` when the node's disk has less than
        ``min_free_mb`` free, ``NotFound`` for a missing layer file and ``Internal`` for
        anything else (bad layer image, runc error, agent not answering within
        ``agent_timeout_s``), with the tail of the box's log. On any failure
        everything done so far is undone first.
        """
        self._validate(spec)
        if spec.id in self._busy or spec.id in self._boxes:
            raise AlreadyExists(f"sandbox {spec.id} already exists on this node")
        bundle = self.sandboxes_dir / spec.id
        if bundle.exists():
            raise AlreadyExists(
                f"sandbox {spec.id} already exists on this node (leftover {bundle}; destroy it)"
            )
        st = os.statvfs(self.state_dir)
        free_mb = (st.f_bavail * st.f_frsize >> 20) - self.min_free_mb
        if free_mb <= 0:
            raise ResourceExhausted(
                f"the node's disk has less than {self.min_free_mb} MiB free ({self.state_dir})"
            )
        if spec.disk_mb is not None and spec.disk_mb > free_mb:
            # Images are sparse, but one box must not be able to fill the node's disk.
            raise ResourceExhausted(
                f"disk_mb={spec.disk_mb} is more than this node's free disk ({free_mb} MiB"
                f" after a {self.min_free_mb} MiB reserve): ask for less"
            )
        self._busy.add(spec.id)
        box = _Box(id=spec.id, bundle=bundle)
        try:
            try:
                return await self._start(spec, box)
            except BaseException as e:
                tail = log_tail(bundle / "log")
                cleanup = ""
                try:
                    await self._teardown(box)
                except Exception as te:  # reported with the original error
                    cleanup = f"\ncleanup failed too: {te}"
                if isinstance(e, SandfleetError) and not isinstance(e, Internal) and not cleanup:
                    raise
                if isinstance(e, Exception):
                    msg = f"creating sandbox {spec.id} failed: {e}{cleanup}"
                    if tail:
                        msg += f"\n--- log tail ---\n{tail}"
                    raise Internal(msg) from e
                raise
        finally:
            self._busy.discard(spec.id)

    async def _start(self, spec: SandboxSpec, box: _Box) -> BoxHandle:
        bundle = box.bundle
        bundle.mkdir(mode=0o700)
        (bundle / "rootfs").mkdir()
        # Loop devices and mounts can block for milliseconds in the kernel: off the
        # event loop, so creates in flight overlap instead of queueing behind them.
        disk = None
        if spec.init is None:
            disk = await settled(self.disks.make, bundle, spec.disk_mb or self._disk_max_mb)
        lowers = []
        for layer in spec.layers:
            name, point = self.layers.acquire(layer)
            box.layers.append(name)
            lowers.append(str(point))
        # "digests": the layers stacked, bottom first (what a snapshot stacks on).
        record = {"id": spec.id, "layers": box.layers, "digests": [x.digest for x in spec.layers]}
        (bundle / "sandbox.json").write_text(json.dumps(record))
        if spec.init is not None:
            # On a read-only root the mount points must exist below: a top layer
            # of them (which also gives overlayfs the two lower layers it needs).
            lowers.append(str(_mount_points(bundle / "points", spec.init)))
        # overlayfs wants the top layer first
        await settled(self._mount_rootfs, bundle, disk, list(reversed(lowers)))

        cg_path = f"/sandfleet/{spec.id}"
        config = oci_config(
            sandbox_id=spec.id,
            agent_host_path=str(self.agent_binary),
            env=spec.env,
            memory_mb=spec.memory_mb,
            cpu=spec.cpu,
            pids_limit=spec.pids_limit,
            cgroups_path=cg_path,
            nofile=self._nofile,
            init=spec.init,
        )
        (bundle / "config.json").write_text(json.dumps(config))

        rc = await self._runc_run(bundle, spec.id)
        if rc != 0:
            raise Internal(f"runc run exited with status {rc}")
        box.pid = int((bundle / "pid").read_text())
        box.pidfd = _open_pidfd(box.pid, cg_path)
        sock = bundle / "agent.sock"
        # The loopback guard runs in its own thread while the agent starts.
        lo = asyncio.ensure_future(ensure_loopback_up_async(box.pid))
        try:
            await self._wait_agent(sock, box.pidfd, spec.init.ready if spec.init else None)
        finally:
            await asyncio.wait({lo})
            lo_err = lo.exception()  # retrieved even when the agent failed first
        if lo_err is not None:
            raise lo_err
        box.handle = BoxHandle(
            id=spec.id,
            agent_socket=sock,
            pid=box.pid,
            extra={"bundle": str(bundle), "cgroup": cg_path, "workdir": spec.workdir},
        )
        (bundle / "ready").touch()
        self._boxes[spec.id] = box
        return box.handle

    def _mount_rootfs(self, bundle: Path, disk: Path | None, lowers_top_first: list[str]) -> None:
        opts = f"lowerdir={':'.join(lowers_top_first)}"
        if disk is None:  # read-only: no upper layer
            mount("overlay", bundle / "rootfs", "overlay", 0, opts)
            return
        opts += f",upperdir={disk / 'upper'},workdir={disk / 'work'}"
        if self._overlay_volatile:
            # volatile: no syncfs on unmount; the upper layer dies with the box.
            try:
                mount("overlay", bundle / "rootfs", "overlay", 0, opts + ",volatile")
                return
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self._overlay_volatile = False  # kernel < 5.10
        mount("overlay", bundle / "rootfs", "overlay", 0, opts)

    async def _runc_run(self, bundle: Path, sandbox_id: str) -> int:
        listener = _bind_agent_socket(bundle)
        log_fd = os.open(
            bundle / "log", os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600
        )
        null_fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        try:
            # posix_spawn, not subprocess: it can place the listener at exactly fd 3
            # (what --preserve-fds passes on) without a preexec_fn in a threaded process.
            pid = os.posix_spawnp(
                self.runc,
                [
                    self.runc, "--root", str(self.runc_root), "run", "-d", "--preserve-fds", "1",
                    "--pid-file", str(bundle / "pid"), "--bundle", str(bundle), sandbox_id,
                ],
                os.environ,
                file_actions=[
                    (os.POSIX_SPAWN_DUP2, null_fd, 0),
                    (os.POSIX_SPAWN_DUP2, log_fd, 1),
                    (os.POSIX_SPAWN_DUP2, log_fd, 2),
                    (os.POSIX_SPAWN_DUP2, listener.fileno(), AGENT_LISTEN_FD),
                ],
            )  # fmt: skip
        finally:
            os.close(log_fd)
            os.close(null_fd)
            listener.close()  # the box holds it now
        pidfd = os.pidfd_open(pid)
        try:
            await _wait_fd(pidfd, 120.0)
            _, status = os.waitpid(pid, 0)
        except BaseException:
            # Cancelled: let runc finish so that teardown sees a consistent state.
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            await asyncio.shield(asyncio.to_thread(os.waitpid, pid, 0))
            raise
        finally:
            os.close(pidfd)
        return os.waitstatus_to_exitcode(status)

    async def _wait_agent(
        self, sock: Path, pidfd: int, probe: Callable[[Path], Awaitable[None]] | None = None
    ) -> None:
        """Wait for the agent (or ``probe``) to answer; fail at once if the box's PID 1 exits."""
        from sandfleet.guest.client import AgentClient

        loop = asyncio.get_running_loop()
        died: asyncio.Future[None] = loop.create_future()
        loop.add_reader(pidfd, _resolve, died)
        if probe is None:
            ready = asyncio.ensure_future(AgentClient(sock).wait_ready(self.agent_timeout_s))
        else:
            ready = asyncio.ensure_future(asyncio.wait_for(probe(sock), self.agent_timeout_s))
        try:
            await asyncio.wait({ready, died}, return_when=asyncio.FIRST_COMPLETED)
            if ready.done():
                ready.result()  # re-raises the client's error
                return
            what = "the agent" if probe is None else "PID 1"
            raise Internal(f"{what} (PID 1 of the box) exited before answering")
        except (TimeoutError, OSError) as e:
            raise Internal(
                f"the agent did not answer on {sock} within {self.agent_timeout_s:g} s: {e}"
            ) from e
        finally:
            loop.remove_reader(pidfd)
            if not ready.done():
                ready.cancel()
                with contextlib.suppress(BaseException):
                    await ready

    # ------------------------------------------------------------------ destroy

    async def destroy(self, sandbox_id: str) -> None:
        """Kill every process of the box and remove all it created. Idempotent.

        Works whether the box runs, died, or was only half created. Raises
        ``InvalidArgument`` for a malformed id and ``Internal`` when something
        could not be removed (the message names it).
        """
        if not ID_RE.match(sandbox_id):
            raise InvalidArgument(f"sandbox id {sandbox_id!r} is malformed")
        while sandbox_id in self._busy:  # a create or destroy of this id in flight
            await asyncio.sleep(0.005)
        box = self._boxes.pop(sandbox_id, None)
        if box is None:
            box = _Box(id=sandbox_id, bundle=self.sandboxes_dir / sandbox_id)
            box.layers = _recorded_layers(box.bundle)
            for name in box.layers:
                # Refcounts of an unknown box were never taken; take them so
                # that teardown's release balances.
                self.layers.take(name)
        self._busy.add(sandbox_id)
        try:
            await self._teardown(box)
        finally:
            self._busy.discard(sandbox_id)

    async def _teardown(self, box: _Box) -> None:
        problems: list[str] = []
        init_dead = False
        if box.pidfd is not None:
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(box.pidfd, signal.SIGKILL)
            # A paused box dies once thawed: it wakes with SIGKILL pending, running nothing.
            self.freezer.thaw_now(f"/sandfleet/{box.id}")
            if init_dead := await _wait_fd(box.pidfd, 1.0):
                # Reap it if it is our child (the node agent may be a child
                # subreaper); otherwise its parent, usually PID 1, does.
                with contextlib.suppress(ChildProcessError, OSError):
                    os.waitid(os.P_PIDFD, box.pidfd, os.WEXITED | os.WNOHANG)
            os.close(box.pidfd)
            box.pidfd = None
        runc_state = self.runc_root / box.id
        if runc_state.exists() and not init_dead:
            self.freezer.thaw_now(f"/sandfleet/{box.id}")  # runc cannot kill a frozen box
            rc, out = await self._runc("delete", "--force", box.id)
            if rc != 0 and "does not exist" not in out:
                problems.append(f"runc delete: {out.strip()}")
        # With its init gone, the kernel has killed the whole PID namespace, and all
        # `runc delete` would do is remove cgroups and its state dir: done below,
        # without starting a Go process per destroy (~1/3 of runc's CPU per sandbox).
        left = self.cgroups.dirs(f"/sandfleet/{box.id}")
        if any(d.exists() for d in left):
            stuck = await asyncio.to_thread(remove_cgroups, left)
            problems += [f"cgroup {d} busy" for d in stuck]
        if runc_state.exists() and not problems:
            await asyncio.to_thread(shutil.rmtree, runc_state, True)
        await settled(_unmount_all, box.bundle)
        for name in box.layers:
            self.layers.release(name)
        box.layers = []
        if mounts_under(box.bundle):
            problems.append(f"mounts remain under {box.bundle}")
        if box.bundle.exists() and not problems:
            # Last: the bundle is the record that lets destroy/recover finish the job.
            await asyncio.to_thread(shutil.rmtree, box.bundle, True)
            if box.bundle.exists():
                problems.append(f"could not remove {box.bundle}")
        if problems:
            raise Internal(f"destroying sandbox {box.id} left: " + "; ".join(problems))

    async def _runc(self, *args: str, stderr: bool = True) -> tuple[int, str]:
        """Run ``runc --root <ours> *args``; returns its status and stdout (+ stderr)."""
        proc = await asyncio.create_subprocess_exec(
            self.runc, "--root", str(self.runc_root), *args,
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT if stderr else asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        out, _ = await proc.communicate()
        return proc.returncode or 0, out.decode("utf-8", errors="replace")

    # ------------------------------------------------------------------ pause

    async def pause(self, sandbox_id: str) -> None:
        """Freeze every process of the box (cgroup freezer): its memory stays, it uses no CPU.

        Idempotent. Raises ``NotFound`` for a box this backend does not run,
        ``FailedPrecondition`` while it is being created or destroyed, and
        ``Internal`` when the freeze does not complete (the box is left running).
        """
        await self.freezer.freeze(self._cgroup_of_running(sandbox_id))

    async def resume(self, sandbox_id: str) -> None:
        """Thaw a paused box. Idempotent (a running box is left as it is).

        Raises ``NotFound``, ``FailedPrecondition`` and ``Internal`` as :meth:`pause` does.
        """
        await self.freezer.thaw(self._cgroup_of_running(sandbox_id))

    def paused(self, sandbox_id: str) -> bool:
        """Whether the box is frozen (False for an unknown box)."""
        if not ID_RE.match(sandbox_id):
            return False
        return self.freezer.frozen(f"/sandfleet/{sandbox_id}")

    def _cgroup_of_running(self, sandbox_id: str) -> str:
        if sandbox_id in self._busy:
            raise FailedPrecondition(
                f"sandbox {sandbox_id} is being created or destroyed: retry once it is running"
            )
        if sandbox_id not in self._boxes:
            raise NotFound(f"sandbox {sandbox_id} does not exist on this node")
        return f"/sandfleet/{sandbox_id}"

    # ------------------------------------------------------------------ snapshot

    async def snapshot(
        self, sandbox_id: str, meta_file: Path, blob_file: Path, exclude_regex: Sequence[str] = ()
    ) -> list[str] | None:
        """Pack the box's writable layer into a split EROFS layer, frozen meanwhile.

        ``meta_file``, ``blob_file`` and ``exclude_regex`` as for
        :func:`~sandfleet.images.erofs.pack_erofs`. Returns the digests of the
        layers the box was started from, bottom first (None for a box created
        before they were recorded). A destroy meanwhile waits
        for the end. Raises ``NotFound``, ``FailedPrecondition`` (being created
        or destroyed, or in another snapshot; no writable layer) and what
        :func:`sandfleet.backends.container.snapshot.pack_upper` raises.
        """
        from sandfleet.backends.container.snapshot import pack_upper

        if sandbox_id in self._busy:
            raise FailedPrecondition(
                f"sandbox {sandbox_id} is being created, destroyed or snapshotted: retry later"
            )
        box = self._boxes.get(sandbox_id)
        if box is None:
            raise NotFound(f"sandbox {sandbox_id} does not exist on this node")
        try:
            digests = json.loads((box.bundle / "sandbox.json").read_text()).get("digests")
        except (OSError, ValueError, AttributeError):
            digests = None
        self._busy.add(sandbox_id)  # destroy waits; create, pause and recover keep off
        try:
            await pack_upper(
                self.freezer, sandbox_id, box.bundle, meta_file, exclude_regex, blob_file
            )
        finally:
            self._busy.discard(sandbox_id)
        return None if digests is None else [str(d) for d in digests]

    # ------------------------------------------------------------------ queries

    def oom_kills(self, sandbox_id: str) -> int:
        """Processes the box's memory limit has killed so far; 0 if unknown.

        Read from memory.oom_control (cgroup v1) or memory.events (v2).
        """
        if not ID_RE.match(sandbox_id):
            return 0
        return self.cgroups.oom_kills(f"/sandfleet/{sandbox_id}")

    def handle(self, sandbox_id: str) -> BoxHandle:
        """The handle of a running box. Raises ``NotFound``."""
        box = self._boxes.get(sandbox_id)
        if box is None or box.handle is None:
            raise NotFound(f"sandbox {sandbox_id} does not exist on this node")
        return box.handle

    # ------------------------------------------------------------------ restart

    async def recover(self) -> list[BoxHandle]:
        """Adopt boxes that survived a restart of the node agent; destroy the rest.

        Adopted: running or paused containers in our runc root whose create
        finished (bundle with its ``ready`` mark). Everything else a previous
        instance left is removed, also when it was killed in the middle of a
        create or destroy: runc commands still running on our runc root are
        killed first (a ``runc run`` outliving its node agent would otherwise
        start a box after the sweep), then every bundle that is not adopted is
        destroyed (runc container in any state, cgroups, overlay and disk
        mounts, loop devices, state), and with ``node_id`` set, cgroups of this
        node's sandboxes that have no bundle. Layer mounts are re-adopted and
        refcounted from the adopted boxes. Returns the adopted handles.
        """
        self.layers.adopt()
        for tmp in self.disks.root.glob(".*.tmp"):
            # Half-made templates: files, or the directory trees they are made from.
            if tmp.is_dir() and not tmp.is_symlink():
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                tmp.unlink(missing_ok=True)
        await self._kill_stray_runc()
        # stdout alone: runc warns on stderr about state dirs without state.json
        rc, out = await self._runc("list", "--format", "json", stderr=False)
        states = (json.loads(out or "null") or []) if rc == 0 else []
        handles: list[BoxHandle] = []
        for st in states:
            sid = str(st.get("id", ""))
            if not ID_RE.match(sid) or sid in self._boxes or sid in self._busy:
                continue
            bundle = self.sandboxes_dir / sid
            pid = int(st.get("pid") or 0)
            pidfd = None
            # paused (frozen) boxes are alive too; created/stopped ones go.
            if (
                st.get("status") in ("running", "paused")
                and pid > 0
                and (bundle / "ready").is_file()
            ):
                with contextlib.suppress(OSError, Internal):
                    pidfd = _open_pidfd(pid, f"/sandfleet/{sid}")
            if pidfd is None:
                await self.destroy(sid)
                continue
            box = _Box(id=sid, bundle=bundle, pid=pid, pidfd=pidfd)
            for name in _recorded_layers(bundle):
                if self.layers.take(name):
                    box.layers.append(name)
            box.handle = BoxHandle(
                id=sid,
                agent_socket=bundle / "agent.sock",
                pid=pid,
                extra={"bundle": str(bundle), "cgroup": f"/sandfleet/{sid}", "adopted": True},
            )
            self._boxes[sid] = box
            handles.append(box.handle)
        # Bundles runc does not list (killed before or during `runc run`), and
        # runc state without a bundle (killed during a destroy, after the rmtree).
        names = {p.name for p in self.sandboxes_dir.iterdir()}
        names |= {p.name for p in self.runc_root.iterdir() if p.is_dir()}
        for name in sorted(names):
            if name not in self._boxes and name not in self._busy and ID_RE.match(name):
                await self.destroy(name)
        if self.node_id:
            await self._sweep_cgroups()
        return handles

    async def _kill_stray_runc(self) -> None:
        """SIGKILL runc commands on our runc root left by a previous instance; wait for them."""
        needle = f"\0--root\0{self.runc_root}\0".encode()
        pidfds = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if needle in b"\0" + cmdline and os.path.basename(cmdline.split(b"\0")[0]) == b"runc":
                with contextlib.suppress(OSError):
                    fd = os.pidfd_open(int(entry.name))
                    signal.pidfd_send_signal(fd, signal.SIGKILL)
                    pidfds.append(fd)
        for fd in pidfds:
            await _wait_fd(fd, 2.0)
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitid(os.P_PIDFD, fd, os.WEXITED | os.WNOHANG)
            os.close(fd)

    async def _sweep_cgroups(self) -> None:
        assert self.node_id is not None
        mine = re.compile(rf"^(sb|fw)-[0-9a-f]{{12}}-{re.escape(self.node_id)}$")
        names: set[str] = set()
        for parent in self.cgroups.dirs("/sandfleet"):
            with contextlib.suppress(OSError):
                names |= {p.name for p in parent.iterdir() if p.is_dir() and mine.match(p.name)}
        for name in sorted(names):
            if name in self._boxes or name in self._busy or (self.sandboxes_dir / name).exists():
                continue
            await asyncio.to_thread(remove_cgroups, self.cgroups.dirs(f"/sandfleet/{name}"))

    async def close(self) -> None:
        """Unmount layers no box uses; running boxes are left alone (see ``recover``)."""
        for box in self._boxes.values():
            if box.pidfd is not None:
                os.close(box.pidfd)
                box.pidfd = None
        self._boxes.clear()
        self.layers.close()


# ---------------------------------------------------------------------- helpers


def _unmount_all(bundle: Path) -> None:
    # deepest first: the overlay (rootfs/) before the disk holding its upper layer
    for point in mounts_under(bundle):
        try:
            umount(point)
        except OSError:
            umount(point, MNT_DETACH)


def _bind_agent_socket(bundle: Path) -> socket.socket:
    """A listening Unix socket at ``bundle/agent.sock`` (mode 0600), not inheritable.

    Bound through ``/proc/self/fd/N`` of the bundle directory, so a deep state
    directory never hits the 108-byte ``sun_path`` limit. If ``listener``'s
    fd were 3 already, posix_spawn's dup2 would keep its close-on-exec flag:
    it is moved higher first.
    """
    dirfd = os.open(bundle, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        if listener.fileno() == AGENT_LISTEN_FD:
            moved = socket.socket(fileno=os.dup(listener.fileno()))
            listener.close()
            listener = moved
        os.fchmod(listener.fileno(), 0o600)
        listener.bind(f"/proc/self/fd/{dirfd}/agent.sock")
        os.chmod(bundle / "agent.sock", 0o600)
        listener.listen(128)
    except BaseException:
        listener.close()
        raise
    finally:
        os.close(dirfd)
    return listener


def _mount_points(root: Path, init: BoxInit) -> Path:
    """A directory tree holding the mount points ``init`` needs (files for binds)."""
    root.mkdir()
    for dest in init.tmpfs:
        point = root / dest.lstrip("/")
        point.mkdir(parents=True, exist_ok=True)
        point.chmod(0o1777)  # runc gives a tmpfs the mode of the directory it covers
    for dest in init.binds:
        target = root / dest.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.touch()
    return root


def _module_available(name: str) -> bool:
    release = os.uname().release
    base = Path("/lib/modules") / release / "kernel" / "fs" / name
    return base.is_dir()


def _recorded_layers(bundle: Path) -> list[str]:
    try:
        data = json.loads((bundle / "sandbox.json").read_text())
        return [str(n) for n in data.get("layers", [])]
    except (OSError, ValueError, AttributeError):
        return []


def _open_pidfd(pid: int, cgroup_path: str) -> int:
    """A pidfd for ``pid``, checked to be a member of ``cgroup_path`` (not a reused pid).

    Raises ``Internal`` when the process is gone or belongs to another cgroup.
    """
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        raise Internal(f"the box's PID 1 ({pid}) exited at once") from None
    try:
        with open(f"/proc/{pid}/cgroup", encoding="utf-8") as fh:
            member = any(line.rstrip("\n").endswith(":" + cgroup_path) for line in fh)
    except OSError:
        member = False
    if not member:
        os.close(fd)
        raise Internal(f"process {pid} is not in cgroup {cgroup_path} (exited, pid reused?)")
    return fd


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


async def _wait_fd(fd: int, timeout_s: float) -> bool:
    """Wait until ``fd`` (a pidfd) is readable, i.e. the process exited; False on timeout."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()
    loop.add_reader(fd, _resolve, done)
    try:
        await asyncio.wait_for(done, timeout_s)
        return True
    except TimeoutError:
        return False
    finally:
        loop.remove_reader(fd)
