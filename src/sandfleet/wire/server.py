"""Server-side halves of the wire contract, shared by the control plane and node agent.

Every :class:`SandfleetError` becomes ``{"error": {"code", "message"}}`` with
its HTTP status; request validation failures become INVALID_ARGUMENT naming the
field; anything else is INTERNAL (logged, never a stack trace on the wire).
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from sandfleet.wire.errors import Internal, InvalidArgument, SandfleetError, Unauthenticated

__all__ = ["install_error_handlers", "token_checker"]

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
