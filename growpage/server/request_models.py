"""The OpenAI request bodies the server reads (pydantic).

Only what the server serves is modelled: ``/v1/completions`` and ``/v1/chat/completions`` with
``n = 1``. Fields the engine cannot honour (``logprobs``, ``echo``, penalties, tools...) are
refused with a 400 when set to anything but their default; fields the format has and that do
not change the output (``user``, ``metadata``...) are accepted and ignored.

The request models are strict where the format is typed: an integer is a JSON integer (not
``5.0``, ``"5"`` or ``true``), a boolean a JSON boolean, a token id an integer; a number may be
an integer. Text must be valid Unicode (JSON can escape a lone surrogate, UTF-8 cannot encode
it). A field that may hold one of several shapes (``prompt``, ``stop``, ``content``) fails with
one message naming the shapes, under the field's name.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    field_validator,
)
from pydantic_core import PydanticCustomError

from growpage.engine.sampling_params import SamplingParams
from growpage.errors import EngineError
from growpage.server.protocol import ServerError
from growpage.validators import lone_surrogate

MAX_STOPS = 4  # OpenAI's limit on stop sequences


def _valid_unicode(text: str) -> str:
    """``text``, or a validation error naming its first lone surrogate."""
    problem = lone_surrogate(text)
    if problem is not None:
        raise PydanticCustomError(
            "invalid_unicode", "not valid Unicode text: {problem}", {"problem": problem}
        )
    return text


def _one_of(shapes: str) -> WrapValidator:
    """A union field's errors as one, ``expected {shapes}`` (a member's text that is not valid
    Unicode keeps its own, more precise, message)."""

    def validate(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(value)
        except ValidationError as exc:
            for error in exc.errors():
                if error["type"] == "invalid_unicode":
                    raise PydanticCustomError(
                        "invalid_unicode", "{reason}", {"reason": error["msg"]}
                    ) from None
            raise PydanticCustomError(
                "invalid_type", "expected {shapes}", {"shapes": shapes}
            ) from None

    return WrapValidator(validate)


Text = Annotated[str, AfterValidator(_valid_unicode)]


class _Body(BaseModel):
    """A JSON object of a request: strict types, unknown fields ignored."""

    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class _GenerationRequest(_Body):
    """Fields both endpoints share. ``ignore_eos`` is an extension (as vLLM's)."""

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)
    stop: Annotated[Text | list[Text] | None, _one_of("a string or a list of strings")] = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    def check_supported(self) -> None:
        """``ServerError`` 400 for what the engine cannot do."""
        if self.n != 1:
            raise ServerError(400, f"only n = 1 is supported, got n = {self.n}", param="n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise ServerError(400, f"{name} is not supported (leave it 0)", param=name)
        if self.logit_bias:
            raise ServerError(400, "logit_bias is not supported", param="logit_bias")
        stops = self.stop_list()
        if len(stops) > MAX_STOPS:
            raise ServerError(
                400, f"at most {MAX_STOPS} stop sequences, got {len(stops)}", param="stop"
            )
        if any(not s for s in stops):
            raise ServerError(400, "stop sequences must be non-empty strings", param="stop")

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """The engine's ``SamplingParams``; ``max_tokens`` when the body gives none. OpenAI's
        defaults: temperature 1, top_p 1."""
        try:
            return SamplingParams(
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                max_tokens=self.requested_max_tokens() or max_tokens,
                seed=self.seed,
                stop=self.stop_list(),
                ignore_eos=self.ignore_eos,
            )
        except EngineError as exc:  # "SamplingParams.top_p must be a number in (0, 1], got 0"
            field = str(exc).removeprefix("SamplingParams.").split(" ", 1)[0]
            raise ServerError(400, str(exc), param=field) from None


class CompletionRequest(_GenerationRequest):
    """``POST /v1/completions``: one prompt, text or token ids."""

    prompt: Annotated[
        Text | list[Text] | list[int] | list[list[int]],
        _one_of("a string or a list of token ids (integers), or a list holding one of those"),
    ]
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        for name, default in (("echo", False), ("logprobs", None), ("suffix", None)):
            if getattr(self, name) != default:
                raise ServerError(400, f"{name} is not supported", param=name)
        if self.best_of not in (None, 1):
            raise ServerError(400, "only best_of = 1 is supported", param="best_of")

    def single_prompt(self) -> str | list[int]:
        """The request's one prompt (a list of one prompt is that prompt)."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise ServerError(
                    400, f"one prompt per request (n = 1), got {len(p)}", param="prompt"
                )
            return p[0]
        if isinstance(p, list) and not p:
            raise ServerError(400, "the prompt is empty", param="prompt")
        return p  # type: ignore[return-value]


class TextPart(_Body):
    type: Literal["text"]
    text: Text


class ChatMessage(_Body):
    """One message; only an assistant's may leave out its content. Tool messages and tool
    calls are refused: the server has no tool calling (``tools`` is refused too)."""

    role: Literal["system", "developer", "user", "assistant"]
    content: Annotated[
        Text | list[TextPart] | None, _one_of("a string or a list of text parts")
    ] = Field(default=None, validate_default=True)
    tool_calls: list[Any] | None = None

    @field_validator("content")
    @classmethod
    def _content_given(cls, content: str | list[TextPart] | None, info: ValidationInfo) -> Any:
        role = info.data.get("role")
        if content is None and role not in (None, "assistant"):
            raise PydanticCustomError(
                "missing_content",
                "a {role} message needs content: a string or a list of text parts",
                {"role": role},
            )
        return content

    def as_template_message(self) -> dict[str, str]:
        """``{"role", "content"}`` for the chat template (``developer`` is the system role)."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": content or ""}


class ChatCompletionRequest(_GenerationRequest):
    """``POST /v1/chat/completions``: messages through the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    tools: list[Any] | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.logprobs:
            raise ServerError(400, "logprobs is not supported", param="logprobs")
        if self.tools:
            raise ServerError(400, "tools are not supported", param="tools")
        for i, message in enumerate(self.messages):
            if message.tool_calls:
                raise ServerError(
                    400, "tool calls are not supported", param=f"messages.{i}.tool_calls"
                )

    def requested_max_tokens(self) -> int | None:
        """``max_tokens``, or its newer name ``max_completion_tokens``."""
        return self.max_tokens if self.max_tokens is not None else self.max_completion_tokens
