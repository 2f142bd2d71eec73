"""The OpenAI wire format's replies: response and chunk bodies, server-sent events and error
bodies (the request bodies are in ``growpage.server.request_models``)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import attrs

from growpage.engine.outputs import StreamChunk

DONE = "data: [DONE]\n\n"  # the last server-sent event of a stream
COMPLETIONS_MAX_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions


class ServerError(Exception):
    """An error answered with ``status`` and an OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type,
            param,
            code,
        )

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def internal_error(message: str) -> ServerError:
    return ServerError(500, message, type="server_error", code="internal_error")


def usage(num_prompt_tokens: int, num_completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_completion_tokens,
        "total_tokens": num_prompt_tokens + num_completion_tokens,
    }


def now_s() -> int:
    """``created``: Unix seconds."""
    return int(time.time())


def completion_body(
    request_id: str,
    created: int,
    model: str,
    text: str,
    finish_reason: str | None,
    usage_: dict[str, int] | None,
    chunk: bool = False,
) -> dict[str, Any]:
    """A ``text_completion`` (``chunk``: one of its stream's chunks, ``usage_`` on the last
    one only, with no choice)."""
    choices = [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]
    body: dict[str, Any] = {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [] if chunk and usage_ is not None else choices,
    }
    if usage_ is not None:
        body["usage"] = usage_
    return body


def chat_body(
    request_id: str,
    created: int,
    model: str,
    text: str,
    finish_reason: str | None,
    usage_: dict[str, int],
) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish_reason,
            }
        ],
        "usage": usage_,
    }


def chat_chunk(
    request_id: str,
    created: int,
    model: str,
    delta: dict[str, str] | None,
    finish_reason: str | None = None,
    usage_: dict[str, int] | None = None,
) -> dict[str, Any]:
    """A ``chat.completion.chunk``; ``delta`` None: the usage chunk (no choice)."""
    body: dict[str, Any] = {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": []
        if delta is None
        else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
    }
    if usage_ is not None:
        body["usage"] = usage_
    return body


def sse(body: dict[str, Any]) -> str:
    """One server-sent event holding ``body`` as JSON."""
    return f"data: {json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n\n"


def from_lines(events: list[dict[str, Any]]) -> str:
    """The server-sent events of ``events``, one after another."""
    return "".join(sse(e) for e in events)


@attrs.define
class Reply:
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
