"""``POST /run_code``: SandboxFusion's format, checked with its own client from PyPI.

Three layers: the pure translations (no server); the route on a real HTTP
server with a scripted control plane (errors that are hard to cause for real:
a full queue, a flaky node); and a real ``sandfleet up`` running fncall
workers, called with ``sandbox_fusion.run_code`` and ``run_code_async``.
"""

from __future__ import annotations

import asyncio
import base64
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import sandbox_fusion
import uvicorn
from fastapi import FastAPI
from sandbox_fusion import RunCodeRequest as SFRequest
from sandbox_fusion import RunCodeResponse as SFResponse
from sandbox_fusion import SummaryMapping, summary_run_code_result

from sandfleet.cli.local import LocalDeployment
from sandfleet.controlplane import fusion
from sandfleet.wire.errors import InvalidArgument, NotFound, ResourceExhausted
from sandfleet.wire.models import RunRequest, RunResult, StageResult
from sandfleet.wire.server import install_error_handlers
from tests.conftest import assert_clean

#: Distinct labels, so a summary names exactly which case it saw.
MAPPING = SummaryMapping(
    Success="ok",
    Failed="failed",
    CompileFailed="compile-failed",
    CompileTimeout="compile-timeout",
    RunFailed="run-failed",
    RunTimeout="run-timeout",
)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def req(**kw: object) -> fusion.RunCodeRequest:
    return fusion.RunCodeRequest.model_validate({"code": "print(1)", "language": "python", **kw})


def as_client_response(resp: fusion.RunCodeResponse) -> SFResponse:
    """Our answer as SandboxFusion's client parses it (through JSON, as on the wire)."""
    return SFResponse.parse_raw(resp.model_dump_json())


# --------------------------------------------------------------------------- request


def test_request_defaults_match_sandboxfusion() -> None:
    run = fusion.to_run_request(req(code="print(2)"))
    assert run.language == "python"
    assert run.code == "print(2)"
    assert run.stdin == b""
    assert run.timeout_s == 10
    assert run.files == {} and run.fetch_files == []
    # The client's own request, as it sends it, is accepted as it is.
    sent = SFRequest(code="print(1)", language="python").dict()
    assert fusion.to_run_request(fusion.RunCodeRequest.model_validate(sent)).timeout_s == 10


@pytest.mark.parametrize(
    ("name", "language"),
    [("python", "python"), ("python3", "python"), ("bash", "bash"), ("cpp", "cpp"), ("c", "c")],
)
def test_languages(name: str, language: str) -> None:
    assert fusion.to_run_request(req(language=name)).language == language


@pytest.mark.parametrize("name", ["nodejs", "go", "java", "python2", "pytest", "Python", ""])
def test_unsupported_language_names_the_supported_ones(name: str) -> None:
    with pytest.raises(InvalidArgument, match="bash, c, cpp, python, python3") as info:
        fusion.to_run_request(req(language=name))
    assert repr(name) in info.value.message


def test_fields_translate() -> None:
    run = fusion.to_run_request(
        req(
            language="cpp",
            run_timeout=2.5,
            compile_timeout=7,
            stdin="héllo\n",
            files={"a.txt": b64(b"\x00\xff"), "d/b.txt": b64(b"b"), "skipped": None},
            fetch_files=["out.txt"],
            memory_limit_MB=512,
        )
    )
    assert run.timeout_s == 2.5
    assert run.compile_timeout_s == 7
    assert run.stdin == "héllo\n".encode()
    assert run.files == {"a.txt": b"\x00\xff", "d/b.txt": b"b"}
    assert run.fetch_files == ["out.txt"]
    assert run.memory_mb == 512


def test_compile_timeout_of_an_interpreted_language_is_ignored() -> None:
    # SandboxFusion ignores it there; a 0 must not fail a Python call.
    assert fusion.to_run_request(req(compile_timeout=0)).compile_timeout_s == 30


