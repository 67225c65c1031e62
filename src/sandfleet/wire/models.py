"""Everything that crosses the wire, as pydantic models.

Unknown fields are rejected (``extra="forbid"``) so a typo in a request is an
error, not a silently ignored option. Bytes travel as standard base64 strings
in JSON; in Python they are plain ``bytes``.
"""

from __future__ import annotations

import base64
import binascii
import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PlainSerializer, PlainValidator

__all__ = [
    "BUILT_KINDS",
    "FNCALL_IMAGE",
    "KINDS",
    "LANGUAGES",
    "REPLAYED_HEADER",
    "RUN_BATCH_MAX",
    "SNAPSHOT_EXCLUDE",
    "STEP_HEADER",
    "B64Bytes",
    "CreateSandboxRequest",
    "ErrorInfo",
    "ExecEvent",
    "ExecEventType",
    "ExecRequest",
    "ExecResult",
    "ExecStatus",
    "FileEntry",
    "GroupRequest",
    "GroupResult",
    "ImageConfig",
    "ImageManifest",
    "Kind",
    "Language",
    "LayerDescriptor",
    "LayerKind",
    "LifetimeRequest",
    "LogEntry",
    "NodeCapacity",
    "NodeCreateRequest",
    "NodeHeartbeat",
    "NodeInfo",
    "NodeRegistered",
    "NodeRegistration",
    "OutputChunk",
    "PoolConfig",
    "PoolInfo",
    "ProcessInfo",
    "ProcessState",
    "RunBatchLine",
    "RunBatchRequest",
    "RunRequest",
    "RunResult",
    "SandboxInfo",
    "SandboxState",
    "SnapshotRequest",
    "SpawnRequest",
    "StageResult",
    "WireModel",
    "WireResponse",
]

Kind = Literal["fncall", "container", "microvm", "vm"]
KINDS: tuple[str, ...] = ("fncall", "container", "microvm", "vm")
#: Kinds of sandbox this release can create; the others are rejected with a clear error.
#: (``fncall`` has no sandboxes to create: its calls go to ``run``.)
BUILT_KINDS: tuple[str, ...] = ("container", "microvm", "vm")

Language = Literal["python", "bash", "c", "cpp"]
LANGUAGES: tuple[str, ...] = ("python", "bash", "c", "cpp")
#: The image fncall calls run in unless they name another: Debian with python3, gcc, g++.
FNCALL_IMAGE = "sandfleet/fncall:1"

ExecStatus = Literal["exited", "signaled", "timeout", "oom"]
ProcessState = Literal["running", "exited", "signaled", "killed", "timeout"]
ExecEventType = Literal["stdout", "stderr", "result", "error"]
SandboxState = Literal["creating", "running", "paused", "destroying", "destroyed", "failed"]
LayerKind = Literal["base", "toolkit", "workspace", "diff"]


def _b64_validate(value: Any) -> bytes:
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    if isinstance(value, str):
        try:
            return base64.b64decode(value, validate=True)
        except binascii.Error as exc:
            raise ValueError(f"not valid base64: {exc}") from exc
    raise ValueError("expected bytes (base64 in JSON)")


B64Bytes = Annotated[
    bytes,
    PlainValidator(_b64_validate),
    PlainSerializer(
        lambda b: base64.b64encode(b).decode("ascii"), return_type=str, when_used="json"
    ),
]


class WireModel(BaseModel):
    """Requests: unknown fields are an error, so a typo never passes silently.

    NaN and infinities are refused too: JSON has no such numbers, and a NaN TTL
    would otherwise travel as null, i.e. "no TTL".
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class WireResponse(BaseModel):
    """Answers: unknown fields are ignored, so older clients read newer servers."""

    model_config = ConfigDict(extra="ignore")


# --------------------------------------------------------------------------- sandboxes


class CreateSandboxRequest(WireModel):
    """What a caller asks for when creating a sandbox."""

    kind: Kind = "container"
    """Isolation level; the single switch between kinds."""
    image: str
    """Image reference ``name:tag`` (tag defaults to ``latest``)."""
    workspace: str | None = None
    """Optional workspace layer ``name:tag`` stacked on top of the image."""
    cpu: float = Field(1.0, description="CPU share in cores (0.05-64).")
    memory_mb: int = Field(512, description="Memory limit in MiB (16-65536).")
    pids_limit: int = Field(256, description="Maximum number of processes (8-65536).")
    disk_mb: int = Field(
        4096, description="Size limit of the writable layer in MiB (16-1048576); ENOSPC beyond."
    )
    ttl_s: float | None = Field(3600.0, description="Hard lifetime in seconds; None = no TTL.")
    idle_ttl_s: float | None = Field(
        None, description="Reclaimed after this many seconds without a call; None = never."
    )
    labels: dict[str, str] = Field(default_factory=dict)
    env: dict[str, str] = Field(default_factory=dict, description="Environment for every exec.")


class NodeCreateRequest(CreateSandboxRequest):
    """The control plane's create call to a node: the request plus the chosen id."""

    id: str


