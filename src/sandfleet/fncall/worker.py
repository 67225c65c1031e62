"""PID 1 of an fncall worker box: a zygote that runs each call in a fresh child.

This file is bind-mounted into the box and run by the image's own ``python3``
(3.9 or later), so it uses the standard library only. The node holds one
connection on the listening socket (fd 3) and sends one call at a time.

Frames both ways are a 4-byte big-endian length and a JSON object. On accept
the worker sends ``{"hello": {"languages": [...], "pid": N}}``; each call is
answered with ``{"compile": stage|null, "run": stage|null, "files": {...},
"missing_files": [...], "fetch_errors": {...}}`` or ``{"error": "..."}``. A stage
is ``{"status": "exited"|"signaled"|"timeout", "exit_code", "signal", "stdout",
"stderr" (base64), "stdout_dropped", "stderr_dropped", "duration_s"}``.

Why a zygote: starting CPython and importing the standard library costs tens
of milliseconds; forking a process that has done it once costs a fraction of
one. Why PID 1: ``kill(-1, SIGKILL)`` from a PID namespace's init reaches every
other process in it and never the init itself, so after each call nothing the
call started survives, whatever it did (new sessions, double forks), and the
kernel keeps the call's processes from signalling PID 1. Calls run as
``nobody`` without capabilities; PID 1 keeps only what the scrub needs.
"""

from __future__ import annotations

import base64
import builtins
import contextlib
import gc
import io
import json
import os
import select
import shutil
import signal
import socket
import stat
import struct
import sys
import time
from typing import Any

LISTEN_FD = 3
#: Exists only inside a worker box (the node binds this file there): the scrub
#: refuses to empty anything without it, even as PID 1 of some other namespace.
BOX_MARK = "/.sandfleet/fnworker.py"
CALL_UID = CALL_GID = 65534
WORKDIR = "/tmp"
#: Writable places a call can leave things in; emptied after every call.
SCRUB_DIRS = ("/tmp", "/dev/shm", "/dev/mqueue")
#: Largest total of fetched files per call, bytes.
MAX_FETCH_BYTES = 64 << 20
_HEADER = struct.Struct(">I")
_MAX_FRAME = 256 << 20

#: Imported once by the zygote, so a call's ``import json`` is a dict lookup.
#: Chosen for what reward checks and judge programs import most, not for breadth:
#: each MiB the zygote holds costs about 0.1 ms per fork on these machines.
PRELOAD = [
    *("bisect", "collections", "copy", "dataclasses", "datetime", "decimal", "fractions"),
    *("functools", "heapq", "itertools", "json", "math", "operator", "random", "re"),
    *("statistics", "string", "time", "typing"),
]

#: What a stage runs: "setup" (write the call's files), "python" (the code in this
#: fork), or an argv to exec.
Stage = Any

COMPILERS = {
    "c": ("gcc", "main.c", ["-O2", "-o", "main", "main.c", "-lm"]),
    "cpp": ("g++", "main.cpp", ["-O2", "-std=c++17", "-o", "main", "main.cpp"]),
}


# ---------------------------------------------------------------------- framing


def recv_frame(sock: socket.socket) -> Any:
    """One frame as a dict, or None at EOF."""
    head = _recv_exact(sock, _HEADER.size)
    if head is None:
        return None
    (size,) = _HEADER.unpack(head)
    if size > _MAX_FRAME:
        raise ValueError(f"frame of {size} bytes is over the limit")
    body = _recv_exact(sock, size)
    if body is None:
        raise ValueError("connection closed inside a frame")
    return json.loads(body)


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            if buf:
                raise ValueError("connection closed inside a frame")
            return None
        buf += chunk
    return bytes(buf)


def send_frame(sock: socket.socket, obj: object) -> None:
    body = json.dumps(obj, separators=(",", ":")).encode()
    sock.sendall(_HEADER.pack(len(body)) + body)


