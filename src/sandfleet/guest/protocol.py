"""Wire protocol between the node and the in-sandbox agent (``agent.c``).

Transport: a Unix stream socket (a virtio-serial port later); one request per
connection; the agent forks a handler per connection, so calls never wait on
each other.

Frame: ``u32 big-endian payload length | u8 type | payload`` (payload at most
4 MiB). Integers are big-endian. A request is one *op frame* whose payload is a
list of TLV fields ``u8 tag | u32 length | value``, optionally followed by
``D`` data frames and a ``Z`` end frame (exec stdin, write_file contents).

Op frames (node -> agent) and their fields:

- ``p`` ping -> ``K`` with fields ``v`` version, ``p`` pid (decimal).
- ``x`` exec: ``a`` argv item (repeated) or ``c`` shell string (``/bin/sh -c``),
  ``e`` ``KEY=VALUE`` (repeated), ``d`` cwd, ``t`` timeout ms (u64), ``o``
  output cap per stream (u64); then stdin as ``D``... ``Z``. Answer: ``1``
  stdout / ``2`` stderr frames while the command runs, then ``X``:
  ``u8 status (0 exited, 1 signaled, 2 timeout) | i32 exit code | i32 signal |
  u64 stdout dropped | u64 stderr dropped | u64 duration ns``.
  Output cap: the first ceil(cap/2) bytes of a stream are streamed live, the
  last floor(cap/2) are kept in a ring and sent just before ``X``; the middle
  is dropped and counted. Concatenating the ``1`` frames gives head + tail.
- ``r`` read ``P`` path -> ``D`` chunks (256 KiB) then ``Z``.
- ``w`` write ``P`` path, ``M`` mode (u32); then ``D``... ``Z`` -> ``F``.
  Atomic: a temp file in the same directory, renamed over the path.
- ``l`` list ``P`` -> ``F`` per entry, then ``Z``. ``s`` stat (lstat) ``P`` -> ``F``.
- ``u`` remove ``P``, ``R`` recursive (u8) -> ``K``.
- ``m`` mkdir ``P``, ``R`` parents (u8), ``M`` mode -> ``F``.

``F`` entry: ``u8 type (0 file, 1 dir, 2 symlink, 3 other) | u64 size |
u32 mode (permission bits) | u64 mtime ns | name bytes``.
``E`` error (ends any request): ``i32 errno (Linux numbering) | UTF-8 message
naming the path``. After an error the agent still reads and discards the
request's data frames up to ``Z``, so a sender never sees a reset.

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
    SandfleetError,
)
from sandfleet.wire.models import ExecRequest, ExecResult, ExecStatus, FileEntry

__all__ = [
    "CHUNK",
    "MAX_FRAME",
    "decode_entry",
    "decode_error",
    "decode_fields",
    "decode_result",
    "encode_exec",
    "encode_fields",
    "frame",
    "path_field",
]

MAX_FRAME = 4 << 20
"""Largest payload either side accepts, bytes."""
CHUNK = 256 << 10
"""Size of the data frames this client sends, bytes."""

OP_PING, OP_EXEC, OP_READ, OP_WRITE = b"p", b"x", b"r", b"w"
OP_LIST, OP_STAT, OP_REMOVE, OP_MKDIR = b"l", b"s", b"u", b"m"
DATA, END, OK, ERROR, ENTRY, RESULT = b"D", b"Z", b"K", b"E", b"F", b"X"
STDOUT, STDERR = b"1", b"2"

_HEADER = struct.Struct(">IB")
_RESULT = struct.Struct(">BiiQQQ")
_ENTRY = struct.Struct(">BQIQ")
_TYPES = ("file", "dir", "symlink", "other")
_STATUS: tuple[ExecStatus, ...] = ("exited", "signaled", "timeout")


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


def encode_exec(req: ExecRequest) -> bytes:
    """The ``x`` op frame for ``req`` (stdin is sent separately as data frames)."""
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
    fields.append((b"t", max(1, round(req.timeout_s * 1000)).to_bytes(8, "big")))
    fields.append((b"o", req.max_output_bytes.to_bytes(8, "big")))
    payload = encode_fields(fields)
    if len(payload) > MAX_FRAME:
        raise InvalidArgument(
            f"command and env take {len(payload)} bytes, over the {MAX_FRAME} byte limit: "
            "pass large inputs as stdin or a file"
        )
    return frame(OP_EXEC, payload)


def decode_result(payload: bytes, stdout: bytes, stderr: bytes) -> ExecResult:
    """Build the :class:`ExecResult` from an ``X`` frame and the collected output."""
    status, code, sig, out_drop, err_drop, dur_ns = _RESULT.unpack(payload)
    st = _STATUS[status]
    return ExecResult(
        status=st,
        exit_code=code if st == "exited" else None,
        signal=sig if st == "signaled" else None,
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
    if err in (errno.ENOSPC, errno.EDQUOT):
        return FailedPrecondition(
            f"{msg}: no space left on device; free space in the sandbox or ask for a bigger disk"
        )
    if err == errno.EAGAIN:
        return FailedPrecondition(f"{msg}; the sandbox is at its process limit, retry later")
    return Internal(f"{msg} (errno {err})")
