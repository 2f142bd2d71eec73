"""``SamplingParams``: how one request is decoded (validated on construction)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import numpy as np

from growpage.errors import EngineError
from growpage.validators import (
    Check,
    flag,
    in_range,
    is_int,
    is_text,
    non_negative_number,
    optional,
    positive_int,
)

SEED_RANGE = (-(2**63), 2**64)  # what torch.Generator.manual_seed takes
GREEDY_BELOW = 1e-5  # temperatures below it decode greedily (vLLM's threshold too)


def _as_tuple(value: Any, field: str, what: str) -> tuple:
    try:
        return tuple(value)
    except TypeError:
        raise EngineError(f"SamplingParams.{field} must be {what}, got {value!r:.80}") from None


def _stop_tuple(value: str | list[str] | tuple[str, ...] | None) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, (bytes, Mapping)):  # a dict would give its keys
        raise EngineError(
            f"SamplingParams.stop must be a string or a list of strings, got {value!r:.80}"
        )
    return tuple(
        str(s) if isinstance(s, np.str_) else s
        for s in _as_tuple(value, "stop", "a string or a list of strings")
    )


def _id_tuple(value: list[int] | tuple[int, ...]) -> tuple[int, ...]:
    if isinstance(value, (str, bytes, Mapping)):
        raise EngineError(
            f"SamplingParams.stop_token_ids must be a list of token ids, got {value!r:.80}"
        )
    return tuple(_plain(v) for v in _as_tuple(value, "stop_token_ids", "a list of token ids"))


def _plain(value: Any) -> Any:
    """A numpy scalar as the Python number it holds (numpy bools stay, to be refused)."""
    if isinstance(value, np.generic) and not isinstance(value, np.bool_):
        return value.item()
    return value


SEED = Check(  # EngineConfig.seed's too
    "an integer in [-2**63, 2**64)", lambda v: is_int(v) and SEED_RANGE[0] <= v < SEED_RANGE[1]
)
_STOP = Check(
    "non-empty strings of valid Unicode text",
    lambda v: all(is_text(s) and s for s in v),
    EngineError,
)
_STOP_IDS = Check(
    "non-negative integers", lambda v: all(is_int(i) and i >= 0 for i in v), EngineError
)


@attrs.frozen(kw_only=True)
class SamplingParams:
    """Decoding settings of one request.

    Attributes:
        temperature: 0 means greedy (the default), as does anything below ``GREEDY_BELOW``
            (1e-5); above it samples from ``softmax(logits / T)``.
        top_p: nucleus sampling mass in (0, 1]; 1 keeps the whole distribution.
        max_tokens: most tokens to generate (>= 1).
        seed: per-request RNG seed in [-2**63, 2**64); None draws from the engine's generator.
        stop: strings that end generation; the returned text stops before the match.
        stop_token_ids: token ids that end generation (besides the model's end tokens).
        ignore_eos: keep generating past the model's end-of-sequence tokens.
    """

    temperature: float = attrs.field(
        default=0.0, converter=_plain, validator=non_negative_number.raising(EngineError)
    )
    top_p: float = attrs.field(
        default=1.0, converter=_plain, validator=in_range(0, 1, lo_open=True).raising(EngineError)
    )
    max_tokens: int = attrs.field(
        default=256, converter=_plain, validator=positive_int.raising(EngineError)
    )
    seed: int | None = attrs.field(
        default=None, converter=_plain, validator=optional(SEED).raising(EngineError)
    )
    stop: tuple[str, ...] = attrs.field(default=(), converter=_stop_tuple, validator=_STOP)
    stop_token_ids: tuple[int, ...] = attrs.field(
        default=(), converter=_id_tuple, validator=_STOP_IDS
    )
    ignore_eos: bool = attrs.field(default=False, validator=flag.raising(EngineError))

    @property
    def is_greedy(self) -> bool:
        """Temperatures below ``GREEDY_BELOW`` pick the top token (a smaller one would make
        ``logits / T`` overflow float32 into NaN probabilities)."""
        return self.temperature < GREEDY_BELOW

    def replace(self, **changes: Any) -> SamplingParams:
        return attrs.evolve(self, **changes)
