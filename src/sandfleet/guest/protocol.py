"""Wire protocol between the node and the in-sandbox agent (``agent.c``).

Transport: a Unix stream socket; one request per connection; the agent forks
a handler per connection, so calls never wait on each other. In a VM the
connections are channels of the mux protocol on one virtio-serial port (see
*Guest mode* at the end); each channel carries exactly what a connection does.

Frame: ``u32 big-endian payload length | u8 type | payload`` (payload at most
4 MiB). Integers are big-endian. A request is one *op frame* whose payload is a
list of TLV fields ``u8 tag | u32 length | value``, optionally followed by
``D`` data frames and a ``Z`` end frame (exec stdin, write_file contents).

Op frames (node -> agent) and their fields:

- ``p`` ping -> ``K`` with fields ``v`` version, ``p`` pid (decimal).
- ``x`` exec: ``a`` argv item (repeated) or ``c`` shell string (``/bin/sh -c``),
  ``e`` ``KEY=VALUE`` (repeated), ``d`` cwd, ``t`` timeout ms (u64), ``o``
  output cap per stream (u64), ``u`` user, ``g`` kill grace ms (u64); then
  stdin as ``D``... ``Z``. Answer: ``1`` stdout / ``2`` stderr frames while
  the command runs, then ``X``:
  ``u8 status (0 exited, 1 signaled, 2 timeout, 3 oom) | i32 exit code | i32 signal |
  u64 stdout dropped | u64 stderr dropped | u64 duration ns``.
  Status 3 only with ``--oom-events PATH``: the ``oom_kill N`` count in PATH
  (cgroup v2 ``memory.events``, v1 ``memory.oom_control``) plus the early
  OOM killer's kills (below) grew while the command ran and the command
  failed (signaled, or a non-zero exit such as a shell's 137); it decodes as
  ``oom`` with no exit code and signal 9.

  Early OOM killer (with ``--oom-events``, when PATH's directory has a
  readable cgroup v2 ``memory.pressure``; else it stays off and PID 1 never
  wakes without cause). Past its limit a process can thrash for a minute
  under TCG before the kernel's OOM killer acts, limit reclaim evicting and
  refaulting the executables' page cache. So PID 1 kills first, as userspace
  OOM killers do: driven by PSI like systemd-oomd (60% is its default memory
  pressure limit, DefaultMemoryPressureLimit, held for 30 s there; a
  sandbox's commands are short, hence 2 s here), taking the largest process
  like earlyoom. Every 250 ms PID 1 reads the ``full ... total=`` line of
  ``memory.pressure`` (microseconds during which every non-idle task of the
  cgroup was stalled on memory). When it grew by at least 60% of a window of
  at least 2 s (1.2 s of 2 s), PID 1 SIGKILLs the process in
  ``cgroup.procs`` with the largest resident set (``/proc/<pid>/statm``),
  counts it for status 3, and logs ``sandfleet-agent: memory thrashing (N%
  full stall over 2 s): killed pid P (comm, X MiB resident)`` on its stderr.
  Never killed: PID 1 and every process whose real uid is the agent's guard
  uid (handlers, supervisors, the mux). After a kill, or when the kernel's
  own ``oom_kill`` count grows during a stall (its victim's stall is no
  reason for a second kill), the window starts over: no kill for 2 s.

  Output cap: the first ceil(cap/2) bytes of a stream are streamed live, the
  last floor(cap/2) are kept in a ring and sent just before ``X``; the middle
  is dropped and counted. Concatenating the ``1`` frames gives head + tail.

  Process tree: the handler is a child subreaper, so every descendant stays
  below it even after ``setsid()``/``setpgid()`` or a double fork. At the
  timeout (or when the client goes away) it SIGKILLs the command's group,
  then every process whose parent chain leads to it (from ``/proc/*/stat``),
  repeating until none is left (bounded, ~2 s) and reaping them. With a grace
  ``g``, SIGTERM goes to the same tree first and SIGKILL ``g`` ms later (or
  as soon as the main process exits). When the command exits by itself its
  background jobs keep running and pass to PID 1, which reaps them.

  User ``u``: ``name``, ``uid``, or ``user:group`` (names or numbers), resolved
  from the sandbox's own ``/etc/passwd`` and ``/etc/group`` (no NSS). The
  child calls setgroups (every group listing the user; only the given group
  with ``user:group``), setgid, setuid, and gets HOME, USER, LOGNAME (request
  env wins). A uid without a passwd entry gets gid = uid and HOME=/. Errors:
  ``EINVAL`` unknown user or group; ``EPERM`` when the sandbox lacks
  CAP_SETUID/CAP_SETGID (same uid and gid as the agent need no capability).
- ``r`` read ``P`` path -> ``D`` chunks (256 KiB) then ``Z``.
- ``w`` write ``P`` path, ``M`` mode (u32); then ``D``... ``Z`` -> ``F``.
  Atomic: a temp file in the same directory, renamed over the path.
- ``l`` list ``P`` -> ``F`` per entry, then ``Z``. ``s`` stat (lstat) ``P`` -> ``F``.
- ``u`` remove ``P``, ``R`` recursive (u8) -> ``K``.
- ``m`` mkdir ``P``, ``R`` parents (u8), ``M`` mode -> ``F``.

Background processes (spawn). Each spawned process gets a *supervisor*: a
process forked by the handler (so neither PID 1 nor in PID 1's memory), a
subreaper in its own session, that owns the process, its pipes and the last
``o`` bytes of each stream, and listens on ``<run dir>/<id>`` (run dir: 0700,
``/run/sandfleet``, else ``/tmp/.sandfleet-run``; for an agent that is not
PID 1 ``/tmp/.sandfleet-run.<pid>``; ``--run-dir`` overrides). Handlers relay
the requests below to it. The process outlives the client's connection; its
record and output stay readable after it ends, until ``R`` or until more
than 64 finished processes exist (the oldest go first). Ids are ``p1``,
``p2``, ... unique for the agent's lifetime. Requests naming an unknown or
removed id answer ``E`` with ``ENOENT``.

- ``S`` spawn: the exec fields (``t`` optional: absent = no timeout; ``o``
  default 4 MiB, kept per stream) plus ``n`` close stdin after the initial
  stdin (u8); then the initial stdin (at most 4 MiB) as ``D``... ``Z``.
  Answer ``P``. stdin stays open otherwise (see ``i``/``I``).
- ``L`` list -> ``P`` per process (by id), then ``Z``.
- ``W`` wait: ``i`` id, ``t`` timeout ms (absent = no limit) -> ``P`` when it
  ends or at the timeout (then still ``running``).
- ``k`` kill: ``i``, ``g`` signal (default 9) -> ``P``. The signal goes to the
  whole tree as for exec timeouts, also to background jobs left after the
  main process ended; for SIGKILL the answer comes after the tree is gone.
- ``i`` stdin: ``i``; then ``D``... ``Z`` -> ``K``; ``E`` ``EPIPE`` if stdin
  is closed or the process ended.
- ``I`` close stdin: ``i`` -> ``K``.
- ``o`` output: ``i``, ``S`` stream (1 stdout, 2 stderr), ``F`` offset (u64),
  ``f`` follow (u8), ``t`` timeout ms -> ``O`` frames then ``Z``. ``O``:
  ``u64 offset | u64 next offset | u64 dropped | u64 total | u8 flags | data``;
  data starts at max(requested, oldest retained) and ``dropped`` counts the
  bytes in between; flags bit 0: the stream is closed and fully read, bit 1:
  the process has ended. Without follow, the bytes up to the total at the
  call's start (the first frame always comes, maybe empty). With follow, new
  output streams until the process has ended and its output up to then is
  sent, or the timeout passes.
- ``R`` remove: ``i`` -> ``K``; ``E`` ``EBUSY`` while it runs. Background
  jobs it left keep running.

``P`` record (TLV): ``i`` id, ``p`` pid (u64), ``c`` command (at most 1 KiB),
``s`` state (u8: 0 running, 1 exited, 2 signaled, 3 killed (by ``k``), 4
timeout), ``x`` exit code (u64, exited), ``g`` signal (u64, signaled/killed),
``b`` start and ``n`` end (u64 Unix ns), ``O``/``R`` stdout/stderr bytes
written in all (u64), ``I`` stdin open (u64).

``F`` entry: ``u8 type (0 file, 1 dir, 2 symlink, 3 other) | u64 size |
u32 mode (permission bits) | u64 mtime ns | name bytes``.
``E`` error (ends any request): ``i32 errno (Linux numbering) | UTF-8 message
naming the path``. After an error the agent still reads and discards the
request's data frames up to ``Z``, so a sender never sees a reset.

Guest mode (``--vport-fd N`` or ``--vport PATH``, in a VM). PID 1 forks a
*mux* process (before PID 1 drops every capability outside the container's
AGENT_CAPS and sets no_new_privs; oom_score_adj -1000; restarted by PID 1 at
most once a second if it dies, then with PID 1's reduced capabilities, so
its hellos no longer set the clock or hostname). The mux speaks the protocol
below on the port;
for each channel it makes a socketpair and passes one end to PID 1
(SCM_RIGHTS), which serves it exactly like an accepted connection. The host
side is :mod:`sandfleet.backends.vm.mux`.

Mux frame: ``u8 type | u32 channel | u32 length | payload`` (big-endian,
payload at most 64 KiB).

- ``S`` host -> guest, channel 0, payload the 16 bytes ``sandfleet-mux-v1``:
  a session starts. The guest drops every channel. Out of sync, the guest
  skips input up to the next exact S frame.
- ``H`` host -> guest: ``u64 realtime ns | u16 hostname length (<= 64) |
  hostname | 32 bytes entropy``. The guest drops every channel, sets
  CLOCK_REALTIME, the hostname, adds the entropy (RNDADDENTROPY, 256 bits,
  then RNDRESEEDCRNG) and answers ``H`` with ``u32 version`` (1). Steps it
  lacks the capabilities for are skipped (logged once on stderr).
- ``O`` open channel c (host only; ids never reused within a session).
  The guest answers ``C`` when it cannot (over 256 channels, no memory).
- ``D`` data; ``A`` (``u32`` bytes) acknowledges data delivered to the local
  end. Per channel and direction at most 256 KiB may be unacknowledged, so a
  slow reader stalls only its own channel.
- ``F`` the sender sends no more on c (the receiver half-closes its local
  end once all data is delivered). A channel is gone when both sent ``F``.
- ``C`` abort c: the local end is closed at once; no answer.
- ``Q`` host -> guest: the guest drops every channel, calls sync() and
  answers ``Q``. Sent before the VM is saved; no channel is open across it.

Sessions. The host starts every session (a new chardev connection, or after
reading an invalid frame) with 64 KiB + 9 zero bytes, ``S`` and ``H``: the
zeros complete whatever frame the guest had half-read, and the zero header
that follows is invalid, so the guest drops everything and looks for ``S``.
The host ignores everything up to the exact ``H`` answer
(``48 00000000 00000004 00000001``). A new mux process (the first one, or one
PID 1 restarted) sends the same zeros and starts out of sync, and so does a
guest that reads an invalid frame other than zeros: a host mid-session then
reads an invalid frame itself and starts a new session. An invalid frame is
an unknown type, a length over 64 KiB, or a malformed ``S``.
When the guest polls ``POLLHUP`` (or reads EOF) on the port, the host side is
gone: it drops every channel and all buffered input and output and checks the
port again every 50 ms.

This module only encodes and decodes; it does no I/O.
"""

