"""The SDK's logic that does no network I/O, shared by the async and sync clients.

Settings, the requests each method sends, how answers are read and how errors
are translated all live here, so :mod:`sandfleet.sdk.client` (async) and
:mod:`sandfleet.sdk.sync` only move bytes and both surfaces behave alike.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import socket
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Generic, TypeVar
from urllib.parse import quote, urlsplit

import httpx
from pydantic import BaseModel, ConfigDict, ValidationError

from sandfleet.wire.errors import (
    DeadlineExceeded,
    Internal,
    InvalidArgument,
    SandfleetError,
    Unavailable,
    error_from_wire,
)
from sandfleet.wire.models import (
    BUILT_KINDS,
    FNCALL_IMAGE,
    KINDS,
    CreateSandboxRequest,
    ExecEvent,
    ExecRequest,
    ExecResult,
    FileEntry,
    GroupRequest,
    GroupResult,
    ImageManifest,
    LifetimeRequest,
    NodeInfo,
    OutputChunk,
    PoolConfig,
    PoolInfo,
    ProcessInfo,
    RunRequest,
    RunResult,
    SandboxEvent,
    SandboxInfo,
    SpawnRequest,
    StageResult,
)

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)

DEFAULT_URL = "http://127.0.0.1:7070"
DEFAULT_TIMEOUT_S = 30.0
ENV_URL = "SANDFLEET_URL"
ENV_TOKEN = "SANDFLEET_TOKEN"
#: Seconds an exec call waits beyond the command's own ``timeout_s``, for the
#: two HTTP hops and the process-group kill to report a ``timeout`` result.
EXEC_MARGIN_S = 10.0
#: Size of the pieces streamed uploads and downloads are moved in, bytes.
CHUNK_BYTES = 1 << 20
#: A request timeout meaning "no read timeout": the answer may rightly take as
#: long as it likes (waiting for a process without a bound, following its output).
#: Connecting and sending still use the client's timeout.
NO_READ_TIMEOUT = math.inf
#: Default cap on a command's captured stdout and stderr, each, bytes.
EXEC_MAX_OUTPUT_BYTES = 16 * 1024 * 1024
#: Default output a spawned process keeps per stream (the most recent), bytes.
SPAWN_MAX_OUTPUT_BYTES = 4 * 1024 * 1024
#: ``max_connections=None``: no client-side queue; thousands of concurrent execs
#: each hold a connection, and the control plane's admission is the limit.
POOL_LIMITS = httpx.Limits(max_connections=None, max_keepalive_connections=256)
#: httpcore writes a request's head and body separately; without TCP_NODELAY a
#: small body can wait for a delayed ACK (~40 ms) on real networks.
SOCKET_OPTIONS = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]

_JSON = {"content-type": "application/json"}
_OCTETS = {"content-type": "application/octet-stream"}


# --------------------------------------------------------------------------- settings


@dataclass(frozen=True, slots=True)
class Settings:
    """Where the control plane is and how long to wait for it.

    ``url`` has no trailing slash; ``timeout_s`` is the default per-request
    timeout in seconds.
    """

    url: str
    token: str | None
    timeout_s: float

    @classmethod
    def resolve(
        cls,
        url: str | None,
        token: str | None,
        timeout_s: float | None,
        environ: Mapping[str, str] | None = None,
    ) -> Settings:
        """THE one place settings are resolved. Precedence, first found wins:

        1. a per-call argument (only timeouts have one: an exec call waits for
           its command's ``timeout_s`` + :data:`EXEC_MARGIN_S`, see
           :meth:`exec_timeout_s`);
        2. the argument given to ``AsyncClient(...)`` / ``Client(...)``;
        3. the environment: ``SANDFLEET_URL``, ``SANDFLEET_TOKEN`` (empty = unset);
        4. the default: ``http://127.0.0.1:7070``, no token, 30 s per request.

        Raises :class:`InvalidArgument` for a URL that is not ``http(s)://host[:port]``
        or a timeout that is not positive, naming where the bad value came from.
        """
        env = os.environ if environ is None else environ
        where = "url argument"
        if url is None:
            url, where = env.get(ENV_URL) or None, f"${ENV_URL}"
        if url is None:
            url, where = DEFAULT_URL, "default url"
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise InvalidArgument(
                f"{where} {url!r} is not a control plane address;"
                f" give it as http://host:port, e.g. {DEFAULT_URL}"
            )
        if token is None:
            token = env.get(ENV_TOKEN) or None
        if timeout_s is None:
            timeout_s = DEFAULT_TIMEOUT_S
        if not timeout_s > 0:
            raise InvalidArgument(f"timeout_s must be > 0 seconds, got {timeout_s!r}")
        return cls(url=url.rstrip("/"), token=token, timeout_s=float(timeout_s))

    def exec_timeout_s(self, cmd_timeout_s: float) -> float:
        """Seconds an exec request may take: the command's timeout plus a margin."""
        return cmd_timeout_s + EXEC_MARGIN_S

    def http_timeout(self, timeout_s: float | None) -> httpx.Timeout | None:
        """The httpx timeout of a request taking ``timeout_s`` seconds.

        None: the client's own timeout (returns None). :data:`NO_READ_TIMEOUT`:
        no bound on reading the answer, the client's timeout for the rest.
        """
        if timeout_s is None:
            return None
        if timeout_s == NO_READ_TIMEOUT:
            return httpx.Timeout(self.timeout_s, read=None)
        return httpx.Timeout(timeout_s)

    def headers(self) -> dict[str, str]:
        """Headers every request carries (the bearer token, when there is one)."""
        return {"authorization": f"Bearer {self.token}"} if self.token else {}


