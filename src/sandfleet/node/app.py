"""The node agent's HTTP API, called by the control plane with the cluster token."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, FastAPI, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import StreamingResponse
from pydantic import ValidationError

from sandfleet.fncall.service import FnCallService
from sandfleet.node.lifetimes import ActivityMiddleware, lifecycle_router
from sandfleet.node.registration import heartbeat_forever
from sandfleet.node.service import NodeService
from sandfleet.node.trajectory import Logged, step_of
from sandfleet.wire.errors import FailedPrecondition, InvalidArgument, SandfleetError
from sandfleet.wire.models import (
    ExecRequest,
    ExecResult,
    FileEntry,
    ImageManifest,
    NodeCreateRequest,
    NodeRegistration,
    OutputChunk,
    PoolConfig,
    PoolInfo,
    ProcessInfo,
    RunBatchRequest,
    RunRequest,
    RunResult,
    SandboxEvent,
    SnapshotRequest,
    SpawnRequest,
)
from sandfleet.wire.server import cancel_on_disconnect, install_error_handlers, token_checker

__all__ = ["create_node_app"]

NDJSON = "application/x-ndjson"
Stream = Literal["stdout", "stderr"]


async def _chunk_lines(chunks: AsyncIterator[OutputChunk]) -> AsyncIterator[bytes]:
    """NDJSON lines of ``chunks``; a failure mid-stream ends it with an ``{"error"}`` line."""
    try:
        async for chunk in chunks:
            yield chunk.model_dump_json().encode() + b"\n"
    except SandfleetError as exc:
        yield json.dumps(exc.to_wire()).encode() + b"\n"


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
    ``destroy_on_exit`` destroys every box at shutdown (``sandfleet up``),
    unless the shutdown is the SIGHUP of ``up``'s death; otherwise boxes keep
    running and are adopted by the next node agent.
    """

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await service.recover()
        service.start()
        task = None
        if control_plane and registration:
            task = asyncio.get_running_loop().create_task(
                heartbeat_forever(
                    control_plane,
                    token,
                    registration,
                    service.load,
                    service.ids,
                    disown=service.lifetimes.disown,
                )
            )
        yield
        if task:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        from sandfleet.cli import serve

        # SIGHUP: `sandfleet up` died under us; its next start adopts the boxes.
        orphaned = serve.stopped_by == signal.SIGHUP
        await service.close(destroy_all=destroy_on_exit and not orphaned)

    app = FastAPI(title="sandfleet node agent", version="1", lifespan=lifespan)
    install_error_handlers(app)
    # Calls on a box are activity (idle TTL) and resume it when paused (node/lifetimes.py).
    app.add_middleware(ActivityMiddleware, lifetimes=service.lifetimes, token=token)
    api = APIRouter(prefix="/v1/sandboxes", dependencies=[Depends(token_checker(token))])
    svc = service
    logged = Logged(svc)  # calls with a step header: the trajectory log

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

    @api.post("/{sandbox_id}/exec", response_model=ExecResult)
    async def exec_(sandbox_id: str, req: ExecRequest, request: Request) -> ExecResult | Response:
        if req.max_output_bytes is None:
            raise InvalidArgument(
                "max_output_bytes=None (no cap) is for streamed exec only: an uncapped"
                " capture could fill memory; give a cap or use exec_stream / on_stdout"
            )
        if (step := step_of(request)) is not None:
            # Not cancelled when the caller goes away: see Logged.detached.
            work = logged.exec(sandbox_id, step, req, lambda: svc.exec(sandbox_id, req))
            return await logged.detached(sandbox_id, step, work)
        return await cancel_on_disconnect(request, svc.exec(sandbox_id, req))

    @api.post("/{sandbox_id}/steps/{step}/cancel")
    async def cancel_step(sandbox_id: str, step: int) -> dict[str, str]:
        return {"state": await logged.cancel(sandbox_id, step)}

    @api.post("/{sandbox_id}/exec/stream")
    async def exec_stream(sandbox_id: str, req: ExecRequest, request: Request) -> StreamingResponse:
        # Errors before the first event (bad cwd, unknown user) are HTTP errors, so
        # the answer starts with the first event; a client gone meanwhile cancels it.
        if (step := step_of(request)) is not None:
            return await cancel_on_disconnect(request, logged.exec_stream(sandbox_id, step, req))
        cm = svc.exec_stream(sandbox_id, req)
        events = await cancel_on_disconnect(request, cm.__aenter__())

        async def body() -> AsyncIterator[bytes]:
            try:
                async for event in events:
                    yield event.to_line()
            finally:
                # A client gone mid-stream cancels this body: the command is killed.
                await cm.__aexit__(None, None, None)

        return StreamingResponse(body(), media_type=NDJSON)

    # ---------------------------------------------------------------- processes
    @api.post("/{sandbox_id}/processes", status_code=201, response_model=ProcessInfo)
    async def spawn(sandbox_id: str, req: SpawnRequest, request: Request) -> ProcessInfo | Response:
        if (step := step_of(request)) is not None:
            fields, stored = logged.spawn_fields(req)
            run = lambda: svc.spawn(sandbox_id, req)  # noqa: E731
            return await logged.call(
                sandbox_id, step, "spawn", fields, run, stored=stored, status_code=201
            )
        return await svc.spawn(sandbox_id, req)

    @api.get("/{sandbox_id}/processes")
    async def list_processes(sandbox_id: str) -> dict[str, list[ProcessInfo]]:
        return {"processes": await svc.list_processes(sandbox_id)}

    @api.get("/{sandbox_id}/processes/{process_id}")
    async def get_process(sandbox_id: str, process_id: str) -> ProcessInfo:
        return await svc.get_process(sandbox_id, process_id)

    @api.post("/{sandbox_id}/processes/{process_id}/wait")
    async def wait_process(
        sandbox_id: str,
        process_id: str,
        request: Request,
        timeout_s: Annotated[float | None, Query(ge=0, le=30 * 86400)] = None,
    ) -> ProcessInfo:
        await request.body()  # read (and ignore) any body: the next message is the disconnect
        work = svc.wait_process(sandbox_id, process_id, timeout_s)
        return await cancel_on_disconnect(request, work)

    @api.post("/{sandbox_id}/processes/{process_id}/kill", response_model=ProcessInfo)
    async def kill_process(
        sandbox_id: str,
        process_id: str,
        request: Request,
        signal: Annotated[int, Query(ge=1, le=64)] = 9,
    ) -> ProcessInfo | Response:
        if (step := step_of(request)) is not None:
            fields = {"process_id": process_id, "signal": signal}
            run = lambda: svc.kill_process(sandbox_id, process_id, signal)  # noqa: E731
            return await logged.call(sandbox_id, step, "kill", fields, run)
        return await svc.kill_process(sandbox_id, process_id, signal)

    @api.post("/{sandbox_id}/processes/{process_id}/stdin", status_code=204)
    async def write_stdin(sandbox_id: str, process_id: str, request: Request) -> Response:
        if (step := step_of(request)) is not None:
            return await logged.streamed(
                sandbox_id, step, "stdin", {"process_id": process_id}, request.stream(),
                lambda data: svc.write_stdin(sandbox_id, process_id, data),
                key="data", status_code=204,
            )  # fmt: skip
        await svc.write_stdin(sandbox_id, process_id, request.stream())
        return Response(status_code=204)

    @api.post("/{sandbox_id}/processes/{process_id}/stdin/close", status_code=204)
    async def close_stdin(sandbox_id: str, process_id: str, request: Request) -> Response:
        if (step := step_of(request)) is not None:
            run = lambda: svc.close_stdin(sandbox_id, process_id)  # noqa: E731
            fields = {"process_id": process_id}
            return await logged.call(sandbox_id, step, "close_stdin", fields, run, status_code=204)
        await svc.close_stdin(sandbox_id, process_id)
        return Response(status_code=204)

    @api.get("/{sandbox_id}/processes/{process_id}/output", response_model=None)
    async def output(
        sandbox_id: str,
        process_id: str,
        stream: Stream = "stdout",
        offset: Annotated[int, Query(ge=0)] = 0,
        follow: bool = False,
    ) -> OutputChunk | StreamingResponse:
        if not follow:
            return await svc.read_output(sandbox_id, process_id, stream, offset)
        cm = svc.follow_output(sandbox_id, process_id, stream, offset)
        chunks = await cm.__aenter__()

        async def body() -> AsyncIterator[bytes]:
            try:
                async for line in _chunk_lines(chunks):
                    yield line
            finally:
                await cm.__aexit__(None, None, None)

        return StreamingResponse(body(), media_type=NDJSON)

    @api.delete("/{sandbox_id}/processes/{process_id}", status_code=204)
    async def remove_process(sandbox_id: str, process_id: str, request: Request) -> Response:
        if (step := step_of(request)) is not None:
            run = lambda: svc.remove_process(sandbox_id, process_id)  # noqa: E731
            fields = {"process_id": process_id}
            return await logged.call(
                sandbox_id, step, "remove_process", fields, run, status_code=204
            )
        await svc.remove_process(sandbox_id, process_id)
        return Response(status_code=204)

    # ---------------------------------------------------------------- files
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

    @api.put("/{sandbox_id}/files/content", response_model=FileEntry)
    async def upload(
        sandbox_id: str, path: str, request: Request, mode: int = 0o644
    ) -> FileEntry | Response:
        if (step := step_of(request)) is not None:
            return await logged.streamed(
                sandbox_id, step, "write", {"path": path, "mode": mode}, request.stream(),
                lambda data: svc.write_file(sandbox_id, path, data, mode), key="content",
            )  # fmt: skip
        return await svc.write_file(sandbox_id, path, request.stream(), mode)

    @api.get("/{sandbox_id}/files/list")
    async def list_dir(sandbox_id: str, path: str) -> dict[str, list[FileEntry]]:
        return {"entries": await svc.list_dir(sandbox_id, path)}

    @api.get("/{sandbox_id}/files/stat")
    async def stat(sandbox_id: str, path: str) -> FileEntry:
        return await svc.stat(sandbox_id, path)

    @api.delete("/{sandbox_id}/files", status_code=204)
    async def remove(
        sandbox_id: str, path: str, request: Request, recursive: bool = False
    ) -> Response:
        if (step := step_of(request)) is not None:
            run = lambda: svc.remove(sandbox_id, path, recursive)  # noqa: E731
            fields = {"path": path, "recursive": recursive}
            return await logged.call(sandbox_id, step, "remove", fields, run, status_code=204)
        await svc.remove(sandbox_id, path, recursive)
        return Response(status_code=204)

    @api.post("/{sandbox_id}/files/mkdir", response_model=FileEntry)
    async def mkdir(
        sandbox_id: str, path: str, request: Request, parents: bool = True
    ) -> FileEntry | Response:
        if (step := step_of(request)) is not None:
            run = lambda: svc.mkdir(sandbox_id, path, parents)  # noqa: E731
            fields = {"path": path, "parents": parents}
            return await logged.call(sandbox_id, step, "mkdir", fields, run)
        return await svc.mkdir(sandbox_id, path, parents)

    @api.get("/{sandbox_id}/log")
    async def trajectory_log(
        sandbox_id: str,
        start: Annotated[int, Query(ge=0)] = 0,
        tail: Annotated[int | None, Query(ge=0)] = None,
    ) -> Response:
        """The trajectory log: NDJSON LogEntry lines in step order (node/trajectory.py)."""
        return Response(await logged.export(sandbox_id, start, tail), media_type=NDJSON)

    @api.get("/{sandbox_id}/events")
    async def events(sandbox_id: str, since: float = 0.0) -> dict[str, list[SandboxEvent]]:
        """Events of the box since ``since`` (Unix s): layer data that could not be fetched."""
        return {"events": await svc.events(sandbox_id, since)}

    @api.post("/{sandbox_id}/snapshot", status_code=201)
    async def snapshot(sandbox_id: str, req: SnapshotRequest) -> ImageManifest:
        """Pack the box's writable layer into a new ``diff`` image (images/snapshot.py)."""
        return await svc.snapshot(sandbox_id, req)

    @app.get("/v1/layers/stats", dependencies=[Depends(token_checker(token))])
    async def layer_stats() -> dict[str, Any]:
        """The on-demand daemon's counters: chunks and bytes fetched per source, cache use."""
        return await svc.images.stats()

    app.include_router(api)
    app.include_router(lifecycle_router(svc.lifetimes, token))
    app.include_router(fncall_router(svc, token))
    return app


