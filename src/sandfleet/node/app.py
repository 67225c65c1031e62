"""The node agent's HTTP API, called by the control plane with the cluster token."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request, Response
from fastapi.responses import StreamingResponse

from sandfleet.node.registration import heartbeat_forever
from sandfleet.node.service import NodeService
from sandfleet.wire.models import (
    ExecRequest,
    ExecResult,
    FileEntry,
    NodeCreateRequest,
    NodeRegistration,
)
from sandfleet.wire.server import cancel_on_disconnect, install_error_handlers, token_checker

__all__ = ["create_node_app"]


def create_node_app(
    service: NodeService,
    *,
    token: str | None,
    control_plane: str | None = None,
    registration: NodeRegistration | None = None,
    destroy_on_exit: bool = False,
) -> FastAPI:
    """The node agent app around ``service``.

    With ``control_plane`` and ``registration`` it registers and heartbeats.
    ``destroy_on_exit`` destroys every box at shutdown (``sandfleet up``);
    otherwise boxes keep running and are adopted by the next node agent.
    """

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await service.recover()
        task = None
        if control_plane and registration:
            task = asyncio.get_running_loop().create_task(
                heartbeat_forever(control_plane, token, registration, service.load, service.ids)
            )
        yield
        if task:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await service.close(destroy_all=destroy_on_exit)

    app = FastAPI(title="sandfleet node agent", version="1", lifespan=lifespan)
    install_error_handlers(app)
    api = APIRouter(prefix="/v1/sandboxes", dependencies=[Depends(token_checker(token))])
    svc = service

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        return {"status": "ok", "node_id": svc.node_id, "load": svc.load().model_dump()}

    @api.post("", status_code=201)
    async def create(req: NodeCreateRequest) -> dict[str, Any]:
        await svc.create(req)
        return {"id": req.id, "load": svc.load().model_dump()}

    @api.get("")
    async def list_boxes() -> dict[str, list[str]]:
        return {"ids": svc.ids()}

    @api.delete("/{sandbox_id}", status_code=204)
    async def destroy(sandbox_id: str) -> Response:
        await svc.destroy(sandbox_id)
        return Response(status_code=204)

    @api.post("/{sandbox_id}/exec")
    async def exec_(sandbox_id: str, req: ExecRequest, request: Request) -> ExecResult:
        return await cancel_on_disconnect(request, svc.exec(sandbox_id, req))

    @api.get("/{sandbox_id}/files/content")
    async def download(
        sandbox_id: str, path: str, max_bytes: int | None = None
    ) -> StreamingResponse:
        cm = svc.read_file(sandbox_id, path, max_bytes)
        chunks = await cm.__aenter__()

        async def body() -> AsyncIterator[bytes]:
            try:
                async for chunk in chunks:
                    yield chunk
            finally:
                await cm.__aexit__(None, None, None)

        return StreamingResponse(body(), media_type="application/octet-stream")

    @api.put("/{sandbox_id}/files/content")
    async def upload(sandbox_id: str, path: str, request: Request, mode: int = 0o644) -> FileEntry:
        return await svc.write_file(sandbox_id, path, request.stream(), mode)

    @api.get("/{sandbox_id}/files/list")
    async def list_dir(sandbox_id: str, path: str) -> dict[str, list[FileEntry]]:
        return {"entries": await svc.list_dir(sandbox_id, path)}

    @api.get("/{sandbox_id}/files/stat")
    async def stat(sandbox_id: str, path: str) -> FileEntry:
        return await svc.stat(sandbox_id, path)

    @api.delete("/{sandbox_id}/files", status_code=204)
    async def remove(sandbox_id: str, path: str, recursive: bool = False) -> Response:
        await svc.remove(sandbox_id, path, recursive)
        return Response(status_code=204)

    @api.post("/{sandbox_id}/files/mkdir")
    async def mkdir(sandbox_id: str, path: str, parents: bool = True) -> FileEntry:
        return await svc.mkdir(sandbox_id, path, parents)

    app.include_router(api)
    return app
