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
import secrets
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import attrs
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from growpage.engine.inputs import encode_prompt, seconds_of
from growpage.engine.outputs import StreamChunk
from growpage.errors import EngineError
from growpage.server.engine_loop import Accepted, EngineLoop, EngineRequest, Event
from growpage.server.metrics import CONTENT_TYPE, ServerMetrics
from growpage.server.protocol import (
    COMPLETIONS_MAX_TOKENS,
    DONE,
    ChatCompletionRequest,
    CompletionRequest,
    ServerError,
    chat_body,
    chat_chunk,
    completion_body,
    now_s,
    sse,
    usage,
)
from growpage.validators import Check, non_empty_str, optional, positive_int

if TYPE_CHECKING:
    from growpage.engine.llm import LLM

_DISCONNECTED = object()  # put in a request's event queue when its client goes away
_seconds = Check("a finite number of seconds >= 0", lambda v: seconds_of(v) is not None)


@attrs.frozen(kw_only=True)
class ServerConfig:
    """Settings of the HTTP face (the engine's are the ``LLM``'s).

    Attributes:
        model_name: the name clients pass as ``model`` (``/v1/models`` lists it).
        max_waiting: most requests queued for admission; one more gets a 429 (None: no limit).
        default_max_tokens: ``max_tokens`` of a chat request that gives none (a completion
            request's default is OpenAI's, 16); generation also ends at the model's context.
        shutdown_timeout_s: on SIGTERM, how long requests in flight may run on before they are
            aborted (``growpage serve``).
    """

    model_name: str = attrs.field(validator=non_empty_str)
    max_waiting: int | None = attrs.field(default=256, validator=optional(positive_int))
    default_max_tokens: int = attrs.field(default=512, validator=positive_int)
    shutdown_timeout_s: float = attrs.field(default=30.0, validator=_seconds)


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
    serve = _Handlers(llm, loop, config, app)

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


