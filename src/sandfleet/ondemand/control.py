"""The daemon's control socket: JSON lines over a Unix stream socket.

Each request is one JSON object on one line; each gets one JSON line back::

    {"op": "stats"}                                   -> {"ok": true, "stats": {...}}
    {"op": "prefetch", "layer": "sha256:..", "chunks": [0, 5]} -> {"ok": true, "queued": 2}
    {"op": "access", "layer": "sha256:.."}            -> {"ok": true, "chunks": [3, 0, 1]}
    {"op": "events", "since": 0}                      -> {"ok": true, "events": [..], "next": 7}

A failure answers ``{"ok": false, "error": {"code": "...", "message": "..."}}``
with sandfleet's wire codes (:mod:`sandfleet.wire.errors`).
"""

from __future__ import annotations

import contextlib
import json
import os
import socketserver
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sandfleet.blobstore.keys import digest_hex
from sandfleet.wire.errors import InvalidArgument, SandfleetError

from .fetcher import Fetcher, Layer

__all__ = ["MAX_LINE", "ControlServer"]

#: Bytes a request line may hold.
MAX_LINE = 1 << 20


class ControlServer:
    """Serves :mod:`control` requests on ``socket_path`` from a daemon thread.

    ``layer`` resolves a layer's hex digest (raises NotFound); ``status`` gives
    extra fields for ``stats`` (mount state, pid). The socket file is replaced
    if it exists and made accessible to root only.
    """

    def __init__(
        self,
        socket_path: Path | str,
        fetcher: Fetcher,
        layer: Callable[[str], Layer],
        status: Callable[[], dict[str, Any]],
    ) -> None:
        self.socket_path = Path(socket_path)
        self.fetcher = fetcher
        self._layer = layer
        self._status = status
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()
        self.socket_path.parent.mkdir(parents=True, exist_ok=True)
        server = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                while True:
                    line = self.rfile.readline(MAX_LINE)
                    if not line:
                        return
                    answer = server.answer(line)
                    self.wfile.write(json.dumps(answer).encode() + b"\n")
                    self.wfile.flush()

        class Server(socketserver.ThreadingUnixStreamServer):
            daemon_threads = True

        old = os.umask(0o077)
        # Bound through /proc/self/fd of its directory: a deep state directory
        # would pass sun_path's 108 bytes.
        dirfd = os.open(self.socket_path.parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            self._server = Server(f"/proc/self/fd/{dirfd}/{self.socket_path.name}", Handler)
        finally:
            os.umask(old)
            os.close(dirfd)
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="control", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()

    def answer(self, line: bytes) -> dict[str, Any]:
        """The answer to one request line (never raises)."""
        try:
            try:
                req = json.loads(line)
            except ValueError as e:
                raise InvalidArgument(f"request is not JSON: {e}") from None
            if not isinstance(req, dict):
                raise InvalidArgument("request must be a JSON object with an 'op'")
            return {"ok": True, **self._dispatch(req)}
        except SandfleetError as e:
            return {"ok": False, **e.to_wire()}
        except Exception as e:
            return {"ok": False, "error": {"code": "INTERNAL", "message": repr(e)}}

    def _dispatch(self, req: dict[str, Any]) -> dict[str, Any]:
        op = req.get("op")
        if op == "stats":
            cache = self.fetcher.cache.stats()
            return {
                "stats": {
                    **self._status(),
                    "fetcher": self.fetcher.stats(),
                    "cache": {
                        "bytes": cache.bytes,
                        "count": cache.count,
                        "max_bytes": cache.max_bytes,
                        "hits": cache.hits,
                        "misses": cache.misses,
                        "evictions": cache.evictions,
                    },
                }
            }
        if op == "prefetch":
            chunks = req.get("chunks")
            if not isinstance(chunks, list) or not all(
                isinstance(c, int) and not isinstance(c, bool) for c in chunks
            ):
                raise InvalidArgument("'chunks' must be a list of chunk indexes")
            layer = self._layer(digest_hex(str(req.get("layer"))))
            return {"queued": self.fetcher.prefetch(layer, chunks)}
        if op == "access":
            digest = str(req.get("layer"))
            digest_hex(digest)
            return {"chunks": self.fetcher.access(digest)}
        if op == "events":
            since = req.get("since", 0)
            if not isinstance(since, int):
                raise InvalidArgument("'since' must be an integer event cursor")
            events, nxt = self.fetcher.events(since)
            return {"events": [e.to_dict() for e in events], "next": nxt}
        raise InvalidArgument(f"unknown op {op!r}: use 'stats', 'prefetch', 'access' or 'events'")