# --------------------------------------------------------------------------- requests


@dataclass(frozen=True, slots=True)
class Request(Generic[T]):
    """One HTTP call, described without doing it.

    ``parse`` turns the body of a 2xx answer into the method's result.
    ``timeout_s`` None means the client's timeout.
    """

    method: str
    path: str
    parse: Callable[[bytes], T]
    params: tuple[tuple[str, str], ...] | None = None
    body: bytes | None = None
    headers: Mapping[str, str] | None = None
    timeout_s: float | None = None


class _Answer(BaseModel):
    # Envelopes of list answers; unknown keys are ignored so the server may add some.
    model_config = ConfigDict(extra="ignore")


class _Sandboxes(_Answer):
    sandboxes: list[SandboxInfo]


class _Entries(_Answer):
    entries: list[FileEntry]


class _Images(_Answer):
    images: list[ImageManifest]


class _Nodes(_Answer):
    nodes: list[NodeInfo]


def _model(cls: type[M]) -> Callable[[bytes], M]:
    return cls.model_validate_json


def _none(_: bytes) -> None:
    return None


#: For requests whose answer is read some other way (streamed lines).
no_answer = _none
JSON_HEADERS = _JSON


def _raw(content: bytes) -> bytes:
    return content


def _sandboxes(content: bytes) -> list[SandboxInfo]:
    return _Sandboxes.model_validate_json(content).sandboxes


def _entries(content: bytes) -> list[FileEntry]:
    return _Entries.model_validate_json(content).entries


def _images(content: bytes) -> list[ImageManifest]:
    return _Images.model_validate_json(content).images


def _nodes(content: bytes) -> list[NodeInfo]:
    return _Nodes.model_validate_json(content).nodes


def _build(cls: type[M], **fields: Any) -> M:
    """Build a request model; a value pydantic rejects is the caller's InvalidArgument."""
    try:
        return cls(**fields)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()
        )
        raise InvalidArgument(f"invalid {cls.__name__}: {problems}") from None


def check_kind(kind: str) -> None:
    """Reject, before any request, a kind this release cannot run."""
    if kind in BUILT_KINDS:
        return
    available = ", ".join(repr(k) for k in BUILT_KINDS)
    if kind == "fncall":
        raise InvalidArgument(
            "kind 'fncall' has no sandboxes to create: its calls are stateless, use"
            f" client.run(code, kind='fncall'); sandbox kinds available: {available}"
        )
    if kind in KINDS:
        raise InvalidArgument(
            f"kind {kind!r} is not built in this release; kinds available: {available}"
        )
    planned = ", ".join(repr(k) for k in KINDS if k not in BUILT_KINDS and k != "fncall")
    raise InvalidArgument(
        f"unknown kind {kind!r}; kinds available: {available} (stateless calls:"
        f" client.run(code, kind='fncall'); planned: {planned})"
    )


def _sandbox_path(sandbox_id: str, suffix: str = "") -> str:
    if not isinstance(sandbox_id, str) or not sandbox_id:
        raise InvalidArgument(f"sandbox_id must be a non-empty string, got {sandbox_id!r}")
    return f"/v1/sandboxes/{quote(sandbox_id, safe='')}{suffix}"


