"""Serving rules the engine and the simulator share: who is preempted and what its recompute
costs.

The engine's ``Scheduler`` and ``KVCacheManager`` and the simulator's ``Scheduler`` call these
functions; each world keeps its own stepping (tensors and streams in the engine, event segments
in the simulator). Counts are in tokens and pages of ``page_size`` tokens.

Preemption is by recompute: the victim frees its pages and returns to the front of the waiting
queue; when admitted again its prefill computes every token it has (prompt and output, the
last sampled one included), which rebuilds its full KV (what its compressions dropped is back)
and samples its next token.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TypeVar

R = TypeVar("R")


def pages_for(num_tokens: int, page_size: int) -> int:
    """Pages that ``num_tokens`` tokens take."""
    return math.ceil(num_tokens / page_size)


def fits_pool(num_tokens: int, page_size: int, num_pages: int) -> bool:
    """Whether ``num_tokens`` tokens and the next one fit a pool of ``num_pages`` pages: a
    prefill of them (a recompute's included) followed by one decode step."""
    return pages_for(num_tokens + 1, page_size) <= num_pages


def pick_victim(running: Sequence[R], can_recompute: Callable[[R], bool]) -> R | None:
    """The preemption victim: the most recently admitted of ``running`` (in admission order)
    whose recompute can fit the pool (``can_recompute``); None when none can, and the request
    that needs room waits for a later step instead."""
    for r in reversed(running):
        if can_recompute(r):
            return r
    return None
