"""The SDK against a real tiny HTTP server: surface parity, settings, errors, streaming.

The server is a Starlette app run by uvicorn on a free port in a thread. It
keeps sandboxes and files in memory, answers canned error bodies for special
ids, and records what it was sent. No mocks of httpx.
"""

from __future__ import annotations

import asyncio
import base64
import inspect
import json
import os
import socket
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

import sandfleet.sdk
from sandfleet.sdk import AsyncClient, AsyncProcess, AsyncSandbox, Client, Process, Sandbox
from sandfleet.sdk._core import EXEC_MARGIN_S, Settings
from sandfleet.sdk.client import AsyncFiles
from sandfleet.sdk.sync import Files
from sandfleet.wire import errors as E
from sandfleet.wire.models import (
    BUILT_KINDS,
    KINDS,
    ErrorInfo,
    ExecEvent,
    ExecResult,
    OutputChunk,
    ProcessInfo,
    SandboxInfo,
)

T = TypeVar("T")
ALL_ERRORS: list[type[E.SandfleetError]] = [
    getattr(E, name)
    for name in E.__all__
    if isinstance(getattr(E, name), type)
    and issubclass(getattr(E, name), E.SandfleetError)
    and getattr(E, name) is not E.SandfleetError
]

# --------------------------------------------------------------------------- the server


@dataclass
class State:
    sandboxes: dict[str, SandboxInfo] = field(default_factory=dict)
    files: dict[tuple[str, str], bytes] = field(default_factory=dict)
    deleted: list[str] = field(default_factory=list)
    seen: list[tuple[str, str, str, str | None]] = field(default_factory=list)
    upload_chunks: int = 0
    exec_started: threading.Event = field(default_factory=threading.Event)
    counter: int = 0

    def reset(self) -> None:
        self.__init__()  # type: ignore[misc]


def _error(code: str, message: str) -> JSONResponse:
    cls = next(c for c in ALL_ERRORS if c.code == code)
    return JSONResponse(cls(message).to_wire(), status_code=cls.http_status)


def _entry(path: str, kind: str = "file", size: int = 0, mode: int = 0o644) -> dict[str, Any]:
    return {
        "name": path.rsplit("/", 1)[-1],
        "path": path,
        "type": kind,
        "size": size,
        "mode": mode,
        "mtime": 1.0,
    }


