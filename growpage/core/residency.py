"""Serving rules the engine and the simulator share: admission with the prefix cache and the
watermark, a resident request's entries in the prefix cache (``PrefixChain``), whether a
boundary is decided while scheduling or late, who sits out a step for deferred boundary work,
and the preemption victim.

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
from typing import TYPE_CHECKING, TypeVar

import attrs

from growpage.core.pages import PagePool

if TYPE_CHECKING:  # (capacity and kv_view import torch)
    from growpage.core.capacity import CapacityController
    from growpage.core.kv_view import KVView
    from growpage.core.request import RequestState

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


def cached_prefix(
    pool: PagePool, ids: Sequence[int], num_tokens: int, page_tokens: int
) -> list[int]:
    """The cached pages a prefill of ``num_tokens`` tokens takes (not taken yet): those of the
    longest cached run of its full leading pages (``ids``: its token ids in the pool's units),
    never all its tokens (the last one is computed for its logits)."""
    pages = pool.match_prefix(ids)
    if pages and len(pages) * page_tokens >= num_tokens:
        pages = pages[:-1]
    return pages


def admission_pages(pool: PagePool, cached: Sequence[int], num_tokens: int, page_size: int) -> int:
    """Free pages that admitting a prefill of ``num_tokens`` tokens whose first pages are
    ``cached`` uses up: new pages for the rest, and the freed cached pages it revives."""
    revived = sum(1 for page in cached if pool.refcounts[page] == 0)
    return pages_for(num_tokens, page_size) - len(cached) + revived


def can_admit(
    pool: PagePool,
    cached: Sequence[int],
    num_tokens: int,
    page_size: int,
    num_running: int,
    reserve: int = 0,
) -> bool:
    """Whether a prefill of ``num_tokens`` tokens (first pages ``cached``) can be admitted now:
    while ``num_running`` requests run it leaves the pool's watermark and ``reserve`` more
    pages free for them to grow into; a request alone may take every page."""
    running = num_running > 0
    need = admission_pages(pool, cached, num_tokens, page_size) + (reserve if running else 0)
    return pool.can_allocate(need, respect_watermark=running)


def admit(pool: PagePool, cached: list[int], num_tokens: int, page_size: int) -> list[int]:
    """The block table of an admitted prefill: ``cached`` (acquired) and new pages for the
    rest. All or nothing: check ``can_admit`` first; on failure nothing is held."""
    for page in cached:
        pool.acquire(page)
    try:
        return cached + pool.allocate(pages_for(num_tokens, page_size) - len(cached))
    except BaseException:
        pool.free(cached)
        raise


@attrs.define
class PrefixChain:
    """How far a resident request's full pages are entered in the prefix cache; a new one at
    each admission.

    Attributes:
        num_registered_pages: its leading pages entered (or tried).
        last_page_hash: the chain hash through its last entered page.
        last_cached_page: the cached page holding that prefix (its own, or an equal one
            cached before it); None when that prefix is not cached.
    """

    num_registered_pages: int = 0
    last_page_hash: int | None = None
    last_cached_page: int | None = None

    def register(
        self, pool: PagePool, block_table: Sequence[int], ids: Sequence[int], num_full: int
    ) -> None:
        """Enter the request's first ``num_full`` full pages (``ids``: its token ids in the
        pool's units), each chained to the cached page of the prefix before it, so that a page
        another request cached first is found in its place."""
        b = pool.page_size
        while self.num_registered_pages < num_full:
            i = self.num_registered_pages
            self.last_page_hash, self.last_cached_page = pool.extend_chain(
                block_table[i],
                ids[i * b : (i + 1) * b],
                self.last_page_hash,
                self.last_cached_page,
                first=i == 0,
            )
            self.num_registered_pages += 1


def decides_late(controller: CapacityController, state: RequestState, view: KVView) -> bool:
    """Whether a boundary can be decided beside the next step (``async_decisions``) instead of
    while scheduling it: its policy decides it (``CapacityController.will_decide``) and no
    outcome can need a preemption, which only scheduling can settle. A refused growth falls
    back to compressing (``fallback_to_compress``), and a compression needs no page when none
    of the request's pages is shared (no copy-on-write; pages become shared only at
    admission)."""
    return (
        bool(getattr(controller.policy, "fallback_to_compress", True))
        and not any(controller.pool.is_shared(page) for page in state.block_table)
        and controller.will_decide(state, view)
    )


def defers_beside_step(num_deferred: int, num_others: int) -> bool:
    """Whether the boundary work deferred while scheduling a decode step (``async_compaction``'s
    compressions, ``async_decisions``' late boundaries) runs beside that step, which its
    ``num_deferred`` requests then sit out: only when ``num_others`` requests decode in it.
    Otherwise the work runs at once and its requests decode in the step (a step of nobody
    would only wait for it). The step waits for the deferred work only where it outlasts the
    forward."""
    return num_deferred > 0 and num_others > 0