# ---------------------------------------------------------------------- output


class Capture:
    """Keeps the head and the tail of a stream under ``cap`` bytes, counting the rest."""

    def __init__(self, cap: int) -> None:
        self.head_left = cap - cap // 2
        self.tail_cap = cap // 2
        self.head = bytearray()
        self.tail = bytearray()
        self.dropped = 0

    def add(self, data: bytes) -> None:
        if self.head_left:
            k = min(len(data), self.head_left)
            self.head += data[:k]
            self.head_left -= k
            data = data[k:]
        if not data:
            return
        self.tail += data
        over = len(self.tail) - self.tail_cap
        if over > 0:
            self.dropped += over
            del self.tail[:over]

    def value(self) -> bytes:
        return bytes(self.head + self.tail)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


# ---------------------------------------------------------------------- scrub


def _check_pid1() -> None:
    # Outside its box, kill(-1) and the scrub would hit the whole host.
    if os.getpid() != 1:
        raise SystemExit("the fncall worker runs only as PID 1 of its own box")


def kill_all() -> None:
    """SIGKILL every process in the box but this one and reap them all."""
    _check_pid1()
    while True:
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            break
        _reap(block=True)
    _reap(block=False)


def _reap(block: bool) -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, 0 if block else os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def scrub() -> None:
    """Empty every writable place and remove SysV IPC objects a call left."""
    _check_pid1()
    if not os.path.exists(BOX_MARK):
        raise SystemExit(f"{BOX_MARK} is missing: this is not an fncall worker box")
    for top in SCRUB_DIRS:
        try:
            entries = list(os.scandir(top))
        except OSError:
            continue
        for entry in entries:
            try:
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path, ignore_errors=True)
                else:
                    os.unlink(entry.path)
            except OSError:
                pass
    _remove_ipc()


_IPC_RMID = 0


def _remove_ipc() -> None:
    # Rare, so ctypes is imported only when a call left something.
    found = []
    for kind in ("shm", "sem", "msg"):
        try:
            with open("/proc/sysvipc/" + kind) as fh:
                lines = fh.read().splitlines()[1:]
        except OSError:
            continue
        found += [(kind, int(line.split()[1])) for line in lines if line.strip()]
    if not found:
        return
    # IPC_RMID takes the owner's uid (or CAP_SYS_ADMIN, which PID 1 lacks): the
    # objects are the calls' user's, so a child of that user removes them.
    pid = os.fork()
    if pid == 0:
        try:
            import ctypes

            os.setresgid(CALL_GID, CALL_GID, CALL_GID)
            os.setresuid(CALL_UID, CALL_UID, CALL_UID)
            libc = ctypes.CDLL(None, use_errno=True)
            for kind, ipc_id in found:
                if kind == "shm":
                    libc.shmctl(ipc_id, _IPC_RMID, None)
                elif kind == "sem":
                    libc.semctl(ipc_id, 0, _IPC_RMID)
                else:
                    libc.msgctl(ipc_id, _IPC_RMID, None)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


# ---------------------------------------------------------------------- the child


def _become_caller(
    out_w: int, err_w: int, stdin_fd: int | None = None, keep: int | None = None
) -> None:
    """What every call's process does first, whatever the call: stdin (``stdin_fd``,
    else empty), stdout/stderr on the pipes, a session of its own, first in line
    for the OOM killer, the unprivileged user, the working directory. Only
    ``keep`` (moved to fd 3) survives of the other fds."""
    if stdin_fd is None:
        stdin_fd = os.open(os.devnull, os.O_RDONLY)
    os.dup2(stdin_fd, 0)
    os.dup2(out_w, 1)
    os.dup2(err_w, 2)
    if keep is not None:
        os.dup2(keep, 3)
    os.closerange(3 if keep is None else 4, 65536)
    os.setsid()
    with contextlib.suppress(OSError), open("/proc/self/oom_score_adj", "w") as fh:
        fh.write("1000")  # the OOM killer takes the call, never PID 1 (-1000, set by the node)
    os.setgroups([])
    os.setresgid(CALL_GID, CALL_GID, CALL_GID)
    os.setresuid(CALL_UID, CALL_UID, CALL_UID)
    os.umask(0o022)
    os.chdir(WORKDIR)


