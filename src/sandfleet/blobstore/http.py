"""``http(s)://`` blob stores: any static server for reads, WebDAV PUT/DELETE for writes.

What the server must offer, with nginx's directives::

    location / {
        autoindex on; autoindex_format json;       # list(): JSON directory indexes
        dav_methods PUT DELETE;                    # put(), delete()
        create_full_put_path on;                   # PUT creates the key's folders
        client_max_body_size 0;                    # chunks and metadata images of any size
    }

Reads need only the first line (and ``get``/``get_range``/``exists`` not even
that). nginx writes a PUT's body to a temporary file and renames it into
place, so readers never see a partial object.
"""

from __future__ import annotations

import builtins
import contextlib
import json
from collections.abc import Iterator
from email.utils import parsedate_to_datetime
from typing import Any

import httpx

from sandfleet.wire.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    SandfleetError,
    Unavailable,
)

from .base import DEFAULT_TIMEOUT_S, BlobStore, ObjectInfo, check_key

__all__ = ["HttpBlobStore"]

_WRITE_HINT = (
    "the server does not take writes: serve the store with WebDAV PUT and DELETE"
    " (nginx: `dav_methods PUT DELETE; create_full_put_path on; client_max_body_size 0;`)"
    " and let its worker user write the directory, or push to a file:// store instead"
)
_LIST_HINT = "turn on JSON directory indexes (nginx: `autoindex on; autoindex_format json;`)"


