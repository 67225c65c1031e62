"""The control plane's HTTP API (``/v1``; OpenAPI at ``/openapi.json``)."""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import quote

import httpx
from fastapi import APIRouter, Depends, FastAPI, Query, Request, Response
from fastapi.responses import StreamingResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    generate_latest,
)

from sandfleet.controlplane import fusion
from sandfleet.controlplane.lifetimes import lifecycle_router
from sandfleet.controlplane.service import ControlPlane
from sandfleet.controlplane.store import SqlStore
from sandfleet.wire.errors import InvalidArgument, SandfleetError, Unavailable
from sandfleet.wire.models import (
    REPLAYED_HEADER,
    STEP_HEADER,
    CreateSandboxRequest,
    ErrorInfo,
    ExecEvent,
    ExecRequest,
    ExecResult,
    FileEntry,
    ImageManifest,
    NodeHeartbeat,
    NodeInfo,
    NodeRegistered,
    NodeRegistration,
    OutputChunk,
    PoolConfig,
    PoolInfo,
    ProcessInfo,
    RunResult,
    SandboxInfo,
    SnapshotRequest,
    SpawnRequest,
)
from sandfleet.wire.server import (
    cancel_on_disconnect,
    install_error_handlers,
    path_token_checker,
    token_checker,
)

__all__ = ["create_app"]

NDJSON = "application/x-ndjson"
#: Read timeout of calls that may rightly stay silent for as long as they like
#: (a wait without a bound, following a quiet process's output).
NO_READ_TIMEOUT = math.inf
#: Extra seconds the node gets beyond a command's or a wait's own bound.
NODE_MARGIN_S = 5.0
#: Seconds a node may take to snapshot a sandbox (packing a few GiB of changes).
SNAPSHOT_TIMEOUT_S = 900.0


async def _lines(
    stack: AbstractAsyncContextManager[httpx.Response],
    resp: httpx.Response,
    error_line: Callable[[SandfleetError], bytes],
    last: list[bytes],
) -> AsyncIterator[bytes]:
    """Relay an NDJSON answer as it comes, only ever in whole lines.

    If the node's answer breaks off, the partial line is dropped and
    ``error_line`` of an :class:`Unavailable` ends the stream, so the caller
    reads a reason instead of a truncated line. ``last[0]`` is kept as the last
    complete line relayed. Closing this (the caller went away) closes the
    node's answer, which cancels the work there.
    """
    pending: list[bytes] = []
    try:
        try:
            async for chunk in resp.aiter_raw():
                cut = chunk.rfind(b"\n") + 1
                if not cut:
                    pending.append(chunk)  # a long line: relay it once it is whole
                    continue
                whole = b"".join([*pending, chunk[:cut]])
                pending = [chunk[cut:]] if cut < len(chunk) else []
                start = whole.rfind(b"\n", 0, len(whole) - 1) + 1
                last[:] = [whole[start:]]
                yield whole
        except httpx.HTTPError as exc:
            yield error_line(
                Unavailable(
                    f"the node's answer broke off ({type(exc).__name__}: {exc}); the node or its"
                    " sandbox may have died: retry"
                )
            )
            return
        if pending:
            yield error_line(Unavailable("the node's answer ended in the middle of a line"))
    finally:
        await stack.__aexit__(None, None, None)


def _exec_error_line(exc: SandfleetError) -> bytes:
    return ExecEvent(type="error", error=ErrorInfo(code=exc.code, message=exc.message)).to_line()


def _plain_error_line(exc: SandfleetError) -> bytes:
    return json.dumps(exc.to_wire()).encode() + b"\n"


async def _cp_of(request: Request) -> ControlPlane:
    # async: FastAPI runs a plain-def dependency in a thread, a hop per request.
    cp: ControlPlane = request.app.state.cp
    return cp


# Module level: FastAPI resolves these string annotations in the module's globals.
CP = Annotated[ControlPlane, Depends(_cp_of)]


def _labels(label: list[str]) -> dict[str, str]:
    out = {}
    for item in label:
        key, sep, value = item.partition("=")
        if not sep:
            raise InvalidArgument(f"label filter {item!r} must look like key=value")
        out[key] = value
    return out