def _run(call: dict[str, Any], stage: Stage) -> None:
    """The call's own part, after :func:`_become_caller`; never returns."""
    code = 1
    try:
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": WORKDIR, "LANG": "C.UTF-8"}
        env["TMPDIR"] = WORKDIR
        env.update(call.get("env") or {})
        if stage == "python":
            # Signals stay as the interpreter set them up (SIGPIPE ignored, SIGINT
            # raising KeyboardInterrupt), as for python3 -c.
            code = _run_python(call["code"], call.get("args") or [], env)
        else:
            # What the interpreter ignores, a program started by exec must not.
            for sig in (signal.SIGPIPE, signal.SIGXFSZ):
                signal.signal(sig, signal.SIG_DFL)
            os.execvpe(stage[0], stage, env)
    except SystemExit as e:  # from _run_python's own handling
        code = e.code if isinstance(e.code, int) else 1
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.write(2, f"sandfleet: {type(e).__name__}: {e}\n".encode())
        code = 127 if isinstance(e, FileNotFoundError) and stage != "python" else 1
    os._exit(code & 0xFF)


def _warm_up() -> None:
    """Touch, before the call comes, what every call touches: after a fork each first
    write to a page of the zygote's memory copies it (a page fault, microseconds
    each here), and Python writes reference counts everywhere it reads."""
    json.loads(json.dumps({"call": {"code": "", "args": [], "env": {}}, "stdin": ""}))
    scratch = type(sys)("__main__")
    exec(compile("x = [str(i) for i in range(3)]\nprint", "<string>", "exec"), scratch.__dict__)
    io.TextIOWrapper(io.BufferedWriter(io.FileIO(os.open(os.devnull, os.O_WRONLY), "w")))
    base64.b64decode(_b64(b"warm"))


def _spare(out_w: int, err_w: int, ctl: int) -> None:
    """A call's process forked ahead of the call; waits on fd 3 for it. Never returns.

    The order comes as JSON (the call without its stdin and files) with the
    call's stdin as a passed file descriptor, until the zygote's end closes.
    """
    try:
        _become_caller(out_w, err_w, keep=ctl)
        _warm_up()
        with socket.socket(fileno=3) as sock:
            parts, fds = [], []
            while True:
                data, got, _, _ = socket.recv_fds(sock, 1 << 16, 1)
                fds += got
                if not data:
                    break
                parts.append(data)
        if not parts:
            os._exit(0)  # retired unused
        order = json.loads(b"".join(parts))
        if fds:
            os.dup2(fds[0], 0)
            os.close(fds[0])
    except BaseException:
        os._exit(1)
    _run(order["call"], order["stage"])


def place_files(files: dict[str, str]) -> None:
    """Write a call's files into the (empty) working directory, owned by the call's user.

    Done by PID 1 before any process of the call exists, so no symlink can be
    in the way: each file is created anew, never followed. Raises ValueError
    naming the path when one cannot be written (a parent that is a file).
    """
    for rel, data in files.items():
        path = os.path.join(WORKDIR, rel)
        try:
            _make_parents(os.path.dirname(path))
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        except OSError as exc:
            raise ValueError(f"files[{rel!r}] cannot be written: {exc.strerror}") from None
        try:
            with io.FileIO(fd, "w", closefd=False) as fh:
                fh.write(base64.b64decode(data))
            os.fchown(fd, CALL_UID, CALL_GID)
        finally:
            os.close(fd)