class SandboxInfo(WireResponse):
    """A sandbox as the control plane records it."""

    id: str
    kind: Kind
    node_id: str
    state: SandboxState
    image: str
    workspace: str | None = None
    cpu: float
    memory_mb: int
    pids_limit: int
    disk_mb: int = 4096
    labels: dict[str, str] = Field(default_factory=dict)
    created_at: float = Field(default_factory=time.time, description="Unix time, seconds.")
    expires_at: float | None = Field(None, description="Unix time the TTL ends, seconds.")
    idle_ttl_s: float | None = None
    last_active_at: float | None = Field(None, description="Unix time of the last call, seconds.")
    ended: str | None = Field(
        None, description="Why it is gone: 'destroyed', 'TTL', 'idle TTL', 'gone from its node'."
    )
    ended_at: float | None = Field(None, description="Unix time it ended, seconds.")


class LifetimeRequest(WireModel):
    """New lifetimes of a running sandbox (``POST /v1/sandboxes/{id}/lifetime``).

    ``ttl_s``: the hard TTL now ends this many seconds from now (None: no hard
    TTL); ``idle_ttl_s``: the idle TTL (None: none). Fields left out are kept.
    """

    ttl_s: float | None = None
    idle_ttl_s: float | None = None


class GroupRequest(WireModel):
    """A group of sandboxes by labels (every label must match), e.g. one RL job's."""

    labels: dict[str, str] = Field(min_length=1)


class GroupResult(WireResponse):
    """What a group operation did: ids it acted on, and ids it could not, with why."""

    sandboxes: list[str] = Field(default_factory=list)
    failed: dict[str, ErrorInfo] = Field(default_factory=dict)


class SnapshotRequest(WireModel):
    """Pack a sandbox's writable layer into a new ``diff`` layer and an image over it.

    ``image``: ``name:tag`` of the new image (default ``snapshot/<sandbox id>:<n>``).
    ``exclude``: glob patterns of paths left out (caches, build debris); None
    takes :data:`SNAPSHOT_EXCLUDE`.
    """

    image: str | None = None
    exclude: list[str] | None = None


#: Paths a snapshot leaves out unless told otherwise: caches and debris that a
#: copy of the sandbox does not need.
SNAPSHOT_EXCLUDE = [
    "/tmp/*",
    "/var/tmp/*",
    "/var/cache/apt/*",
    "/root/.cache/*",
    "**/__pycache__",
    "**/.pytest_cache",
]


#: Request header carrying a call's step number in its sandbox's trajectory log.
STEP_HEADER = "sandfleet-step"
#: Answer header set to "1" when the answer came from the log, not from running the call.
REPLAYED_HEADER = "sandfleet-replayed"


class SandboxEvent(WireResponse):
    """Something that happened to a sandbox outside its commands.

    ``kind``: ``layer_fetch_error`` (data of one of its image layers could
    not be fetched from the blob stores: reads of those files fail with EIO
    until a store answers) or ``layer_daemon_restarted`` (the node's
    on-demand daemon died and was started again: data of its layers not read
    before is lost to it). ``at`` in Unix seconds.
    """

    at: float
    kind: str
    message: str
    layer: str | None = None


class LogEntry(WireResponse):
    """One call in a sandbox's trajectory log.

    ``step`` is the caller's step number (0, 1, ...); ``op`` the call (``exec``,
    ``write``, ``remove``, ``mkdir``, ``spawn``, ...); ``digest`` the sha256 of
    the canonical request, which a re-issued call must match; ``request`` and
    ``result`` are bounded copies (large outputs are cut, with a note).
    ``at`` is Unix time, seconds.
    """

    step: int
    op: str
    digest: str
    request: dict[str, Any] = Field(default_factory=dict)
    result: dict[str, Any] = Field(default_factory=dict)
    at: float = 0.0


# --------------------------------------------------------------------------- exec