def test_memory_limit_minus_one_is_the_run_code_default() -> None:
    # Looser than fncall's own default: programs written for SandboxFusion expect room.
    default = fusion.DEFAULT_MEMORY_MB
    assert default > RunRequest(code="").memory_mb
    assert fusion.to_run_request(req(memory_limit_MB=-1)).memory_mb == default
    assert fusion.to_run_request(req()).memory_mb == default


def test_lone_surrogate_in_stdin_is_refused() -> None:
    # A str from Python (not JSON) may hold one; it has no UTF-8 form.
    with pytest.raises(InvalidArgument, match="stdin is not valid Unicode"):
        fusion.to_run_request(req(stdin="\ud800"))


def test_bad_base64_names_the_file() -> None:
    with pytest.raises(InvalidArgument, match=r"files\['x.bin'\] is not valid base64"):
        fusion.to_run_request(req(files={"x.bin": "not base64!"}))


@pytest.mark.parametrize(
    ("kw", "name"),
    [
        ({"run_timeout": 0}, "run_timeout"),
        ({"run_timeout": 4000}, "run_timeout"),
        ({"language": "c", "compile_timeout": -1}, "compile_timeout"),
        ({"memory_limit_MB": 4}, "memory_limit_MB"),
    ],
)
def test_values_out_of_bounds_name_sandboxfusion_fields(kw: dict[str, object], name: str) -> None:
    with pytest.raises(InvalidArgument, match=f"invalid request: {name}:"):
        fusion.to_run_request(req(**kw))


def test_unknown_fields_are_ignored() -> None:
    r = req(some_future_field={"x": 1}, language="bash")
    assert fusion.to_run_request(r).language == "bash"


@pytest.mark.parametrize(
    "bad",
    [
        {"code": 1, "language": "python"},
        {"language": "python"},
        {"code": "", "language": "python", "run_timeout": "soon"},
        {"code": "", "language": "python", "files": ["a"]},
        {"code": "", "language": "python", "stdin": 5},
        {"code": "", "language": "python", "run_timeout": float("nan")},
    ],
)
def test_wrong_types_are_refused(bad: dict[str, object]) -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError):
        fusion.RunCodeRequest.model_validate(bad)


# --------------------------------------------------------------------------- response


def stage(status: str = "exited", **kw: object) -> StageResult:
    return StageResult.model_validate({"status": status, "duration_s": 0.25, **kw})


def result(run: StageResult | None, compile: StageResult | None = None, **kw: object) -> RunResult:
    last = run if run is not None else compile
    assert last is not None
    return RunResult.model_validate(
        {
            **last.model_dump(),
            "stage": "run" if run is not None else "compile",
            "run": run,
            "compile": compile,
            **kw,
        }
    )


RUN_REQ = RunRequest(code="")


@pytest.mark.parametrize(
    ("st", "status", "code"),
    [
        (stage("exited", exit_code=0), "Finished", 0),
        (stage("exited", exit_code=3), "Finished", 3),
        (stage("signaled", signal=11), "Finished", -11),
        (stage("oom", signal=9), "Finished", -9),
        (stage("timeout"), "TimeLimitExceeded", None),
    ],
)
def test_command_result(st: StageResult, status: str, code: int | None) -> None:
    got = fusion.command_result(st)
    assert (got.status, got.return_code, got.execution_time) == (status, code, 0.25)


def test_output_is_decoded_with_replacement() -> None:
    got = fusion.command_result(stage(exit_code=0, stdout=b"a\xffb\x00", stderr="é".encode()))
    assert got.stdout == "a\ufffdb\x00"
    assert got.stderr == "é"


def test_success() -> None:
    resp = fusion.to_response(result(stage(exit_code=0, stdout=b"hi\n")), RUN_REQ)
    assert resp.status == "Success"
    assert resp.message == ""
    assert resp.compile_result is None
    assert resp.run_result is not None and resp.run_result.stdout == "hi\n"
    assert resp.executor_pod_name is None
    assert summary_run_code_result(as_client_response(resp), MAPPING) == "ok"