def _make_parents(directory: str) -> None:
    if directory in (WORKDIR, "") or os.path.isdir(directory):
        return
    _make_parents(os.path.dirname(directory))
    os.mkdir(directory, 0o755)
    os.chown(directory, CALL_UID, CALL_GID)


def _memfd(data: bytes) -> int:
    fd = os.memfd_create("stdin", os.MFD_CLOEXEC)
    if data:
        os.write(fd, data)
        os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _run_python(code: str, args: list[str], env: dict[str, str]) -> int:
    """Run ``code`` as ``python3 -c`` would, in this fresh child; returns the exit code."""
    os.environ.clear()
    os.environ.update(env)
    sys.argv = ["-c", *args]
    sys.path.insert(0, "")
    # As python3 -c sets them up under a UTF-8 locale (surrogateescape: bytes
    # that are not UTF-8 pass through stdin to stdout unchanged).
    sys.stdin = io.TextIOWrapper(
        io.BufferedReader(io.FileIO(0, "r", closefd=False)),
        encoding="utf-8",
        errors="surrogateescape",
    )
    sys.stdout = io.TextIOWrapper(
        io.BufferedWriter(io.FileIO(1, "w", closefd=False)),
        encoding="utf-8",
        errors="surrogateescape",
    )
    sys.stderr = io.TextIOWrapper(
        io.BufferedWriter(io.FileIO(2, "w", closefd=False)),
        encoding="utf-8",
        errors="backslashreplace",
        line_buffering=True,
    )
    main = type(sys)("__main__")
    main.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = main
    status = 0
    try:
        exec(compile(code, "<string>", "exec"), main.__dict__)
    except SystemExit as e:
        status = _exit_status(e.code)
    except BaseException as exc:
        # From the call's own frames on, as python3 -c shows it.
        tb = exc.__traceback__
        exc = exc.with_traceback(tb.tb_next if tb is not None else None)
        sys.excepthook(type(exc), exc, exc.__traceback__)
        status = -signal.SIGINT if isinstance(exc, KeyboardInterrupt) else 1
    try:
        # As at interpreter exit: join non-daemon threads, run atexit functions.
        # threading only if the call imported it: importing it costs a millisecond.
        threading = sys.modules.get("threading")
        if threading is not None:
            threading._shutdown()
        import atexit

        atexit._run_exitfuncs()
    except BaseException:
        status = status or 1
    for stream in (sys.stdout, sys.stderr):
        try:
            if not stream.closed:
                stream.flush()
        except BaseException:
            status = status or 120  # as CPython does when flushing stdout fails
    if status == -signal.SIGINT:
        # An uncaught KeyboardInterrupt ends CPython by SIGINT, which shells see as 130.
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return status