async def _batch_lines(service: FnCallService, calls: list[dict[str, Any]]) -> AsyncIterator[bytes]:
    """Run every call of a batch at once; one NDJSON line per call as it ends.

    Leaving early (the caller went away) cancels the calls still running.
    """
    done: asyncio.Queue[bytes] = asyncio.Queue()

    async def one(index: int, doc: dict[str, Any]) -> None:
        try:
            try:
                req = RunRequest.model_validate(doc)
            except ValidationError as exc:
                raise InvalidArgument(f"call {index} of the batch is invalid: {exc}") from None
            result = await service.run(req)
            line = b'{"index":%d,"result":%s}\n' % (index, result.model_dump_json().encode())
        except SandfleetError as exc:
            line = json.dumps({"index": index, **exc.to_wire()}).encode() + b"\n"
        except Exception as exc:  # one call's bug must not lose the others' answers
            err = {"code": "INTERNAL", "message": f"internal error: {type(exc).__name__}: {exc}"}
            line = json.dumps({"index": index, "error": err}).encode() + b"\n"
        done.put_nowait(line)

    tasks = [asyncio.ensure_future(one(i, doc)) for i, doc in enumerate(calls)]
    try:
        for _ in tasks:
            yield await done.get()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def fncall_router(svc: NodeService, token: str | None) -> APIRouter:
    """``POST /v1/run``, ``GET/PUT /v1/pools``: the node's fncall pools.

    The run call reads and writes raw JSON: at thousands of calls per second
    FastAPI's own validation and serialization of the same models would
    double the per-call CPU.
    """
    router = APIRouter(prefix="/v1", dependencies=[Depends(token_checker(token))])

    def pools() -> FnCallService:
        if svc.fncall is None:
            raise FailedPrecondition(f"node {svc.node_id} does not offer kind 'fncall'")
        return svc.fncall

    @router.post("/run", response_model=RunResult)
    async def run(request: Request) -> Response:
        try:
            req = RunRequest.model_validate_json(await request.body())
        except ValidationError as exc:
            raise RequestValidationError(exc.errors()) from None
        result = await cancel_on_disconnect(request, pools().run(req))
        return Response(result.model_dump_json(), media_type="application/json")

    @router.post("/run/batch")
    async def run_batch(request: Request) -> StreamingResponse:
        try:
            batch = RunBatchRequest.model_validate_json(await request.body())
        except ValidationError as exc:
            raise RequestValidationError(exc.errors()) from None
        service = pools()
        return StreamingResponse(_batch_lines(service, batch.calls), media_type=NDJSON)

    @router.get("/pools")
    async def list_pools() -> dict[str, list[PoolInfo]]:
        return {"pools": pools().pool_infos()}

    @router.put("/pools")
    async def configure_pool(config: PoolConfig) -> PoolInfo:
        return pools().configure(config)

    return router