@pytest.mark.parametrize(
    ("run", "summary"),
    [
        (stage(exit_code=1), "run-failed"),
        (stage("signaled", signal=6), "run-failed"),
        (stage("timeout"), "run-timeout"),
    ],
)
def test_failed_run(run: StageResult, summary: str) -> None:
    resp = fusion.to_response(result(run), RUN_REQ)
    assert resp.status == "Failed"
    assert summary_run_code_result(as_client_response(resp), MAPPING) == summary


def test_oom_says_the_memory_limit_killed_it() -> None:
    resp = fusion.to_response(result(stage("oom", signal=9)), RunRequest(code="", memory_mb=64))
    assert resp.status == "Failed"
    assert resp.run_result is not None and resp.run_result.return_code == -9
    assert "memory limit (64 MiB)" in resp.message
    assert summary_run_code_result(as_client_response(resp), MAPPING) == "run-failed"


def test_compile_failure_has_no_run_result() -> None:
    comp = stage(exit_code=1, stderr=b"main.cpp:1: error")
    resp = fusion.to_response(result(None, comp), RUN_REQ)
    assert resp.status == "Failed"
    assert resp.run_result is None
    assert resp.compile_result is not None
    assert resp.compile_result.return_code == 1
    assert resp.compile_result.stderr == "main.cpp:1: error"
    assert summary_run_code_result(as_client_response(resp), MAPPING) == "compile-failed"
    tle = fusion.to_response(result(None, stage("timeout")), RUN_REQ)
    assert summary_run_code_result(as_client_response(tle), MAPPING) == "compile-timeout"


def test_compiled_success_has_both_results() -> None:
    resp = fusion.to_response(result(stage(exit_code=0), stage(exit_code=0)), RUN_REQ)
    assert resp.status == "Success"
    assert resp.compile_result is not None and resp.run_result is not None
    assert summary_run_code_result(as_client_response(resp), MAPPING) == "ok"
    failed = fusion.to_response(result(stage(exit_code=2), stage(exit_code=0)), RUN_REQ)
    assert failed.status == "Failed"
    assert summary_run_code_result(as_client_response(failed), MAPPING) == "run-failed"


def test_single_stage_result_without_stage_fields() -> None:
    # A result whose stage is only in its own top-level fields still answers a run_result.
    bare = RunResult(status="exited", exit_code=0, stdout=b"x", duration_s=0.1)
    resp = fusion.to_response(bare, RUN_REQ)
    assert resp.run_result is not None and resp.run_result.stdout == "x"
    assert resp.status == "Success"


def test_files_and_notes() -> None:
    res = result(
        stage(exit_code=0, stdout_dropped=10),
        files={"out.bin": b"\x00\xff", "d/x": b""},
        missing_files=["nope"],
        fetch_errors={"big": "larger than 64 MiB"},
    )
    asked = RunRequest(code="", fetch_files=["out.bin", "/tmp/d/./x", "d/x", "nope", "big"])
    resp = fusion.to_response(res, asked)
    assert resp.status == "Success"
    # Keyed as requested, as SandboxFusion does; fncall keys them relative to /tmp.
    assert resp.files == {"out.bin": b64(b"\x00\xff"), "/tmp/d/./x": "", "d/x": ""}
    assert "run: 10 bytes of stdout dropped" in resp.message
    assert "fetch_files 'big': larger than 64 MiB" in resp.message
    assert as_client_response(resp).files == resp.files


def test_sandbox_error_makes_the_client_raise() -> None:
    resp = as_client_response(fusion.sandbox_error("NOT_FOUND: no image"))
    assert resp.status == sandbox_fusion.RunStatus.SandboxError
    assert resp.message == "NOT_FOUND: no image"


# --------------------------------------------------------------------------- route, scripted


