"""Server-side halves of the wire contract, shared by the control plane and node agent.

Every :class:`SandfleetError` becomes ``{"error": {"code", "message"}}`` with
its HTTP status; request validation failures become INVALID_ARGUMENT naming the
field; anything else is INTERNAL (logged, never a stack trace on the wire).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from sandfleet.wire.errors import (
    Internal,
    InvalidArgument,
    NotFound,
    SandfleetError,
    Unauthenticated,
)

__all__ = ["cancel_on_disconnect", "install_error_handlers", "token_checker"]

T = TypeVar("T")

log = logging.getLogger("sandfleet")


def install_error_handlers(app: FastAPI) -> None:
    """Map errors to wire bodies on ``app``."""

    @app.exception_handler(SandfleetError)
    async def _sandfleet(_: Request, exc: SandfleetError) -> JSONResponse:
        return JSONResponse(exc.to_wire(), status_code=exc.http_status)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        parts = []
        for err in exc.errors():
            where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
            parts.append(f"{where}: {err.get('msg')}")
        e = InvalidArgument("invalid request: " + "; ".join(parts))
        return JSONResponse(e.to_wire(), status_code=e.http_status)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Unknown routes and methods answer in the same format as everything else.
        e: SandfleetError
        if exc.status_code == 404:
            e = NotFound(f"no such endpoint: {request.method} {request.url.path}")
        elif exc.status_code == 405:
            e = InvalidArgument(f"{request.method} is not allowed on {request.url.path}")
        else:
            e = Internal(f"HTTP {exc.status_code}: {exc.detail}")
        return JSONResponse(e.to_wire(), status_code=exc.status_code)

    @app.exception_handler(ClientDisconnect)
    async def _gone(_: Request, __: ClientDisconnect) -> Response:
        # The caller went away while its request was read: nobody to answer, nothing
        # to log (a cancelled call, a killed driver).
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        e = Internal(f"internal error: {type(exc).__name__}: {exc}")
        return JSONResponse(e.to_wire(), status_code=e.http_status)


def token_checker(token: str | None) -> Callable[[Request], Coroutine[Any, Any, None]]:
    """A FastAPI dependency requiring ``Authorization: Bearer <token>`` (no-op if None)."""

    async def check(request: Request) -> None:
        if token is None:
            return
        got = request.headers.get("authorization", "")
        if not hmac.compare_digest(got.encode(), f"Bearer {token}".encode()):
            raise Unauthenticated(
                "missing or wrong token: send 'Authorization: Bearer <token>' with the"
                " cluster's token (SANDFLEET_TOKEN)"
            )

    return check


def path_token_checker(token: str | None) -> Callable[[Request], Coroutine[Any, Any, None]]:
    """Like :func:`token_checker`, for clients that cannot send headers: the token is
    the ``{token}`` path parameter. With no token configured, any value passes."""

    async def check(request: Request) -> None:
        if token is None:
            return
        got = str(request.path_params.get("token", ""))
        if not hmac.compare_digest(got.encode(), token.encode()):
            raise Unauthenticated("wrong token in the URL: use /token/<the API token>/...")

    return check


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``, cancelling it if the HTTP client goes away first.

    A caller that gives up (cancels its task, times out, dies) closes its
    connection; without this the command would run on to its own timeout. The
    request body must already have been read: the next message is then the
    disconnect.
    """
    task = asyncio.ensure_future(work)
    gone = False

    async def watch() -> None:
        nonlocal gone
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                gone = True
                task.cancel()
                return

    watcher = asyncio.ensure_future(watch())
    try:
        return await task
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if gone and not (current is not None and current.cancelling()):
            raise ClientDisconnect() from None  # answered quietly (499), not a traceback
        raise
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
