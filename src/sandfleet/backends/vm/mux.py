"""Host side of the multiplexer that carries agent connections over a VM's one port.

A VM reaches its agent through one byte stream: a virtio-serial port that QEMU
exposes on the host as a chardev Unix socket (``-chardev socket,...,server=on``).
:class:`AgentMux` connects to it and serves a Unix socket of its own
(``listen_path``); every connection accepted there is relayed over a channel
of its own, so :class:`sandfleet.guest.client.AgentClient` works unchanged.

The frames, the credit flow control and how sessions start are documented in
:mod:`sandfleet.guest.protocol` (*Guest mode*); the guest side is the agent's
mux process in ``agent.c``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import select
import socket
import struct
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from sandfleet.guest.client import open_socket_file
from sandfleet.wire.errors import FailedPrecondition, InvalidArgument, Unavailable

__all__ = ["MAX_PAYLOAD", "WINDOW", "AgentMux", "Hello", "MuxState", "bind_private"]

log = logging.getLogger(__name__)

WINDOW = 256 << 10
"""Bytes a sender may have unacknowledged per channel and direction."""
MAX_PAYLOAD = 64 << 10
"""Largest frame payload, bytes."""

MuxState = Literal["new", "active", "quiesced", "disconnected", "closed"]

_HEADER = struct.Struct(">BII")  # type, channel, payload length
_VERSION = 1
_MAGIC = b"sandfleet-mux-v1"
# Zeros complete any frame the guest had half-read; the zero header after them
# is invalid, so the guest drops everything and looks for the S frame.
_PAD = bytes(_HEADER.size + MAX_PAYLOAD)
_SYNC = _HEADER.pack(ord("S"), 0, len(_MAGIC)) + _MAGIC
_HELLO_ANSWER = _HEADER.pack(ord("H"), 0, 4) + _VERSION.to_bytes(4, "big")
_GUEST_TYPES = frozenset(b"HQDFCA")
# An answer slower than this came from a booting guest that read a stale clock.
_FRESH_HELLO_S = 0.2
# How often a half-closed client is checked for having closed its socket, seconds.
_HANGUP_POLL_S = 0.25
# A call's client has its answer a moment before its channel is gone: quiesce
# waits this long for channels to end before refusing, seconds.
_CLOSING_GRACE_S = 0.5
_READ_LIMIT = 4 * (_HEADER.size + MAX_PAYLOAD)


@dataclass(frozen=True)
class Hello:
    """What the ``H`` frame that starts each session tells the guest.

    ``realtime_ns`` (Unix time, ns) and ``entropy`` (32 bytes) are taken afresh
    (``time.time_ns()``, ``os.urandom(32)``) every time the hello is sent when
    left None, so one Hello serves any number of reconnects and VMs restored
    from one template never share their random state. ``hostname`` is at most
    64 bytes (UTF-8). Raises InvalidArgument otherwise.
    """

    hostname: str
    realtime_ns: int | None = None
    entropy: bytes | None = None

    def __post_init__(self) -> None:
        name = self.hostname.encode()
        if len(name) > 64 or b"\0" in name:
            raise InvalidArgument(
                f"hostname {self.hostname!r} is over 64 bytes or holds a NUL: shorten it"
            )
        if self.entropy is not None and len(self.entropy) != 32:
            raise InvalidArgument(f"entropy is {len(self.entropy)} bytes: give exactly 32")

    @classmethod
    def now(cls, hostname: str) -> Hello:
        """A hello for ``hostname`` with the host's clock and fresh entropy at each send."""
        return cls(hostname)

    def payload(self) -> bytes:
        """The ``H`` payload: u64 realtime ns, u16 hostname length, hostname, entropy."""
        name = self.hostname.encode()
        now = time.time_ns() if self.realtime_ns is None else self.realtime_ns
        entropy = os.urandom(32) if self.entropy is None else self.entropy
        return now.to_bytes(8, "big") + len(name).to_bytes(2, "big") + name + entropy


class _SessionFailed(Exception):
    """The guest did not answer a new session's hello: the connection is useless."""


