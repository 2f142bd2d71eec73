"""``SamplingParams``: how one request is decoded (validated on construction)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import attrs
import numpy as np

from growpage.errors import EngineError


def _check(cond: bool, field: str, msg: str) -> None:
    if not cond:
        raise EngineError(f"SamplingParams.{field}: {msg}")


SEED_RANGE = (-(2**63), 2**64)  # what torch.Generator.manual_seed takes
GREEDY_BELOW = 1e-5  # temperatures below it decode greedily (vLLM's threshold too)


def _as_tuple(value: Any, field: str, what: str) -> tuple:
    try:
        return tuple(value)
    except TypeError:
        raise EngineError(f"SamplingParams.{field}: must be {what}, got {value!r}") from None


def _stop_tuple(value: str | list[str] | tuple[str, ...] | None) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, (bytes, Mapping)):  # a dict would give its keys
        raise EngineError(
            f"SamplingParams.stop: must be a string or a list of strings, got {value!r:.80}"
        )
    return tuple(
        str(s) if isinstance(s, np.str_) else s
        for s in _as_tuple(value, "stop", "a string or a list of strings")
    )


def _id_tuple(value: list[int] | tuple[int, ...]) -> tuple[int, ...]:
    if isinstance(value, (str, bytes, Mapping)):
        raise EngineError(
            f"SamplingParams.stop_token_ids: must be a list of token ids, got {value!r:.80}"
        )
    return tuple(_plain(v) for v in _as_tuple(value, "stop_token_ids", "a list of token ids"))


def _plain(value: Any) -> Any:
    """A numpy scalar as the Python number it holds (numpy bools stay, to be refused)."""
    if isinstance(value, np.generic) and not isinstance(value, np.bool_):
        return value.item()
    return value


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


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

    temperature: float = attrs.field(default=0.0, converter=_plain)
    top_p: float = attrs.field(default=1.0, converter=_plain)
    max_tokens: int = attrs.field(default=256, converter=_plain)
    seed: int | None = attrs.field(default=None, converter=_plain)
    stop: tuple[str, ...] = attrs.field(default=(), converter=_stop_tuple)
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=_id_tuple)
    ignore_eos: bool = False

    def __attrs_post_init__(self) -> None:
        t, p = self.temperature, self.top_p
        _check(
            isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t) and t >= 0,
            "temperature",
            f"must be a finite number >= 0, got {t!r}",
        )
        _check(
            isinstance(p, (int, float)) and not isinstance(p, bool) and 0 < p <= 1,
            "top_p",
            f"must lie in (0, 1], got {p!r}",
        )
        _check(
            _is_int(self.max_tokens) and self.max_tokens >= 1,
            "max_tokens",
            f"must be a positive integer, got {self.max_tokens!r}",
        )
        low, high = SEED_RANGE
        _check(
            self.seed is None or (_is_int(self.seed) and low <= self.seed < high),
            "seed",
            f"must be an integer in [-2**63, 2**64) or None, got {self.seed!r}",
        )
        _check(
            all(isinstance(s, str) and s for s in self.stop),
            "stop",
            f"must be non-empty strings, got {self.stop!r}",
        )
        _check(
            all(_is_int(i) and i >= 0 for i in self.stop_token_ids),
            "stop_token_ids",
            f"must be non-negative integers, got {self.stop_token_ids!r}",
        )
        _check(
            isinstance(self.ignore_eos, bool),
            "ignore_eos",
            f"must be True or False, got {self.ignore_eos!r}",
        )

    @property
    def is_greedy(self) -> bool:
        """Temperatures below ``GREEDY_BELOW`` pick the top token (a smaller one would make
        ``logits / T`` overflow float32 into NaN probabilities)."""
        return self.temperature < GREEDY_BELOW

    def replace(self, **changes: Any) -> SamplingParams:
        return attrs.evolve(self, **changes)