class ExecRequest(WireModel):
    """One command to run inside a sandbox.

    ``cmd`` is an argv list (run directly, no shell) or a string (run by
    ``/bin/sh -c``). ``stdin`` is empty unless given. ``timeout_s`` bounds the
    whole command; on expiry its whole process tree is killed (also processes
    that left its group or session); background jobs of a command that exits
    by itself keep running.
    """

    cmd: list[str] | str
    env: dict[str, str] = Field(default_factory=dict)
    cwd: str | None = None
    stdin: B64Bytes = b""
    timeout_s: float = Field(60.0, gt=0, le=86400)
    max_output_bytes: int | None = Field(
        16 * 1024 * 1024,
        ge=0,
        description="Cap on captured stdout and stderr each, bytes (head and tail kept). "
        "None: no cap, for streamed exec only (a capture without a cap could fill memory).",
    )
    user: str | None = Field(
        None,
        description="Run as this user of the sandbox's /etc/passwd: a name, a uid, or "
        "'user:group' (names or numbers). None: the agent's own user (root).",
    )
    kill_grace_ms: int = Field(
        0,
        ge=0,
        le=60_000,
        description="At the timeout, SIGTERM the process tree and SIGKILL it this many "
        "milliseconds later; 0: SIGKILL at once.",
    )


class SpawnRequest(WireModel):
    """A background process: starts, returns at once, outlives the call.

    Like :class:`ExecRequest`, but ``timeout_s`` is optional (None: no limit)
    and output is kept per stream as the most recent ``max_output_bytes``
    bytes, readable by absolute offset. ``stdin`` is written first; the pipe
    then stays open for more (write_stdin) unless ``close_stdin``.
    """

    cmd: list[str] | str
    env: dict[str, str] = Field(default_factory=dict)
    cwd: str | None = None
    stdin: B64Bytes = b""
    close_stdin: bool = Field(False, description="Close stdin after writing `stdin`.")
    user: str | None = None
    timeout_s: float | None = Field(None, gt=0, le=30 * 86400)
    max_output_bytes: int = Field(
        4 * 1024 * 1024, ge=0, description="Bytes kept per stream (the most recent), bytes."
    )
    kill_grace_ms: int = Field(0, ge=0, le=60_000)


class ProcessInfo(WireResponse):
    """A spawned process as its supervisor reports it.

    ``state``: ``running``; ``exited`` (see ``exit_code``); ``signaled`` (see
    ``signal``); ``killed`` (ended by a signal after kill_process); ``timeout``
    (killed at its deadline). Times are Unix seconds; ``*_bytes`` count all
    output ever written, retained or not.
    """

    id: str
    pid: int
    command: str
    state: ProcessState
    exit_code: int | None = None
    signal: int | None = None
    started_at: float
    ended_at: float | None = None
    stdout_bytes: int = 0
    stderr_bytes: int = 0
    stdin_open: bool = False


class OutputChunk(WireResponse):
    """Output of a spawned process from an absolute byte offset.

    ``data`` starts at ``offset`` (the requested offset, or the oldest byte
    still retained); ``dropped`` bytes between the requested offset and
    ``offset`` were lost to the retention bound; read on from ``next_offset``.
    ``eof``: the stream is closed and everything has been read.
    """

    data: B64Bytes = b""
    offset: int
    next_offset: int
    dropped: int = 0
    eof: bool = False


class ExecResult(WireResponse):
    """How a command ended.

    ``status`` is ``exited`` (see ``exit_code``), ``signaled`` (see ``signal``),
    ``timeout`` (killed at its deadline; ``exit_code`` is None) or ``oom``
    (it failed while the sandbox's memory limit killed a process of it, from
    the cgroup's OOM counter; ``exit_code`` is None, ``signal`` 9).
    """

    status: ExecStatus
    exit_code: int | None = None
    signal: int | None = None
    stdout: B64Bytes = b""
    stderr: B64Bytes = b""
    stdout_dropped: int = Field(0, description="Bytes of stdout dropped by the output cap.")
    stderr_dropped: int = Field(0, description="Bytes of stderr dropped by the output cap.")
    duration_s: float = 0.0
    replayed: bool = Field(False, description="Taken from the trajectory log, not run again.")

    @property
    def ok(self) -> bool:
        """True when the command exited with code 0."""
        return self.status == "exited" and self.exit_code == 0

    @property
    def stdout_text(self) -> str:
        """stdout decoded as UTF-8; undecodable bytes become U+FFFD, never an error."""
        return self.stdout.decode("utf-8", errors="replace")

    @property
    def stderr_text(self) -> str:
        """stderr decoded as UTF-8; undecodable bytes become U+FFFD, never an error."""
        return self.stderr.decode("utf-8", errors="replace")