@dataclass
class ScriptedCP:
    """Stands in for the ControlPlane: ``code`` picks the outcome."""

    seen: list[RunRequest] = field(default_factory=list)
    flaky_left: int = 1

    async def run(self, req: RunRequest) -> RunResult:
        self.seen.append(req)
        if req.code == "full":
            raise ResourceExhausted("the pool's queue is full")
        if req.code == "flaky" and self.flaky_left:
            self.flaky_left -= 1
            raise ResourceExhausted("the pool's queue is full")
        if req.code == "no-image":
            raise NotFound("no image sandfleet/fncall:1")
        if req.code == "bug":
            raise RuntimeError("boom")
        return RunResult(status="exited", exit_code=0, stdout=req.stdin, duration_s=0.01)


@dataclass
class Served:
    url: str
    cp: ScriptedCP


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    app = FastAPI()
    install_error_handlers(app)
    app.include_router(fusion.router)
    cp = ScriptedCP()
    app.state.cp = cp
    server = uvicorn.Server(
        uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=2)
    )
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        try:
            deadline = time.monotonic() + 10
            while not server.started:
                assert time.monotonic() < deadline, "test server did not start"
                time.sleep(0.01)
            yield Served(f"http://127.0.0.1:{sock.getsockname()[1]}", cp)
        finally:
            server.should_exit = True
            thread.join(10)


def test_route_answers_the_client(served: Served) -> None:
    resp = sandbox_fusion.run_code(
        SFRequest(code="echo", language="python", stdin="in"), endpoint=served.url
    )
    assert resp.status == sandbox_fusion.RunStatus.Success
    assert resp.run_result is not None and resp.run_result.stdout == "in"
    assert served.cp.seen[-1].stdin == b"in"


def test_route_full_queue_is_503_and_the_client_retries(served: Served) -> None:
    r = httpx.post(f"{served.url}/run_code", json={"code": "full", "language": "python"})
    assert r.status_code == 503
    assert r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "RESOURCE_EXHAUSTED"
    with pytest.raises(Exception, match="responded with code 503"):
        sandbox_fusion.run_code(
            SFRequest(code="full", language="python"), endpoint=served.url, max_attempts=1
        )
    # The first attempt meets a full queue, the retry runs.
    resp = sandbox_fusion.run_code(
        SFRequest(code="flaky", language="python"), endpoint=served.url, max_attempts=2
    )
    assert resp.status == sandbox_fusion.RunStatus.Success


def test_route_other_errors_are_sandbox_errors(served: Served) -> None:
    r = httpx.post(f"{served.url}/run_code", json={"code": "no-image", "language": "python"})
    assert r.status_code == 200
    assert r.json()["status"] == "SandboxError"
    assert r.json()["message"] == "NOT_FOUND: no image sandfleet/fncall:1"
    with pytest.raises(Exception, match="Sandbox responded with error: NOT_FOUND"):
        sandbox_fusion.run_code(
            SFRequest(code="no-image", language="python"), endpoint=served.url, max_attempts=1
        )


def test_route_lone_surrogate_is_refused_not_a_crash(served: Served) -> None:
    # FastAPI's JSON parser refuses it before the route runs; to_run_request would too.
    body = b'{"code": "", "language": "python", "stdin": "\\ud800"}'
    r = httpx.post(f"{served.url}/run_code", content=body)
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "INVALID_ARGUMENT"


def test_route_unsupported_language_never_reaches_the_pool(served: Served) -> None:
    n = len(served.cp.seen)
    with pytest.raises(Exception, match="'nodejs' is not supported"):
        sandbox_fusion.run_code(
            SFRequest(code="1", language="nodejs"), endpoint=served.url, max_attempts=1
        )
    assert len(served.cp.seen) == n


def test_route_wrong_types_are_refused_in_sandfleet_format(served: Served) -> None:
    r = httpx.post(f"{served.url}/run_code", json={"code": 1, "language": "python"})
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "INVALID_ARGUMENT"
    assert "code" in r.json()["error"]["message"]


def test_route_unexpected_failure_is_internal_not_a_trace(served: Served) -> None:
    r = httpx.post(f"{served.url}/run_code", json={"code": "bug", "language": "python"})
    assert r.status_code == 500
    assert r.json()["error"]["code"] == "INTERNAL"