def make_app(state: State) -> Callable[..., Awaitable[None]]:
    def lookup(request: Request) -> SandboxInfo | Response:
        sid = request.path_params["sid"]
        if sid.startswith("err-"):
            return _error(sid[4:], f"canned {sid[4:]}")
        if sid in state.sandboxes:
            return state.sandboxes[sid]
        return _error("NOT_FOUND", f"no sandbox {sid}")

    async def sandboxes(request: Request) -> Response:
        if request.method == "GET":
            want = dict(v.split("=", 1) for v in request.query_params.getlist("label"))
            found = [
                s.model_dump(mode="json")
                for s in state.sandboxes.values()
                if all(s.labels.get(k) == v for k, v in want.items())
            ]
            return JSONResponse({"sandboxes": found})
        body = await request.json()
        if body["image"] == "busy":
            return _error("RESOURCE_EXHAUSTED", "no node has room")
        if body["image"] == "slow-create":
            await asyncio.sleep(0.5)
        state.counter += 1
        info = SandboxInfo(
            id=f"sb-{state.counter}",
            kind=body["kind"],
            node_id="n1",
            state="running",
            image=body["image"],
            cpu=body["cpu"],
            memory_mb=body["memory_mb"],
            pids_limit=body["pids_limit"],
            labels=body["labels"],
        )
        state.sandboxes[info.id] = info
        return JSONResponse(info.model_dump(mode="json"), status_code=201)

    async def sandbox(request: Request) -> Response:
        sid = request.path_params["sid"]
        if sid == "slow":
            await asyncio.sleep(1.0)
        if sid == "garbage":
            return PlainTextResponse("<html>hello</html>")
        if sid == "text502":
            return PlainTextResponse("Bad Gateway", status_code=502)
        found = lookup(request)
        if isinstance(found, Response):
            return found
        if request.method == "DELETE":
            del state.sandboxes[sid]
            state.deleted.append(sid)
            return Response(status_code=204)
        return JSONResponse(found.model_dump(mode="json"))

    async def exec_(request: Request) -> Response:
        found = lookup(request)
        if isinstance(found, Response):
            return found
        body = await request.json()
        state.exec_started.set()
        if body["cmd"] == "fail":
            return _error("INTERNAL", "agent crashed")
        if body["cmd"] == "sleep":
            await asyncio.sleep(0.6)
        stdin = base64.b64decode(body["stdin"])
        out = json.dumps(
            {
                "cmd": body["cmd"],
                "env": body["env"],
                "cwd": body["cwd"],
                "timeout_s": body["timeout_s"],
            }
        ).encode()
        return JSONResponse(
            {
                "status": "exited",
                "exit_code": 0,
                "stdout": base64.b64encode(out).decode(),
                "stderr": base64.b64encode(stdin).decode(),
            }
        )

    async def exec_stream(request: Request) -> Response:
        found = lookup(request)
        if isinstance(found, Response):
            return found
        cmd = (await request.json())["cmd"]
        lines = [
            ExecEvent(type="stdout", data=b"\xe2\0").to_line(),
            ExecEvent(type="stderr", data=b"e").to_line(),
            ExecEvent(type="stdout", data=b"\n" * 70_000).to_line(),
        ]
        if cmd == "fail-mid":
            error = ErrorInfo(code="UNAVAILABLE", message="the node died")
            lines.append(ExecEvent(type="error", error=error).to_line())
        elif cmd == "truncated":
            lines.append(b'{"type":"stdout","da')
        elif cmd != "no-result":
            result = ExecResult(status="exited", exit_code=3)
            lines.append(ExecEvent(type="result", result=result).to_line())

        async def gen() -> AsyncIterator[bytes]:
            for line in lines:  # split anywhere: the client reassembles lines
                for i in range(0, len(line), 7000):
                    yield line[i : i + 7000]

        return StreamingResponse(gen(), media_type="application/x-ndjson")

    async def process(request: Request) -> Response:
        info = ProcessInfo(
            id=request.path_params["pid"], pid=7, command="x", state="running", started_at=1.0
        )
        return JSONResponse(info.model_dump(mode="json"))

    async def follow(request: Request) -> Response:
        assert request.query_params["follow"] == "true"
        chunk = OutputChunk(data=b"\xe2", offset=5, next_offset=6)
        lines = [chunk.model_dump_json().encode() + b"\n"]
        lines.append(json.dumps(E.Unavailable("the agent died").to_wire()).encode() + b"\n")
        return StreamingResponse(iter(lines), media_type="application/x-ndjson")

    async def content(request: Request) -> Response:
        found = lookup(request)
        if isinstance(found, Response):
            return found
        key = (found.id, request.query_params["path"])
        if request.method == "PUT":
            chunks = [c async for c in request.stream() if c]
            state.upload_chunks = len(chunks)
            state.files[key] = b"".join(chunks)
            mode = int(request.query_params["mode"])
            return JSONResponse(_entry(key[1], size=len(state.files[key]), mode=mode))
        if key not in state.files:
            return _error("NOT_FOUND", f"no file {key[1]}")
        data = state.files[key]

        async def stream() -> AsyncIterator[bytes]:
            for i in range(0, len(data), 256 * 1024):
                yield data[i : i + 256 * 1024]

        return StreamingResponse(stream(), media_type="application/octet-stream")

    async def files_op(request: Request) -> Response:
        found = lookup(request)
        if isinstance(found, Response):
            return found
        op, path = request.path_params.get("op", "remove"), request.query_params["path"]
        if op == "list":
            entries = [
                _entry(p, size=len(d))
                for (sid, p), d in sorted(state.files.items())
                if sid == found.id and p.startswith(path)
            ]
            return JSONResponse({"entries": entries})
        if op == "stat":
            if (found.id, path) not in state.files:
                return _error("NOT_FOUND", f"no file {path}")
            return JSONResponse(_entry(path, size=len(state.files[found.id, path])))
        if op == "mkdir":
            assert request.query_params["parents"] in ("true", "false")
            return JSONResponse(_entry(path, "dir", mode=0o755))
        assert request.query_params["recursive"] in ("true", "false")
        if state.files.pop((found.id, path), None) is None:
            return _error("NOT_FOUND", f"no file {path}")
        return Response(status_code=204)

    async def images(_: Request) -> Response:
        return JSONResponse(
            {
                "images": [
                    {
                        "name": "python",
                        "tag": "3.11",
                        "kind": "base",
                        "layers": [{"digest": "sha256:00", "size": 1, "kind": "base"}],
                    }
                ]
            }
        )

    async def nodes(_: Request) -> Response:
        return JSONResponse(
            {
                "nodes": [
                    {
                        "node_id": "n1",
                        "address": "http://x",
                        "kinds": ["container"],
                        "capacity": {"max_sandboxes": 8, "cpu": 2.0, "memory_mb": 1024},
                    }
                ]
            }
        )

    app = Starlette(
        routes=[
            Route("/v1/sandboxes", sandboxes, methods=["GET", "POST"]),
            Route("/v1/sandboxes/{sid}", sandbox, methods=["GET", "DELETE"]),
            Route("/v1/sandboxes/{sid}/exec", exec_, methods=["POST"]),
            Route("/v1/sandboxes/{sid}/exec/stream", exec_stream, methods=["POST"]),
            Route("/v1/sandboxes/{sid}/processes/{pid}", process),
            Route("/v1/sandboxes/{sid}/processes/{pid}/output", follow),
            Route("/v1/sandboxes/{sid}/files/content", content, methods=["GET", "PUT"]),
            Route("/v1/sandboxes/{sid}/files/{op}", files_op, methods=["GET", "POST"]),
            Route("/v1/sandboxes/{sid}/files", files_op, methods=["DELETE"]),
            Route("/v1/images", images),
            Route("/v1/nodes", nodes),
        ]
    )

    async def recording(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            auth = dict(scope["headers"]).get(b"authorization")
            state.seen.append(
                (
                    scope["method"],
                    scope["path"],
                    scope["query_string"].decode(),
                    auth.decode() if auth else None,
                )
            )
        await app(scope, receive, send)

    return recording


@dataclass
class Server:
    url: str
    state: State


@pytest.fixture(scope="module")
def _server() -> Iterator[Server]:
    state = State()
    config = uvicorn.Config(
        make_app(state), log_level="warning", lifespan="off", timeout_graceful_shutdown=2
    )
    server = uvicorn.Server(config)
    # proto=IPPROTO_TCP so asyncio sets TCP_NODELAY on accepted connections (else ~40 ms/call)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP) as sock:
        sock.bind(("127.0.0.1", 0))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        try:
            deadline = time.monotonic() + 10
            while not server.started:
                assert time.monotonic() < deadline, "test server did not start"
                time.sleep(0.01)
            yield Server(f"http://127.0.0.1:{sock.getsockname()[1]}", state)
        finally:
            server.should_exit = True
            thread.join(10)


@pytest.fixture
def server(_server: Server, monkeypatch: pytest.MonkeyPatch) -> Server:
    _server.state.reset()
    monkeypatch.delenv("SANDFLEET_URL", raising=False)
    monkeypatch.delenv("SANDFLEET_TOKEN", raising=False)
    return _server


@pytest.fixture
def closed_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@pytest.fixture(params=["sync", "async"])
def flavor(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def make_client(flavor: str, url: str | None = None, **kw: Any) -> Any:
    return (Client if flavor == "sync" else AsyncClient)(url, **kw)


async def aw(value: Any) -> Any:
    """Await what the async client returned; pass the sync client's results through."""
    return await value if inspect.isawaitable(value) else value


def scenario(fn: Callable[..., Awaitable[T]], *args: Any) -> T:
    """Run one scenario written once for both clients."""
    return asyncio.run(fn(*args))  # type: ignore[arg-type]


# --------------------------------------------------------------------------- surface


def _public(cls: type) -> dict[str, Any]:
    return {n: m for n, m in vars(cls).items() if not n.startswith("_")}


@pytest.mark.parametrize(
    ("async_cls", "sync_cls"),
    [
        (AsyncClient, Client),
        (AsyncSandbox, Sandbox),
        (AsyncFiles, Files),
        (AsyncProcess, Process),
    ],
)
def test_async_and_sync_surfaces_match(async_cls: type, sync_cls: type) -> None:
    a, s = _public(async_cls), _public(sync_cls)
    assert a.keys() == s.keys()
    for name, member in a.items():
        if isinstance(member, property):
            assert isinstance(s[name], property), name
            continue
        if inspect.isasyncgenfunction(member):
            # streams: an async iterator on one side, a plain iterator on the other
            assert inspect.isgeneratorfunction(s[name]), f"{sync_cls.__name__}.{name}"
        else:
            assert inspect.iscoroutinefunction(member), f"{async_cls.__name__}.{name} is not async"
            assert not inspect.iscoroutinefunction(s[name]), f"{sync_cls.__name__}.{name} is async"
            assert not inspect.isgeneratorfunction(s[name]), f"{sync_cls.__name__}.{name}"
        assert inspect.signature(member).parameters == inspect.signature(s[name]).parameters, name
        assert member.__doc__ and s[name].__doc__, f"{name} lacks a docstring"
    shape = [(p.name, p.kind, p.default) for p in inspect.signature(async_cls).parameters.values()]
    assert shape == [
        (p.name, p.kind, p.default) for p in inspect.signature(sync_cls).parameters.values()
    ]
    assert hasattr(async_cls, "__aenter__") == hasattr(sync_cls, "__enter__")


def test_public_exports_are_exactly_all() -> None:
    assert sorted(sandfleet.sdk.__all__) == [
        "AsyncClient",
        "AsyncProcess",
        "AsyncSandbox",
        "Client",
        "Process",
        "Sandbox",
    ]
    public = {n for n in vars(sandfleet.sdk) if not n.startswith("_")}
    assert public - {"client", "sync"} == set(sandfleet.sdk.__all__)


# --------------------------------------------------------------------------- settings


def test_settings_precedence() -> None:
    env = {"SANDFLEET_URL": "http://env:1/", "SANDFLEET_TOKEN": "envtok"}
    default = Settings("http://127.0.0.1:7070", None, 30.0)
    assert Settings.resolve("http://arg:2", "argtok", 5, env) == Settings(
        "http://arg:2", "argtok", 5
    )
    assert Settings.resolve(None, None, None, env) == Settings("http://env:1", "envtok", 30.0)
    assert Settings.resolve(None, None, None, {}) == default
    assert (
        Settings.resolve(None, None, None, {"SANDFLEET_URL": "", "SANDFLEET_TOKEN": ""}) == default
    )
    assert Settings.resolve(None, None, 2, {}).exec_timeout_s(60) == 60 + EXEC_MARGIN_S
    with pytest.raises(E.InvalidArgument, match=r"\$SANDFLEET_URL 'localhost:7070'.*http://"):
        Settings.resolve(None, None, None, {"SANDFLEET_URL": "localhost:7070"})
    with pytest.raises(E.InvalidArgument, match="timeout_s"):
        Settings.resolve(None, None, 0, {})


def test_env_settings_reach_the_wire(
    server: Server, monkeypatch: pytest.MonkeyPatch, flavor: str
) -> None:
    monkeypatch.setenv("SANDFLEET_URL", server.url)
    monkeypatch.setenv("SANDFLEET_TOKEN", "from-env")

    async def run() -> None:
        for kw, want in (({}, "Bearer from-env"), ({"token": "from-arg"}, "Bearer from-arg")):
            client = make_client(flavor, **kw)
            assert client.url == server.url
            assert await aw(client.list()) == []
            assert server.state.seen[-1][3] == want
            await aw(client.close())

    scenario(run)


# --------------------------------------------------------------------------- behaviour


def test_lifecycle_exec_and_files(server: Server, flavor: str, tmp_path: Path) -> None:
    async def run() -> None:
        client = make_client(flavor, server.url)
        sb = await aw(client.create(image="python:3.11", labels={"job": "j1"}))
        assert sb.id == "sb-1" and sb.info.state == "running" and sb.info.labels == {"job": "j1"}
        assert sb.id in repr(sb)

        r = await aw(sb.exec(["echo", "hi"], env={"A": "1"}, cwd="/w", stdin="é", timeout_s=5))
        assert r.ok and r.stderr == "é".encode()
        assert json.loads(r.stdout) == {
            "cmd": ["echo", "hi"],
            "env": {"A": "1"},
            "cwd": "/w",
            "timeout_s": 5,
        }
        assert json.loads((await aw(sb.exec("echo $A"))).stdout)["cmd"] == "echo $A"

        entry = await aw(sb.files.write("/w/a.txt", "text", mode=0o600))
        assert entry.size == 4 and entry.mode == 0o600
        assert await aw(sb.files.read("/w/a.txt")) == b"text"
        assert [e.path for e in await aw(sb.files.list("/w"))] == ["/w/a.txt"]
        assert (await aw(sb.files.stat("/w/a.txt"))).size == 4
        assert (await aw(sb.files.mkdir("/w/d"))).type == "dir"
        await aw(sb.files.remove("/w/a.txt"))
        with pytest.raises(E.NotFound, match="no file"):
            await aw(sb.files.read("/w/a.txt"))

        assert (await aw(sb.refresh())).id == sb.id
        assert [s.id for s in await aw(client.list({"job": "j1"}))] == ["sb-1"]
        assert await aw(client.list({"job": "other"})) == []
        assert any(q == "label=job%3Dj1" for _, _, q, _ in server.state.seen)
        assert (await aw(client.get("sb-1"))).info == sb.info
        assert (await aw(client.images()))[0].ref == "python:3.11"
        assert (await aw(client.nodes()))[0].capacity.memory_mb == 1024

        await aw(sb.destroy())
        await aw(sb.destroy())  # idempotent on the handle
        assert server.state.deleted == ["sb-1"]
        with pytest.raises(E.NotFound, match="destroyed"):
            await aw(sb.exec("true"))
        with pytest.raises(E.NotFound, match="no sandbox sb-1"):
            await aw(client.get("sb-1"))
        await aw(client.close())
        await aw(client.close())
        with pytest.raises(E.FailedPrecondition, match="closed"):
            await aw(client.list())

    scenario(run)


def test_context_managers_destroy(server: Server) -> None:
    with Client(server.url) as client, client.create(image="img") as sb:
        assert sb.id in server.state.sandboxes
    assert server.state.deleted == [sb.id]

    async def run() -> str:
        async with AsyncClient(server.url) as client, await client.create(image="img") as sb:
            pass
        return str(sb.id)

    sandbox_id = asyncio.run(run())
    assert server.state.deleted == [sb.id, sandbox_id]


def test_fncall_arguments_checked_before_any_request(closed_url: str, flavor: str) -> None:
    async def run() -> None:
        client = make_client(flavor, closed_url)  # any request would raise Unavailable
        with pytest.raises(E.InvalidArgument, match=r"no sandboxes.*client.run"):
            await aw(client.create(kind="fncall", image="img"))
        with pytest.raises(E.InvalidArgument, match="language"):
            await aw(client.run("1", kind="fncall", language="cobol"))
        with pytest.raises(E.InvalidArgument, match="language='bash' only"):
            await aw(client.run(["echo", "1"], kind="fncall"))
        with pytest.raises(E.InvalidArgument, match="timeout_s"):
            await aw(client.run("1", kind="fncall", timeout_s=-1))
        with pytest.raises(E.InvalidArgument, match="user, cpu apply to sandbox kinds only"):
            await aw(client.run("1", kind="fncall", user="root", cpu=2))
        with pytest.raises(E.InvalidArgument, match="kind='fncall' only"):
            await aw(client.run("true", image="img", files={"a": b""}))
        with pytest.raises(E.InvalidArgument, match="needs an image"):
            await aw(client.run("true"))
        with pytest.raises(E.InvalidArgument, match="min_workers"):
            await aw(client.configure_pool(min_workers=-1))
        await aw(client.close())

    scenario(run)


@pytest.mark.parametrize("kind", sorted({*KINDS, "bogus"} - {*BUILT_KINDS, "fncall"}))
def test_unavailable_kind_rejected_before_any_request(
    closed_url: str, flavor: str, kind: str
) -> None:
    async def run() -> None:
        client = make_client(flavor, closed_url)  # any request would raise Unavailable
        for call in (
            lambda: client.create(kind=kind, image="img"),
            lambda: client.run("true", kind=kind, image="img"),
        ):
            with pytest.raises(E.InvalidArgument, match=rf"{kind}.*available: 'container'"):
                await aw(call())
        with pytest.raises(E.InvalidArgument, match="timeout_s"):
            await aw(client.run("true", image="img", timeout_s=0))
        await aw(client.close())

    scenario(run)


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize("cls", ALL_ERRORS, ids=lambda c: c.code)
def test_server_error_bodies_become_their_class(
    server: Server, flavor: str, cls: type[E.SandfleetError]
) -> None:
    async def run() -> None:
        client = make_client(flavor, server.url)
        with pytest.raises(cls, match=f"canned {cls.code}") as info:
            await aw(client.get(f"err-{cls.code}"))
        assert type(info.value) is cls
        await aw(client.close())

    scenario(run)


def test_unexpected_answers_are_internal(server: Server, flavor: str) -> None:
    async def run() -> None:
        client = make_client(flavor, server.url)
        with pytest.raises(E.Internal, match=r"HTTP 502.*Bad Gateway"):
            await aw(client.get("text502"))
        with pytest.raises(E.Internal, match="unexpected answer"):
            await aw(client.get("garbage"))
        with pytest.raises(E.ResourceExhausted) as info:
            await aw(client.create(image="busy"))
        assert info.value.retryable
        await aw(client.close())

    scenario(run)


def test_closed_port_is_unavailable(closed_url: str, flavor: str, tmp_path: Path) -> None:
    local = tmp_path / "f"
    local.write_bytes(b"x")
    info = SandboxInfo(
        id="sb-1",
        kind="container",
        node_id="n",
        state="running",
        image="i",
        cpu=1,
        memory_mb=1,
        pids_limit=8,
    )

    async def run() -> None:
        client = make_client(flavor, closed_url)
        sb = (Sandbox if flavor == "sync" else AsyncSandbox)(client, info)
        calls = [
            client.list,
            lambda: client.create(image="i"),
            lambda: sb.exec("true"),
            lambda: sb.files.upload(local, "/f"),
            lambda: sb.files.download("/f", tmp_path / "g"),
        ]
        for call in calls:
            with pytest.raises(E.Unavailable) as err:
                await aw(call())
            msg = str(err.value)
            assert closed_url in msg and "sandfleet up" in msg and "SANDFLEET_URL" in msg
            assert isinstance(err.value, ConnectionError) and err.value.retryable
        assert not (tmp_path / "g").exists()
        await aw(client.close())

    scenario(run)


def test_timeouts(server: Server, flavor: str) -> None:
    async def run() -> None:
        client = make_client(flavor, server.url, timeout_s=0.2)
        with pytest.raises(E.DeadlineExceeded, match=r"within 0.2 s") as err:
            await aw(client.get("slow"))
        assert isinstance(err.value, TimeoutError)
        # exec waits for the command's timeout + margin, not the client's 0.2 s
        sb = await aw(client.create(image="img"))
        assert (await aw(sb.exec("sleep", timeout_s=1))).ok
        await aw(client.close())

    scenario(run)


# --------------------------------------------------------------------------- streaming


def test_upload_and_download_stream(server: Server, flavor: str, tmp_path: Path) -> None:
    data = os.urandom(3 * 1024 * 1024 + 17)
    src, dst = tmp_path / "src.bin", tmp_path / "dst.bin"
    src.write_bytes(data)

    async def run() -> None:
        client = make_client(flavor, server.url)
        sb = await aw(client.create(image="img"))
        entry = await aw(sb.files.upload(src, "/big.bin", mode=0o755))
        assert entry.size == len(data) and entry.mode == 0o755
        assert server.state.upload_chunks > 1  # sent in pieces, not as one body
        assert await aw(sb.files.download("/big.bin", dst)) == len(data)
        assert dst.read_bytes() == data
        with pytest.raises(E.NotFound):
            await aw(sb.files.download("/missing", tmp_path / "none"))
        assert sorted(p.name for p in tmp_path.iterdir()) == ["dst.bin", "src.bin"]
        gone = (Sandbox if flavor == "sync" else AsyncSandbox)(
            client, sb.info.model_copy(update={"id": "err-NOT_FOUND"})
        )
        with pytest.raises(E.NotFound, match="canned"):  # refused before the body is read
            await aw(gone.files.upload(src, "/big.bin"))
        with pytest.raises(FileNotFoundError):
            await aw(sb.files.upload(tmp_path / "absent", "/x"))
        await aw(client.close())

    scenario(run)


async def _collect(items: Any, into: list[Any]) -> None:
    """Append what a sync or an async iterator yields to ``into``."""
    if hasattr(items, "__aiter__"):
        async for item in items:
            into.append(item)
    else:
        into.extend(items)


def test_streams_rebuild_results_and_raise_errors(server: Server, flavor: str) -> None:
    async def run() -> None:
        client = make_client(flavor, server.url)
        sb = await aw(client.create(image="img"))
        out: list[bytes] = []
        r = await aw(sb.exec("ok", on_stdout=out.append))
        assert (r.exit_code, r.stdout, r.stderr) == (3, b"\xe2\0" + b"\n" * 70_000, b"e")
        assert b"".join(out) == r.stdout
        events: list[ExecEvent] = []
        await _collect(sb.exec_stream("ok"), events)
        assert [e.type for e in events] == ["stdout", "stderr", "stdout", "result"]
        assert events[-1].result is not None and events[-1].result.stdout == b""
        for cmd, error in (
            ("fail-mid", E.Unavailable),
            ("truncated", E.Unavailable),
            ("no-result", E.Internal),
        ):
            events = []
            with pytest.raises(error):
                await _collect(sb.exec_stream(cmd), events)
            assert events[0].data == b"\xe2\0", cmd  # what came before the failure
            with pytest.raises(error):
                await aw(sb.exec(cmd, on_stderr=out.append))
        ghost = await aw(client.get("sb-1"))
        for sid, error in (("sb-404", E.NotFound), ("err-PERMISSION_DENIED", E.PermissionDenied)):
            ghost._info = ghost._info.model_copy(update={"id": sid})
            with pytest.raises(error):
                await _collect(ghost.exec_stream("ok"), [])

        proc = await aw(sb.process("p7"))
        assert (proc.id, proc.info.pid) == ("p7", 7)
        chunks: list[OutputChunk] = []
        with pytest.raises(E.Unavailable, match="agent died"):
            await _collect(proc.follow_output(offset=5), chunks)
        assert [c.data for c in chunks] == [b"\xe2"]
        with pytest.raises(E.InvalidArgument):
            await _collect(proc.follow_output("stdlog"), [])
        with pytest.raises(E.InvalidArgument):
            await aw(proc.kill(0))
        await aw(client.close())

    scenario(run)


# --------------------------------------------------------------------------- run()


def test_run_destroys_on_success_and_error(server: Server, flavor: str) -> None:
    async def run() -> None:
        client = make_client(flavor, server.url)
        result = await aw(client.run(["echo"], image="img", stdin=b"in", memory_mb=64))
        assert result.ok and result.stderr == b"in"
        with pytest.raises(E.Internal, match="agent crashed"):
            await aw(client.run("fail", image="img"))
        assert server.state.deleted == ["sb-1", "sb-2"] and not server.state.sandboxes
        await aw(client.close())

    scenario(run)


def test_async_run_destroys_on_cancel(server: Server) -> None:
    async def run() -> None:
        async with AsyncClient(server.url) as client:
            task = asyncio.create_task(client.run("sleep", image="img"))
            await asyncio.to_thread(server.state.exec_started.wait, 5)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert server.state.deleted == ["sb-1"]

            # cancelled while the sandbox is still being created: destroyed once it exists
            task = asyncio.create_task(client.run("true", image="slow-create"))
            await asyncio.sleep(0.1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        assert server.state.deleted == ["sb-1", "sb-2"] and not server.state.sandboxes

    asyncio.run(run())