def _exit_status(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    with contextlib.suppress(BaseException):
        sys.stderr.write(str(code) + "\n")
    return 1


# ---------------------------------------------------------------------- the zygote


class Zygote:
    def __init__(self) -> None:
        #: (pid, socket fd to send it the call, stdout and stderr read ends) of the spare.
        self.spare: tuple[int, int, int, int] | None = None
        self.languages = ["python", "bash"] if shutil.which("bash") else ["python"]
        self.languages += [lang for lang, (cc, _, _) in COMPILERS.items() if shutil.which(cc)]

    def serve(self, listener: socket.socket) -> None:
        while True:
            conn, _ = listener.accept()
            try:
                send_frame(conn, {"hello": {"languages": self.languages, "pid": os.getpid()}})
                self._fork_spare()
                while True:
                    call = recv_frame(conn)
                    if call is None:
                        break
                    send_frame(conn, self.handle(call))
                    # Answered first: the scrub, and forking the next call's
                    # process, overlap the answer's way back.
                    kill_all()
                    scrub()
                    self._fork_spare()
            except (OSError, ValueError):
                pass
            finally:
                conn.close()
                kill_all()
                self.spare = None
                scrub()

    def handle(self, call: dict[str, Any]) -> dict[str, Any]:
        try:
            return self._handle(call)
        except Exception as e:
            kill_all()
            return {"error": f"{type(e).__name__}: {e}"}

    def _handle(self, call: dict[str, Any]) -> dict[str, Any]:
        language = call.get("language", "python")
        if language not in self.languages:
            has = ", ".join(self.languages)
            return {"error": f"this image cannot run {language} (it has: {has})"}
        cap = int(call.get("max_output_bytes", 1 << 20))
        timeout = float(call.get("timeout_s", 10))
        args = list(call.get("args") or [])
        files = call.pop("files", None) or {}
        if language in COMPILERS:
            files[COMPILERS[language][1]] = _b64(call["code"].encode())
        try:
            place_files(files)
        except ValueError as exc:
            return {"invalid": str(exc)}
        del files  # only the tmpfs holds them now: charged to the call once
        # stdin travels to the call's process as a memfd, not through its order.
        stdin = _memfd(base64.b64decode(call.pop("stdin", None) or ""))
        answer: dict[str, Any] = {"compile": None, "run": None}
        try:
            if language == "python":
                answer["run"] = self.stage(call, "python", stdin, timeout, cap, first=True)
            elif language == "bash":
                argv = ["bash", "-c", call["code"], "bash", *args]
                answer["run"] = self.stage(call, argv, stdin, timeout, cap, first=True)
            else:
                cc, _, cc_args = COMPILERS[language]
                compile_timeout = float(call.get("compile_timeout_s", 30))
                built = self.stage(call, [cc, *cc_args], None, compile_timeout, cap, first=True)
                answer["compile"] = built
                if built["status"] != "exited" or built["exit_code"] != 0:
                    return answer
                kill_all()  # nothing of the compiler may linger into the run
                answer["run"] = self.stage(call, ["./main", *args], stdin, timeout, cap)
        finally:
            os.close(stdin)
        if call.get("fetch_files"):
            kill_all()  # no process of the call may change a file while it is read
            answer.update(fetch(call["fetch_files"]))
        return answer

    def stage(
        self,
        call: dict[str, Any],
        stage: Stage,
        stdin: int | None,
        timeout_s: float,
        cap: int,
        first: bool = False,
    ) -> dict[str, Any]:
        """Run ``stage`` of ``call`` in a process of its own and wait for it under ``timeout_s``.

        ``stdin`` is a file descriptor to read from (None: empty). A call's
        first stage goes to the spare forked ahead of time, if there is one.
        """
        spare, self.spare = (self.spare, None) if first else (None, self.spare)
        started = time.monotonic()
        if spare is not None:
            pid, ctl, out_r, err_r = spare
            order = json.dumps({"call": call, "stage": stage}, separators=(",", ":")).encode()
            try:
                with socket.socket(fileno=ctl) as sock:  # closing it tells the spare: go
                    socket.send_fds(sock, [order[: 1 << 16]], [] if stdin is None else [stdin])
                    if len(order) > 1 << 16:
                        sock.sendall(order[1 << 16 :])
            except OSError:  # the spare is gone: fork as usual
                spare = None
                kill_all()
                os.close(out_r)
                os.close(err_r)
        if spare is None:
            out_r, out_w = os.pipe2(os.O_CLOEXEC)
            err_r, err_w = os.pipe2(os.O_CLOEXEC)
            try:
                pid = os.fork()
                if pid == 0:
                    _become_caller(out_w, err_w, stdin)
                    _run(call, stage)
            finally:
                os.close(out_w)
                os.close(err_w)
        try:
            return self._wait(pid, started, timeout_s, out_r, err_r, cap)
        finally:
            os.close(out_r)
            os.close(err_r)

    def _fork_spare(self) -> None:
        """Fork the next call's process now, while no call waits for it."""
        out_r, out_w = os.pipe2(os.O_CLOEXEC)
        err_r, err_w = os.pipe2(os.O_CLOEXEC)
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            pid = os.fork()
            if pid == 0:
                _spare(out_w, err_w, theirs.fileno())
        finally:
            for fd in (out_w, err_w):
                os.close(fd)
            theirs.close()
        self.spare = (pid, mine.detach(), out_r, err_r)

    def _wait(
        self, pid: int, started: float, timeout_s: float, out_r: int, err_r: int, cap: int
    ) -> dict[str, Any]:
        pidfd = os.pidfd_open(pid)
        captures = {out_r: Capture(cap), err_r: Capture(cap)}
        poller = select.poll()
        for fd in (out_r, err_r, pidfd):
            poller.register(fd, select.POLLIN)
        open_pipes = 2
        status = None
        timed_out = False
        deadline = started + timeout_s
        try:
            while True:
                running = status is None and not timed_out
                if running:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        timed_out = True
                        kill_all()  # the whole tree, also what left the session
                        poller.unregister(pidfd)
                        continue
                    wait_ms = int(left * 1000) + 1
                elif not open_pipes:
                    break
                else:
                    wait_ms = 1000  # every writer is dead: EOF is due at once
                events = poller.poll(wait_ms)
                if not events and not running:
                    break  # never expected; an answer beats a hung worker
                for fd, _ in events:
                    if fd == pidfd:
                        poller.unregister(pidfd)
                        if not timed_out:  # else kill_all has reaped it
                            _, status = os.waitpid(pid, 0)
                            kill_all()  # background processes do not outlive the call
                        continue
                    data = os.read(fd, 1 << 16)
                    if data:
                        captures[fd].add(data)
                    else:
                        poller.unregister(fd)
                        open_pipes -= 1
        finally:
            os.close(pidfd)
        duration = time.monotonic() - started
        out, err = captures[out_r], captures[err_r]
        result = {
            "status": "exited",
            "exit_code": None,
            "signal": None,
            "stdout": _b64(out.value()),
            "stderr": _b64(err.value()),
            "stdout_dropped": out.dropped,
            "stderr_dropped": err.dropped,
            "duration_s": round(duration, 6),
        }
        if timed_out or status is None:
            result["status"] = "timeout"
        elif os.WIFSIGNALED(status):
            result["status"] = "signaled"
            result["signal"] = os.WTERMSIG(status)
        else:
            result["exit_code"] = os.WEXITSTATUS(status)
        return result


def fetch(paths: list[str]) -> dict[str, Any]:
    """Read the files a call asked back, as root but only regular files under WORKDIR."""
    files, missing, errors = {}, [], {}
    total = 0
    root = os.path.realpath(WORKDIR)
    for rel in paths:
        real = os.path.realpath(os.path.join(WORKDIR, rel))
        if not real.startswith(root + os.sep):
            missing.append(rel)  # a symlink out of the working directory
            continue
        try:
            fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            missing.append(rel)
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                missing.append(rel)
                continue
            if total + st.st_size > MAX_FETCH_BYTES:
                errors[rel] = (
                    f"{st.st_size} bytes: fetched files are limited to {MAX_FETCH_BYTES} bytes"
                    " per call"
                )
                continue
            with io.FileIO(fd, "r", closefd=False) as fh:
                data = fh.read()
            total += len(data)
            files[rel] = _b64(data)
        finally:
            os.close(fd)
    return {"files": files, "missing_files": missing, "fetch_errors": errors}


def main() -> None:
    _check_pid1()
    for name in PRELOAD:
        with contextlib.suppress(ImportError):
            __import__(name)
    # Keep the preloaded objects out of the collector's way: children then
    # touch (and copy) fewer of the zygote's pages.
    gc.collect()
    gc.freeze()
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    listener = socket.socket(fileno=LISTEN_FD)
    os.set_inheritable(LISTEN_FD, False)
    Zygote().serve(listener)


if __name__ == "__main__":
    main()
