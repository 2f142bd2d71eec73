"""``EngineKVView``: the core ``KVView`` of one request over the live paged KV cache.

The controller reads keys and query summaries through it at a capacity boundary and calls
``compact`` to execute Compress & Hold / Shrink. Slots and pages::

    src_pages [ 7 | 2 | 9 ]  slot i at page src_pages[i // b], offset i % b   (N = 3b slots)
    keep[l, h] = [0, 3, 4, ..., N-1]      ascending slot indices, K per (layer, KV head)
    dst_pages [ 7 | 5 | 9 ]  kept slot k goes to page dst_pages[k // b], offset k % b

NOTE: destination slots may overlap source slots (pages not replaced by copy-on-write are
reused), so all kept entries of a layer are gathered into a temporary before any is written.

With H2O sums (``accumulated [L, num_pages * page_size, Hkv]``,
``growpage.engine.modeling.accumulation``) ``accumulated_attention`` reads the request's slots
and ``compact`` moves each kept slot's sum with its key and value; the sums of dropped slots
are gone. With a recent-query ring (``growpage.engine.loop.recent_queries``, SnapKV)
``recent_queries`` reads the request's last queries from its query-state slot and rotates them
to their positions.
"""

from __future__ import annotations

import functools
from typing import cast

import torch

from growpage.core.kv_view import CompactionJob, KVView, QueryState
from growpage.core.observation import rotate_queries
from growpage.core.rope import RopeConfig
from growpage.engine.loop import paged_kv_batch
from growpage.engine.loop.query_state import QueryStatePool
from growpage.engine.loop.recent_queries import RecentQueryRing
from growpage.engine.loop.sequence import Sequence
from growpage.engine.loop.transfer import to_device
from growpage.engine.modeling.accumulation import gather_sums
from growpage.errors import EngineError


def page_slots(
    pages: list[int], num_slots: int, page_size: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Flat cache slots ``[num_slots]`` of a request's slots ``0..num_slots-1``."""
    idx = torch.arange(num_slots, device=device)
    table = to_device(pages, torch.long, torch.device(device))  # queued: no host sync on CUDA
    return table[idx // page_size] * page_size + idx % page_size


class EngineKVView(KVView):
    """KV view of ``seq`` over ``kv_cache [2, L, num_pages, page_size, Hkv, d]``."""

    def __init__(
        self,
        seq: Sequence,
        kv_cache: torch.Tensor,
        query_pool: QueryStatePool,
        rope: RopeConfig,
        num_q_heads: int,
        use_kernels: bool | None = None,
        accumulated: torch.Tensor | None = None,
        recent_window: int = 0,
        recent_queries: RecentQueryRing | None = None,
    ) -> None:
        """``use_kernels``: demand estimation and compaction with the Triton kernels of
        ``growpage.kernels`` (default: on CUDA; on CPU only under ``TRITON_INTERPRET=1``).
        ``accumulated``: the engine's H2O sums, when its policy reads them.
        ``recent_window``: the protected window, so that the kernels' table of a boundary holds
        the counts of both candidate sets (estimation and selection) in one copy.
        ``recent_queries``: the engine's ring of recent queries, when its policy reads them."""
        _, num_layers, _, page_size, num_kv_heads, head_dim = kv_cache.shape
        self.use_kernels = boundary_kernels_on(use_kernels, kv_cache)
        self.seq, self.kv_cache, self.query_pool = seq, kv_cache, query_pool
        self.accumulated = accumulated
        self.recent = recent_queries
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.num_q_heads, self.rope = num_q_heads, rope
        self.softmax_scale = head_dim**-0.5
        self.page_size = page_size
        self.recent_window = recent_window

    @property
    def device(self) -> torch.device:
        return self.kv_cache.device

    @property
    def num_tokens(self) -> int:
        return self.seq.state.num_tokens

    @property
    def has_query_state(self) -> bool:
        return self.seq.has_query_state

    @property
    def has_fast_signals(self) -> bool:
        return self.use_kernels

    @staticmethod
    def batch_query_states(views: list[KVView]) -> tuple[torch.Tensor, torch.Tensor]:
        return paged_kv_batch.query_states(cast("list[EngineKVView]", views))

    @staticmethod
    def batch_keys(
        views: list[KVView], tables: list[list[int]] | None, num_tokens: list[int]
    ) -> torch.Tensor:
        engine_views = cast("list[EngineKVView]", views)
        if tables is None:
            tables = [v.seq.state.block_table for v in engine_views]
        return paged_kv_batch.keys(engine_views, tables, num_tokens)

    @staticmethod
    def compact_batch(jobs: list[CompactionJob], keep: torch.Tensor) -> None:
        """All of a step's compactions in one gather and one scatter (one ``compact_kv``
        launch with kernels), then their positions (``paged_kv_batch.compact``)."""
        paged_kv_batch.compact(jobs, keep)

    def _slots(self, pages: list[int], n: int) -> torch.Tensor:
        return page_slots(pages, n, self.page_size, self.device)

    @functools.cached_property
    def _keys(self) -> torch.Tensor:
        slots = self._slots(self.seq.state.block_table, self.num_tokens)
        flat = self.kv_cache[0].flatten(1, 2)  # [L, slots, Hkv, d]
        return flat[:, slots].permute(0, 2, 1, 3)  # [L, Hkv, N, d]

    def keys(self) -> torch.Tensor:
        """Post-RoPE keys ``[L, Hkv, N, d]`` (a copy, in the cache dtype)."""
        return self._keys

    def query_state(self) -> QueryState:
        if self.seq.query_slot is None:
            raise RuntimeError(f"{self.seq.request_id!r} has no query-state slot")
        return self.query_pool.read(self.seq.query_slot)

    def positions(self) -> torch.Tensor:
        return self.seq.slot_positions(self.num_layers, self.num_kv_heads, self.device)

    def accumulated_attention(self) -> torch.Tensor | None:
        """H2O sums of the resident slots ``[L, Hkv, N]`` fp32 (a copy); None when the engine
        does not record them (its policy does not read them)."""
        if self.accumulated is None:
            return None
        return gather_sums(
            self.accumulated, self._slots(self.seq.state.block_table, self.num_tokens)
        )

    def recent_queries(self, window: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The last ``window`` queries the request computed in this residency, rotated to
        their positions (``[L, W', Hq, d]`` fp32, ``[W']``); None without a ring."""
        if self.recent is None:
            return None
        if window > self.recent.window:
            raise EngineError(
                f"recent_queries({window}): the engine keeps the last {self.recent.window} "
                "queries (the policy's needs_recent_queries when the engine was built)"
            )
        if self.seq.query_slot is None:
            raise RuntimeError(f"{self.seq.request_id!r} has no query-state slot")
        end = self.seq.state.position  # the current query is token end - 1's
        start = min(max(end - window, self.seq.num_cached_tokens), end)
        positions = torch.arange(start, end, device=self.device)
        queries = self.recent.read(self.seq.query_slot, positions)
        return rotate_queries(self.rope, queries, positions), positions

    def _table(self, pages: list[int] | list[list[int]]) -> torch.Tensor:
        return to_device(pages, torch.int32, self.device)  # queued: no host sync on CUDA

    def _meta(self, num_candidates: int) -> list[int]:
        """``[Nc, splits]`` of ``demand_attention_batch`` for ``num_candidates``."""
        from growpage.kernels import demand_splits

        return [
            num_candidates,
            demand_splits(num_candidates, self.num_layers, self.num_kv_heads, self.device),
        ]

    def _candidate_sets(self) -> tuple[int, int]:
        """Estimation and selection candidate counts at this boundary."""
        n = self.num_tokens
        return n - self.page_size, n - self.recent_window

    def _row(
        self,
        width: int,
        counts: tuple[int, ...],
        position: int,
        table: list[int] | None = None,
    ) -> list[int]:
        """One row of the kernels' boundary table: the pages (``table``, else the request's
        own; ``-1`` padded to ``width``), then ``[Nc, splits]`` per count
        (``demand_attention_batch``'s meta at ``width + 2 i``), then ``[slot, position]``
        (``boundary_queries_batch``'s at ``width + 2 len(counts)``)."""
        if self.seq.query_slot is None:
            raise RuntimeError(f"{self.seq.request_id!r} has no query-state slot")
        table = self.seq.state.block_table if table is None else table
        row = list(table) + [-1] * (width - len(table))
        for n in counts:
            row += self._meta(max(n, 1))
        return row + [self.seq.query_slot, position]

    @functools.cached_property
    def _demand_table(self) -> torch.Tensor:
        """``[1, P + 6]`` int32 on the device, copied once per boundary: the estimation and the
        selection candidates' counts, and the request's slot and position."""
        return self._table(
            [self._row(self.seq.state.num_pages, self._candidate_sets(), self.seq.state.position)]
        )

    def _inv_freq(self) -> torch.Tensor:
        from growpage.core.rope import inv_frequencies_on

        return inv_frequencies_on(self.rope, self.device)

    def boundary_queries(self, position: int) -> torch.Tensor | None:
        """With kernels: calibration and rotation of both summaries in one launch."""
        if not self.use_kernels:
            return None
        from growpage.kernels import boundary_queries_batch

        width = self.seq.state.num_pages
        if position == self.seq.state.position:
            table, col = self._demand_table, width + 4
        else:
            table, col = self._table([self._row(width, (), position)]), width
        return boundary_queries_batch(
            self.query_pool.summaries, self.query_pool.current, table, col, self._inv_freq()
        )[0]

    def summary_attention(self, queries: torch.Tensor, num_candidates: int) -> torch.Tensor | None:
        """With kernels: ``demand_attention_batch`` reads the keys through the block table (no
        gathered copy of the request's keys, two launches for all layers and heads)."""
        if not self.use_kernels or num_candidates < 1:
            return None
        from growpage.kernels import demand_attention_batch

        width = self.seq.state.num_pages
        est, sel = self._candidate_sets()
        if num_candidates in (est, sel):
            table, col = self._demand_table, width + (0 if num_candidates == est else 2)
        else:
            table, col = (
                self._table([self._row(width, (num_candidates,), self.seq.state.position)]),
                width,
            )
        return demand_attention_batch(
            queries.float().contiguous()[None],
            self.kv_cache[0],
            table,
            col,
            num_candidates,
            self._meta(num_candidates)[1],
            self.softmax_scale,
        )[0]

    @staticmethod
    def batch_boundary_signals(
        views: list[KVView],
        positions: list[int],
        num_candidates: list[int],
        tables: list[list[int]] | None = None,
        queries: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """With kernels: every request's table in one copy, their calibrated, rotated
        summaries in one launch (none when ``queries`` are given) and their attention in
        two."""
        kernel_views = [v for v in views if isinstance(v, EngineKVView) and v.use_kernels]
        if not views or len(kernel_views) != len(views):
            return None
        from growpage.kernels import boundary_queries_batch, demand_attention_batch

        first = kernel_views[0]
        pages = tables if tables is not None else [v.seq.state.block_table for v in kernel_views]
        width = max(len(t) for t in pages)
        rows = [
            v._row(width, (n,), position, table)
            for v, n, position, table in zip(
                kernel_views, num_candidates, positions, pages, strict=True
            )
        ]
        device_rows = first._table(rows)
        if queries is None:
            queries = boundary_queries_batch(
                first.query_pool.summaries,
                first.query_pool.current,
                device_rows,
                width + 2,
                first._inv_freq(),
            )
        attention = demand_attention_batch(
            queries,
            first.kv_cache[0],
            device_rows,
            width,
            max(num_candidates),
            max(row[width + 1] for row in rows),
            first.softmax_scale,
        )
        return queries, attention

    def compact(self, keep: torch.Tensor, src_pages: list[int], dst_pages: list[int]) -> None:
        """Move slots ``keep [L, Hkv, K]`` (ascending) of ``src_pages`` to slots 0..K-1 of
        ``dst_pages``, per layer and KV head; keys, values and H2O sums alike."""
        num_kept = keep.shape[-1]
        keep = keep.to(self.device, torch.long)
        if self.use_kernels:  # one launch; overlapping source and target slots handled there
            from growpage.kernels import compact_kv

            # Both tables in one host-to-device copy; the overlap check runs on the host
            # (``compact_kv`` would otherwise check it on the device, with a sync).
            width = len(src_pages)
            tables = self._table([src_pages, dst_pages + [-1] * (width - len(dst_pages))])
            compact_kv(
                self.kv_cache,
                tables[:1],
                keep[None],
                tables[1:],
                accumulated=self.accumulated,
                staged=not direct_copy_safe(src_pages, dst_pages),
            )
            self._after_compaction(keep)
            return
        src = self._slots(src_pages, self.num_tokens)[keep]  # [L, Hkv, K] flat slots
        dst = self._slots(dst_pages, num_kept)  # [K]
        heads = torch.arange(self.num_kv_heads, device=self.device)
        # Index into the cache flattened to [2, L, slots * Hkv, d]: all layers in one gather
        # and one scatter (a handful of kernel launches per boundary, not a few per layer).
        src_idx = (src * self.num_kv_heads + heads[None, :, None]).flatten(1)  # [L, Hkv*K]
        dst_idx = (dst[None, :] * self.num_kv_heads + heads[:, None]).reshape(1, -1)
        layers = torch.arange(self.num_layers, device=self.device)[:, None]
        flat = self.kv_cache.view(2, self.num_layers, -1, self.head_dim)
        kept = flat[:, layers, src_idx]  # gather: a temporary copy
        flat[:, layers, dst_idx] = kept
        if self.accumulated is not None:  # [L, slots * Hkv]: the same flat indices
            sums = self.accumulated.view(self.num_layers, -1)
            sums[layers, dst_idx] = sums[layers, src_idx]
        self._after_compaction(keep)

    def _after_compaction(self, keep: torch.Tensor) -> None:
        # Positions stay on the cache's device: no device-to-host copy at a boundary.
        self.seq.kept_positions = torch.gather(self.positions(), 2, keep)
        self.seq.tail_start = self.seq.state.position
        self.__dict__.pop("_keys", None)
        self.__dict__.pop("_demand_table", None)


def boundary_kernels_on(use_kernels: bool | None, kv_cache: torch.Tensor) -> bool:
    """Whether boundaries run the Triton kernels: ``use_kernels``, or None = on CUDA."""
    return kv_cache.is_cuda if use_kernels is None else use_kernels


def direct_copy_safe(src_pages: list[int], dst_pages: list[int]) -> bool:
    """Whether compaction may copy in place: every page in both tables sits at the same index
    (the host-side twin of ``growpage.kernels.is_direct_safe``)."""
    index = {page: i for i, page in enumerate(src_pages)}
    return all(index.get(page, j) == j for j, page in enumerate(dst_pages))