def _error_response(error: ServerError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ServerError)
    async def server_error(request: Request, exc: ServerError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def bad_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error_response(_validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error_response(ServerError(exc.status_code, str(exc.detail), type=kind))


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


class _Handlers:
    """The route functions, over one engine loop."""

    def __init__(self, llm: LLM, loop: EngineLoop, config: ServerConfig, app: FastAPI) -> None:
        self.llm, self.loop, self.config, self.app = llm, loop, config, app
        self.max_position = llm.model.config.max_position
        self.created = now_s()

    async def health(self) -> JSONResponse:
        if self.app.state.draining or not self.loop.is_alive:
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def metrics(self) -> Response:
        return Response(self.app.state.metrics.render(), media_type=CONTENT_TYPE)

    async def models(self) -> JSONResponse:
        card = {
            "id": self.config.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "growpage",
            "max_model_len": self.max_position,
            "vocab_size": self.llm.model.config.vocab_size,  # for token-id prompts
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        self._check(body)
        body.check_supported()
        prompt = body.single_prompt()
        try:
            ids, text = encode_prompt(prompt, self.llm.tokenizer, chat=False)
        except EngineError as exc:
            raise ServerError(400, str(exc), param="prompt") from None
        return await self._serve(request, body, "cmpl", ids, text, COMPLETIONS_MAX_TOKENS)

    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
        self._check(body)
        body.check_supported()
        messages = [m.as_template_message() for m in body.messages]
        try:
            ids = self.llm.tokenizer.encode_chat(messages)
        except EngineError as exc:  # no chat template
            raise ServerError(400, str(exc), param="messages") from None
        except Exception as exc:  # noqa: BLE001 - the template raised (jinja2 errors)
            raise ServerError(
                400, f"the chat template refused the messages: {exc}", param="messages"
            ) from None
        return await self._serve(
            request, body, "chatcmpl", ids, None, self.config.default_max_tokens
        )

    def _check(self, body: CompletionRequest | ChatCompletionRequest) -> None:
        if self.app.state.draining:
            raise ServerError(
                503, "the server is shutting down", type="server_error", code="shutting_down"
            )
        if body.model != self.config.model_name:
            raise ServerError(
                404,
                f"the model {body.model!r} does not exist; this server serves "
                f"{self.config.model_name!r}",
                param="model",
                code="model_not_found",
            )

    async def _serve(
        self,
        request: Request,
        body: CompletionRequest | ChatCompletionRequest,
        kind: str,
        ids: list[int],
        text: str | None,
        default_max_tokens: int,
    ) -> Response:
        arrival = time.perf_counter()
        prompt_param = "messages" if kind == "chatcmpl" else "prompt"
        if len(ids) >= self.max_position:
            raise ServerError(
                400,
                f"the prompt has {len(ids)} tokens; the model's context of "
                f"{self.max_position} tokens leaves no room to generate",
                param=prompt_param,
                code="context_length_exceeded",
            )
        params = body.sampling_params(min(default_max_tokens, self.max_position - len(ids)))
        request_id = request.headers.get("x-request-id") or f"{kind}-{secrets.token_hex(12)}"
        events: asyncio.Queue[Any] = asyncio.Queue()
        event_loop = asyncio.get_running_loop()

        def sink(event: Event) -> None:
            with contextlib.suppress(RuntimeError):  # the event loop has closed
                event_loop.call_soon_threadsafe(events.put_nowait, event)

        def disconnected() -> None:  # aborts even a stream whose body never started
            self.loop.abort(request_id)
            events.put_nowait(_DISCONNECTED)

        self.loop.submit(EngineRequest(request_id, ids, params, text, arrival, prompt_param), sink)
        watcher = asyncio.create_task(_watch_disconnect(request, disconnected))
        try:
            first = await events.get()
        except BaseException:
            watcher.cancel()
            self.loop.abort(request_id)
            raise
        if first is _DISCONNECTED:
            return Response(status_code=499)  # nobody reads it
        if isinstance(first, ServerError):
            watcher.cancel()
            return _error_response(first)
        assert isinstance(first, Accepted)
        reply = _Reply(request_id, kind, self.config.model_name, first.num_prompt_tokens)
        if body.stream:
            stream = self._stream(request_id, events, watcher, reply, body.include_usage())
            return StreamingResponse(stream, media_type="text/event-stream")
        return await self._collect(request_id, events, watcher, reply)

    async def _collect(
        self, request_id: str, events: asyncio.Queue, watcher: asyncio.Task, reply: _Reply
    ) -> Response:
        finished = False
        try:
            while True:
                event = await events.get()
                if event is _DISCONNECTED:
                    return Response(status_code=499)
                if isinstance(event, ServerError):
                    finished = True
                    return _error_response(event)
                if event.output is not None:
                    finished = True
                    if event.output.finish_reason == "abort":
                        raise ServerError(
                            503,
                            "the request was aborted: the server is shutting down",
                            type="server_error",
                            code="shutting_down",
                        )
                    return JSONResponse(reply.whole(event))
        finally:
            watcher.cancel()
            if not finished:
                self.loop.abort(request_id)

    async def _stream(
        self,
        request_id: str,
        events: asyncio.Queue,
        watcher: asyncio.Task,
        reply: _Reply,
        include_usage: bool,
    ) -> AsyncIterator[str]:
        finished = False
        try:
            yield from_lines(reply.opening())
            while not finished:
                event = await events.get()
                if event is _DISCONNECTED:
                    return
                if isinstance(event, ServerError):
                    finished = True
                    yield sse(event.body())
                    break
                finished = event.output is not None
                yield from_lines(reply.chunk(event))
            if include_usage and finished:
                yield sse(reply.usage_chunk())
            yield DONE
        finally:
            watcher.cancel()
            if not finished:
                self.loop.abort(request_id)


def from_lines(events: list[dict[str, Any]]) -> str:
    return "".join(sse(e) for e in events)


async def _watch_disconnect(request: Request, on_disconnect: Callable[[], None]) -> None:
    """Call ``on_disconnect`` when the client goes away (the body has been read, so the next
    ASGI message is the disconnect; the server sends it too once the response is complete,
    by when this task has been cancelled)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            on_disconnect()
            return


@attrs.define
class _Reply:
    """Builds one request's response bodies (``kind``: ``cmpl`` or ``chatcmpl``)."""

    request_id: str
    kind: str
    model: str
    num_prompt_tokens: int
    created: int = attrs.field(factory=now_s)
    num_tokens: int = 0

    @property
    def is_chat(self) -> bool:
        return self.kind == "chatcmpl"

    def _usage(self) -> dict[str, int]:
        return usage(self.num_prompt_tokens, self.num_tokens)

    def whole(self, last: StreamChunk) -> dict[str, Any]:
        """The non-streamed response, from the request's last chunk."""
        assert last.output is not None
        out = last.output
        self.num_tokens = len(out.token_ids)
        build: Callable[..., dict[str, Any]] = chat_body if self.is_chat else completion_body
        return build(
            self.request_id, self.created, self.model, out.text, out.finish_reason, self._usage()
        )

    def opening(self) -> list[dict[str, Any]]:
        """A chat stream opens with the assistant's role."""
        if not self.is_chat:
            return []
        delta = {"role": "assistant", "content": ""}
        return [chat_chunk(self.request_id, self.created, self.model, delta)]

    def chunk(self, chunk: StreamChunk) -> list[dict[str, Any]]:
        """The events of one engine chunk: its text, and on the last one the finish reason."""
        self.num_tokens += len(chunk.token_ids)
        reason = None if chunk.output is None else chunk.output.finish_reason
        if self.is_chat:
            bodies = []
            if chunk.text:
                delta = {"content": chunk.text}
                bodies.append(chat_chunk(self.request_id, self.created, self.model, delta))
            if reason is not None:
                bodies.append(chat_chunk(self.request_id, self.created, self.model, {}, reason))
            return bodies
        if not chunk.text and reason is None:
            return []
        return [
            completion_body(
                self.request_id, self.created, self.model, chunk.text, reason, None, chunk=True
            )
        ]

    def usage_chunk(self) -> dict[str, Any]:
        if self.is_chat:
            return chat_chunk(self.request_id, self.created, self.model, None, None, self._usage())
        return completion_body(
            self.request_id, self.created, self.model, "", None, self._usage(), chunk=True
        )