def test_route_is_in_openapi(served: Served) -> None:
    spec = httpx.get(f"{served.url}/openapi.json").json()
    assert "post" in spec["paths"]["/run_code"]


# --------------------------------------------------------------------------- real deployment


@pytest.fixture(scope="module")
def dep(
    tmp_path_factory: pytest.TempPathFactory, fncall_images_dir: Path
) -> Iterator[LocalDeployment]:
    """One real ``sandfleet up`` for the module; nothing may be left on its node after."""
    with LocalDeployment(tmp_path_factory.mktemp("fusion") / "state", fncall_images_dir) as d:
        yield d
    assert_clean(d.state_dir)


def run(dep: LocalDeployment, **kw: object) -> SFResponse:
    """One call through SandboxFusion's own client; no retries, so a failure shows at once."""
    return sandbox_fusion.run_code(SFRequest(**kw), endpoint=dep.url, max_attempts=1)


root = pytest.mark.root


@root
def test_python_print(dep: LocalDeployment) -> None:
    resp = run(dep, code="print('hello')", language="python")
    assert resp.status == sandbox_fusion.RunStatus.Success
    assert resp.compile_result is None
    assert resp.run_result is not None
    assert resp.run_result.status == sandbox_fusion.CommandRunStatus.Finished
    assert resp.run_result.return_code == 0
    assert resp.run_result.stdout == "hello\n"
    assert resp.run_result.execution_time is not None and resp.run_result.execution_time >= 0
    assert summary_run_code_result(resp, MAPPING) == "ok"


@root
def test_nonzero_exit_is_failed(dep: LocalDeployment) -> None:
    resp = run(dep, code="import sys; print('x', file=sys.stderr); sys.exit(3)", language="python")
    assert resp.status == sandbox_fusion.RunStatus.Failed
    assert resp.run_result is not None
    assert resp.run_result.status == sandbox_fusion.CommandRunStatus.Finished
    assert resp.run_result.return_code == 3
    assert resp.run_result.stderr == "x\n"
    assert summary_run_code_result(resp, MAPPING) == "run-failed"


@root
def test_time_limit(dep: LocalDeployment) -> None:
    t0 = time.monotonic()
    code = "import time; print('a', flush=True); time.sleep(30)"
    resp = run(dep, code=code, run_timeout=1, language="python")
    assert time.monotonic() - t0 < 10
    assert resp.status == sandbox_fusion.RunStatus.Failed
    assert resp.run_result is not None
    assert resp.run_result.status == sandbox_fusion.CommandRunStatus.TimeLimitExceeded
    assert resp.run_result.return_code is None
    assert resp.run_result.stdout == "a\n"
    assert summary_run_code_result(resp, MAPPING) == "run-timeout"


@root
def test_signal_is_a_negative_return_code(dep: LocalDeployment) -> None:
    resp = run(
        dep, code="import os, signal; os.kill(os.getpid(), signal.SIGSEGV)", language="python"
    )
    assert resp.status == sandbox_fusion.RunStatus.Failed
    assert resp.run_result is not None
    assert resp.run_result.status == sandbox_fusion.CommandRunStatus.Finished
    assert resp.run_result.return_code == -11


@root
def test_memory_limit(dep: LocalDeployment) -> None:
    code = "b = bytearray(1536 << 20)\nfor i in range(0, len(b), 4096): b[i] = 1\nprint('survived')"
    resp = sandbox_fusion.run_code(
        SFRequest(code=code, language="python"), endpoint=dep.url, max_attempts=1
    )
    # memory_limit_MB is not in this client's model: send it as newer clients do.
    raw = httpx.post(
        f"{dep.url}/run_code",
        json={"code": code, "language": "python", "memory_limit_MB": 64},
        timeout=60,
    ).json()
    assert raw["status"] == "Failed", raw
    assert raw["run_result"]["status"] == "Finished"
    assert raw["run_result"]["return_code"] == -9
    assert "memory limit (64 MiB)" in raw["message"]
    assert "survived" not in raw["run_result"]["stdout"]
    # The default limit (fusion.DEFAULT_MEMORY_MB, 1 GiB) kills it as well.
    assert resp.status == sandbox_fusion.RunStatus.Failed
    assert resp.run_result is not None and resp.run_result.return_code == -9


