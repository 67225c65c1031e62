"""The node's handle on its on-demand daemon: start, adopt, stop, and ask it things.

The daemon runs detached (its own session), so it outlives a restart of the
node agent; the agent's next run :meth:`OnDemand.adopt`\\ s it. Files in the
state directory::

    mnt/             the FUSE mount: one file per layer, <hex of the layer digest>
    ondemand.sock    control socket (JSON lines, see sandfleet.ondemand.control)
    ondemand.pid     the daemon's pid
    ondemand.log     its stdout and stderr, appended
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sandfleet
from sandfleet.blobstore.keys import digest_hex
from sandfleet.node import mounts
from sandfleet.wire.errors import (
    FailedPrecondition,
    SandfleetError,
    Unavailable,
    error_from_wire,
)

from .fetcher import DEFAULT_DEADLINE_S, DEFAULT_READAHEAD

__all__ = ["OnDemand", "OnDemandConfig"]

#: The short-lived parent: starts argv in a new session, output to its stderr, prints the pid.
_SPAWN = (
    "import subprocess, sys; p = subprocess.Popen(sys.argv[1:], start_new_session=True,"
    " stdin=subprocess.DEVNULL, stdout=2, stderr=2); print(p.pid)"
)


@dataclass(frozen=True)
class OnDemandConfig:
    """What the daemon serves. ``store_root``: the local image store;
    ``cache_dir``/``cache_bytes``: the chunk cache and its size in bytes;
    ``remotes``: blob store URLs tried in order; ``readahead``: chunks fetched
    ahead; ``deadline_s``: seconds a chunk may take from the remotes."""

    store_root: Path
    cache_dir: Path
    cache_bytes: int
    remotes: tuple[str, ...] = ()
    readahead: int = DEFAULT_READAHEAD
    deadline_s: float = DEFAULT_DEADLINE_S


class OnDemand:
    """The on-demand daemon of one node, whose files live in ``state_dir``.

    ``start_timeout_s``: seconds :meth:`start` waits for the mount;
    ``request_timeout_s``: seconds one control request may take. Every method
    blocks; none is needed for reads, which go through the kernel.
    """

    def __init__(
        self,
        state_dir: Path | str,
        config: OnDemandConfig,
        *,
        python: str = sys.executable,
        start_timeout_s: float = 10.0,
        request_timeout_s: float = 5.0,
    ) -> None:
        self.state_dir = Path(state_dir).absolute()
        self.config = config
        self.python = python
        self.start_timeout_s = start_timeout_s
        self.request_timeout_s = request_timeout_s
        self.mount_dir = self.state_dir / "mnt"
        self.socket_path = self.state_dir / "ondemand.sock"
        self.pid_file = self.state_dir / "ondemand.pid"
        self.log_file = self.state_dir / "ondemand.log"

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        """Spawn the daemon and wait until its mount is live and its socket answers.

        Does nothing if a daemon already answers. Raises :class:`FailedPrecondition`
        with the end of the daemon's log when it exits or is not ready in time.
        """
        if self._live_pid() is not None:
            return
        if mounts.is_mountpoint(self.mount_dir):
            raise FailedPrecondition(
                f"{self.mount_dir} is mounted already but no daemon answers;"
                " adopt() cleans up after a previous daemon"
            )
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.mount_dir.mkdir(exist_ok=True)
        c = self.config
        cmd = [
            self.python, "-m", "sandfleet.ondemand",
            "--mount", str(self.mount_dir),
            "--store", str(Path(c.store_root).absolute()),
            "--cache", str(Path(c.cache_dir).absolute()),
            "--cache-bytes", str(c.cache_bytes),
            "--socket", str(self.socket_path),
            "--readahead", str(c.readahead),
            "--deadline-s", str(c.deadline_s),
        ]  # fmt: skip
        for url in c.remotes:
            cmd += ["--remote", url]
        env = dict(os.environ)
        src = str(Path(sandfleet.__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, env.get("PYTHONPATH")]))
        log_start = self.log_file.stat().st_size if self.log_file.exists() else 0
        pid = self._spawn(cmd, env)
        self.pid_file.write_text(f"{pid}\n")
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            if not self._is_daemon(pid):
                self.pid_file.unlink(missing_ok=True)
                raise FailedPrecondition(
                    f"the on-demand daemon exited: {self._log_tail(log_start)}"
                )
            with contextlib.suppress(SandfleetError):
                st = self._request({"op": "stats"}, timeout_s=1.0)["stats"]
                if st.get("mounted") and st.get("pid") == pid:
                    return
            if time.monotonic() > deadline:
                self._kill(pid)
                self._clean_mount(lazy=True)
                self.pid_file.unlink(missing_ok=True)
                raise FailedPrecondition(
                    f"the on-demand daemon did not mount {self.mount_dir} within"
                    f" {self.start_timeout_s:g} s: {self._log_tail(log_start)}"
                )
            time.sleep(0.05)

    def _spawn(self, cmd: list[str], env: dict[str, str]) -> int:
        """Start ``cmd`` detached (through a short-lived parent, so the daemon is not our
        child: it never lingers as our zombie) with output to the log; its pid."""
        with open(self.log_file, "ab") as log:
            proc = subprocess.run(
                [self.python, "-c", _SPAWN, *cmd],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=log,
                env=env,
                timeout=30,
                check=False,
            )
        try:
            return int(proc.stdout)
        except ValueError:
            raise FailedPrecondition(
                f"could not spawn the on-demand daemon (status {proc.returncode});"
                f" see {self.log_file}"
            ) from None

    def adopt(self) -> bool:
        """Reuse the daemon of a previous run if it is alive and answers (True); else
        clean what it left (its process, a dead mount, the socket) and :meth:`start`
        afresh (False). A reused daemon keeps the options it was started with."""
        if self._live_pid() is not None:
            return True
        pid = self._recorded_pid()
        if pid is not None and self._is_daemon(pid):
            self._kill(pid)  # alive but not answering: hung
        self._clean_mount(lazy=True)
        self.pid_file.unlink(missing_ok=True)
        self.socket_path.unlink(missing_ok=True)
        self.start()
        return False

    def stop(self, timeout_s: float = 10.0) -> None:
        """Unmount and end the daemon. Raises :class:`FailedPrecondition`, leaving both
        in place, while EROFS mounts still use its files (unmount those first)."""
        try:
            mounts.umount(self.mount_dir)  # not lazy: EBUSY while a layer is mounted
        except OSError as e:
            if e.errno != errno.EBUSY:
                raise
            users = self._erofs_users()
            hint = f" (EROFS mounts of this store: {', '.join(users)})" if users else ""
            raise FailedPrecondition(
                f"the on-demand mount {self.mount_dir} is in use{hint}; unmount the layers"
                " that use it before stopping the daemon"
            ) from None
        pid = self._recorded_pid()
        if pid is not None and self._is_daemon(pid) and not self._wait_exit(pid, timeout_s):
            self._kill(pid)
        self.pid_file.unlink(missing_ok=True)
        self.socket_path.unlink(missing_ok=True)

    def alive(self) -> bool:
        """Whether a daemon answers on the socket with its mount live."""
        return self._live_pid() is not None

    def running(self) -> bool:
        """Whether the recorded daemon process runs (a few syscalls, no request)."""
        pid = self._recorded_pid()
        return pid is not None and self._is_daemon(pid)

    # -- requests ----------------------------------------------------------------------

    def blob_path(self, layer_digest: str) -> Path:
        """The file holding ``layer_digest``'s data blob: EROFS's ``device=``."""
        return self.mount_dir / digest_hex(layer_digest)

    def prefetch(self, layer_digest: str, chunks: Iterable[int]) -> int:
        """Queue background fetches of chunk indexes into the cache; returns how many were
        queued. Raises NotFound (layer not in the store), InvalidArgument, Unavailable."""
        req = {"op": "prefetch", "layer": layer_digest, "chunks": list(chunks)}
        return int(self._request(req)["queued"])

    def access(self, layer_digest: str) -> list[int]:
        """Chunk indexes of the layer in first-read order since the daemon started."""
        return list(self._request({"op": "access", "layer": layer_digest})["chunks"])

    def stats(self) -> dict[str, Any]:
        """The daemon's state and counters: ``pid``, ``mounted``, ``fetcher`` (see
        ``Fetcher.stats``) and ``cache`` (bytes, count, max_bytes, hits, misses, evictions)."""
        return dict(self._request({"op": "stats"})["stats"])

    def events(self, since: int = 0) -> tuple[list[dict[str, Any]], int]:
        """Fetch failures after cursor ``since`` (each: seq, time, layer, chunk, store,
        message) and the cursor to pass next time."""
        answer = self._request({"op": "events", "since": since})
        return list(answer["events"]), int(answer["next"])

    def _request(self, req: dict[str, Any], timeout_s: float | None = None) -> dict[str, Any]:
        timeout = self.request_timeout_s if timeout_s is None else timeout_s
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(timeout)
                # through a dir fd: the path may pass sun_path's 108 bytes
                dirfd = os.open(self.state_dir, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
                try:
                    s.connect(f"/proc/self/fd/{dirfd}/{self.socket_path.name}")
                finally:
                    os.close(dirfd)
                s.sendall(json.dumps(req).encode() + b"\n")
                buf = b""
                while not buf.endswith(b"\n"):
                    part = s.recv(1 << 16)
                    if not part:
                        break
                    buf += part
            answer = json.loads(buf)
        except (OSError, ValueError) as e:
            raise Unavailable(
                f"the on-demand daemon at {self.socket_path} did not answer: {e}"
            ) from None
        if not isinstance(answer, dict):
            raise Unavailable(f"the on-demand daemon answered {answer!r}")
        if not answer.get("ok"):
            raise error_from_wire(answer, 500)
        return answer

    # -- processes and mounts ----------------------------------------------------------

    def _recorded_pid(self) -> int | None:
        try:
            return int(self.pid_file.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def _live_pid(self) -> int | None:
        """The daemon's pid if it answers with its mount live, else None."""
        pid = self._recorded_pid()
        if pid is None or not self._is_daemon(pid):
            return None
        try:
            st = self._request({"op": "stats"}, timeout_s=2.0)["stats"]
        except SandfleetError:
            return None
        if st.get("pid") != pid or not st.get("mounted"):
            return None
        return pid

    def _is_daemon(self, pid: int) -> bool:
        """Whether ``pid`` runs (not a zombie) the daemon of this mount directory."""
        try:
            with open(f"/proc/{pid}/stat", "rb") as fh:
                if fh.read().rpartition(b")")[2].split()[0] == b"Z":
                    return False
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError):
            return False
        return b"sandfleet.ondemand" in argv and os.fsencode(self.mount_dir) in argv

    def _wait_exit(self, pid: int, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self._is_daemon(pid):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True

    def _kill(self, pid: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        self._wait_exit(pid, 5.0)

    def _clean_mount(self, *, lazy: bool) -> None:
        if mounts.is_mountpoint(self.mount_dir):
            mounts.umount(self.mount_dir, mounts.MNT_DETACH if lazy else 0)

    def _erofs_users(self) -> list[str]:
        """Mount points of EROFS mounts whose metadata image is in the local store (the
        kernel does not show ``device=`` in mountinfo, so this is a hint, not proof)."""
        store = os.path.realpath(self.config.store_root) + "/"
        return [
            e.point
            for e in mounts.mount_table()
            if e.fstype == "erofs" and e.source.startswith(store)
        ]

    def _log_tail(self, start: int, limit: int = 2000) -> str:
        try:
            with open(self.log_file, "rb") as fh:
                fh.seek(start)
                text = fh.read().decode(errors="replace").strip()
        except OSError:
            return "(no log)"
        return (text[-limit:] or "(empty log)") + f" [log: {self.log_file}]"