def _remote_path(path: str) -> str:
    if not isinstance(path, str) or not path:
        raise InvalidArgument(f"path must be a non-empty string, got {path!r}")
    return path


def _bool(value: bool) -> str:
    return "true" if value else "false"


def create_request(
    *,
    kind: str,
    image: str,
    workspace: str | None,
    cpu: float,
    memory_mb: int,
    pids_limit: int,
    disk_mb: int,
    ttl_s: float | None,
    labels: Mapping[str, str] | None,
    env: Mapping[str, str] | None,
    idle_ttl_s: float | None = None,
) -> Request[SandboxInfo]:
    check_kind(kind)
    body = _build(
        CreateSandboxRequest,
        kind=kind,
        image=image,
        workspace=workspace,
        cpu=cpu,
        memory_mb=memory_mb,
        pids_limit=pids_limit,
        disk_mb=disk_mb,
        ttl_s=ttl_s,
        idle_ttl_s=idle_ttl_s,
        labels=dict(labels or {}),
        env=dict(env or {}),
    )
    return Request(
        "POST",
        "/v1/sandboxes",
        _model(SandboxInfo),
        body=body.model_dump_json().encode(),
        headers=_JSON,
    )


def get_request(sandbox_id: str) -> Request[SandboxInfo]:
    return Request("GET", _sandbox_path(sandbox_id), _model(SandboxInfo))


def list_request(labels: Mapping[str, str] | None) -> Request[list[SandboxInfo]]:
    params = []
    for key, value in (labels or {}).items():
        if not key or "=" in key:
            raise InvalidArgument(f"label key {key!r} must be non-empty and contain no '='")
        params.append(("label", f"{key}={value}"))
    return Request("GET", "/v1/sandboxes", _sandboxes, params=tuple(params) or None)


def destroy_request(sandbox_id: str) -> Request[None]:
    return Request("DELETE", _sandbox_path(sandbox_id), _none)


# --------------------------------------------------------------------------- lifecycle


class _Keep:
    """The default of :meth:`set_lifetime`'s arguments: leave that lifetime as it is."""

    _instance: _Keep | None = None

    def __new__(cls) -> _Keep:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "KEEP"


#: "Leave this lifetime as it is" (the default of ``set_lifetime``'s arguments).
KEEP: Any = _Keep()


def pause_request(sandbox_id: str) -> Request[SandboxInfo]:
    return Request("POST", _sandbox_path(sandbox_id, "/pause"), _model(SandboxInfo))


def resume_request(sandbox_id: str) -> Request[SandboxInfo]:
    return Request("POST", _sandbox_path(sandbox_id, "/resume"), _model(SandboxInfo))


def lifetime_request(sandbox_id: str, ttl_s: Any, idle_ttl_s: Any) -> Request[SandboxInfo]:
    """The request of ``set_lifetime``; arguments left at :data:`KEEP` are not sent.

    Raises ``InvalidArgument`` when both are left at KEEP, or for a value that is
    not a positive number of seconds (at most 30 days) or None.
    """
    given = {
        name: value
        for name, value in (("ttl_s", ttl_s), ("idle_ttl_s", idle_ttl_s))
        if value is not KEEP
    }
    if not given:
        raise InvalidArgument("give ttl_s and/or idle_ttl_s (seconds; None removes the limit)")
    for name, value in given.items():
        if value is not None and not (
            isinstance(value, int | float) and math.isfinite(value) and 0 < value <= 30 * 86400
        ):
            raise InvalidArgument(
                f"{name}={value!r} is out of range: give seconds in (0, 2592000], or None for"
                " no limit"
            )
    body = _build(LifetimeRequest, **given)
    return Request(
        "POST",
        _sandbox_path(sandbox_id, "/lifetime"),
        _model(SandboxInfo),
        body=body.model_dump_json(exclude_unset=True).encode(),
        headers=_JSON,
    )