def _step(request: Request) -> dict[str, str]:
    """The trajectory step header of a call, to forward to the node (none: not logged)."""
    step = request.headers.get(STEP_HEADER)
    return {} if step is None else {STEP_HEADER: step}


def _replayed(resp: httpx.Response) -> dict[str, str]:
    """The node's "answered from the trajectory log" header, to relay to the caller."""
    return {REPLAYED_HEADER: "1"} if resp.headers.get(REPLAYED_HEADER) == "1" else {}


async def _simple(
    sandbox_id: str,
    method: str,
    suffix: str,
    cp: ControlPlane,
    *,
    node_timeout_s: float | None = None,
    json_body: object = None,
    headers: dict[str, str] | None = None,
    **params: object,
) -> Response:
    """Forward one call and relay the node's answer (body, status) as it is."""
    kw: dict[str, object] = {"params": params}
    if json_body is not None:
        kw["json"] = json_body
    if headers:
        kw["headers"] = headers
    async with cp.forward(sandbox_id, method, suffix, node_timeout_s, **kw) as resp:
        body = await resp.aread()
        return Response(
            body or None,
            status_code=resp.status_code,
            media_type="application/json",
            headers=_replayed(resp),
        )


def _pid(process_id: str) -> str:
    """A process id as one path segment (ids are ``p1``, ``p2``, ...)."""
    return quote(process_id, safe="")


