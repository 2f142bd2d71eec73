"""The routes: an OpenAI-compatible face over one ``LLM`` (FastAPI).

::

    GET  /health                 200 {"status": "ok"}; 503 while shutting down
    GET  /metrics                Prometheus text (growpage.server.metrics)
    GET  /v1/models              the one served model
    POST /v1/completions         prompt (text or token ids) -> text; "stream": true for SSE
    POST /v1/chat/completions    messages through the chat template -> assistant message

Every error is an OpenAI error body ``{"error": {"message", "type", "param", "code"}}``: 400 for
a bad body (bad JSON included), 404 for an unknown model, 429 when the queue is full, 500 when
the request failed in the engine (a policy error), 503 while shutting down. A streamed request
that fails after its first chunk ends with an error event instead (the status is sent).

A client that disconnects aborts its request: its pages go back to the pool.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from growpage.errors import EngineError
from growpage.server.config import ServerConfig
from growpage.server.engine_loop import EngineLoop
from growpage.server.handlers import Handlers, error_response
from growpage.server.metrics import ServerMetrics
from growpage.server.protocol import ServerError

__all__ = ["ServerConfig", "begin_draining", "create_app"]

if TYPE_CHECKING:
    from growpage.engine.llm import LLM


def create_app(llm: LLM, config: ServerConfig) -> FastAPI:
    """The ASGI app serving ``llm``; its lifespan starts and stops the engine thread.

    The app owns ``llm`` while it runs: nothing else may call it. ``app.state.engine_loop``
    is the ``EngineLoop``; ``begin_draining(app)`` makes new requests get a 503.
    """
    if llm.tokenizer is None:
        raise EngineError("the server needs a model with a tokenizer")
    holder: dict[str, EngineLoop] = {}
    metrics = ServerMetrics(lambda: holder["loop"].snapshot)
    loop = EngineLoop(llm, config.max_waiting, metrics)
    holder["loop"] = loop

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loop.start()
        try:
            yield
        finally:
            await asyncio.to_thread(loop.stop)

    app = FastAPI(title="growpage", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.engine_loop, app.state.config, app.state.draining = loop, config, False
    app.state.metrics = metrics
    _add_error_handlers(app)
    serve = Handlers(llm, loop, config, app)

    app.get("/health")(serve.health)
    app.get("/metrics")(serve.metrics)
    app.get("/v1/models")(serve.models)
    app.post("/v1/completions")(serve.completions)
    app.post("/v1/chat/completions")(serve.chat_completions)
    return app


def begin_draining(app: FastAPI) -> None:
    """From now on new requests get a 503, and the requests in flight have
    ``shutdown_timeout_s`` seconds to finish before they are aborted (``growpage serve`` calls
    it on SIGTERM). Safe in a signal handler."""
    if not app.state.draining:
        app.state.draining = True
        app.state.engine_loop.drain(app.state.config.shutdown_timeout_s)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ServerError)
    async def server_error(request: Request, exc: ServerError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def bad_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(_validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(ServerError(exc.status_code, str(exc.detail), type=kind))


def _validation_error(exc: RequestValidationError) -> ServerError:
    """The first problem of a body FastAPI refused, as OpenAI words it."""
    errors = exc.errors()
    first: dict[str, Any] = dict(errors[0]) if errors else {"loc": (), "msg": "invalid request"}
    if first.get("type") == "json_invalid":
        reason = (first.get("ctx") or {}).get("error", "parse error")
        return ServerError(400, f"the body is not valid JSON ({reason})", code="invalid_json")
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    param = ".".join(loc) or None
    if param is None:
        return ServerError(400, f"the body must be a JSON object: {first['msg']}")
    given = f" (got {first['input']!r:.80})" if "input" in first and loc else ""
    more = f"; {len(errors) - 1} more problem(s)" if len(errors) > 1 else ""
    return ServerError(400, f"Invalid '{param}': {first['msg']}{given}{more}", param=param)