def group_request(op: str, labels: Mapping[str, str]) -> Request[GroupResult]:
    """``POST /v1/sandboxes/{op}`` for the sandboxes carrying every one of ``labels``.

    Raises ``InvalidArgument`` for no labels (a group op never acts on every
    sandbox) or a malformed key.
    """
    if not labels:
        raise InvalidArgument(
            f"{op} needs labels naming the group, e.g. labels={{'job': 'my-job'}}: it never"
            " acts on every sandbox"
        )
    for key in labels:
        if not key or "=" in key:
            raise InvalidArgument(f"label key {key!r} must be non-empty and contain no '='")
    body = _build(GroupRequest, labels=dict(labels))
    return Request(
        "POST",
        f"/v1/sandboxes/{op}",
        _model(GroupResult),
        body=body.model_dump_json().encode(),
        headers=_JSON,
    )


def exec_body(
    cmd: str | Sequence[str],
    *,
    env: Mapping[str, str] | None,
    cwd: str | None,
    stdin: bytes | str | None,
    timeout_s: float,
    user: str | None = None,
    max_output_bytes: int | None = EXEC_MAX_OUTPUT_BYTES,
) -> bytes:
    """The JSON body of an exec call (validated, so a bad call fails before any request)."""
    fields = _command_fields(cmd, env, cwd, stdin, user)
    body = _build(ExecRequest, **fields, timeout_s=timeout_s, max_output_bytes=max_output_bytes)
    return body.model_dump_json().encode()


def _command_fields(
    cmd: str | Sequence[str],
    env: Mapping[str, str] | None,
    cwd: str | None,
    stdin: bytes | str | None,
    user: str | None,
) -> dict[str, Any]:
    """What exec and spawn requests share, normalised (str stdin is UTF-8 encoded)."""
    if isinstance(stdin, str):
        stdin = stdin.encode()
    return {
        "cmd": _cmd(cmd),
        "env": dict(env or {}),
        "cwd": cwd,
        "stdin": stdin or b"",
        "user": user,
    }


def _cmd(cmd: str | Sequence[str]) -> str | list[str]:
    if isinstance(cmd, str):
        return cmd
    if isinstance(cmd, bytes | bytearray):
        raise InvalidArgument("cmd is bytes: give a str (run by /bin/sh -c) or a list of str")
    return list(cmd)


def exec_request(
    settings: Settings, sandbox_id: str, body: bytes, timeout_s: float
) -> Request[ExecResult]:
    return Request(
        "POST",
        _sandbox_path(sandbox_id, "/exec"),
        _model(ExecResult),
        body=body,
        headers=_JSON,
        timeout_s=settings.exec_timeout_s(timeout_s),
    )


def exec_stream_request(
    settings: Settings, sandbox_id: str, body: bytes, timeout_s: float
) -> Request[None]:
    """A streaming exec: the answer is NDJSON :class:`ExecEvent` lines (see :class:`Lines`)."""
    return Request(
        "POST",
        _sandbox_path(sandbox_id, "/exec/stream"),
        _none,
        body=body,
        headers=_JSON,
        timeout_s=settings.exec_timeout_s(timeout_s),
    )


class ExecCollector:
    """Rebuilds a full :class:`ExecResult` from the events of a streaming exec.

    ``keep_stdout``/``keep_stderr`` False: that stream went to a callback with no
    cap, and holding it too would make the client's memory unbounded.
    """

    def __init__(self, keep_stdout: bool = True, keep_stderr: bool = True) -> None:
        self._out = bytearray()
        self._err = bytearray()
        self._keep = {"stdout": keep_stdout, "stderr": keep_stderr}
        self._result: ExecResult | None = None

    @classmethod
    def for_exec(
        cls, max_output_bytes: int | None, on_stdout: object, on_stderr: object
    ) -> ExecCollector:
        """Keeps what :meth:`AsyncSandbox.exec` documents: all of it unless uncapped."""
        uncapped = max_output_bytes is None
        return cls(not (uncapped and on_stdout), not (uncapped and on_stderr))

    def add(self, event: ExecEvent) -> None:
        if event.type in self._keep and not self._keep[event.type]:
            return
        if event.type == "stdout":
            self._out += event.data
        elif event.type == "stderr":
            self._err += event.data
        elif event.type == "result":
            self._result = event.result

    def result(self) -> ExecResult:
        """The result with the collected output; Internal if the stream had no result."""
        if self._result is None:
            raise Internal("the exec stream ended without a result event")
        return self._result.model_copy(
            update={"stdout": bytes(self._out), "stderr": bytes(self._err)}
        )


