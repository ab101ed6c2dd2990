"""The FastAPI application: routes, the request guard, CORS, and errors in each protocol's schema.

No request can take the server down: handler errors become the protocol's 4xx/5xx body, and the
batcher's loop isolates failures per request.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import Response

from freetoken.serve import anthropic_api, metrics, openai_api
from freetoken.serve.errors import ApiError, error_response
from freetoken.serve.guard import RequestGuard
from freetoken.serve.state import ServeState

log = logging.getLogger("freetoken.serve")


def create_app(state: ServeState) -> FastAPI:
    app = FastAPI(title="FreeToken", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serve = state
    for module in (openai_api, anthropic_api, metrics):
        app.include_router(module.router)
    app.add_middleware(RequestGuard, state=state)
    if state.config.cors_origins:  # added last: outermost, so preflights are answered before the guard
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(state.config.cors_origins),
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["authorization", "x-api-key", "content-type", "anthropic-version"],
        )

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> Response:
        return error_response(request.url.path, exc.status, exc.message, exc.param, exc.code)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        return error_response(request.url.path, exc.status_code, str(exc.detail))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        return error_response(request.url.path, 400, str(exc))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s", request.url.path)
        return error_response(request.url.path, 500, f"internal error: {type(exc).__name__}: {exc}")

    return app