@root
def test_stdin(dep: LocalDeployment) -> None:
    resp = run(dep, code="print(input()[::-1])", stdin="abc\n", language="python")
    assert resp.run_result is not None and resp.run_result.stdout == "cba\n"
    none = run(dep, code="import sys; print(repr(sys.stdin.read()))", language="python")
    assert none.run_result is not None and none.run_result.stdout == "''\n"


@root
def test_files_round_trip(dep: LocalDeployment) -> None:
    code = (
        "import os\n"
        "data = open('in.txt', 'rb').read() + open('sub/dir/b.bin', 'rb').read()\n"
        "open('out.bin', 'wb').write(data[::-1] + bytes(range(256)))\n"
        "os.makedirs('res', exist_ok=True)\n"
        "open('res/n.txt', 'w').write(str(len(data)))\n"
        "print(sorted(os.listdir('.')))\n"
    )
    resp = run(
        dep,
        code=code,
        language="python",
        files={"in.txt": b64(b"hello"), "sub/dir/b.bin": b64(b"\x00\xff"), "skip": None},
        fetch_files=["out.bin", "/tmp/res/n.txt", "missing.txt", "res"],
    )
    assert resp.status == sandbox_fusion.RunStatus.Success, resp
    # Keyed as requested; a missing file or a directory is left out, as SandboxFusion does.
    assert set(resp.files) == {"out.bin", "/tmp/res/n.txt"}
    assert base64.b64decode(resp.files["out.bin"]) == b"\xff\x00olleh" + bytes(range(256))
    assert base64.b64decode(resp.files["/tmp/res/n.txt"]) == b"7"
    assert resp.run_result is not None and "'skip'" not in resp.run_result.stdout


@root
def test_cpp_compile_error(dep: LocalDeployment) -> None:
    resp = run(dep, code="int main() { return nope; }", language="cpp")
    assert resp.status == sandbox_fusion.RunStatus.Failed
    assert resp.run_result is None
    assert resp.compile_result is not None
    assert resp.compile_result.status == sandbox_fusion.CommandRunStatus.Finished
    assert resp.compile_result.return_code not in (None, 0)
    assert "nope" in (resp.compile_result.stderr or "")
    assert summary_run_code_result(resp, MAPPING) == "compile-failed"


@root
def test_cpp_success(dep: LocalDeployment) -> None:
    code = (
        "#include <iostream>\n#include <vector>\n"
        "int main() { int n; std::cin >> n; std::vector<int> v(n, 2); long s = 0;\n"
        "  for (int x : v) s += x; std::cout << s << std::endl; return 0; }\n"
    )
    resp = run(dep, code=code, language="cpp", stdin="21\n", compile_timeout=60)
    assert resp.status == sandbox_fusion.RunStatus.Success, resp
    assert resp.compile_result is not None and resp.compile_result.return_code == 0
    assert resp.run_result is not None and resp.run_result.stdout == "42\n"
    assert summary_run_code_result(resp, MAPPING) == "ok"


@root
def test_c_and_bash_and_python3(dep: LocalDeployment) -> None:
    # "c" and "python3" are not in the client's Literal: send them as raw JSON.
    c = httpx.post(
        f"{dep.url}/run_code",
        json={"code": '#include <stdio.h>\nint main(){puts("c");return 4;}', "language": "c"},
        timeout=60,
    ).json()
    assert c["status"] == "Failed"
    assert c["compile_result"]["return_code"] == 0
    assert (c["run_result"]["stdout"], c["run_result"]["return_code"]) == ("c\n", 4)
    py3 = httpx.post(
        f"{dep.url}/run_code", json={"code": "print(3)", "language": "python3"}, timeout=60
    ).json()
    assert py3["run_result"]["stdout"] == "3\n"
    resp = run(dep, code='read x; echo "$((x * 2))"; exit 0', stdin="21\n", language="bash")
    assert resp.status == sandbox_fusion.RunStatus.Success
    assert resp.run_result is not None and resp.run_result.stdout == "42\n"