class Lines:
    """Splits a byte stream into NDJSON lines (no I/O); feed chunks, then call :meth:`end`."""

    def __init__(self) -> None:
        self._pending: list[bytes] = []

    def feed(self, chunk: bytes) -> list[bytes]:
        """The complete lines ``chunk`` finishes, without their newlines."""
        if b"\n" not in chunk:
            self._pending.append(chunk)  # a long line: join once, when it ends
            return []
        lines = b"".join([*self._pending, chunk]).split(b"\n")
        tail = lines.pop()
        self._pending = [tail] if tail else []
        return [line for line in lines if line]

    def end(self) -> None:
        """Raise Unavailable if the stream stopped in the middle of a line."""
        if b"".join(self._pending).strip():
            raise Unavailable("the server's answer ended in the middle of a line; retry")


def _stream_error(line: bytes, what: str) -> SandfleetError | None:
    """The error an ``{"error": {...}}`` line carries, if it is one."""
    if not line.startswith(b'{"error"'):
        return None
    try:
        body = json.loads(line)
    except ValueError:
        return Internal(f"{what}: malformed error line {line[:200]!r}")
    return error_from_wire(body, 500)


def parse_exec_event(line: bytes) -> ExecEvent:
    """One line of an exec stream; an ``error`` event is raised as its SandfleetError."""
    try:
        event = ExecEvent.model_validate_json(line)
    except ValueError as exc:
        raise Internal(f"unexpected line in an exec stream: {str(exc)[:300]}") from None
    if event.type == "error":
        err = event.error
        raise error_from_wire(
            {"error": err.model_dump() if err else {"code": "INTERNAL", "message": ""}}, 500
        )
    if event.type == "result" and event.result is None:
        raise Internal("an exec stream's result event carried no result")
    return event


def parse_chunk_line(line: bytes) -> OutputChunk:
    """One line of a followed output; an ``{"error"}`` line is raised as its SandfleetError."""
    if (err := _stream_error(line, "output stream")) is not None:
        raise err
    try:
        return OutputChunk.model_validate_json(line)
    except ValueError as exc:
        raise Internal(f"unexpected line in an output stream: {str(exc)[:300]}") from None


# --------------------------------------------------------------------------- processes


class _Processes(_Answer):
    processes: list[ProcessInfo]


def _processes(content: bytes) -> list[ProcessInfo]:
    return _Processes.model_validate_json(content).processes


def _process_path(sandbox_id: str, process_id: str, suffix: str = "") -> str:
    if not isinstance(process_id, str) or not process_id:
        raise InvalidArgument(f"process_id must be a non-empty string, got {process_id!r}")
    return _sandbox_path(sandbox_id, f"/processes/{quote(process_id, safe='')}{suffix}")


def spawn_request(
    sandbox_id: str,
    cmd: str | Sequence[str],
    *,
    env: Mapping[str, str] | None,
    cwd: str | None,
    stdin: bytes | str | None,
    timeout_s: float | None,
    user: str | None,
    close_stdin: bool,
    max_output_bytes: int,
) -> Request[ProcessInfo]:
    body = _build(
        SpawnRequest,
        **_command_fields(cmd, env, cwd, stdin, user),
        timeout_s=timeout_s,
        close_stdin=close_stdin,
        max_output_bytes=max_output_bytes,
    )
    return Request(
        "POST",
        _sandbox_path(sandbox_id, "/processes"),
        _model(ProcessInfo),
        body=body.model_dump_json().encode(),
        headers=_JSON,
    )


def processes_request(sandbox_id: str) -> Request[list[ProcessInfo]]:
    return Request("GET", _sandbox_path(sandbox_id, "/processes"), _processes)


def process_request(sandbox_id: str, process_id: str) -> Request[ProcessInfo]:
    return Request("GET", _process_path(sandbox_id, process_id), _model(ProcessInfo))


def _seconds(name: str, value: float | None) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < math.inf:
        raise InvalidArgument(f"{name} must be a number of seconds >= 0, or None; got {value!r}")
    return float(value)


def wait_request(
    settings: Settings, sandbox_id: str, process_id: str, timeout_s: float | None
) -> Request[ProcessInfo]:
    timeout_s = _seconds("timeout_s", timeout_s)
    return Request(
        "POST",
        _process_path(sandbox_id, process_id, "/wait"),
        _model(ProcessInfo),
        params=None if timeout_s is None else (("timeout_s", repr(timeout_s)),),
        timeout_s=NO_READ_TIMEOUT if timeout_s is None else settings.exec_timeout_s(timeout_s),
    )