from __future__ import annotations

import errno
import os
import struct
from collections.abc import Iterable

from sandfleet.wire.errors import (
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    SandfleetError,
)
from sandfleet.wire.models import (
    ExecRequest,
    ExecResult,
    ExecStatus,
    FileEntry,
    OutputChunk,
    ProcessInfo,
    ProcessState,
    SpawnRequest,
)

__all__ = [
    "CHUNK",
    "MAX_FRAME",
    "decode_entry",
    "decode_error",
    "decode_fields",
    "decode_output",
    "decode_process",
    "decode_result",
    "encode_exec",
    "encode_fields",
    "encode_spawn",
    "frame",
    "offset_field",
    "path_field",
    "proc_op",
    "stream_field",
    "timeout_ms",
]

MAX_FRAME = 4 << 20
"""Largest payload either side accepts, bytes."""
CHUNK = 256 << 10
"""Size of the data frames this client sends, bytes."""

OP_PING, OP_EXEC, OP_READ, OP_WRITE = b"p", b"x", b"r", b"w"
OP_LIST, OP_STAT, OP_REMOVE, OP_MKDIR = b"l", b"s", b"u", b"m"
OP_SPAWN, OP_PROC_LIST, OP_PROC_WAIT, OP_PROC_KILL = b"S", b"L", b"W", b"k"
OP_PROC_STDIN, OP_PROC_CLOSE_STDIN, OP_PROC_OUTPUT, OP_PROC_REMOVE = b"i", b"I", b"o", b"R"
DATA, END, OK, ERROR, ENTRY, RESULT = b"D", b"Z", b"K", b"E", b"F", b"X"
STDOUT, STDERR, PROCESS, OUTPUT = b"1", b"2", b"P", b"O"