# --------------------------------------------------------------------------- fncall


class RunRequest(WireModel):
    """One stateless call (kind ``fncall``): a program run in a warm, scrubbed worker.

    ``code`` is a Python program, a bash script, or a C/C++ translation unit
    (compiled with ``gcc``/``g++ -O2`` under ``compile_timeout_s``, then run
    under ``timeout_s``). ``files`` are written before the call and
    ``fetch_files`` read after it; their paths are relative to the call's
    working directory ``/tmp`` (or absolute under ``/tmp``). Nothing survives the
    call: files, environment, processes and imported modules are gone before
    the worker takes the next one.
    """

    code: str = Field(max_length=16 * 1024 * 1024)
    language: Language = "python"
    image: str = FNCALL_IMAGE
    stdin: B64Bytes = b""
    args: list[str] = Field(default_factory=list, description="argv[1:] of the program.")
    env: dict[str, str] = Field(default_factory=dict)
    files: dict[str, B64Bytes] = Field(default_factory=dict)
    fetch_files: list[str] = Field(default_factory=list)
    timeout_s: float = Field(10.0, gt=0, le=3600, description="Run time limit, seconds.")
    compile_timeout_s: float = Field(
        30.0, gt=0, le=3600, description="Compile time limit of C/C++, seconds."
    )
    memory_mb: int = Field(256, ge=16, le=65536, description="Memory limit of the call, MiB.")
    max_output_bytes: int = Field(
        1024 * 1024,
        ge=0,
        le=64 * 1024 * 1024,
        description="Cap on captured stdout and stderr each, bytes (head and tail kept).",
    )


class RunBatchRequest(WireModel):
    """Many fncall calls in one request (``POST /v1/run/batch``).

    Each element is a :class:`RunRequest`, validated on its own, so one bad
    call fails alone. At most :data:`RUN_BATCH_MAX` calls.
    """

    calls: list[dict[str, Any]] = Field(max_length=4096)


#: Most calls one batch may carry.
RUN_BATCH_MAX = 4096


class RunBatchLine(WireResponse):
    """One line of a batch's NDJSON answer, sent as each call ends (in any order).

    ``index`` is the call's position in the batch; exactly one of ``result``
    and ``error`` is set. A line with ``error`` and no ``index`` ends the
    answer early: every call not answered yet failed with it.
    """

    index: int | None = None
    result: RunResult | None = None
    error: ErrorInfo | None = None


class StageResult(ExecResult):
    """How one stage (compile or run) of a call ended; the same statuses as exec."""


class RunResult(StageResult):
    """How a call ended: the fields of its last stage, plus the stages and files.

    ``stage`` names the last stage that ran: ``compile`` when compiling failed
    (then ``run`` is None), else ``run``. ``status``, ``exit_code``, ``stdout``...
    are that stage's. ``files`` holds each fetched file found; ``missing_files``
    the requested ones that did not exist (or were not regular files), and
    ``fetch_errors`` those that could not be read (too large, say), with why.
    """

    stage: Literal["compile", "run"] = "run"
    compile: StageResult | None = None
    run: StageResult | None = None
    files: dict[str, B64Bytes] = Field(default_factory=dict)
    missing_files: list[str] = Field(default_factory=list)
    fetch_errors: dict[str, str] = Field(default_factory=dict)
    worker: str = Field("", description="Id of the worker that ran the call.")


class PoolConfig(WireModel):
    """Bounds of one pool of fncall workers, keyed by (image, language).

    ``min_workers`` are kept warm even when idle; workers are added on demand
    up to ``max_workers``; calls wait for a free worker in a queue of at most
    ``max_queue``, beyond which they fail with ``ResourceExhausted``.
    ``idle_s``: a worker above the minimum idle this long is stopped, seconds.
    """

    image: str = FNCALL_IMAGE
    language: Language = "python"
    min_workers: int = Field(1, ge=0, le=4096)
    max_workers: int = Field(8, ge=1, le=4096)
    max_queue: int = Field(4096, ge=0, le=1_000_000)
    idle_s: float = Field(60.0, gt=0, le=86400)