class HttpBlobStore(BlobStore):
    """Objects as files under ``url`` on an HTTP server (see the module docstring).

    One pooled :class:`httpx.Client` serves every thread. ``timeout_s`` bounds
    each phase of a request (connect, each read, each write), in seconds.
    """

    def __init__(self, url: str, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if timeout_s <= 0:
            raise InvalidArgument(f"timeout_s must be positive, got {timeout_s}")
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self._client = httpx.Client(
            timeout=timeout_s,
            limits=httpx.Limits(max_connections=64, max_keepalive_connections=64),
            follow_redirects=False,
        )

    def _url(self, key: str) -> str:
        return f"{self.url}/{key}"

    @contextlib.contextmanager
    def _errors(self, method: str, url: str) -> Iterator[None]:
        """httpx's failures to reach the server become :class:`Unavailable`."""
        try:
            yield
        except httpx.TimeoutException as e:
            raise Unavailable(
                f"{method} {url}: no answer within {self.timeout_s:g}s ({type(e).__name__});"
                " is the store's server overloaded or hung?"
            ) from None
        except httpx.TransportError as e:
            raise Unavailable(
                f"{method} {url}: cannot reach the server ({e or type(e).__name__});"
                " is it running and is the URL right?"
            ) from None

    def _send(
        self,
        method: str,
        key: str,
        *,
        content: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> httpx.Response:
        url = self._url(check_key(key))
        with self._errors(method, url):
            return self._client.request(method, url, content=content, headers=headers)

    def _fail(self, resp: httpx.Response, doing: str) -> SandfleetError:
        """The error for an answer ``doing`` did not expect."""
        req = resp.request
        what = f"{req.method} {req.url}: HTTP {resp.status_code} {resp.reason_phrase}"
        status = resp.status_code
        if status >= 500 and status != 501 and status != 507:
            return Unavailable(f"{what} while {doing}; the store's server is failing, retry later")
        if status in (401, 403):
            return PermissionDenied(f"{what}: the server refuses {doing}; check its access rules")
        if status in (301, 302, 303, 307, 308):
            where = resp.headers.get("location", "?")
            return FailedPrecondition(f"{what}: redirected to {where}; give the store's final URL")
        return FailedPrecondition(f"{what} while {doing}: is {self.url} a blob store?")

    def get(self, key: str) -> bytes:
        resp = self._send("GET", key)
        if resp.status_code == 200:
            return resp.content
        if resp.status_code == 404 or _is_folder_redirect(resp, key):
            raise NotFound(f"{key} is not in the blob store {self.url}")
        raise self._fail(resp, f"reading {key}")

    def get_range(self, key: str, start: int, length: int) -> bytes:
        """Bytes ``[start, start + length)`` of ``key`` (fewer at its end), by an HTTP Range
        request. Raises NotFound, Unavailable, and InvalidArgument for a negative range or
        one starting past the end."""
        if start < 0 or length < 0:
            raise InvalidArgument(f"invalid range start={start} length={length} of {key}")
        if length == 0:
            check_key(key)
            return b""
        resp = self._send("GET", key, headers={"Range": f"bytes={start}-{start + length - 1}"})
        if resp.status_code == 206:
            return resp.content
        if resp.status_code == 200:  # a server may ignore Range (RFC 9110); still correct
            return resp.content[start : start + length]
        if resp.status_code == 404 or _is_folder_redirect(resp, key):
            raise NotFound(f"{key} is not in the blob store {self.url}")
        if resp.status_code == 416:
            raise InvalidArgument(
                f"range start={start} length={length} lies past the end of {key} in {self.url}"
            )
        raise self._fail(resp, f"reading {key}")

    def put(self, key: str, data: bytes) -> None:
        resp = self._send("PUT", key, content=data)
        if resp.status_code in (200, 201, 204):
            return
        if resp.status_code in (403, 405, 501):
            raise PermissionDenied(
                f"cannot write {key} to {self.url} (HTTP {resp.status_code}): " + _WRITE_HINT
            )
        if resp.status_code == 409:
            raise PermissionDenied(
                f"cannot write {key} to {self.url} (HTTP 409, its folder is missing):"
                " nginx needs `create_full_put_path on;`"
            )
        if resp.status_code == 413:
            raise PermissionDenied(
                f"cannot write {key} ({len(data)} bytes) to {self.url}: too large for the"
                " server (nginx: `client_max_body_size 0;`)"
            )
        if resp.status_code == 507:
            raise ResourceExhausted(f"writing {key} to {self.url}: the server's disk is full")
        if resp.status_code == 500:  # what nginx answers when it cannot make the file
            raise Unavailable(
                f"cannot write {key} to {self.url} (HTTP 500): check the server's error log;"
                " nginx needs `create_full_put_path on;` and a root its worker user can write"
            )
        raise self._fail(resp, f"writing {key}")

    def exists(self, key: str) -> bool:
        resp = self._send("HEAD", key)
        if resp.status_code == 200:
            return True
        if resp.status_code == 404 or _is_folder_redirect(resp, key):
            return False
        raise self._fail(resp, f"checking {key}")

    def delete(self, key: str) -> None:
        resp = self._send("DELETE", key)
        if resp.status_code in (200, 202, 204, 404):
            return
        if resp.status_code in (403, 405, 501):
            raise PermissionDenied(
                f"cannot delete {key} from {self.url} (HTTP {resp.status_code}): " + _WRITE_HINT
            )
        raise self._fail(resp, f"deleting {key}")

    def list(self, prefix: str) -> list[ObjectInfo]:
        folder = prefix.rpartition("/")[0]  # 'chunks/sha256/ab' lists 'chunks/sha256/'
        if folder:
            check_key(folder)
        found: list[ObjectInfo] = []
        todo = [folder]
        while todo:
            current = todo.pop()
            for entry in self._index(current):
                name = entry.get("name")
                if not isinstance(name, str) or name in ("", ".", "..") or "/" in name:
                    continue
                key = f"{current}/{name}" if current else name
                if entry.get("type") == "directory":
                    if key != "tmp" and key.startswith(prefix):
                        todo.append(key)
                elif entry.get("type") == "file" and key.startswith(prefix):
                    found.append(ObjectInfo(key, int(entry.get("size", 0)), _mtime(entry)))
        return found

    def _index(self, folder: str) -> builtins.list[dict[str, Any]]:
        """The JSON index of ``folder`` ('' for the root); [] if it does not exist."""
        url = f"{self.url}/{folder}/" if folder else f"{self.url}/"
        with self._errors("GET", url):
            resp = self._client.get(url)
        if resp.status_code == 404:
            return []
        if resp.status_code == 403:
            raise PermissionDenied(f"cannot list {url} (HTTP 403): {_LIST_HINT}")
        if resp.status_code != 200:
            raise self._fail(resp, f"listing {folder or 'the root'}")
        try:
            entries = json.loads(resp.content)
        except ValueError:
            entries = None
        if not isinstance(entries, list):
            raise FailedPrecondition(f"GET {url} did not answer a JSON index: {_LIST_HINT}")
        return [e for e in entries if isinstance(e, dict)]

    def close(self) -> None:
        self._client.close()


def _is_folder_redirect(resp: httpx.Response, key: str) -> bool:
    """nginx answers a folder's URL without its trailing '/' with a redirect to it."""
    location = resp.headers.get("location", "")
    return resp.is_redirect and location.endswith(key + "/")


def _mtime(entry: dict[str, Any]) -> float:
    """nginx's ``mtime`` ('Tue, 02 Jan 2024 10:00:00 GMT') in Unix seconds; 0 if absent."""
    try:
        return parsedate_to_datetime(str(entry["mtime"])).timestamp()
    except (KeyError, TypeError, ValueError):
        return 0.0