_HEADER = struct.Struct(">IB")
_RESULT = struct.Struct(">BiiQQQ")
_ENTRY = struct.Struct(">BQIQ")
_TYPES = ("file", "dir", "symlink", "other")
_STATUS: tuple[ExecStatus, ...] = ("exited", "signaled", "timeout", "oom")
_STATES: tuple[ProcessState, ...] = ("running", "exited", "signaled", "killed", "timeout")
_OUTPUT = struct.Struct(">QQQQB")
_STREAMS = {"stdout": 1, "stderr": 2}


def frame(ftype: bytes, payload: bytes = b"") -> bytes:
    """One frame: length, type byte, payload."""
    return _HEADER.pack(len(payload), ftype[0]) + payload


def encode_fields(fields: Iterable[tuple[bytes, bytes]]) -> bytes:
    """TLV-encode ``(tag, value)`` pairs."""
    return b"".join(tag + len(value).to_bytes(4, "big") + value for tag, value in fields)


def decode_fields(payload: bytes) -> dict[str, bytes]:
    """Decode TLV fields into ``{tag: value}`` (last one wins)."""
    out: dict[str, bytes] = {}
    off = 0
    while off + 5 <= len(payload):
        tag = chr(payload[off])
        n = int.from_bytes(payload[off + 1 : off + 5], "big")
        out[tag] = payload[off + 5 : off + 5 + n]
        off += 5 + n
    return out


