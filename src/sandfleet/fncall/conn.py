"""The node's connection to one fncall worker's zygote (framing in :mod:`worker`)."""

from __future__ import annotations

import asyncio
import json
import socket
import struct
from pathlib import Path
from typing import Any

__all__ = ["WorkerConnection"]

_HEADER = struct.Struct(">I")
_MAX_FRAME = 512 << 20


class WorkerConnection:
    """One connection to a worker's socket; one call at a time.

    Raises ``ConnectionError`` (or ``asyncio.IncompleteReadError``, a subclass
    of EOFError) when the worker goes away.
    """

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self.hello: dict[str, Any] = {}

    @classmethod
    async def open(cls, sock_path: Path) -> WorkerConnection:
        """Connect and read the worker's hello (its languages)."""
        # The bundle path may exceed sun_path's 108 bytes: connect through a dir fd.
        import os

        dirfd = os.open(sock_path.parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.setblocking(False)
            try:
                await asyncio.get_running_loop().sock_connect(
                    sock, f"/proc/self/fd/{dirfd}/{sock_path.name}"
                )
            except BaseException:
                sock.close()
                raise
        finally:
            os.close(dirfd)
        reader, writer = await asyncio.open_unix_connection(sock=sock)
        conn = cls(reader, writer)
        hello = await conn.receive()
        if "hello" not in hello:
            conn.close()
            raise ConnectionError(f"the worker did not say hello: {hello!r}")
        conn.hello = hello["hello"]
        return conn

    async def call(self, request: dict[str, Any]) -> dict[str, Any]:
        body = json.dumps(request, separators=(",", ":")).encode()
        self._writer.write(_HEADER.pack(len(body)) + body)
        await self._writer.drain()
        return await self.receive()

    async def receive(self) -> dict[str, Any]:
        (size,) = _HEADER.unpack(await self._reader.readexactly(_HEADER.size))
        if size > _MAX_FRAME:
            raise ConnectionError(f"the worker sent a frame of {size} bytes")
        doc = json.loads(await self._reader.readexactly(size))
        if not isinstance(doc, dict):
            raise ConnectionError("the worker sent a frame that is not an object")
        return doc

    def close(self) -> None:
        self._writer.close()
