"""``POST /run_code``: SandboxFusion's request and answer, served by fncall workers.

RL frameworks that call SandboxFusion (its ``sandbox-fusion`` client, verl's
reward and tool code) can point at a sandfleet control plane unchanged. The
route is served at the root, as SandboxFusion serves it, not under ``/v1``.

A request is SandboxFusion's ``RunCodeRequest``; it becomes a sandfleet
:class:`~sandfleet.wire.models.RunRequest`, runs through ``ControlPlane.run``,
and the :class:`~sandfleet.wire.models.RunResult` becomes a ``RunCodeResponse``.
The two translations are pure functions (:func:`to_run_request`,
:func:`to_response`) so they are tested without a server.

How SandboxFusion reports outcomes, and so how this route does:

- ``status`` ``Success`` when every stage that ran exited with code 0,
  ``Failed`` when one did not (non-zero exit, signal, time limit, memory limit),
  ``SandboxError`` (still HTTP 200) when the call could not be run: an
  unsupported language, an invalid path or base64 file, an unknown image.
  Its client raises on ``SandboxError``.
- Retryable sandfleet errors (a full queue, an unreachable or silent node)
  answer HTTP 503 with sandfleet's error body and ``Retry-After``:
  SandboxFusion's client retries any non-200 answer.
- A request of the wrong shape (a field of the wrong type) is refused by the
  app's validation handler in sandfleet's error format, before the route runs.
"""

from __future__ import annotations

import base64
import binascii
import posixpath
from typing import Literal

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from sandfleet.controlplane.service import ControlPlane
from sandfleet.wire.errors import InvalidArgument, SandfleetError
from sandfleet.wire.models import Language, RunRequest, RunResult, StageResult
from sandfleet.wire.server import cancel_on_disconnect

__all__ = [
    "LANGUAGES",
    "CommandRunResult",
    "RunCodeRequest",
    "RunCodeResponse",
    "command_result",
    "router",
    "sandbox_error",
    "to_response",
    "to_run_request",
]

#: SandboxFusion language names served here, and the fncall language each runs as.
#: SandboxFusion has no ``c``; it is accepted since fncall has it. ``python3``
#: is the name some callers use for SandboxFusion's ``python``.
LANGUAGES: dict[str, Language] = {
    "python": "python",
    "python3": "python",
    "bash": "bash",
    "cpp": "cpp",
    "c": "c",
}
#: Languages that have a compile stage (whose ``compile_timeout`` applies).
_COMPILED = frozenset({"c", "cpp"})
#: Memory limit of a call that names none (``memory_limit_MB`` -1), MiB.
DEFAULT_MEMORY_MB = 1024
#: The signal a memory-limit kill delivers (SIGKILL); reported as return code -9.
_SIGKILL = 9
#: The call's working directory, where relative file paths point (with its slash).
WORKDIR = "/tmp/"
#: Seconds a caller is told to wait before retrying a 503.
_RETRY_AFTER_S = 1

CommandRunStatus = Literal["Finished", "TimeLimitExceeded", "Error"]
RunStatus = Literal["Success", "Failed", "SandboxError"]


class RunCodeRequest(BaseModel):
    """SandboxFusion's ``RunCodeRequest``.

    Unknown fields are ignored rather than refused, unlike sandfleet's own
    requests: SandboxFusion's clients may send fields of newer servers, and
    refusing them would break those callers for nothing. Values are checked
    when the request is translated (:func:`to_run_request`).
    """

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    code: str
    """The program: Python, a bash script, or a C/C++ translation unit."""
    language: str
    """SandboxFusion's language name; those of :data:`LANGUAGES` are served."""
    compile_timeout: float = 10
    """Compile time limit of C/C++, seconds."""
    run_timeout: float = 10
    """Run time limit, seconds."""
    stdin: str | None = None
    """Standard input, sent as UTF-8; None is no input."""
    files: dict[str, str | None] = Field(default_factory=dict)
    """Files written before the run: path (relative to the working dir) → base64
    content. A None content is skipped, as SandboxFusion does."""
    fetch_files: list[str] = Field(default_factory=list)
    """Paths read after the run and answered base64 in ``files``; missing ones
    are left out, as SandboxFusion does."""
    memory_limit_MB: int = -1
    """Newer SandboxFusion servers' memory limit, MiB; -1 (or any value ≤ 0)
    is fncall's default limit."""