def _c_string(what: str, value: str) -> bytes:
    raw = os.fsencode(value)
    if b"\0" in raw:
        raise InvalidArgument(f"{what} contains a NUL byte, which cannot be passed to a process")
    return raw


def path_field(path: str) -> tuple[bytes, bytes]:
    """The ``P`` field, refusing what no syscall accepts."""
    if not path:
        raise InvalidArgument("path is empty: pass an absolute path inside the sandbox")
    return (b"P", _c_string(f"path {path!r}", path))


def _u64(value: int) -> bytes:
    return value.to_bytes(8, "big")


def _command_fields(req: ExecRequest | SpawnRequest) -> list[tuple[bytes, bytes]]:
    """Fields exec and spawn share: command, env, cwd, user, output cap, grace."""
    fields: list[tuple[bytes, bytes]] = []
    if isinstance(req.cmd, str):
        fields.append((b"c", _c_string("command", req.cmd)))
    else:
        if not req.cmd:
            raise InvalidArgument("cmd is an empty list: give at least the program name")
        fields += [(b"a", _c_string(f"argument {a!r}", a)) for a in req.cmd]
    for key, value in req.env.items():
        if not key or "=" in key:
            raise InvalidArgument(f"env name {key!r} is empty or contains '='")
        fields.append((b"e", _c_string(f"env {key}", f"{key}={value}")))
    if req.cwd is not None:
        fields.append((b"d", _c_string("cwd", req.cwd)))
    if req.user is not None:
        if not req.user:
            raise InvalidArgument("user is empty: give a name, a uid or uid:gid, or None")
        fields.append((b"u", _c_string("user", req.user)))
    if req.kill_grace_ms:
        fields.append((b"g", _u64(req.kill_grace_ms)))
    # No cap: the whole output streams live (the head never ends), nothing is held.
    cap = req.max_output_bytes if req.max_output_bytes is not None else 1 << 62
    fields.append((b"o", _u64(cap)))
    return fields