class PoolInfo(WireResponse):
    """A pool's state on one node: its bounds, workers by state and counters since start."""

    node_id: str
    image: str
    language: Language
    min_workers: int
    max_workers: int
    max_queue: int
    idle_s: float
    idle: int = 0
    busy: int = 0
    starting: int = 0
    queued: int = 0
    calls: int = 0
    replaced: int = Field(0, description="Workers replaced after a failure or an unclean call.")
    rejected: int = Field(0, description="Calls refused because the queue was full.")
    worker_memory_mb: float | None = Field(
        None,
        description="Mean memory charged to an idle worker's cgroup (its zygote and the"
        " process forked ahead for the next call, shared pages once), MiB.",
    )
    last_error: str | None = None


class ErrorInfo(WireResponse):
    """The body of a wire error: ``code`` (e.g. ``NOT_FOUND``) and a message for humans."""

    code: str
    message: str


class ExecEvent(WireResponse):
    """One line of a streaming exec (``POST .../exec/stream``, ``application/x-ndjson``).

    ``stdout``/``stderr``: ``data`` is output as the command produced it (the
    concatenation of a stream's chunks is what a plain exec returns: the head
    and tail under ``max_output_bytes``). ``result``: the last line; ``result``
    is how the command ended, with *empty* ``stdout``/``stderr`` (the chunks
    carried them). ``error``: the call failed after streaming began (the agent
    died, the deadline passed); ``error`` has the code and message, and nothing
    follows. Errors before the first line are ordinary HTTP errors.
    """

    type: ExecEventType
    data: B64Bytes = b""
    """Output bytes of a ``stdout``/``stderr`` event; empty otherwise."""
    result: ExecResult | None = None
    """How the command ended; only on the ``result`` event."""
    error: ErrorInfo | None = None
    """What went wrong; only on the ``error`` event."""

    def to_line(self) -> bytes:
        """This event as one NDJSON line (with its newline), carrying only its type's fields."""
        if self.type in ("stdout", "stderr"):
            return self.model_dump_json(include={"type", "data"}).encode() + b"\n"
        return self.model_dump_json(include={"type", self.type}).encode() + b"\n"


# --------------------------------------------------------------------------- files


class FileEntry(WireResponse):
    """One directory entry or ``stat`` answer. ``size`` in bytes, ``mtime`` Unix seconds."""

    name: str
    path: str
    type: Literal["file", "dir", "symlink", "other"]
    size: int
    mode: int
    mtime: float


# --------------------------------------------------------------------------- images


class LayerDescriptor(WireResponse):
    """One EROFS layer: content-addressed by the sha256 of its file."""

    digest: str = Field(description="'sha256:<hex>' of the EROFS file.")
    size: int = Field(description="Size of the EROFS file in bytes.")
    kind: LayerKind


class ImageConfig(WireResponse):
    """Defaults an image gives every exec."""

    env: dict[str, str] = Field(default_factory=dict)
    workdir: str | None = None


class ImageManifest(WireResponse):
    """A named, versioned stack of layers, bottom layer first."""

    name: str
    tag: str
    kind: LayerKind
    layers: list[LayerDescriptor]
    config: ImageConfig = Field(default_factory=ImageConfig)
    source: str = ""
    created_at: float = Field(default_factory=time.time)

    @property
    def ref(self) -> str:
        return f"{self.name}:{self.tag}"


# --------------------------------------------------------------------------- nodes


class NodeCapacity(WireModel):
    """What a node offers. ``memory_mb`` in MiB, ``cpu`` in cores."""

    max_sandboxes: int
    cpu: float
    memory_mb: int


class NodeRegistration(WireModel):
    """A node agent introducing itself to the control plane."""

    node_id: str
    address: str = Field(description="Base URL of the node agent's HTTP API.")
    kinds: list[Kind]
    capacity: NodeCapacity
    capabilities: dict[str, Any] = Field(default_factory=dict)
    sandboxes: list[str] | None = Field(
        None, description="Ids the node hosts now; records of others on it are closed."
    )


class NodeHeartbeat(WireModel):
    """Load a node reports every few seconds."""

    sandboxes: int
    memory_mb_reserved: int
    cpu_reserved: float


class NodeInfo(WireResponse):
    """A node as the control plane sees it."""

    node_id: str
    address: str
    kinds: list[Kind]
    capacity: NodeCapacity
    capabilities: dict[str, Any] = Field(default_factory=dict)
    sandboxes: int = 0
    memory_mb_reserved: int = 0
    cpu_reserved: float = 0.0
    last_heartbeat: float = 0.0
    healthy: bool = True


class NodeRegistered(NodeInfo):
    """The answer to a node's registration: its record, and what it must destroy."""

    unknown_sandboxes: list[str] = Field(
        default_factory=list,
        description="Ids the node reported that the control plane has no live record of.",
    )
