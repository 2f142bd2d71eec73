"""The route functions behind ``create_app``: one request from its body to the engine loop and
back, whole or streamed as server-sent events, and a client that goes away aborted."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from growpage.engine.inputs import encode_prompt
from growpage.errors import EngineError
from growpage.server.config import ServerConfig
from growpage.server.engine_loop import Accepted, EngineLoop, EngineRequest, Event
from growpage.server.metrics import CONTENT_TYPE
from growpage.server.protocol import (
    COMPLETIONS_MAX_TOKENS,
    DONE,
    Reply,
    ServerError,
    from_lines,
    now_s,
    sse,
)
from growpage.server.request_models import ChatCompletionRequest, CompletionRequest

if TYPE_CHECKING:
    from growpage.engine.llm import LLM

_DISCONNECTED = object()  # put in a request's event queue when its client goes away


def error_response(error: ServerError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


class Handlers:
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
            return error_response(first)
        assert isinstance(first, Accepted)
        reply = Reply(request_id, kind, self.config.model_name, first.num_prompt_tokens)
        if body.stream:
            stream = self._stream(request_id, events, watcher, reply, body.include_usage())
            return StreamingResponse(stream, media_type="text/event-stream")
        return await self._collect(request_id, events, watcher, reply)

    async def _collect(
        self, request_id: str, events: asyncio.Queue, watcher: asyncio.Task, reply: Reply
    ) -> Response:
        finished = False
        try:
            while True:
                event = await events.get()
                if event is _DISCONNECTED:
                    return Response(status_code=499)
                if isinstance(event, ServerError):
                    finished = True
                    return error_response(event)
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
        reply: Reply,
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


async def _watch_disconnect(request: Request, on_disconnect: Callable[[], None]) -> None:
    """Call ``on_disconnect`` when the client goes away (the body has been read, so the next
    ASGI message is the disconnect; the server sends it too once the response is complete,
    by when this task has been cancelled)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            on_disconnect()
            return
