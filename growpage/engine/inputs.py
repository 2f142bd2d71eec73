"""What ``LLM.generate`` and ``LLM.score`` accept, checked and turned into token ids.

A prompt is text or token ids (a list of ints, numpy integers included, or a tensor or numpy
array: ``[N]`` one prompt, ``[B, N]`` B of them); params are one ``SamplingParams`` or one per
prompt; arrival times are seconds, one per prompt. Anything else is an ``EngineError`` that
says what was given.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence as Seq
from typing import Any, TypeGuard

import numpy as np
import torch

from growpage.engine.config import plural
from growpage.engine.sampling_params import SamplingParams
from growpage.errors import EngineError
from growpage.validators import is_finite, lone_surrogate

Prompt = str | list[int]
ARRAYS = (torch.Tensor, np.ndarray)  # token ids: [N] one prompt, [B, N] B of them


def _is_token(value: object) -> bool:
    """An int, or a numpy integer (not a bool)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def as_prompt_list(prompts: Prompt | Seq[Prompt], name: str = "prompts") -> list[Prompt]:
    """One prompt or several, as a list of prompts (``name`` says which input in errors)."""
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, (bytes, bytearray)):
        raise EngineError(
            f"{name} must be a string, a list of token ids or a list of those, "
            "got bytes (decode them to a string first)"
        )
    if isinstance(prompts, ARRAYS):
        prompts = prompts.tolist()
    if not isinstance(prompts, Seq):
        raise EngineError(
            f"{name} must be a string, a list of token ids or a list of those, "
            f"got {type(prompts).__name__}"
        )
    items: list[Any] = list(prompts)
    if items and all(_is_token(t) for t in items):
        return [items]  # one token-id prompt
    return items


def per_prompt_params(params: SamplingParams | Seq[SamplingParams], n: int) -> list[SamplingParams]:
    """``params`` for each of ``n`` prompts."""
    if isinstance(params, SamplingParams):
        return [params] * n
    if not isinstance(params, Seq) or isinstance(params, str):
        raise EngineError(
            f"params must be a SamplingParams or a list of them (one per prompt), "
            f"got {type(params).__name__}"
        )
    params = list(params)
    wrong = [type(p).__name__ for p in params if not isinstance(p, SamplingParams)]
    if wrong:
        raise EngineError(f"params must be SamplingParams, got {', '.join(sorted(set(wrong)))}")
    if len(params) != n:
        raise EngineError(f"give one SamplingParams or one per prompt ({n}), got {len(params)}")
    return params


def where(name: str, index: int, count: int) -> str:
    """``" (prompts[2])"`` for error messages when there are several, else ``""``."""
    return f" ({name}[{index}])" if count > 1 else ""


def encode_prompt(
    prompt: Prompt, tokenizer: Any, chat: bool, at: str = "", what: str = "prompt"
) -> tuple[list[int], str | None]:
    """``(token ids, text or None)`` of one prompt (``chat``: through the chat template);
    ``at`` (from ``where``) ends each error message, ``what`` names the input in it."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise EngineError(f"text {what}s need a tokenizer; pass token ids instead")
        if not prompt:
            raise EngineError(f"empty {what}{at}")
        _require_text(prompt, what, at)
        ids = tokenizer.encode_chat(prompt) if chat else tokenizer.encode(prompt)
        return ids, prompt
    if not isinstance(prompt, (Seq, *ARRAYS)) or isinstance(prompt, (bytes, bytearray)):
        raise EngineError(
            f"a {what} is a string or a list of token ids, got "
            f"{type(prompt).__name__}{at}"
            + (
                " (decode bytes to a string first)"
                if isinstance(prompt, (bytes, bytearray))
                else ""
            )
        )
    ids = prompt.tolist() if isinstance(prompt, ARRAYS) else list(prompt)
    if not isinstance(ids, list) or not all(_is_token(t) for t in ids):
        raise EngineError(f"a token-id {what} must be a list of ints{at}")
    if not ids:
        raise EngineError(f"empty {what}{at}")
    return [int(t) for t in ids], None


def _require_text(text: str, what: str, at: str) -> None:
    """``EngineError`` when ``text`` holds a character UTF-8 cannot encode, named with its
    position (a lone surrogate: undecodable bytes in a command-line argument, or JSON's
    ``"\\ud800"``), instead of the tokenizer's ``TypeError``."""
    problem = lone_surrogate(text)
    if problem is not None:
        raise EngineError(
            f"the {what} is not valid Unicode text: {problem} (undecodable bytes?){at}"
        )