def _op(op: bytes, fields: list[tuple[bytes, bytes]]) -> bytes:
    payload = encode_fields(fields)
    if len(payload) > MAX_FRAME:
        raise InvalidArgument(
            f"command and env take {len(payload)} bytes, over the {MAX_FRAME} byte limit: "
            "pass large inputs as stdin or a file"
        )
    return frame(op, payload)


def encode_exec(req: ExecRequest) -> bytes:
    """The ``x`` op frame for ``req`` (stdin is sent separately as data frames)."""
    fields = _command_fields(req)
    fields.append((b"t", _u64(max(1, round(req.timeout_s * 1000)))))
    return _op(OP_EXEC, fields)


def encode_spawn(req: SpawnRequest) -> bytes:
    """The ``S`` op frame for ``req`` (initial stdin follows as data frames)."""
    if len(req.stdin) > MAX_FRAME:
        raise InvalidArgument(
            f"spawn stdin is {len(req.stdin)} bytes, over {MAX_FRAME}: write the rest "
            "with write_stdin"
        )
    fields = _command_fields(req)
    if req.timeout_s is not None:
        fields.append((b"t", _u64(max(1, round(req.timeout_s * 1000)))))
    if req.close_stdin:
        fields.append((b"n", b"\x01"))
    return _op(OP_SPAWN, fields)


def timeout_ms(timeout_s: float | None) -> list[tuple[bytes, bytes]]:
    """The ``t`` field for a wait bound in seconds; none for None (no bound)."""
    if timeout_s is None:
        return []
    if timeout_s < 0:
        raise InvalidArgument(f"timeout_s is {timeout_s}: give a duration >= 0, or None")
    return [(b"t", _u64(round(timeout_s * 1000)))]


def proc_op(op: bytes, process_id: str, fields: Iterable[tuple[bytes, bytes]] = ()) -> bytes:
    """An op frame about spawned process ``process_id`` (``i`` field first)."""
    return frame(op, encode_fields([(b"i", _c_string("process id", process_id)), *fields]))


def stream_field(stream: str) -> tuple[bytes, bytes]:
    """The ``S`` field: ``stdout`` or ``stderr``."""
    if stream not in _STREAMS:
        raise InvalidArgument(f"stream is {stream!r}: use 'stdout' or 'stderr'")
    return (b"S", _u64(_STREAMS[stream]))


def offset_field(offset: int) -> tuple[bytes, bytes]:
    """The ``F`` field: an absolute output offset, bytes."""
    if offset < 0:
        raise InvalidArgument(f"offset is {offset}: give a byte offset >= 0")
    return (b"F", _u64(offset))


def _int(fields: dict[str, bytes], tag: str) -> int | None:
    raw = fields.get(tag)
    return int.from_bytes(raw, "big") if raw is not None else None


def decode_process(payload: bytes) -> ProcessInfo:
    """Build a :class:`ProcessInfo` from a ``P`` record."""
    f = decode_fields(payload)
    ended = _int(f, "n")
    return ProcessInfo(
        id=f["i"].decode(),
        pid=_int(f, "p") or 0,
        command=f.get("c", b"").decode("utf-8", "replace"),
        state=_STATES[f["s"][0]],
        exit_code=_int(f, "x"),
        signal=_int(f, "g"),
        started_at=(_int(f, "b") or 0) / 1e9,
        ended_at=ended / 1e9 if ended is not None else None,
        stdout_bytes=_int(f, "O") or 0,
        stderr_bytes=_int(f, "R") or 0,
        stdin_open=bool(_int(f, "I")),
    )