class CommandRunResult(BaseModel):
    """How one stage (compile or run) ended, as SandboxFusion reports it.

    ``status``: ``Finished`` (it ended by itself or by a signal: see
    ``return_code``, negative for a signal as Python's subprocess reports it),
    ``TimeLimitExceeded`` (killed at its time limit; ``return_code`` None) or
    ``Error`` (never produced here: sandfleet errors become ``SandboxError``).
    ``execution_time`` is wall time in seconds; ``stdout``/``stderr`` are the
    output decoded as UTF-8, undecodable bytes replaced by U+FFFD.
    """

    status: CommandRunStatus
    execution_time: float | None = None
    cpu_time: float | None = None
    return_code: int | None = None
    stdout: str | None = None
    stderr: str | None = None


class RunCodeResponse(BaseModel):
    """SandboxFusion's ``RunCodeResponse``.

    ``compile_result`` is set for compiled languages only; ``run_result`` is
    None when compiling failed (or the call was not run). ``files`` maps each
    fetched path, as requested, to its base64 content. ``message`` explains a
    ``SandboxError`` and notes what the statuses do not say (a memory-limit
    kill, output dropped by the cap, a file that could not be fetched).
    """

    status: RunStatus
    message: str = ""
    compile_result: CommandRunResult | None = None
    run_result: CommandRunResult | None = None
    executor_pod_name: str | None = None
    files: dict[str, str] = Field(default_factory=dict)


# --------------------------------------------------------------------------- translation


def _b64decode(path: str, content: str) -> bytes:
    try:
        return base64.b64decode(content, validate=True)
    except binascii.Error as exc:
        raise InvalidArgument(f"files[{path!r}] is not valid base64: {exc}") from exc


def to_run_request(req: RunCodeRequest) -> RunRequest:
    """The fncall call a SandboxFusion request asks for.

    Raises InvalidArgument (which the route answers as ``SandboxError``) for a
    language not in :data:`LANGUAGES`, a file that is not base64, or values out
    of fncall's bounds (timeouts in (0, 3600] seconds, memory in [16, 65536] MiB).
    """
    language = LANGUAGES.get(req.language)
    if language is None:
        raise InvalidArgument(
            f"language {req.language!r} is not supported by sandfleet's /run_code;"
            f" supported: {', '.join(sorted(LANGUAGES))}"
        )
    try:
        stdin = (req.stdin or "").encode()
    except UnicodeEncodeError as exc:
        # A lone surrogate (possible in a str, refused in JSON) has no UTF-8 form.
        raise InvalidArgument(f"stdin is not valid Unicode: {exc.reason}") from exc
    fields: dict[str, object] = {
        "code": req.code,
        "language": language,
        "stdin": stdin,
        "files": {p: _b64decode(p, c) for p, c in req.files.items() if c is not None},
        "fetch_files": list(req.fetch_files),
        "timeout_s": req.run_timeout,
    }
    # Only compiled languages have a compile stage; a Python caller's compile_timeout
    # (even 0) means nothing and must not fail its call.
    if language in _COMPILED:
        fields["compile_timeout_s"] = req.compile_timeout
    # SandboxFusion's own runner is not this strict: programs written against it
    # may need more than fncall's 256 MiB default.
    fields["memory_mb"] = req.memory_limit_MB if req.memory_limit_MB > 0 else DEFAULT_MEMORY_MB
    try:
        return RunRequest.model_validate(fields)
    except ValidationError as exc:
        names = {
            "timeout_s": "run_timeout",
            "compile_timeout_s": "compile_timeout",
            "memory_mb": "memory_limit_MB",
        }
        parts = []
        for err in exc.errors():
            loc = [str(p) for p in err.get("loc", ())]
            where = ".".join([names.get(loc[0], loc[0]), *loc[1:]]) if loc else "request"
            parts.append(f"{where}: {err.get('msg')}")
        raise InvalidArgument("invalid request: " + "; ".join(parts)) from exc


