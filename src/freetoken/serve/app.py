"""The FastAPI application: routes, API key, body limit, and errors in each protocol's schema.

No request can take the server down: handler errors become the protocol's 4xx/5xx body, and the
batcher's loop isolates failures per request.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import Response

from freetoken.serve import anthropic_api, metrics, openai_api
from freetoken.serve.errors import ApiError, error_response
from freetoken.serve.state import ServeState

OPEN_PATHS = ("/health", "/metrics")


def create_app(state: ServeState) -> FastAPI:
    app = FastAPI(title="FreeToken", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serve = state
    for module in (openai_api, anthropic_api, metrics):
        app.include_router(module.router)

    @app.middleware("http")
    async def authenticate(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        if state.api_key and request.url.path not in OPEN_PATHS:
            given = request.headers.get("x-api-key") or ""
            auth = request.headers.get("authorization") or ""
            if auth.lower().startswith("bearer "):
                given = given or auth[7:].strip()
            if not hmac.compare_digest(given.encode(), state.api_key.encode()):
                return error_response(request.url.path, 401, "invalid or missing API key")
        return await call_next(request)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> Response:
        return error_response(request.url.path, exc.status, exc.message, exc.param)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        return error_response(request.url.path, exc.status_code, str(exc.detail))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        return error_response(request.url.path, 400, str(exc))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> Response:
        return error_response(request.url.path, 500, f"internal error: {type(exc).__name__}: {exc}")

    return app
