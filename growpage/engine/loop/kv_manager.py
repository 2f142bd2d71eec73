"""``KVCacheManager``: the KV cache tensor, its page accounting, the query-state pool and the
capacity controller, and every page operation the scheduler performs on a sequence.

One ``PagePool`` does the accounting; the ``CapacityController`` gets the same pool, so pages
it grants at a boundary come from the pages admission competes for. Prefix caching (paper
appendix E.2) registers every full page of prefilled tokens under a chained hash; admission
acquires the longest cached run of leading pages instead of recomputing it.

For a policy that reads H2O accumulated attention (``needs_accumulated_attention``) it also
holds the per-slot sums (``growpage.engine.modeling.accumulation``) and turns prefix caching
off; for one that reads recent queries (``needs_recent_queries``, SnapKV) the ring of each
running request's last queries (``growpage.engine.loop.recent_queries``).

The boundary work that runs beside a decode step's forward (``async_compaction``,
``async_decisions``) is filed in ``deferred``, a ``DeferredBoundaries``
(``growpage.engine.loop.deferred``).
"""

from __future__ import annotations

import contextlib
import time

import torch

from growpage.core import residency
from growpage.core.boundary_context import BoundaryBatch
from growpage.core.capacity import BoundaryOutcome, CapacityController
from growpage.core.compaction_batch import CompactionBatch
from growpage.core.pages import PagePool
from growpage.core.threads import one_thread
from growpage.engine.config import EngineConfig
from growpage.engine.loop.deferred import DeferredBoundaries, LateBoundary
from growpage.engine.loop.paged_kv_view import EngineKVView
from growpage.engine.loop.query_state import QueryStatePool
from growpage.engine.loop.recent_queries import RecentQueryRing
from growpage.engine.loop.sequence import Sequence
from growpage.engine.modeling.accumulation import allocate_sums, sum_bytes
from growpage.engine.modeling.attention import (
    allocate_kv_cache,
    check_kv_cache_fits,
    kv_cache_bytes,
)
from growpage.engine.modeling.model import ModelConfig
from growpage.errors import PolicyError
from growpage.policies.base import CapacityPolicy