def encode_continuation(cont: Prompt, tokenizer: Any, at: str = "") -> list[int]:
    """Token ids of a continuation to score (text without special tokens, or token ids)."""
    if isinstance(cont, str) and tokenizer is not None:
        _require_text(cont, "continuation", at)
        ids = tokenizer.encode(cont, add_special_tokens=False)
    else:
        ids, _ = encode_prompt(cont, tokenizer, chat=False, at=at, what="continuation")
    if not ids:
        raise EngineError(f"empty continuation{at}")
    return ids


def arrival_offsets(arrival_s: object, n: int) -> list[float] | None:
    """``arrival_s`` of ``n`` prompts (seconds, one per prompt; None: all at once) as
    offsets from the earliest: the run starts when the first request arrives."""
    if arrival_s is None:
        return None
    if isinstance(arrival_s, ARRAYS):
        arrival_s = arrival_s.tolist()
    if not isinstance(arrival_s, Seq) or isinstance(arrival_s, (str, bytes, bytearray)):
        raise EngineError(
            f"arrival_s must be a list of seconds, one per prompt, got {type(arrival_s).__name__}"
        )
    given = list(arrival_s)
    if len(given) != n:
        raise EngineError(f"arrival_s has {plural(len(given), 'value')} for {plural(n, 'prompt')}")
    times = []
    for i, t in enumerate(given):
        if not _is_real(t):
            raise EngineError(
                f"arrival_s[{i}] must be a number of seconds, got {type(t).__name__} {t!r:.40}"
            )
        seconds = seconds_of(t)
        if seconds is None:
            raise EngineError(f"arrival_s[{i}] must be finite and >= 0, got {t!r:.40}")
        times.append(seconds)
    first = min(times, default=0.0)
    return [t - first for t in times]


def _is_real(value: object) -> TypeGuard[float]:
    """A real number, not a bool (numpy scalars included)."""
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def seconds_of(value: object) -> float | None:
    """``value`` as seconds (a float): a real number, finite and >= 0 (an int too large for a
    float is not finite); None for anything else."""
    return float(value) if _is_real(value) and is_finite(value) and value >= 0 else None


def poisson_arrivals(n: int, rate_per_s: float, seed: int = 0) -> list[float]:
    """``n`` arrival times (seconds, ascending) of a Poisson process of ``rate_per_s`` requests
    per second, for ``LLM.generate(..., arrival_s=...)``: exponential gaps, seeded, drawn as
    the simulator draws a workload's (``WorkloadSpec(arrival="poisson")``)."""
    if not (_is_token(n) and n >= 0):
        raise EngineError(f"poisson_arrivals: n must be an int >= 0, got {n!r}")
    rate = seconds_of(rate_per_s)  # a real number, finite (an int too large is not) and >= 0
    if rate is None or rate <= 0:
        raise EngineError(
            f"poisson_arrivals: rate_per_s must be a finite number > 0, got {rate_per_s!r:.40}"
        )
    if not (_is_token(seed) and seed >= 0):
        raise EngineError(f"poisson_arrivals: seed must be an int >= 0, got {seed!r}")
    # NOTE: a rate near the smallest float has a mean gap (1 / rate), or a sum of gaps, past the
    # largest float: inf times, which ``arrival_offsets`` would refuse later as arrival_s
    # the caller never wrote. Refused here, without numpy's overflow warning.
    with np.errstate(over="ignore"):
        times = np.cumsum(np.random.default_rng(seed).exponential(1.0 / rate, int(n)))
    if n and not math.isfinite(times[-1]):
        raise EngineError(
            f"poisson_arrivals: rate_per_s {rate_per_s!r:.40} is too small for "
            f"{n} arrivals: their times pass the largest float "
            f"({np.finfo(float).max:.3g} s)"
        )
    return [float(t) for t in times]