def create_app(
    *,
    db_url: str,
    images_dir: Path,
    node_token: str | None,
    api_token: str | None = None,
    pulls_images: bool = False,
) -> FastAPI:
    """Build the control plane app.

    ``db_url`` is an SQLAlchemy URL (SQLite by default); ``node_token`` is the
    shared secret node agents use; ``api_token``, if set, is required from SDK
    callers.
    """
    registry = CollectorRegistry()
    created = Counter(
        "sandfleet_sandboxes_created", "Sandboxes created", ["kind"], registry=registry
    )
    refusals = Gauge(
        "sandfleet_placement_refusals",
        "Creates a node refused and placement retried elsewhere",
        registry=registry,
    )
    execs = Counter("sandfleet_execs", "Commands run", ["status"], registry=registry)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        cp = ControlPlane(SqlStore(db_url), images_dir, node_token, pulls_images=pulls_images)
        app.state.cp = cp
        refusals.set_function(lambda: cp.refusals)
        cp.start()
        yield
        await cp.close()

    app = FastAPI(title="sandfleet control plane", version="1", lifespan=lifespan)
    install_error_handlers(app)
    api = APIRouter(prefix="/v1", dependencies=[Depends(token_checker(api_token))])
    nodes_api = APIRouter(prefix="/v1/nodes", dependencies=[Depends(token_checker(node_token))])

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    # ---------------------------------------------------------------- nodes
    @nodes_api.post("/register")
    async def register(reg: NodeRegistration, cp: CP) -> NodeRegistered:
        return cp.register_node(reg)

    @nodes_api.post("/{node_id}/heartbeat")
    async def heartbeat(node_id: str, hb: NodeHeartbeat, cp: CP) -> NodeInfo:
        return cp.heartbeat(node_id, hb)

    @api.get("/nodes")
    async def list_nodes(cp: CP) -> dict[str, list[NodeInfo]]:
        return {"nodes": cp.list_nodes()}

    @api.get("/images")
    async def list_images(cp: CP) -> dict[str, list[dict[str, object]]]:
        return {"images": [m.model_dump(mode="json") for m in cp.list_images()]}

    # ---------------------------------------------------------------- sandboxes
    @api.post("/sandboxes", status_code=201)
    async def create(req: CreateSandboxRequest, cp: CP) -> SandboxInfo:
        info = await cp.create(req)
        created.labels(req.kind).inc()
        return info

    @api.get("/sandboxes")
    async def list_sandboxes(
        cp: CP,
        label: Annotated[list[str], Query()] = [],  # noqa: B006 - FastAPI idiom
    ) -> dict[str, list[SandboxInfo]]:
        return {"sandboxes": cp.list(_labels(label))}

    @api.get("/sandboxes/{sandbox_id}")
    async def get(sandbox_id: str, cp: CP) -> SandboxInfo:
        return cp.get(sandbox_id)

    @api.delete("/sandboxes/{sandbox_id}", status_code=204)
    async def destroy(sandbox_id: str, cp: CP) -> Response:
        await cp.destroy(sandbox_id)
        return Response(status_code=204)

    @api.post("/sandboxes/{sandbox_id}/exec")
    async def exec_(sandbox_id: str, req: ExecRequest, cp: CP, request: Request) -> Response:
        async def call() -> tuple[bytes, dict[str, str]]:
            async with cp.forward(
                sandbox_id,
                "POST",
                "/exec",
                timeout_s=req.timeout_s + 5,
                json=req.model_dump(mode="json"),
                headers=_step(request),
            ) as resp:
                return await resp.aread(), _replayed(resp)

        body, replayed = await cancel_on_disconnect(request, call())
        execs.labels(ExecResult.model_validate_json(body).status).inc()
        return Response(body, media_type="application/json", headers=replayed)

    @api.post("/sandboxes/{sandbox_id}/steps/{step}/cancel")
    async def cancel_step(sandbox_id: str, step: int, cp: CP) -> Response:
        # A logged exec outlives its caller's connection (so a preempted caller's
        # successor gets its result); a caller that means to cancel says so here.
        return await _simple(sandbox_id, "POST", f"/steps/{step}/cancel", cp)

    @api.post("/sandboxes/{sandbox_id}/exec/stream")
    async def exec_stream(
        sandbox_id: str, req: ExecRequest, cp: CP, request: Request
    ) -> StreamingResponse:
        # The node answers once the first event exists (so a bad cwd is an HTTP
        # error); until then a caller that goes away cancels the call.
        stack = cp.forward(
            sandbox_id,
            "POST",
            "/exec/stream",
            timeout_s=req.timeout_s + NODE_MARGIN_S,
            json=req.model_dump(mode="json"),
            headers=_step(request),
        )
        resp = await cancel_on_disconnect(request, stack.__aenter__())
        last: list[bytes] = []

        async def body() -> AsyncIterator[bytes]:
            async for piece in _lines(stack, resp, _exec_error_line, last):
                yield piece
            try:
                event = ExecEvent.model_validate_json(last[0]) if last else None
            except ValueError:
                event = None
            if event is not None and event.result is not None:
                execs.labels(event.result.status).inc()

        return StreamingResponse(body(), media_type=NDJSON, headers=_replayed(resp))

    # ---------------------------------------------------------------- processes
    @api.post("/sandboxes/{sandbox_id}/processes", status_code=201, response_model=ProcessInfo)
    async def spawn(sandbox_id: str, req: SpawnRequest, cp: CP, request: Request) -> Response:
        body = req.model_dump(mode="json")
        return await _simple(
            sandbox_id, "POST", "/processes", cp, json_body=body, headers=_step(request)
        )

    @api.get("/sandboxes/{sandbox_id}/processes")
    async def list_processes(sandbox_id: str, cp: CP) -> Response:
        return await _simple(sandbox_id, "GET", "/processes", cp)

    @api.get("/sandboxes/{sandbox_id}/processes/{process_id}", response_model=ProcessInfo)
    async def get_process(sandbox_id: str, process_id: str, cp: CP) -> Response:
        return await _simple(sandbox_id, "GET", f"/processes/{_pid(process_id)}", cp)

    @api.post("/sandboxes/{sandbox_id}/processes/{process_id}/wait", response_model=ProcessInfo)
    async def wait_process(
        sandbox_id: str,
        process_id: str,
        cp: CP,
        request: Request,
        timeout_s: Annotated[float | None, Query(ge=0, le=30 * 86400)] = None,
    ) -> Response:
        params: dict[str, Any] = {} if timeout_s is None else {"timeout_s": timeout_s}
        limit = NO_READ_TIMEOUT if timeout_s is None else timeout_s + NODE_MARGIN_S
        work = _simple(
            sandbox_id,
            "POST",
            f"/processes/{_pid(process_id)}/wait",
            cp,
            node_timeout_s=limit,
            **params,
        )
        return await cancel_on_disconnect(request, work)

    @api.post("/sandboxes/{sandbox_id}/processes/{process_id}/kill", response_model=ProcessInfo)
    async def kill_process(
        sandbox_id: str,
        process_id: str,
        cp: CP,
        request: Request,
        signal: Annotated[int, Query(ge=1, le=64)] = 9,
    ) -> Response:
        path = f"/processes/{_pid(process_id)}/kill"
        return await _simple(sandbox_id, "POST", path, cp, headers=_step(request), signal=signal)

    @api.post("/sandboxes/{sandbox_id}/processes/{process_id}/stdin", status_code=204)
    async def write_stdin(sandbox_id: str, process_id: str, request: Request, cp: CP) -> Response:
        async with cp.forward(
            sandbox_id,
            "POST",
            f"/processes/{_pid(process_id)}/stdin",
            content=request.stream(),
            headers={"content-type": "application/octet-stream", **_step(request)},
            timeout_s=600,
        ) as resp:
            return Response(status_code=204, headers=_replayed(resp))

    @api.post("/sandboxes/{sandbox_id}/processes/{process_id}/stdin/close", status_code=204)
    async def close_stdin(sandbox_id: str, process_id: str, cp: CP, request: Request) -> Response:
        path = f"/processes/{_pid(process_id)}/stdin/close"
        return await _simple(sandbox_id, "POST", path, cp, headers=_step(request))

    @api.get("/sandboxes/{sandbox_id}/processes/{process_id}/output", response_model=OutputChunk)
    async def output(
        sandbox_id: str,
        process_id: str,
        cp: CP,
        stream: Literal["stdout", "stderr"] = "stdout",
        offset: Annotated[int, Query(ge=0)] = 0,
        follow: bool = False,
    ) -> Response:
        path = f"/processes/{_pid(process_id)}/output"
        if not follow:
            return await _simple(sandbox_id, "GET", path, cp, stream=stream, offset=offset)
        stack = cp.forward(
            sandbox_id,
            "GET",
            path,
            timeout_s=NO_READ_TIMEOUT,
            params={"stream": stream, "offset": offset, "follow": "true"},
        )
        resp = await stack.__aenter__()
        lines = _lines(stack, resp, _plain_error_line, [])
        return StreamingResponse(lines, media_type=NDJSON)

    @api.delete("/sandboxes/{sandbox_id}/processes/{process_id}", status_code=204)
    async def remove_process(
        sandbox_id: str, process_id: str, cp: CP, request: Request
    ) -> Response:
        path = f"/processes/{_pid(process_id)}"
        return await _simple(sandbox_id, "DELETE", path, cp, headers=_step(request))

    # ---------------------------------------------------------------- files
    @api.get("/sandboxes/{sandbox_id}/files/content")
    async def download(
        sandbox_id: str, path: str, cp: CP, max_bytes: int | None = None
    ) -> StreamingResponse:
        params: dict[str, str | int] = {"path": path}
        if max_bytes is not None:
            params["max_bytes"] = max_bytes
        stack = cp.forward(sandbox_id, "GET", "/files/content", params=params)
        resp: httpx.Response = await stack.__aenter__()

        async def body() -> AsyncIterator[bytes]:
            try:
                async for chunk in resp.aiter_raw():
                    yield chunk
            finally:
                await stack.__aexit__(None, None, None)

        return StreamingResponse(body(), media_type="application/octet-stream")

    @api.put("/sandboxes/{sandbox_id}/files/content")
    async def upload(
        sandbox_id: str, path: str, request: Request, cp: CP, mode: int = 0o644
    ) -> Response:
        async with cp.forward(
            sandbox_id,
            "PUT",
            "/files/content",
            params={"path": path, "mode": mode},
            content=request.stream(),
            headers=_step(request),
            timeout_s=600,
        ) as resp:
            body = await resp.aread()
            replayed = _replayed(resp)
        return Response(body, media_type="application/json", headers=replayed)

    @api.get("/sandboxes/{sandbox_id}/files/list")
    async def list_dir(sandbox_id: str, path: str, cp: CP) -> Response:
        return await _simple(sandbox_id, "GET", "/files/list", cp, path=path)

    @api.get("/sandboxes/{sandbox_id}/files/stat", response_model=FileEntry)
    async def stat(sandbox_id: str, path: str, cp: CP) -> Response:
        return await _simple(sandbox_id, "GET", "/files/stat", cp, path=path)

    @api.delete("/sandboxes/{sandbox_id}/files", status_code=204)
    async def remove(
        sandbox_id: str, path: str, cp: CP, request: Request, recursive: bool = False
    ) -> Response:
        return await _simple(
            sandbox_id, "DELETE", "/files", cp, headers=_step(request), path=path,
            recursive=recursive,
        )  # fmt: skip

    @api.post("/sandboxes/{sandbox_id}/files/mkdir", response_model=FileEntry)
    async def mkdir(
        sandbox_id: str, path: str, cp: CP, request: Request, parents: bool = True
    ) -> Response:
        return await _simple(
            sandbox_id, "POST", "/files/mkdir", cp, headers=_step(request), path=path,
            parents=parents,
        )  # fmt: skip

    @api.get("/sandboxes/{sandbox_id}/log")
    async def trajectory_log(
        sandbox_id: str,
        cp: CP,
        start: Annotated[int, Query(ge=0)] = 0,
        tail: Annotated[int | None, Query(ge=0)] = None,
    ) -> Response:
        """The sandbox's trajectory log: NDJSON :class:`LogEntry` lines in step order.

        ``start``: only steps >= it; ``tail``: only the last ``tail`` entries.
        """
        params: dict[str, int] = {"start": start}
        if tail is not None:
            params["tail"] = tail
        async with cp.forward(sandbox_id, "GET", "/log", params=params) as resp:
            body = await resp.aread()
        return Response(body, media_type=NDJSON)

    @api.get("/sandboxes/{sandbox_id}/events")
    async def events(sandbox_id: str, cp: CP, since: float = 0.0) -> Response:
        """``{"events": [SandboxEvent]}``: what happened to it outside its commands."""
        return await _simple(sandbox_id, "GET", "/events", cp, since=since)

    # ---------------------------------------------------------------- snapshots
    @api.post("/sandboxes/{sandbox_id}/snapshot", status_code=201, response_model=ImageManifest)
    async def snapshot(sandbox_id: str, req: SnapshotRequest, cp: CP) -> Response:
        # The node packs the layer into the shared image store: the answer is its manifest.
        return await _simple(
            sandbox_id,
            "POST",
            "/snapshot",
            cp,
            node_timeout_s=SNAPSHOT_TIMEOUT_S,
            json_body=req.model_dump(mode="json"),
        )

    # ---------------------------------------------------------------- fncall
    @api.post("/run", response_model=RunResult)
    async def run(request: Request, cp: CP) -> Response:
        # Passed on as bytes: the node validates, and parsing here too would
        # cost as much CPU as the call itself at thousands of calls per second.
        body = await request.body()
        answer = await cancel_on_disconnect(request, cp.run_raw(body))
        return Response(answer, media_type="application/json")

    @api.post("/run/batch")
    async def run_batch(request: Request, cp: CP) -> StreamingResponse:
        # Relayed line by line as the node's calls end; see RunBatchLine.
        body = await request.body()
        stack = cp.run_batch(body)
        resp = await cancel_on_disconnect(request, stack.__aenter__())
        lines = _lines(stack, resp, _plain_error_line, [])
        return StreamingResponse(lines, media_type=NDJSON)

    @api.get("/pools")
    async def list_pools(cp: CP) -> dict[str, list[PoolInfo]]:
        return {"pools": await cp.pools()}

    @api.put("/pools")
    async def configure_pool(config: PoolConfig, cp: CP) -> dict[str, list[PoolInfo]]:
        return {"pools": await cp.configure_pool(config)}

    app.include_router(nodes_api)
    app.include_router(api)
    # pause/resume (one sandbox, or a group by labels) and lifetimes: controlplane/lifetimes.py
    app.include_router(lifecycle_router([Depends(token_checker(api_token))]))
    # SandboxFusion's clients (verl's among them) send no headers: with an API
    # token they use the URL http://<host>/token/<token>/run_code instead.
    app.include_router(fusion.router, dependencies=[Depends(token_checker(api_token))])
    app.include_router(
        fusion.router,
        prefix="/token/{token}",
        dependencies=[Depends(path_token_checker(api_token))],
    )
    return app