def decode_output(payload: bytes) -> OutputChunk:
    """Build an :class:`OutputChunk` from an ``O`` frame."""
    offset, next_offset, dropped, _total, flags = _OUTPUT.unpack_from(payload)
    return OutputChunk(
        data=payload[_OUTPUT.size :],
        offset=offset,
        next_offset=next_offset,
        dropped=dropped,
        eof=bool(flags & 1),
    )


def decode_result(payload: bytes, stdout: bytes, stderr: bytes) -> ExecResult:
    """Build the :class:`ExecResult` from an ``X`` frame and the collected output."""
    status, code, sig, out_drop, err_drop, dur_ns = _RESULT.unpack(payload)
    st = _STATUS[status]
    return ExecResult(
        status=st,
        exit_code=code if st == "exited" else None,
        # oom: like a timeout, never a code that could pass for the command's own
        signal=sig if st == "signaled" else 9 if st == "oom" else None,
        stdout=stdout,
        stderr=stderr,
        stdout_dropped=out_drop,
        stderr_dropped=err_drop,
        duration_s=dur_ns / 1e9,
    )


def decode_entry(payload: bytes, path: str | None, parent: str | None = None) -> FileEntry:
    """Build a :class:`FileEntry` from an ``F`` frame.

    ``path`` is the path asked for (stat, write, mkdir); for list entries pass
    ``parent`` instead and the path is ``parent/name``. Names that are not
    UTF-8 are decoded with ``surrogateescape`` so they round-trip to the agent.
    """
    ftype, size, mode, mtime_ns = _ENTRY.unpack_from(payload)
    name = os.fsdecode(payload[_ENTRY.size :])
    if path is None:
        path = name if parent is None else parent.rstrip("/") + "/" + name
        if parent == "/":
            path = "/" + name
    return FileEntry(
        name=name, path=path, type=_TYPES[ftype], size=size, mode=mode, mtime=mtime_ns / 1e9
    )


_HINTS = {
    errno.ENOTEMPTY: "the directory is not empty; pass recursive=True to remove it",
    errno.EISDIR: "the path is a directory; use list_dir, or remove(recursive=True)",
    errno.ENOTDIR: "a component of the path is not a directory",
    errno.EEXIST: "the path exists already",
    errno.EINVAL: "change the argument",
    errno.ELOOP: "the path runs through a loop of symlinks",
    errno.ENAMETOOLONG: "a name in the path is over 255 bytes, or the path over 4095",
}


def decode_error(payload: bytes, in_exec: bool = False) -> SandfleetError:
    """Turn an ``E`` frame into the sandfleet error for its errno.

    ``in_exec``: the error refused an exec before it started; a missing cwd is
    then the caller's argument (InvalidArgument), not a missing sandbox.
    """
    err = int.from_bytes(payload[:4], "big", signed=True)
    msg = payload[4:].decode("utf-8", "replace")
    if in_exec and err in (errno.ENOENT, errno.ENOTDIR):
        return InvalidArgument(f"{msg}: pass an existing directory as cwd, or create it first")
    if err == errno.ENOENT:
        return NotFound(msg)
    if err in (errno.EACCES, errno.EPERM, errno.EROFS):
        return PermissionDenied(msg)
    if err in _HINTS:
        return InvalidArgument(f"{msg} ({_HINTS[err]})")
    if err == errno.EBUSY:
        return FailedPrecondition(msg)
    if err == errno.EPIPE:
        return FailedPrecondition(f"{msg}; spawn a new process to send more input")
    if err in (errno.ENOSPC, errno.EDQUOT):
        return FailedPrecondition(
            f"{msg}; free space in the sandbox, or create it with a larger disk_mb"
        )
    if err == errno.EAGAIN:
        return ResourceExhausted(
            f"{msg}; the sandbox is at its process limit (pids_limit): retry once some end"
        )
    return Internal(f"{msg} (errno {err})")