def kill_request(sandbox_id: str, process_id: str, signal: int) -> Request[ProcessInfo]:
    if isinstance(signal, bool) or not isinstance(signal, int) or not 1 <= signal <= 64:
        raise InvalidArgument(f"signal must be a signal number 1-64 (e.g. 9, 15), got {signal!r}")
    return Request(
        "POST",
        _process_path(sandbox_id, process_id, "/kill"),
        _model(ProcessInfo),
        params=(("signal", str(int(signal))),),
    )


def stdin_request(sandbox_id: str, process_id: str, data: bytes | str) -> Request[None]:
    if isinstance(data, str):
        data = data.encode()
    if not isinstance(data, bytes | bytearray | memoryview):
        raise InvalidArgument(f"data must be bytes or str, got {type(data).__name__}")
    return Request(
        "POST",
        _process_path(sandbox_id, process_id, "/stdin"),
        _none,
        body=bytes(data),
        headers=_OCTETS,
    )


def close_stdin_request(sandbox_id: str, process_id: str) -> Request[None]:
    return Request("POST", _process_path(sandbox_id, process_id, "/stdin/close"), _none)


def _output_params(stream: str, offset: int) -> tuple[tuple[str, str], ...]:
    if stream not in ("stdout", "stderr"):
        raise InvalidArgument(f"stream must be 'stdout' or 'stderr', got {stream!r}")
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise InvalidArgument(f"offset must be an int >= 0 (bytes), got {offset!r}")
    return (("stream", stream), ("offset", str(offset)))


def read_output_request(
    sandbox_id: str, process_id: str, stream: str, offset: int
) -> Request[OutputChunk]:
    return Request(
        "GET",
        _process_path(sandbox_id, process_id, "/output"),
        _model(OutputChunk),
        params=_output_params(stream, offset),
    )


def follow_output_request(
    sandbox_id: str, process_id: str, stream: str, offset: int
) -> Request[None]:
    """Output as NDJSON :class:`OutputChunk` lines until the process ends (see :class:`Lines`)."""
    return Request(
        "GET",
        _process_path(sandbox_id, process_id, "/output"),
        _none,
        params=(*_output_params(stream, offset), ("follow", "true")),
        timeout_s=NO_READ_TIMEOUT,
    )


def remove_process_request(sandbox_id: str, process_id: str) -> Request[None]:
    return Request("DELETE", _process_path(sandbox_id, process_id), _none)


#: Default cap on :meth:`files.read`, bytes; larger files go through ``download``.
READ_MAX_BYTES = 256 * 1024 * 1024


def read_request(sandbox_id: str, path: str, max_bytes: int | None = None) -> Request[bytes]:
    params: tuple[tuple[str, str], ...] = (("path", _remote_path(path)),)
    if max_bytes is not None:
        if not isinstance(max_bytes, int) or max_bytes < 0:
            raise InvalidArgument(f"max_bytes must be an int >= 0, got {max_bytes!r}")
        params += (("max_bytes", str(max_bytes)),)
    return Request("GET", _sandbox_path(sandbox_id, "/files/content"), _raw, params=params)


def write_request(
    sandbox_id: str, path: str, mode: int, data: bytes | str | None = None
) -> Request[FileEntry]:
    """A file write; ``data`` None when the I/O layer streams the body itself."""
    if not isinstance(mode, int) or not 0 <= mode <= 0o7777:
        raise InvalidArgument(f"mode must be an int in 0..0o7777 (e.g. 0o644), got {mode!r}")
    if isinstance(data, str):
        data = data.encode()
    return Request(
        "PUT",
        _sandbox_path(sandbox_id, "/files/content"),
        _model(FileEntry),
        params=(("path", _remote_path(path)), ("mode", str(mode))),
        body=data,
        headers=_OCTETS,
    )


def list_dir_request(sandbox_id: str, path: str) -> Request[list[FileEntry]]:
    return Request(
        "GET",
        _sandbox_path(sandbox_id, "/files/list"),
        _entries,
        params=(("path", _remote_path(path)),),
    )


def stat_request(sandbox_id: str, path: str) -> Request[FileEntry]:
    return Request(
        "GET",
        _sandbox_path(sandbox_id, "/files/stat"),
        _model(FileEntry),
        params=(("path", _remote_path(path)),),
    )


def remove_request(sandbox_id: str, path: str, recursive: bool) -> Request[None]:
    return Request(
        "DELETE",
        _sandbox_path(sandbox_id, "/files"),
        _none,
        params=(("path", _remote_path(path)), ("recursive", _bool(recursive))),
    )


