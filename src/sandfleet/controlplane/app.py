"""The control plane's HTTP API (``/v1``; OpenAPI at ``/openapi.json``)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated

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

from sandfleet.controlplane.service import ControlPlane
from sandfleet.controlplane.store import SqlStore
from sandfleet.wire.errors import InvalidArgument
from sandfleet.wire.models import (
    CreateSandboxRequest,
    ExecRequest,
    ExecResult,
    FileEntry,
    NodeHeartbeat,
    NodeInfo,
    NodeRegistration,
    SandboxInfo,
)
from sandfleet.wire.server import cancel_on_disconnect, install_error_handlers, token_checker

__all__ = ["create_app"]


def _cp_of(request: Request) -> ControlPlane:
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


def create_app(
    *, db_url: str, images_dir: Path, node_token: str | None, api_token: str | None = None
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
        cp = ControlPlane(SqlStore(db_url), images_dir, node_token)
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
    async def register(reg: NodeRegistration, cp: CP) -> NodeInfo:
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
        async def call() -> bytes:
            async with cp.forward(
                sandbox_id,
                "POST",
                "/exec",
                timeout_s=req.timeout_s + 5,
                json=req.model_dump(mode="json"),
            ) as resp:
                return await resp.aread()

        body = await cancel_on_disconnect(request, call())
        execs.labels(ExecResult.model_validate_json(body).status).inc()
        return Response(body, media_type="application/json")

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
            timeout_s=600,
        ) as resp:
            body = await resp.aread()
        return Response(body, media_type="application/json")

    async def _simple(
        sandbox_id: str, method: str, suffix: str, cp: ControlPlane, **params: object
    ) -> Response:
        async with cp.forward(sandbox_id, method, suffix, params=params) as resp:
            body = await resp.aread()
            return Response(
                body or None, status_code=resp.status_code, media_type="application/json"
            )

    @api.get("/sandboxes/{sandbox_id}/files/list")
    async def list_dir(sandbox_id: str, path: str, cp: CP) -> Response:
        return await _simple(sandbox_id, "GET", "/files/list", cp, path=path)

    @api.get("/sandboxes/{sandbox_id}/files/stat", response_model=FileEntry)
    async def stat(sandbox_id: str, path: str, cp: CP) -> Response:
        return await _simple(sandbox_id, "GET", "/files/stat", cp, path=path)

    @api.delete("/sandboxes/{sandbox_id}/files", status_code=204)
    async def remove(sandbox_id: str, path: str, cp: CP, recursive: bool = False) -> Response:
        return await _simple(sandbox_id, "DELETE", "/files", cp, path=path, recursive=recursive)

    @api.post("/sandboxes/{sandbox_id}/files/mkdir", response_model=FileEntry)
    async def mkdir(sandbox_id: str, path: str, cp: CP, parents: bool = True) -> Response:
        return await _simple(sandbox_id, "POST", "/files/mkdir", cp, path=path, parents=parents)

    app.include_router(nodes_api)
    app.include_router(api)
    return app