def command_result(stage: StageResult) -> CommandRunResult:
    """One sandfleet stage as SandboxFusion reports it.

    ``exited`` → Finished with its exit code; ``signaled`` → Finished with
    ``-signal`` (what SandboxFusion's subprocess-based runner reports);
    ``oom`` → Finished with -9 (the memory limit's SIGKILL); ``timeout`` →
    TimeLimitExceeded with no return code.
    """
    status: CommandRunStatus = "Finished"
    code: int | None
    if stage.status == "exited":
        code = stage.exit_code
    elif stage.status == "signaled":
        code = -(stage.signal or _SIGKILL)
    elif stage.status == "oom":
        code = -_SIGKILL
    else:
        status, code = "TimeLimitExceeded", None
    return CommandRunResult(
        status=status,
        execution_time=stage.duration_s,
        return_code=code,
        stdout=stage.stdout_text,
        stderr=stage.stderr_text,
    )


def _notes(name: str, stage: StageResult, req: RunRequest) -> list[str]:
    """What a stage's CommandRunResult cannot say, for the answer's message."""
    notes = []
    if stage.status == "oom":
        notes.append(f"{name}: killed by the memory limit ({req.memory_mb} MiB)")
    for stream, dropped in (("stdout", stage.stdout_dropped), ("stderr", stage.stderr_dropped)):
        if dropped:
            notes.append(
                f"{name}: {dropped} bytes of {stream} dropped from the middle"
                f" (cap {req.max_output_bytes} bytes, head and tail kept)"
            )
    return notes


def _fetched_key(path: str) -> str:
    """The key fncall gives a fetched ``path``: normalized, relative to ``/tmp``."""
    norm = posixpath.normpath(path)
    return norm[len(WORKDIR) :] if norm.startswith(WORKDIR) else norm


def _fetched(result: RunResult, fetch_files: list[str]) -> dict[str, str]:
    """Each fetched file by the path it was requested by (SandboxFusion's keys), base64."""
    files = {}
    for path in fetch_files:
        data = result.files.get(path)
        if data is None:
            data = result.files.get(_fetched_key(path))
        if data is not None:
            files[path] = base64.b64encode(data).decode("ascii")
    return files


def to_response(result: RunResult, req: RunRequest) -> RunCodeResponse:
    """A fncall result as SandboxFusion's answer to the request ``req``.

    ``Success`` iff every stage that ran exited with code 0. Fetched files keep
    the paths they were requested by (``/tmp/out.txt`` stays so, though fncall
    answers it as ``out.txt``); missing ones are left out.
    """
    run: StageResult | None = result.run
    if run is None and result.compile is None:
        # A single-stage result may carry its stage only in its own fields.
        run = result
    stages = [("compile", result.compile), ("run", run)]
    ran = [(name, s) for name, s in stages if s is not None]
    notes = [note for name, s in ran for note in _notes(name, s, req)]
    notes += [f"fetch_files {p!r}: {why}" for p, why in result.fetch_errors.items()]
    return RunCodeResponse(
        status="Success" if all(s.ok for _, s in ran) else "Failed",
        message="; ".join(notes),
        compile_result=command_result(result.compile) if result.compile is not None else None,
        run_result=command_result(run) if run is not None else None,
        files=_fetched(result, req.fetch_files),
    )


def sandbox_error(message: str) -> RunCodeResponse:
    """SandboxFusion's answer to a call that could not be run (its client raises on it)."""
    return RunCodeResponse(status="SandboxError", message=message)


# --------------------------------------------------------------------------- route

router = APIRouter(tags=["sandboxfusion"])


@router.post(
    "/run_code",
    response_model=RunCodeResponse,
    responses={503: {"description": "No capacity right now (sandfleet error body); retry."}},
)
async def run_code(body: RunCodeRequest, request: Request) -> RunCodeResponse | Response:
    """Run one program the way SandboxFusion's ``/run_code`` does (see the module doc)."""
    cp: ControlPlane = request.app.state.cp
    try:
        run_req = to_run_request(body)
        # A caller that gives up (SandboxFusion clients have a client_timeout) frees
        # its worker at once instead of when the program's own time limit ends.
        result = await cancel_on_disconnect(request, cp.run(run_req))
    except SandfleetError as exc:
        if exc.retryable:
            return JSONResponse(
                exc.to_wire(), status_code=503, headers={"Retry-After": str(_RETRY_AFTER_S)}
            )
        return sandbox_error(f"{exc.code}: {exc.message}")
    return to_response(result, run_req)
