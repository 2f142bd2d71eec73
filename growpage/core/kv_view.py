"""The KV view: what the controller and the ``BoundaryContext`` read and change of one request.

The simulator implements it over a recorded or synthetic trace, the engine over the live paged
cache. ``DenseKVView`` keeps everything in dense tensors; it serves the tests, the conformance kit
and the simulator's replay.
"""

from __future__ import annotations

import abc

import attrs
import torch

from growpage.core.observation import rotate_queries
from growpage.core.rope import RopeConfig


@attrs.frozen
class QueryState:
    """The query signals of a request at a boundary, all pre-RoPE (post q-norm), ``[L, Hq, d]``."""

    short: torch.Tensor
    long: torch.Tensor
    current: torch.Tensor


@attrs.frozen
class CompactionJob:
    """One compaction of a step's batch (``KVView.compact_batch``): keep slots ``keep
    [L, Hkv, K]`` (ascending) of the ``num_tokens`` slots in pages ``source``, moved to slots
    ``0..K-1`` of pages ``target``, at the boundary of the token at ``position``."""

    view: KVView
    keep: torch.Tensor
    source: list[int]
    target: list[int]
    num_tokens: int
    position: int


class KVView(abc.ABC):
    """One request's KV content over its participating layers.

    Slot ``i`` (0..num_tokens-1) is the i-th resident token in order; after a compaction each
    (layer, KV head) may hold a different token in slot ``i``, but all hold ``num_tokens``.
    """

    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    rope: RopeConfig
    softmax_scale: float

    @property
    @abc.abstractmethod
    def num_tokens(self) -> int:
        """Resident tokens."""

    @abc.abstractmethod
    def keys(self) -> torch.Tensor:
        """Post-RoPE keys of the resident slots, ``[L, Hkv, num_tokens, d]``."""

    @abc.abstractmethod
    def query_state(self) -> QueryState:
        """Short and long EMA summaries and the current query, each ``[L, Hq, d]``.

        NOTE: "current" is the query of the last token whose KV is resident (the token that
        filled the last slot); the summaries include it. The token that needs a slot has no
        query yet: the scheduler decides before its forward pass, in both worlds.
        """

    @property
    def has_query_state(self) -> bool:
        """False before the first decode query (a prompt that ends exactly on a page boundary);
        the controller then grows without asking the policy."""
        return True

    @abc.abstractmethod
    def positions(self) -> torch.Tensor:
        """Absolute token positions held in each slot, ``[L, Hkv, num_tokens]`` int64."""

    def accumulated_attention(self) -> torch.Tensor | None:
        """Attention accumulated by every past query on each slot (H2O), ``[L, Hkv, N]``.

        Every query the request has run counts, prompt included: its softmax weight on the
        slot, averaged over the query heads of each KV head, summed over queries; a compaction
        keeps the kept slots' sums. None when the view does not record it (both worlds record
        it for a policy with ``needs_accumulated_attention``).
        """
        return None

    def recent_queries(self, window: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The queries of the last ``window`` tokens the request computed in this residency
        (SnapKV's observation window): post-RoPE, each at its own position, ``[L, W', Hq, d]``
        fp32, and their positions ``[W']`` int64, ascending, the last one the current query's
        (token t - 1). ``W' < window`` when fewer were computed: early on, or after a prefix
        hit, whose cached tokens ran no query. None when the view does not keep them (both
        worlds keep them for a policy whose ``needs_recent_queries`` is at least ``window``).
        """
        return None

    def boundary_queries(self, position: int) -> torch.Tensor | None:
        """Optional fast path: the short/long summaries RMS-calibrated to the current query
        (Eq. 12) and rotated to ``position``, ``[2, L, Hq, d]`` fp32.

        None (the default) lets ``BoundaryContext`` compute them from ``query_state()`` in
        torch; the engine answers with one Triton launch on CUDA.
        """
        return None

    def summary_attention(self, queries: torch.Tensor, num_candidates: int) -> torch.Tensor | None:
        """Optional fast path: attention of ``queries [V, L, Hq, d]`` (calibrated, rotated)
        over slots ``0..num_candidates-1``, ``[V, L, Hkv, num_candidates]`` fp32 (softmax per
        query head, then the mean over each KV head's group), computed without ``keys()``.

        None (the default) lets ``BoundaryContext`` compute it from ``keys()`` in torch; the
        engine answers with a Triton kernel on CUDA that reads keys through the block table.
        """
        return None

    @staticmethod
    def batch_boundary_signals(
        views: list[KVView],
        positions: list[int],
        num_candidates: list[int],
        tables: list[list[int]] | None = None,
        queries: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Optional fast path: ``boundary_queries`` and ``summary_attention`` of several
        requests' views (of one class) at once: ``[R, 2, L, Hq, d]`` queries rotated to
        ``positions[r]`` (``queries`` when given) and ``[R, 2, L, Hkv, max(num_candidates)]``
        fp32 attention, request r's distributions over its ``num_candidates[r]`` candidates
        then zeros. ``tables``: the block tables to read the keys through (as
        ``batch_keys``'). Used by ``BoundaryBatch`` and a step's batched selection; None (the
        default) computes each request on its own."""
        return None

    @property
    def has_fast_signals(self) -> bool:
        """Whether ``boundary_queries`` and ``summary_attention`` answer (the engine's kernels);
        else ``BoundaryContext`` computes the signals in torch from ``query_state()`` and
        ``keys()``, for several requests at once through ``batch_query_states`` and
        ``batch_keys``."""
        return False

    @staticmethod
    def batch_query_states(views: list[KVView]) -> tuple[torch.Tensor, torch.Tensor]:
        """``query_state()`` of several views: ``[R, 2, L, Hq, d]`` short and long summaries
        and ``[R, L, Hq, d]`` current queries (a view class may read them in one pass)."""
        states = [v.query_state() for v in views]
        short = torch.stack([s.short for s in states])
        long = torch.stack([s.long for s in states])
        return torch.stack([short, long], dim=1), torch.stack([s.current for s in states])

    @staticmethod
    def batch_keys(
        views: list[KVView], tables: list[list[int]] | None, num_tokens: list[int]
    ) -> torch.Tensor:
        """``keys()`` of several views in one tensor ``[R, L, Hkv, max(num_tokens), d]``:
        request r's first ``num_tokens[r]`` slots, then padding of any value (nothing reads
        it; zeros here). A view class may read them in one pass.

        ``tables``: the views' block tables at their boundary, when their requests may have
        been booked since (a view over pages reads through them; others ignore them); None:
        the views' own."""
        keys = [v.keys()[:, :, :n] for v, n in zip(views, num_tokens, strict=True)]
        num_layers, num_kv, _, d = keys[0].shape
        out = keys[0].new_zeros(len(keys), num_layers, num_kv, max(num_tokens), d)
        for r, k in enumerate(keys):
            out[r, :, :, : k.shape[2]] = k
        return out

    @staticmethod
    def compact_batch(jobs: list[CompactionJob], keep: torch.Tensor) -> None:
        """Run several compactions of one step (``job.view`` of this class each), as if one
        after the other in order; every job reads its slots before any job writes. ``keep``:
        the jobs' slots in one tensor ``[R, L, Hkv, K_max]``, -1 past each job's.

        The default calls each view's ``compact``, which suits a view that holds its own
        slots (its ``num_tokens`` is still the job's); the engine's view, which reads its
        request's state, moves every job's slots in one gather and one scatter."""
        for job in jobs:
            job.view.compact(job.keep, job.source, job.target)

    @abc.abstractmethod
    def compact(self, keep: torch.Tensor, src_pages: list[int], dst_pages: list[int]) -> None:
        """Keep only slots ``keep [L, Hkv, K]`` (ascending), moved to slots 0..K-1.

        ``src_pages`` is the block table before, ``dst_pages`` after (shared pages replaced by
        private ones, a released page dropped). Views without physical pages ignore them.
        """

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")


class DenseKVView(KVView):
    """A KV view over dense tensors with room for ``capacity`` slots."""

    def __init__(
        self,
        num_layers: int,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rope: RopeConfig,
        capacity: int,
        softmax_scale: float | None = None,
        device: str | torch.device = "cpu",
        track_accumulated: bool = False,
    ) -> None:
        if num_q_heads % num_kv_heads:
            raise ValueError(
                f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
            )
        self.num_layers, self.num_q_heads = num_layers, num_q_heads
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.rope = rope
        self.softmax_scale = softmax_scale if softmax_scale is not None else head_dim**-0.5
        self._device = torch.device(device)
        shape = (num_layers, num_kv_heads, capacity)
        self._keys = torch.zeros(*shape, head_dim, device=self._device)
        self._positions = torch.zeros(shape, dtype=torch.long, device=self._device)
        self._acc = torch.zeros(shape, device=self._device) if track_accumulated else None
        self._n = 0
        zeros = torch.zeros(num_layers, num_q_heads, head_dim, device=self._device)
        self.summaries = torch.zeros(num_layers, 2, num_q_heads, head_dim, device=self._device)
        self.current_query = zeros
        self._has_queries = False
        self._recent: tuple[torch.Tensor, torch.Tensor] | None = None  # pre-RoPE, positions

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def num_tokens(self) -> int:
        return self._n

    @property
    def capacity(self) -> int:
        return self._keys.shape[2]

    def append(self, keys: torch.Tensor, position: int) -> None:
        """Write one token's post-RoPE keys ``[L, Hkv, d]`` into the next slot."""
        self.extend(keys.unsqueeze(2), torch.tensor([position]))

    def extend(self, keys: torch.Tensor, positions: torch.Tensor) -> None:
        """Write ``n`` tokens' post-RoPE keys ``[L, Hkv, n, d]`` at ``positions [n]``."""
        n = keys.shape[2]
        while self._n + n > self.capacity:
            self._grow_storage(max(self.capacity, n))
        self._keys[:, :, self._n : self._n + n] = keys.to(self._keys.dtype)
        self._positions[:, :, self._n : self._n + n] = positions.to(self._positions.device)
        if self._acc is not None:
            self._acc[:, :, self._n : self._n + n] = 0
        self._n += n

    def add_attention(self, attn: torch.Tensor) -> None:
        """Accumulate one query's attention ``[L, Hkv, N]`` over the resident slots (H2O)."""
        if self._acc is not None:
            self._acc[:, :, : self._n] += attn.to(self._acc.dtype)

    def set_queries(self, summaries: torch.Tensor, current: torch.Tensor) -> None:
        """``summaries [L, 2, Hq, d]`` (short, long) and ``current [L, Hq, d]``, pre-RoPE."""
        self.summaries = summaries
        self.current_query = current
        self._has_queries = True

    def set_recent_queries(self, queries: torch.Tensor, positions: torch.Tensor) -> None:
        """Pre-RoPE (post q-norm) ``queries [L, n, Hq, d]`` of the tokens at ``positions [n]``
        (consecutive, ascending, the last the current query's) for ``recent_queries``."""
        if queries.shape[1] != positions.numel():
            raise ValueError(
                f"{queries.shape[1]} recent queries given with {positions.numel()} positions"
            )
        self._recent = queries, positions.to(torch.long)

    def recent_queries(self, window: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self._recent is None:
            return None
        queries, positions = self._recent
        start = max(positions.numel() - window, 0)
        positions = positions[start:].to(self._device)
        return rotate_queries(self.rope, queries[:, start:].to(self._device), positions), positions

    def clear_queries(self) -> None:
        """No query summary until the next ``set_queries`` (the request has not decoded since its
        admission)."""
        self._has_queries = False

    @property
    def has_query_state(self) -> bool:
        return self._has_queries

    def keys(self) -> torch.Tensor:
        return self._keys[:, :, : self._n]

    def positions(self) -> torch.Tensor:
        return self._positions[:, :, : self._n]

    def accumulated_attention(self) -> torch.Tensor | None:
        return None if self._acc is None else self._acc[:, :, : self._n]

    def query_state(self) -> QueryState:
        return QueryState(self.summaries[:, 0], self.summaries[:, 1], self.current_query)

    def compact(self, keep: torch.Tensor, src_pages: list[int], dst_pages: list[int]) -> None:
        k = keep.shape[-1]
        idx = keep.to(self._device)
        kept_keys = torch.gather(
            self.keys(), 2, idx.unsqueeze(-1).expand(-1, -1, -1, self.head_dim)
        )
        self._keys[:, :, :k] = kept_keys
        self._positions[:, :, :k] = torch.gather(self.positions(), 2, idx)
        if self._acc is not None:
            self._acc[:, :, :k] = torch.gather(self._acc[:, :, : self._n], 2, idx)
        self._n = k

    def _grow_storage(self, extra: int) -> None:
        def pad(t: torch.Tensor) -> torch.Tensor:
            shape = list(t.shape)
            shape[2] = extra
            return torch.cat([t, t.new_zeros(shape)], dim=2)

        self._keys, self._positions = pad(self._keys), pad(self._positions)
        if self._acc is not None:
            self._acc = pad(self._acc)