@root
def test_unsupported_language_makes_the_client_raise(dep: LocalDeployment) -> None:
    with pytest.raises(Exception, match=r"Sandbox responded with error:.*'nodejs' is not supp"):
        run(dep, code="console.log(1)", language="nodejs")


@root
def test_wrong_types_and_extra_fields(dep: LocalDeployment) -> None:
    bad = httpx.post(f"{dep.url}/run_code", json={"code": ["x"], "language": "python"})
    assert bad.status_code == 400
    assert bad.json()["error"]["code"] == "INVALID_ARGUMENT"
    ok = httpx.post(
        f"{dep.url}/run_code",
        json={"code": "print(5)", "language": "python", "a_newer_field": {"x": 1}},
        timeout=60,
    )
    assert ok.status_code == 200
    assert ok.json()["run_result"]["stdout"] == "5\n"


@root
def test_async_client(dep: LocalDeployment) -> None:
    async def main() -> list[SFResponse]:
        calls = [
            sandbox_fusion.run_code_async(
                SFRequest(code=f"print({i} * {i})", language="python"),
                endpoint=dep.url,
                max_attempts=1,
            )
            for i in range(16)
        ]
        return list(await asyncio.gather(*calls))

    answers = asyncio.run(main())
    assert [a.run_result.stdout if a.run_result else None for a in answers] == [
        f"{i * i}\n" for i in range(16)
    ]
    assert all(summary_run_code_result(a, MAPPING) == "ok" for a in answers)


@root
def test_full_queue_is_503_and_the_client_retries(dep: LocalDeployment) -> None:
    # The bash pool only, so the other tests' Python calls keep the default bounds.
    pools = f"{dep.url}/v1/pools"
    tight = {"language": "bash", "min_workers": 1, "max_workers": 1, "max_queue": 0}
    httpx.put(pools, json=tight, timeout=60).raise_for_status()
    try:
        assert run(dep, code="echo warm", language="bash").status == "Success"

        async def burst() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=60) as c:
                body = {"code": "sleep 0.5", "language": "bash"}
                calls = [c.post(f"{dep.url}/run_code", json=body) for _ in range(4)]
                return list(await asyncio.gather(*calls))

        answers = asyncio.run(burst())
        assert sorted(r.status_code for r in answers) == [200, 503, 503, 503]
        refused = next(r for r in answers if r.status_code == 503)
        assert refused.json()["error"]["code"] == "RESOURCE_EXHAUSTED"
        assert refused.headers["retry-after"] == "1"

        async def retried() -> list[SFResponse]:
            request = SFRequest(code="sleep 0.2; echo ok", language="bash")
            calls = [
                sandbox_fusion.run_code_async(request, endpoint=dep.url, max_attempts=8)
                for _ in range(3)
            ]
            return list(await asyncio.gather(*calls))

        assert [a.run_result.stdout if a.run_result else None for a in asyncio.run(retried())] == [
            "ok\n"
        ] * 3
    finally:
        httpx.put(pools, json={"language": "bash"}, timeout=60).raise_for_status()


@root
def test_sandbox_error_for_a_bad_path(dep: LocalDeployment) -> None:
    r = httpx.post(
        f"{dep.url}/run_code",
        json={"code": "", "language": "python", "files": {"/etc/passwd": b64(b"x")}},
        timeout=60,
    )
    assert r.status_code == 200
    body = r.json()
    assert body["status"] == "SandboxError"
    assert body["message"].startswith("INVALID_ARGUMENT: ")


def test_module_exports() -> None:
    for name in fusion.__all__:
        assert hasattr(fusion, name), name
    assert isinstance(fusion.sandbox_error("x"), fusion.RunCodeResponse)