class _Channel:
    """One relayed connection: the client's streams, our credit, the guest's data."""

    def __init__(
        self, cid: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self.id = cid
        self.reader = reader
        self.writer = writer
        self.credit = WINDOW  # bytes we may still send to the guest
        self.credit_more = asyncio.Event()
        self.inbox: deque[bytes] = deque()  # guest data not yet written to the client
        self.inbox_bytes = 0
        self.guest_fin = False
        self.wake = asyncio.Event()  # inbox or guest_fin changed
        self.tasks: list[asyncio.Task[None]] = []
        self.aborted = False
        self.half_closed = False  # the client shut down its writing, and we sent F


class AgentMux:
    """Relays connections on a Unix socket to the agent in a VM over its one port.

    States: ``new`` -> :meth:`start` -> ``active`` -> :meth:`quiesce` ->
    ``quiesced`` -> :meth:`reconnect` -> ``active``. When the chardev
    connection drops (QEMU exited) every relayed connection is aborted and the
    state is ``disconnected`` until :meth:`reconnect`; :meth:`close` ends it all.
    ``listen_path`` exists only while ``active``: otherwise a client fails at
    once (``Unavailable``: the agent socket does not exist), it never hangs.
    An invalid frame from the guest (its mux restarted) aborts every relayed
    connection and starts a new session on the same chardev connection.
    """

    def __init__(self) -> None:
        self._state: MuxState = "new"
        self._chardev = Path()
        self._listen = Path()
        self._hello = Hello("")
        self._timeout_s = 30.0
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._server: asyncio.Server | None = None
        self._pump: asyncio.Task[None] | None = None
        self._channels: dict[int, _Channel] = {}
        self._next_id = 0
        self._quiesce_answer: asyncio.Future[None] | None = None
        self._ready = asyncio.Event()  # clear while a new session is being started

    def __repr__(self) -> str:
        return f"AgentMux({str(self._chardev)!r} -> {str(self._listen)!r}, {self._state})"

    @property
    def state(self) -> MuxState:
        """``new``, ``active``, ``quiesced``, ``disconnected`` or ``closed``."""
        return self._state

    def active_channels(self) -> int:
        """Connections being relayed now."""
        return len(self._channels)

    async def start(
        self, chardev_path: Path, listen_path: Path, *, hello: Hello, timeout_s: float = 30.0
    ) -> None:
        """Connect to QEMU's chardev socket, start a session, listen on ``listen_path``.

        ``timeout_s`` (seconds) bounds both waiting for the chardev socket to
        appear and the guest's answer to the hello: give a booting VM its boot
        time. It also bounds the new session after an invalid frame.
        ``listen_path`` is created 0600; a stale socket there is replaced.
        Raises Unavailable when the socket cannot be reached or the guest does
        not answer in time, FailedPrecondition when already started.
        """
        if self._state != "new":
            raise FailedPrecondition(
                f"this AgentMux was started already ({self._state}): use reconnect(), "
                "or a new AgentMux"
            )
        self._chardev, self._listen = Path(chardev_path), Path(listen_path)
        self._hello, self._timeout_s = hello, timeout_s
        self._state = "disconnected"
        await self._open_session(timeout_s)

    async def reconnect(
        self, hello: Hello, *, chardev_path: Path | None = None, timeout_s: float | None = None
    ) -> None:
        """A new chardev connection and session (after the VM was resumed or restored).

        Aborts whatever is relayed and drops the current connection first.
        ``chardev_path`` defaults to the one given to :meth:`start`, ``timeout_s``
        (seconds) to its timeout. Raises as :meth:`start`, and FailedPrecondition
        before :meth:`start` or after :meth:`close`.
        """
        if self._state in ("new", "closed"):
            raise FailedPrecondition(f"cannot reconnect an AgentMux that is {self._state}")
        await self._disconnect()
        self._state = "disconnected"
        if chardev_path is not None:
            self._chardev = Path(chardev_path)
        self._hello = hello
        if timeout_s is not None:
            self._timeout_s = timeout_s
        await self._open_session(self._timeout_s)

    async def quiesce(self, timeout_s: float = 30.0, *, force: bool = False) -> None:
        """Stop relaying and have the guest drop its channels and sync() its disks.

        Done before the VM is saved: no channel may be open across it. Channels
        still open after a short grace (0.5 s, for calls that just ended) make it
        refuse (FailedPrecondition) unless ``force``, which aborts them.
        Afterwards no connection is accepted until :meth:`reconnect`.
        Raises Unavailable when the guest does not answer within ``timeout_s``
        seconds or the chardev connection drops, FailedPrecondition unless active.
        """
        if self._state != "active":
            raise FailedPrecondition(f"cannot quiesce: the agent mux is {self._state}")
        loop = asyncio.get_running_loop()
        grace_end = loop.time() + _CLOSING_GRACE_S
        with contextlib.suppress(TimeoutError):  # a new session being started
            async with asyncio.timeout(timeout_s):
                await self._ready.wait()
        while self._channels and not force and loop.time() < grace_end:
            await asyncio.sleep(0.01)
        if self._state != "active" or not self._ready.is_set():
            raise FailedPrecondition(f"cannot quiesce: the agent mux is {self._state}")
        if self._channels and not force:
            raise FailedPrecondition(
                f"{len(self._channels)} agent calls are in flight in the VM: wait for them "
                "to end, or pass force=True to abort them"
            )
        self._state = "quiesced"
        self._stop_listening()
        self._abort_all(tell_guest=False)  # Q drops them in the guest
        answer = asyncio.get_running_loop().create_future()
        self._quiesce_answer = answer
        self._send(b"Q", 0)
        try:
            async with asyncio.timeout(timeout_s):
                await answer
        except TimeoutError as exc:
            raise Unavailable(
                f"the agent in the VM did not answer quiesce within {timeout_s} s: the guest "
                "may be hung (see its console log)"
            ) from exc
        finally:
            self._quiesce_answer = None

    async def close(self) -> None:
        """Stop listening, abort every relayed connection, drop the chardev connection.

        Idempotent; never raises.
        """
        if self._state == "closed":
            return
        self._state = "closed"
        await self._disconnect()

    # ------------------------------------------------------------------ sessions

    async def _open_session(self, timeout_s: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        # QEMU creates the socket as it starts: wait for it
        while True:
            try:
                reader, writer = await open_socket_file(str(self._chardev), limit=_READ_LIMIT)
                break
            except (FileNotFoundError, ConnectionRefusedError) as exc:
                if loop.time() >= deadline:
                    raise Unavailable(
                        f"cannot connect to the VM's agent port {self._chardev} within "
                        f"{timeout_s} s ({exc.strerror}): is QEMU running with "
                        "-chardev socket,server=on,path=<it>?"
                    ) from exc
                await asyncio.sleep(0.02)
            except OSError as exc:
                raise Unavailable(
                    f"cannot connect to the VM's agent port {self._chardev}: {exc}"
                ) from exc
        try:
            async with asyncio.timeout(max(0.0, deadline - loop.time())):
                await self._handshake(reader, writer)
            self._reader, self._writer = reader, writer
            await self._listen_now()
        except BaseException as exc:
            writer.close()
            self._reader = self._writer = None
            if isinstance(exc, TimeoutError):
                raise Unavailable(
                    f"the agent in the VM did not answer on {self._chardev} within "
                    f"{timeout_s} s: see the VM's console log (did the kernel boot, and did "
                    "init start the agent with --vport-fd on the sandfleet.agent port?)"
                ) from exc
            if isinstance(exc, asyncio.IncompleteReadError | ConnectionError):
                raise Unavailable(
                    f"the VM's agent port {self._chardev} closed during the hello: QEMU exited "
                    "(see its log)"
                ) from exc
            raise
        self._state = "active"
        self._ready.set()
        self._pump = asyncio.create_task(self._read_guest(reader))

    async def _handshake(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Zeros, S and H, then skip everything up to the H answer."""
        loop = asyncio.get_running_loop()
        sent = loop.time()
        writer.write(_PAD + _SYNC + _frame(b"H", 0, self._hello.payload()))
        await _skip_to(reader, _HELLO_ANSWER)
        if loop.time() - sent > _FRESH_HELLO_S:
            # A booting guest read the hello late: its clock would lag by the boot time.
            writer.write(_SYNC + _frame(b"H", 0, self._hello.payload()))
            await _skip_to(reader, _HELLO_ANSWER)

    async def _resync(self, reader: asyncio.StreamReader, why: str) -> None:
        """A new session on the same connection after an invalid frame."""
        log.warning("agent mux on %s: %s; starting a new session", self._chardev, why)
        self._ready.clear()
        self._abort_all(tell_guest=False)
        assert self._writer is not None
        try:
            async with asyncio.timeout(self._timeout_s):
                await self._handshake(reader, self._writer)
        except TimeoutError as exc:
            raise _SessionFailed(
                f"the agent in the VM did not answer a new hello within {self._timeout_s} s "
                f"after {why}"
            ) from exc
        self._ready.set()

    async def _read_guest(self, reader: asyncio.StreamReader) -> None:
        """The one reader of the chardev connection: frames to their channels."""
        try:
            while True:
                ftype, cid, n = _HEADER.unpack(await reader.readexactly(_HEADER.size))
                if n > MAX_PAYLOAD or ftype not in _GUEST_TYPES:
                    await self._resync(reader, f"invalid frame {ftype:#04x} of {n} bytes")
                    continue
                self._dispatch(ftype, cid, await reader.readexactly(n) if n else b"")
        except (asyncio.IncompleteReadError, ConnectionError, OSError) as exc:
            self._lost(f"the VM's agent port closed ({exc.__class__.__name__}): QEMU exited")
        except _SessionFailed as exc:
            self._lost(str(exc))

    def _dispatch(self, ftype: int, cid: int, payload: bytes) -> None:
        if ftype == ord("Q"):
            if self._quiesce_answer is not None and not self._quiesce_answer.done():
                self._quiesce_answer.set_result(None)
            return
        ch = self._channels.get(cid)
        if ch is None:  # H: a repeated hello's answer; else a channel closed meanwhile
            return
        if ftype == ord("D"):
            if ch.guest_fin or ch.inbox_bytes + len(payload) > WINDOW:
                self._abort(ch, tell_guest=True)
                return
            ch.inbox.append(payload)
            ch.inbox_bytes += len(payload)
            ch.wake.set()
        elif ftype == ord("A") and len(payload) == 4:
            ch.credit = min(WINDOW, ch.credit + int.from_bytes(payload, "big"))
            ch.credit_more.set()
        elif ftype == ord("F"):
            ch.guest_fin = True
            ch.wake.set()
        elif ftype == ord("C"):
            self._abort(ch, tell_guest=False)

    def _lost(self, reason: str) -> None:
        """The chardev connection is gone: fail everything fast until reconnect()."""
        log.warning("agent mux on %s: %s", self._chardev, reason)
        if self._state != "closed":
            self._state = "disconnected"
        self._ready.clear()
        self._stop_listening()
        self._abort_all(tell_guest=False)
        if self._quiesce_answer is not None and not self._quiesce_answer.done():
            self._quiesce_answer.set_exception(Unavailable(reason))
        if self._writer is not None:
            self._writer.close()
        self._reader = self._writer = None

    async def _disconnect(self) -> None:
        self._stop_listening()
        self._abort_all(tell_guest=False)
        if self._quiesce_answer is not None and not self._quiesce_answer.done():
            self._quiesce_answer.set_exception(Unavailable("the agent mux was closed"))
        pump, self._pump = self._pump, None
        if pump is not None:
            pump.cancel()
            await asyncio.gather(pump, return_exceptions=True)
        writer, self._writer, self._reader = self._writer, None, None
        self._ready.clear()
        if writer is not None:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    # ------------------------------------------------------------------ listening

    async def _listen_now(self) -> None:
        try:
            sock = bind_private(self._listen)
        except OSError as exc:
            raise FailedPrecondition(
                f"cannot listen on {self._listen}: {exc.strerror}; give a path in an existing, "
                "writable directory"
            ) from exc
        self._server = await asyncio.start_unix_server(self._relay, sock=sock, limit=_READ_LIMIT)

    def _stop_listening(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()
            with contextlib.suppress(FileNotFoundError):
                self._listen.unlink()

    # ------------------------------------------------------------------ channels

    def _send(self, ftype: bytes, cid: int, payload: bytes = b"") -> None:
        # No drain: what is in flight is bounded by the credit windows.
        if self._writer is not None and not self._writer.is_closing():
            self._writer.write(_frame(ftype, cid, payload))

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One accepted connection, relayed over a new channel until both sides end."""
        if self._state == "active" and not self._ready.is_set():
            # a new session is starting (the guest's mux restarted): bounded wait
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._timeout_s):
                    await self._ready.wait()
        if self._state != "active" or not self._ready.is_set():
            writer.transport.abort()
            return
        self._next_id = self._next_id % 0xFFFFFFFF + 1
        ch = _Channel(self._next_id, reader, writer)
        self._channels[ch.id] = ch
        self._send(b"O", ch.id)
        up = asyncio.create_task(self._client_to_guest(ch))
        down = asyncio.create_task(self._guest_to_client(ch))
        ch.tasks = [up, down]
        try:
            await asyncio.gather(down, return_exceptions=True)
            if ch.half_closed:  # both sides sent F: nothing left to watch
                up.cancel()
            await asyncio.gather(up, return_exceptions=True)
        finally:
            if self._channels.get(ch.id) is ch:
                del self._channels[ch.id]
            if ch.aborted:
                writer.transport.abort()
            else:
                writer.close()

    async def _client_to_guest(self, ch: _Channel) -> None:
        try:
            while True:
                while ch.credit <= 0:
                    ch.credit_more.clear()
                    await ch.credit_more.wait()
                data = await ch.reader.read(min(ch.credit, MAX_PAYLOAD))
                if not data:
                    break
                ch.credit -= len(data)
                self._send(b"D", ch.id, data)
            # EOF. A client that closed its socket gets C: the handler must see it
            # gone, as on a direct socket (a call whose caller left is killed).
            # One that only shut down its writing gets F, and is watched until
            # the guest's F ends the channel, or it closes after all.
            if not _hung_up(ch.writer):
                self._send(b"F", ch.id)
                ch.half_closed = True
                while not _hung_up(ch.writer):
                    await asyncio.sleep(_HANGUP_POLL_S)
            self._abort(ch, tell_guest=True)
        except (ConnectionError, OSError):
            self._abort(ch, tell_guest=True)

    async def _guest_to_client(self, ch: _Channel) -> None:
        try:
            while True:
                while not ch.inbox and not ch.guest_fin:
                    ch.wake.clear()
                    await ch.wake.wait()
                if not ch.inbox:  # F, and everything before it is written
                    if ch.writer.can_write_eof():
                        ch.writer.write_eof()
                    return
                chunks, n = list(ch.inbox), ch.inbox_bytes
                ch.inbox.clear()
                ch.inbox_bytes = 0
                ch.writer.writelines(chunks)
                await ch.writer.drain()
                self._send(b"A", ch.id, n.to_bytes(4, "big"))
        except (ConnectionError, OSError):
            self._abort(ch, tell_guest=True)

    def _abort(self, ch: _Channel, *, tell_guest: bool) -> None:
        """Close the client's connection at once (it sees a reset); C to the guest."""
        if ch.aborted:
            return
        ch.aborted = True
        if self._channels.get(ch.id) is ch:
            del self._channels[ch.id]
        if tell_guest:
            self._send(b"C", ch.id)
        ch.writer.transport.abort()
        me = asyncio.current_task()
        for task in ch.tasks:
            if task is not me:
                task.cancel()

    def _abort_all(self, *, tell_guest: bool) -> None:
        for ch in list(self._channels.values()):
            self._abort(ch, tell_guest=tell_guest)


def _hung_up(writer: asyncio.StreamWriter) -> bool:
    """True when the peer closed its socket (POLLHUP), not only shut down its writing."""
    sock = writer.get_extra_info("socket")
    if sock is None:
        return True
    poller = select.poll()
    poller.register(sock.fileno(), 0)  # no events asked: only POLLHUP/POLLERR come back
    return any(ev & (select.POLLHUP | select.POLLERR) for _, ev in poller.poll(0))


def _frame(ftype: bytes, cid: int, payload: bytes = b"") -> bytes:
    return _HEADER.pack(ftype[0], cid, len(payload)) + payload


async def _skip_to(reader: asyncio.StreamReader, marker: bytes) -> None:
    """Discard input up to and including ``marker``; IncompleteReadError at EOF."""
    while True:
        try:
            await reader.readuntil(marker)
            return
        except asyncio.LimitOverrunError as exc:
            await reader.readexactly(exc.consumed)


def bind_private(path: Path) -> socket.socket:
    """A listening Unix socket at ``path``, mode 0600 from its first moment.

    Bound through ``/proc/self/fd/N/<name>`` of its directory, which lifts the
    108-byte ``sun_path`` limit on deep state directories. Raises OSError.
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        # bind() creates the file with the socket inode's mode (less the umask)
        os.fchmod(sock.fileno(), 0o600)
        dfd = os.open(path.parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path.name, dir_fd=dfd)  # a stale socket of an earlier run
            sock.bind(f"/proc/self/fd/{dfd}/{path.name}")
        finally:
            os.close(dfd)
        os.chmod(path, 0o600)
        sock.listen(128)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock
