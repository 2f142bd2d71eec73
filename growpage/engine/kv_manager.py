"""``KVCacheManager``: the KV cache tensor, its page accounting, the query-state pool and the
capacity controller, and every page operation the scheduler performs on a sequence.

One ``PagePool`` does the accounting; the ``CapacityController`` gets the same pool, so pages
it grants at a boundary come from the pages admission competes for. Prefix caching (paper
appendix E.2) registers every full page of prefilled tokens under a chained hash; admission
acquires the longest cached run of leading pages instead of recomputing it.

For a policy that reads H2O accumulated attention (``needs_accumulated_attention``) it also
holds the per-slot sums (``growpage.engine.accumulation``) and turns prefix caching off.
"""

from __future__ import annotations

import math
import time

import torch

from growpage.core.capacity import BoundaryOutcome, CapacityController
from growpage.core.context import BoundaryBatch
from growpage.core.pages import PagePool, chain_hash
from growpage.engine.accumulation import allocate_sums, sum_bytes
from growpage.engine.attention import allocate_kv_cache, kv_cache_bytes
from growpage.engine.config import EngineConfig
from growpage.engine.kv_view import EngineKVView
from growpage.engine.model import ModelConfig
from growpage.engine.query_state import QueryStatePool
from growpage.engine.sequence import Sequence
from growpage.policies.base import CapacityPolicy


class KVCacheManager:
    """Pages, slots and capacity control of all sequences of one engine."""

    def __init__(self, model_config: ModelConfig, config: EngineConfig,
                 policy: CapacityPolicy) -> None:
        c, gp = model_config, config.growpage
        self.model_config, self.config = model_config, config
        self.page_size = gp.page_size
        records_sums = bool(getattr(policy, "needs_accumulated_attention", False))
        page_bytes = kv_cache_bytes(c.num_layers, gp.page_size, c.num_kv_heads, c.head_dim,
                                    config.dtype)
        if records_sums:
            page_bytes += sum_bytes(c.num_layers, gp.page_size, c.num_kv_heads)
        self.num_pages = config.num_pages_for(page_bytes)
        self.cache = allocate_kv_cache(c.num_layers, self.num_pages, gp.page_size,
                                       c.num_kv_heads, c.head_dim, config.dtype, config.device)
        # H2O sums [L, slots, Hkv] fp32, only for a policy that reads them; their slots must
        # not be shared, so they turn prefix caching off.
        self.accumulated = (allocate_sums(c.num_layers, self.num_pages * gp.page_size,
                                          c.num_kv_heads, config.device)
                            if records_sums else None)
        self.prefix_caching = config.enable_prefix_caching and not records_sums
        self.pool = PagePool(self.num_pages, gp.page_size, watermark=min(gp.watermark,
                                                                         self.num_pages - 1))
        self.query_pool = QueryStatePool(c.num_layers, config.max_num_seqs, c.num_q_heads,
                                         c.head_dim, gp.beta_short, gp.beta_long, config.device)
        self.controller = CapacityController(policy, self.pool, gp)
        self.prefix_hit_tokens = 0
        self.boundary_seconds = 0.0  # wall time spent in capacity control (running total)
        self._batch: BoundaryBatch | None = None  # this decode step's (prepare_boundaries)
        self.shared_steps = 0       # decode steps whose decided boundaries shared a batch
        self.shared_boundaries = 0  # the boundaries prepared in those batches (running totals)

    # ---- sizes ----------------------------------------------------------------------------
    def pages_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.page_size)

    def can_ever_fit(self, num_tokens: int) -> bool:
        """Whether ``num_tokens`` plus the next generated token fit in the whole pool."""
        return self.pages_for(num_tokens + 1) <= self.num_pages

    # ---- admission ------------------------------------------------------------------------
    def _cached_prefix(self, seq: Sequence) -> list[int]:
        if not self.prefix_caching:
            return []
        tokens = seq.token_ids
        pages = self.pool.match_prefix(tokens)
        if pages and len(pages) * self.page_size >= len(tokens):
            pages = pages[:-1]  # the last token must be computed to get its logits
        return pages

    def can_admit(self, seq: Sequence, respect_watermark: bool) -> bool:
        """Whether ``seq`` can get all pages of its prefill now (and a query-state slot)."""
        if not self.query_pool.can_bind():
            return False
        cached = self._cached_prefix(seq)
        num_new = self.pages_for(seq.num_total_tokens) - len(cached)
        num_revived = sum(1 for p in cached if self.pool.refcounts[p] == 0)
        return self.pool.can_allocate(num_new + num_revived, respect_watermark)

    def admit(self, seq: Sequence) -> None:
        """Give ``seq`` its prefill pages (cached prefix + new pages) and a query slot.

        All or nothing: call ``can_admit`` first; on failure nothing is held.
        """
        cached = self._cached_prefix(seq)
        for page in cached:
            self.pool.acquire(page)
        try:
            new = self.pool.allocate(self.pages_for(seq.num_total_tokens) - len(cached))
        except BaseException:
            self.pool.free(cached)
            raise
        seq.reset_residency()
        seq.query_slot = self.query_pool.bind()
        seq.state.block_table = cached + new
        seq.state.num_tokens = seq.state.position = len(cached) * self.page_size
        seq.prefill_target = seq.num_total_tokens
        seq.num_cached_tokens = len(cached) * self.page_size
        self.prefix_hit_tokens += seq.num_cached_tokens
        self.register_full_pages(seq)

    def release(self, seq: Sequence) -> None:
        """Return ``seq``'s pages (tail first, so cached heads stay longest) and its slot."""
        self.pool.free(list(reversed(seq.state.block_table)))
        if seq.query_slot is not None:
            self.query_pool.release(seq.query_slot)
        seq.reset_residency()

    def register_full_pages(self, seq: Sequence) -> None:
        """Enter the full, uncompacted pages of computed tokens in the prefix cache."""
        if not self.prefix_caching or seq.kept_positions is not None:
            return
        b, tokens = self.page_size, seq.token_ids
        while (seq.num_registered_pages + 1) * b <= seq.state.position:
            i = seq.num_registered_pages
            chunk = tokens[i * b:(i + 1) * b]
            seq.last_page_hash = chain_hash(seq.last_page_hash, chunk)
            parent = seq.state.block_table[i - 1] if i else None
            self.pool.register(seq.state.block_table[i], seq.last_page_hash, chunk, parent=parent)
            seq.num_registered_pages += 1

    # ---- slots ----------------------------------------------------------------------------
    def slots(self, seq: Sequence, start: int, num: int) -> list[int]:
        """Flat cache slots of ``seq``'s slots ``start .. start + num - 1``."""
        b, table = self.page_size, seq.state.block_table
        return [table[i // b] * b + i % b for i in range(start, start + num)]

    def prepare_boundaries(self, seqs: list[Sequence]) -> None:
        """Before a decode step: the sequences of ``seqs`` whose boundary the policy will decide
        share one ``BoundaryBatch`` (their top-p sizes and Delta_t in one pass and one host
        sync), used by ``make_room`` until ``end_boundaries``."""
        at = [seq for seq in seqs if self.controller.needs_decision(seq.state)]
        self._batch = None
        if len(at) < 2:
            return
        start = time.perf_counter()
        batch = self.controller.prepare((seq.state, self.view(seq)) for seq in at)
        self._batch = batch if len(batch) > 1 else None
        if self._batch is not None:
            self.shared_steps += 1
            self.shared_boundaries += len(batch)
        self.boundary_seconds += time.perf_counter() - start

    def end_boundaries(self) -> None:
        self._batch = None

    def make_room(self, seq: Sequence) -> BoundaryOutcome | None:
        """Run capacity control when ``seq`` is at a boundary (None when it has a free slot).

        A ``PREEMPT`` outcome changed nothing; the caller frees pages and asks again.
        """
        if not self.controller.needs_decision(seq.state):
            return None
        start = time.perf_counter()
        try:
            return self.controller.on_boundary(seq.state, self.view(seq), self._batch)
        finally:
            if self.cache.is_cuda:
                torch.cuda.synchronize(self.cache.device)  # count the kernels it launched
            self.boundary_seconds += time.perf_counter() - start

    def view(self, seq: Sequence, use_kernels: bool | None = None) -> EngineKVView:
        """``seq``'s KV view over the cache (``use_kernels`` None: the config's choice)."""
        return EngineKVView(seq, self.cache, self.query_pool, self.model_config.rope,
                            self.model_config.num_q_heads,
                            use_kernels=self.config.boundary_kernels if use_kernels is None
                            else use_kernels, accumulated=self.accumulated,
                            recent_window=self.config.growpage.recent_window)

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