def mkdir_request(sandbox_id: str, path: str, parents: bool) -> Request[FileEntry]:
    return Request(
        "POST",
        _sandbox_path(sandbox_id, "/files/mkdir"),
        _model(FileEntry),
        params=(("path", _remote_path(path)), ("parents", _bool(parents))),
    )


class _SandboxEvents(_Answer):
    events: list[SandboxEvent]


def _events(content: bytes) -> list[SandboxEvent]:
    return _SandboxEvents.model_validate_json(content).events


def events_request(sandbox_id: str, since: float = 0.0) -> Request[list[SandboxEvent]]:
    return Request(
        "GET", _sandbox_path(sandbox_id, "/events"), _events, params=(("since", str(since)),)
    )


def images_request() -> Request[list[ImageManifest]]:
    return Request("GET", "/v1/images", _images)


def nodes_request() -> Request[list[NodeInfo]]:
    return Request("GET", "/v1/nodes", _nodes)


# --------------------------------------------------------------------------- answers and errors


def finish(request: Request[T], status: int, content: bytes) -> T:
    """The result of ``request`` from its answer, or the error the server sent."""
    check_status(status, content)
    try:
        return request.parse(content)
    except (ValidationError, ValueError) as exc:
        raise Internal(
            f"unexpected answer to {request.method} {request.path}"
            f" (HTTP {status}): {str(exc)[:500]}"
        ) from None


def check_status(status: int, content: bytes) -> None:
    """Raise the :class:`SandfleetError` a 4xx/5xx answer carries."""
    if status < 400:
        return
    body: Any
    try:
        body = json.loads(content)
    except ValueError:
        body = content.decode("utf-8", errors="replace")
    raise error_from_wire(body, status)


@contextmanager
def translate_errors(settings: Settings, request: Request[Any]) -> Iterator[None]:
    """The SDK's one boundary: every httpx exception becomes a :class:`SandfleetError`.

    Connect failures → :class:`Unavailable` (naming the URL and how to fix it);
    timeouts → :class:`DeadlineExceeded`; a connection broken mid-call →
    :class:`Unavailable`; a malformed URL → :class:`InvalidArgument`; anything
    else from httpx → :class:`Internal`. Works around ``await`` too.
    """
    what = f"{request.method} {request.path}"
    try:
        yield
    except SandfleetError:
        raise
    except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
        raise Unavailable(
            f"cannot reach the sandfleet control plane at {settings.url}"
            f" ({exc or type(exc).__name__});"
            f" start one with `sandfleet up` or set {ENV_URL} to its address"
        ) from exc
    except httpx.TimeoutException as exc:
        waited = request.timeout_s if request.timeout_s is not None else settings.timeout_s
        if waited == NO_READ_TIMEOUT:
            waited = settings.timeout_s
        raise DeadlineExceeded(
            f"{what} to {settings.url} got no answer within {waited:g} s"
            f" ({type(exc).__name__}); pass a larger timeout_s or retry"
        ) from exc
    except httpx.TransportError as exc:
        if isinstance(exc, httpx.UnsupportedProtocol):
            raise InvalidArgument(f"bad control plane URL {settings.url!r}: {exc}") from exc
        raise Unavailable(
            f"connection to {settings.url} failed during {what}"
            f" ({type(exc).__name__}: {exc}); retry"
        ) from exc
    except httpx.InvalidURL as exc:
        raise InvalidArgument(f"bad URL for {what} at {settings.url!r}: {exc}") from exc
    except (httpx.HTTPError, httpx.StreamError) as exc:
        raise Internal(f"{what} to {settings.url} failed: {type(exc).__name__}: {exc}") from exc


# --------------------------------------------------------------------------- local files