class KVCacheManager:
    """Pages, slots and capacity control of all sequences of one engine."""

    #: The compressions of a decode step with a shared ``BoundaryBatch`` (two or more
    #: decided boundaries) are booked at their turn, and their selections and compactions run
    #: together at the end of scheduling (``core.compaction_batch``); False runs each at its
    #: turn (the same decisions, slots and tokens; the reference in tests).
    compacts_together: bool = True

    def __init__(
        self, model_config: ModelConfig, config: EngineConfig, policy: CapacityPolicy
    ) -> None:
        c, gp = model_config, config.growpage
        self.model_config, self.config = model_config, config
        self.page_size = gp.page_size
        records_sums = bool(getattr(policy, "needs_accumulated_attention", False))
        page_bytes = kv_cache_bytes(
            c.num_layers, gp.page_size, c.num_kv_heads, c.head_dim, config.dtype
        )
        if records_sums:
            page_bytes += sum_bytes(c.num_layers, gp.page_size, c.num_kv_heads)
        self.num_pages = config.num_pages_for(page_bytes)
        check_kv_cache_fits(self.num_pages * page_bytes, self.num_pages, config.device)
        self.cache = allocate_kv_cache(
            c.num_layers,
            self.num_pages,
            gp.page_size,
            c.num_kv_heads,
            c.head_dim,
            config.dtype,
            config.device,
        )
        # H2O sums [L, slots, Hkv] fp32, only for a policy that reads them; their slots must
        # not be shared, so they turn prefix caching off.
        self.accumulated = (
            allocate_sums(
                c.num_layers, self.num_pages * gp.page_size, c.num_kv_heads, config.device
            )
            if records_sums
            else None
        )
        self.prefix_caching = config.enable_prefix_caching and not records_sums
        self.pool = PagePool(
            self.num_pages, gp.page_size, watermark=min(gp.watermark, self.num_pages - 1)
        )
        self.query_pool = QueryStatePool(
            c.num_layers,
            config.max_num_seqs,
            c.num_q_heads,
            c.head_dim,
            gp.beta_short,
            gp.beta_long,
            config.device,
            zero_start=gp.summary_start == "average",
        )
        window = recent_window_of(policy)
        self.recent = (
            RecentQueryRing(
                c.num_layers,
                config.max_num_seqs,
                window,
                c.num_q_heads,
                c.head_dim,
                config.dtype,
                config.device,
            )
            if window
            else None
        )
        self.controller = CapacityController(policy, self.pool, gp)
        self.prefix_hit_tokens = 0
        self.boundary_s = 0.0  # wall time spent in capacity control (running total)
        self._batch: BoundaryBatch | None = None  # this decode step's (prepare_boundaries)
        self._compactions: CompactionBatch | None = None  # this decode step's booked ones
        self.shared_steps = 0  # decode steps whose decided boundaries shared a batch
        self.shared_boundaries = 0  # the boundaries prepared in those batches (running totals)
        # This step's deferred compressions (async_compaction) and late boundaries
        # (async_decisions), run beside its forward.
        self.deferred = DeferredBoundaries(self)

    # ---- sizes ----------------------------------------------------------------------------
    def pages_for(self, num_tokens: int) -> int:
        return residency.pages_for(num_tokens, self.page_size)

    def can_ever_fit(self, num_tokens: int) -> bool:
        """Whether ``num_tokens`` plus the next generated token fit in the whole pool."""
        return residency.fits_pool(num_tokens, self.page_size, self.num_pages)

    # ---- admission ------------------------------------------------------------------------
    def _cached_prefix(self, seq: Sequence) -> list[int]:
        if not self.prefix_caching:
            return []
        tokens = seq.token_ids
        return residency.cached_prefix(self.pool, tokens, len(tokens), self.page_size)

    def can_admit(self, seq: Sequence, num_running: int) -> bool:
        """Whether ``seq`` can get all pages of its prefill now (and a query-state slot)."""
        return self.query_pool.can_bind() and residency.can_admit(
            self.pool, self._cached_prefix(seq), seq.num_total_tokens, self.page_size, num_running
        )

    def admit(self, seq: Sequence) -> None:
        """Give ``seq`` its prefill pages (cached prefix + new pages) and a query slot.

        All or nothing: call ``can_admit`` first; on failure nothing is held.
        """
        cached = self._cached_prefix(seq)
        table = residency.admit(self.pool, cached, seq.num_total_tokens, self.page_size)
        seq.reset_residency()
        seq.query_slot = self.query_pool.bind()
        seq.state.block_table = table
        seq.state.num_tokens = seq.state.position = len(cached) * self.page_size
        seq.prefill_target = seq.num_total_tokens
        seq.num_cached_tokens = len(cached) * self.page_size
        self.prefix_hit_tokens += seq.num_cached_tokens
        self.register_full_pages(seq)

    def release(self, seq: Sequence) -> None:
        """Return ``seq``'s pages (tail first, so cached heads stay longest) and its slot; a
        compression of it still pending is cancelled."""
        self.deferred.cancel(seq)
        if self._compactions is not None:
            self._compactions.drop(seq.state)
        self.pool.free(list(reversed(seq.state.block_table)))
        if seq.query_slot is not None:
            self.query_pool.release(seq.query_slot)
        seq.reset_residency()

    def register_full_pages(self, seq: Sequence) -> None:
        """Enter the full, uncompacted pages of computed tokens in the prefix cache
        (``PrefixChain.register``)."""
        if self.prefix_caching and seq.kept_positions is None:
            full = seq.state.position // self.page_size
            seq.prefix_chain.register(self.pool, seq.state.block_table, seq.token_ids, full)

    # ---- slots ----------------------------------------------------------------------------
    def slots(self, seq: Sequence, start: int, num: int) -> list[int]:
        """Flat cache slots of ``seq``'s slots ``start .. start + num - 1``."""
        b, table = self.page_size, seq.state.block_table
        return [table[i // b] * b + i % b for i in range(start, start + num)]

    def prepare_boundaries(self, seqs: list[Sequence]) -> None:
        """Before a decode step: the sequences of ``seqs`` whose boundary the policy will decide
        share one ``BoundaryBatch`` (their top-p sizes and Delta_t in one pass and one host
        sync), used by ``make_room`` until ``end_boundaries``."""
        start = time.perf_counter()
        at = [seq for seq in seqs if self.controller.needs_decision(seq.state)]
        if self.config.async_decisions and at:  # late ones are decided beside the forward
            at = [seq for seq in at if not self.deferred.decides_late(seq)]
            self.boundary_s += time.perf_counter() - start  # the filter is boundary work
            start = time.perf_counter()
        self._batch = self._compactions = None
        if len(at) < 2:
            return
        self._batch = self.shared_batch(at)
        if self._batch is not None and self.compacts_together:
            self._compactions = CompactionBatch(self.controller)
        self.boundary_s += time.perf_counter() - start

    def shared_batch(self, seqs: list[Sequence]) -> BoundaryBatch | None:
        """One ``BoundaryBatch`` for the boundaries of ``seqs`` (None for fewer than two),
        counted in ``shared_steps`` and ``shared_boundaries``; the late boundaries of
        ``deferred`` share one too."""
        if len(seqs) < 2:
            return None
        batch = self.controller.prepare((seq.state, self.view(seq)) for seq in seqs)
        if len(batch) < 2:
            return None
        self.shared_steps += 1
        self.shared_boundaries += len(batch)
        return batch

    def end_boundaries(self) -> None:
        """After a decode step's scheduling (also when it failed): the step's booked
        compressions run (their selections and compactions, together)."""
        compactions, self._compactions, self._batch = self._compactions, None, None
        try:
            if compactions:
                self.run_compactions(compactions)
        finally:
            self.deferred.mark_ready()

    def run_compactions(self, compactions: CompactionBatch) -> None:
        """``compactions.run()``, counted as boundary time."""
        start = time.perf_counter()
        try:
            with self.one_thread():
                compactions.run()
        finally:
            if self.cache.is_cuda:
                torch.cuda.synchronize(self.cache.device)  # count the kernels it launched
            self.boundary_s += time.perf_counter() - start

    def make_room(self, seq: Sequence, defer: bool | None = None) -> BoundaryOutcome | None:
        """Run capacity control when ``seq`` is at a boundary (None when it has a free slot).

        A ``PREEMPT`` outcome changed nothing; the caller frees pages and asks again. With
        ``defer`` (None: ``EngineConfig.async_compaction``) a compression is settled, not run:
        the outcome's ``pending`` is set and ``seq`` is unchanged (``deferred.is_deferred``)
        until ``deferred.run`` (or ``deferred.cancel``) in this step. With
        ``EngineConfig.async_decisions`` a boundary that ``deferred.decides_late`` is only filed:
        None is returned, ``seq`` is unchanged and deferred, and ``deferred.run`` decides it.
        """
        if not self.controller.needs_decision(seq.state):
            return None
        if self.deferred.is_deferred(seq):
            raise ValueError(f"request {seq.request_id!r} already has boundary work pending")
        start = time.perf_counter()
        if self.config.async_decisions and self.deferred.decides_late(seq):
            self.deferred.add(seq, LateBoundary(self, seq))
            self.boundary_s += time.perf_counter() - start  # filing it is boundary work
            return None  # unchanged, no room yet: is_deferred says it sits the step out
        try:
            if defer is None:
                defer = bool(self.config.async_compaction)  # None: not resolved, off
            with self.one_thread():
                outcome = self.controller.on_boundary(
                    seq.state, self.view(seq), self._batch, defer, self._compactions
                )
            if outcome.pending is not None:
                self.deferred.add(seq, outcome.pending)
            return outcome
        finally:
            if self.cache.is_cuda:
                torch.cuda.synchronize(self.cache.device)  # count the kernels it launched
            self.boundary_s += time.perf_counter() - start

    def one_thread(self) -> contextlib.AbstractContextManager[None]:
        """Boundary work on one CPU thread (``core.threads.one_thread``)."""
        c = self.model_config
        return one_thread(self.cache.device, c.num_layers * c.num_kv_heads)

    def view(self, seq: Sequence, use_kernels: bool | None = None) -> EngineKVView:
        """``seq``'s KV view over the cache (``use_kernels`` None: the config's choice)."""
        return EngineKVView(
            seq,
            self.cache,
            self.query_pool,
            self.model_config.rope,
            self.model_config.num_q_heads,
            use_kernels=self.config.boundary_kernels if use_kernels is None else use_kernels,
            accumulated=self.accumulated,
            recent_window=self.config.growpage.recent_window,
            recent_queries=self.recent,
        )

    def append_slot(self, seq: Sequence) -> int:
        """Take the next slot of ``seq`` for its next token (room must have been made)."""
        state = seq.state
        (slot,) = self.slots(seq, state.num_tokens, 1)
        state.num_tokens += 1
        state.position += 1
        return slot

    def block_tables(self, seqs: list[Sequence]) -> torch.Tensor:
        """``[B, max_pages]`` int64 page ids, ``-1`` padded."""
        width = max(seq.state.num_pages for seq in seqs)
        rows = [seq.state.block_table + [-1] * (width - seq.state.num_pages) for seq in seqs]
        return torch.tensor(rows, dtype=torch.long)


def recent_window_of(policy: CapacityPolicy) -> int:
    """The policy's ``needs_recent_queries``, checked (0 for an object without it)."""
    window = getattr(policy, "needs_recent_queries", 0)
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise PolicyError(
            f"policy {getattr(policy, 'name', policy)!r}: needs_recent_queries must be an "
            f"integer >= 0 (the queries it reads; 0 = none), got {window!r}"
        )
    return window
