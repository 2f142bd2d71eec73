"""The HTTP face's settings (``create_app``'s ``ServerConfig``; the engine's are the ``LLM``'s)."""

from __future__ import annotations

import attrs

from growpage.engine.inputs import seconds_of
from growpage.validators import Check, non_empty_str, optional, positive_int

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