class PartFile:
    """A local file written under a temporary name, renamed into place on success.

    A download that fails half-way leaves nothing at ``path`` (and no
    temporary file). ``size`` counts the bytes written.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        head, name = os.path.split(self.path)
        self._tmp = os.path.join(head, f".{name}.{secrets.token_hex(4)}.part")
        self.size = 0

    def __enter__(self) -> PartFile:
        self._file = open(self._tmp, "xb")
        return self

    def write(self, chunk: bytes) -> None:
        self._file.write(chunk)
        self.size += len(chunk)

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self._file.close()
        if exc_type is None:
            os.replace(self._tmp, self.path)
        else:
            os.unlink(self._tmp)


# --------------------------------------------------------------------------- fncall

#: Default cap of an fncall call's stdout and stderr each, bytes.
FNCALL_MAX_OUTPUT_BYTES = 1024 * 1024
#: Defaults of ``run`` that differ by kind: (timeout_s, memory_mb).
RUN_DEFAULTS = {"fncall": (10.0, 256), "container": (60.0, 512)}


class _Pools(_Answer):
    pools: list[PoolInfo]


def _pools(content: bytes) -> list[PoolInfo]:
    return _Pools.model_validate_json(content).pools


def run_defaults(kind: str, timeout_s: float | None, memory_mb: int | None) -> tuple[float, int]:
    """``timeout_s`` and ``memory_mb`` of a ``run``, the kind's defaults where None."""
    t, m = RUN_DEFAULTS.get(kind, RUN_DEFAULTS["container"])
    return (t if timeout_s is None else timeout_s), (m if memory_mb is None else memory_mb)


def fncall_request(
    code: str | Sequence[str],
    *,
    language: str | None,
    image: str | None,
    stdin: bytes | str | None,
    args: Sequence[str] | None,
    env: Mapping[str, str] | None,
    files: Mapping[str, bytes | str] | None,
    fetch_files: Sequence[str] | None,
    timeout_s: float,
    compile_timeout_s: float,
    memory_mb: int,
    max_output_bytes: int,
) -> Request[RunResult]:
    """A ``POST /v1/run`` call (validated, so a bad call fails before any request).

    A list ``code`` is a command: allowed for bash only, where it is quoted
    into one line. str file contents and stdin are UTF-8 encoded.
    """
    language = language or "python"
    if not isinstance(code, str):
        if isinstance(code, bytes | bytearray) or language != "bash":
            raise InvalidArgument(
                "code must be a str (the program); a list of arguments is a command, allowed"
                " with language='bash' only"
            )
        import shlex

        code = shlex.join(list(code))
    if isinstance(stdin, str):
        stdin = stdin.encode()
    body = _build(
        RunRequest,
        code=code,
        language=language,
        image=image or FNCALL_IMAGE,
        stdin=stdin or b"",
        args=list(args or []),
        env=dict(env or {}),
        files={p: d.encode() if isinstance(d, str) else d for p, d in (files or {}).items()},
        fetch_files=list(fetch_files or []),
        timeout_s=timeout_s,
        compile_timeout_s=compile_timeout_s,
        memory_mb=memory_mb,
        max_output_bytes=max_output_bytes,
    )
    bound = body.timeout_s + (body.compile_timeout_s if body.language in ("c", "cpp") else 0)
    return Request(
        "POST",
        "/v1/run",
        _model(RunResult),
        body=body.model_dump_json().encode(),
        headers=_JSON,
        timeout_s=bound + EXEC_MARGIN_S + 20.0,  # + the node's margin for a hung worker
    )


def check_not_sandbox_only(**given: object) -> None:
    """Refuse arguments of ``run`` that only a sandbox kind has, with kind='fncall'."""
    named = [k for k, v in given.items() if v]
    if named:
        raise InvalidArgument(
            f"{', '.join(named)} apply to sandbox kinds only: an fncall call runs as an"
            " unprivileged user in /tmp of a warm worker, within memory_mb and timeout_s"
        )


def check_not_fncall_only(**given: object) -> None:
    """Refuse fncall-only arguments of ``run`` for a sandbox kind."""
    named = [k for k, v in given.items() if v]
    if named:
        raise InvalidArgument(
            f"{', '.join(named)} apply to kind='fncall' only; with a sandbox kind pass a"
            " command, and use create() and the sandbox's files for files"
        )


def as_run_result(result: ExecResult) -> RunResult:
    """A sandbox exec's result in the shape of an fncall result (one ``run`` stage)."""
    fields = result.model_dump()
    return RunResult(**fields, run=StageResult(**fields))


def pools_request() -> Request[list[PoolInfo]]:
    return Request("GET", "/v1/pools", _pools)


def configure_pool_request(**fields: Any) -> Request[list[PoolInfo]]:
    body = _build(PoolConfig, **{k: v for k, v in fields.items() if v is not None})
    return Request("PUT", "/v1/pools", _pools, body=body.model_dump_json().encode(), headers=_JSON)
