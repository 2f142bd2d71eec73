"""``BoundaryContext``: everything a policy may look at when a request hits its capacity boundary.

The same class serves the simulator and the engine; only the ``KVView`` behind it differs.
Signals are computed on first use and cached, so a policy pays only for what it reads.

Candidate sets over the resident slots ``0..N-1`` (b = page size, R = recent window)::

    slots:      0 ................................ N-b-1 | N-b ....... N-R-1 | N-R ... N-1
    estimation: [----------- candidates C_t ----------]   (most recent page excluded)
    selection:  [------------------------ candidates -------------------]   (protected R kept)

With ``GrowPageConfig.protect_prompt`` the first ``num_protected_prefix`` slots (the prompt)
are kept as well: a selection holds them, and chooses among slots ``prefix .. N-R-1``.
"""

from __future__ import annotations

import functools
from collections.abc import Hashable

import torch

from growpage.core import boundary_signals, demand, observation
from growpage.core.config import GrowPageConfig
from growpage.core.kv_view import KVView
from growpage.core.rope import rope_at
from growpage.core.selection import importance
from growpage.errors import ConfigError

VIEWS = ("short", "long")


class BoundaryContext:
    """Read-only snapshot of one request at a capacity boundary, with lazily computed signals.

    Attributes:
        request_id: the request's id (``Hashable``; a ``str`` in the engine and the simulator).
        num_tokens: resident tokens N (all ``num_pages * page_size`` slots are used).
        position: absolute position t of the token that needs a slot; the current query (the
            view's ``current_query``) is token t - 1's, the last one decoded.
        num_pages: pages held P (``capacity`` is ``P * page_size``, in tokens).
        num_free_pages: free pages in the pool right now.
        config: the ``GrowPageConfig`` in force.
        view: the KV view (read it; never change it).
        num_prompt_tokens: the request's prompt length (0 when unknown).
        batch: the ``BoundaryBatch`` this context shares its top-p sizes and Delta_t with, or
            None.
        num_recent_queries: the policy's ``needs_recent_queries``: ``recent_queries(w)`` and
            ``window_attention(w)`` are None when it is 0, and refuse a ``w`` above it (in both
            worlds alike, whatever the view keeps); None: the view decides.
    """

    def __init__(
        self,
        request_id: Hashable,
        num_tokens: int,
        position: int,
        num_pages: int,
        num_free_pages: int,
        config: GrowPageConfig,
        view: KVView,
        num_prompt_tokens: int = 0,
        num_recent_queries: int | None = None,
    ) -> None:
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self.num_tokens = num_tokens
        self.position = position
        self.num_pages = num_pages
        self.num_free_pages = num_free_pages
        self.config = config
        self.view = view
        #: The most recent queries the policy may read (its ``needs_recent_queries``, as the
        #: controller builds the context); None: as many as the view keeps.
        self.num_recent_queries = num_recent_queries
        #: The ``BoundaryBatch`` this context shares its top-p sizes and Delta_t with, if any.
        self.batch: BoundaryBatch | None = None
        self._counts: dict[float, torch.Tensor] = {}  # p -> [2, L, Hkv] top-p sizes (int64)
        self._ratios: dict[float, torch.Tensor] = {}  # p -> [2, L, Hkv]
        self._deltas: dict[float, float] = {}  # p -> Delta_t (one host sync each)
        self._read_missing_sums = False  # accumulated_attention() answered None: for errors
        self._read_missing_queries = False  # recent_queries() answered None: for errors
        self._windows: dict[int, torch.Tensor | None] = {}  # window -> window_attention

    # ---- plain facts ----------------------------------------------------------------------
    @property
    def page_size(self) -> int:
        return self.config.page_size

    @property
    def recent_window(self) -> int:
        return self.config.recent_window

    @property
    def capacity(self) -> int:
        """Tokens the request can hold now, ``num_pages * page_size``."""
        return self.num_pages * self.page_size

    @property
    def num_protected_prefix(self) -> int:
        """Leading slots every selection keeps: the prompt with ``config.protect_prompt``,
        else 0. (Kept through every compression, they still hold the prompt's tokens.)"""
        return self.num_prompt_tokens if self.config.protect_prompt else 0

    @property
    def num_estimation_candidates(self) -> int:
        return self.num_tokens - self.page_size

    @property
    def num_selection_candidates(self) -> int:
        return self.num_tokens - self.recent_window

    @property
    def shape(self) -> tuple[int, int]:
        """``(L, Hkv)`` of the participating layers."""
        return self.view.num_layers, self.view.num_kv_heads

    @property
    def device(self) -> torch.device:
        return self.view.device

    # ---- lazily computed signals ----------------------------------------------------------
    @functools.cached_property
    def _queries(self) -> torch.Tensor:
        """``[2, L, Hq, d]`` short/long summaries, RMS-calibrated (Eq. 12) and rotated to the
        current position."""
        fast = self.view.boundary_queries(self.position)
        if fast is not None:
            return fast
        qs = self.view.query_state()
        # Both views in one pass: the same elementwise maths as calibrating each on its own.
        summaries = torch.stack([qs.short, qs.long])
        return rope_at(self.view.rope, demand.rms_calibrate(summaries, qs.current), self.position)

    @functools.cached_property
    def _logits(self) -> torch.Tensor:
        """``[2, L, Hkv, G, N]`` scaled logits of the calibrated, rotated short/long summaries."""
        keys = self.view.keys()
        return boundary_signals.summary_logits(
            self._queries[None], keys[None], self.view.softmax_scale
        )[0]

    def _group_softmax(self, num_candidates: int) -> torch.Tensor:
        # Mean over the query group of each query head's softmax (see core.demand docstring).
        fast = self.view.summary_attention(self._queries, num_candidates)
        if fast is not None:
            return fast
        return self._logits[..., :num_candidates].softmax(dim=-1).mean(dim=3)

    @functools.cached_property
    def _estimation_attention(self) -> torch.Tensor:
        return self._group_softmax(self.num_estimation_candidates)

    @functools.cached_property
    def _selection_attention(self) -> torch.Tensor:
        return self._group_softmax(self.num_selection_candidates)

    def attention(self, view: str) -> torch.Tensor:
        """Normalized attention of the ``"short"`` or ``"long"`` summary over the estimation
        candidates, ``[L, Hkv, N - b]`` (mean over each KV head's query group)."""
        return self._estimation_attention[_view_index(view, "attention")]

    def working_set_ratio(self, view: str, p: float | None = None) -> torch.Tensor:
        """Top-p working-set ratio r (Eq. 7) per layer and KV head, ``[L, Hkv]`` in (0, 1].

        ``p``: coverage in (0, 1]; None means ``config.top_p``."""
        index = _view_index(view, "working_set_ratio")
        return self._ratio_pair(self._coverage(p, "working_set_ratio"))[index]

    def _coverage(self, p: float | None, method: str) -> float:
        if p is None:
            return self.config.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 < p <= 1.0:
            raise ConfigError(
                f"BoundaryContext.{method}(p): the coverage must be a number in "
                f"(0, 1] or None (config.top_p), got {p!r}"
            )
        return float(p)

    def _size_pair(self, p: float) -> torch.Tensor:
        """``[2, L, Hkv]`` top-p working-set sizes of both views at ``p`` (one sort for both;
        with a batch, one sort for every request in it)."""
        if p not in self._counts and self.batch is not None:
            self.batch.fill(p, self, deltas=False)
        if p not in self._counts:
            self._counts[p] = demand.working_set_counts([self._estimation_attention], p)[0]
        return self._counts[p]

    def _ratio_pair(self, p: float) -> torch.Tensor:
        """``[2, L, Hkv]`` working-set ratios of both views at ``p``."""
        if p not in self._ratios:
            self._ratios[p] = self._size_pair(p).float() / self.num_estimation_candidates
        return self._ratios[p]

    def delta(self, p: float | None = None) -> float:
        """Demand trend Delta_t = r^S - r^L averaged over layers and KV heads (Eq. 8).

        ``p``: coverage in (0, 1]; None means ``config.top_p``."""
        key = self._coverage(p, "delta")
        if key not in self._deltas and self.batch is not None:
            self.batch.fill(key, self, deltas=True)
        if key not in self._deltas:
            sizes = self._size_pair(key)
            self._deltas[key] = demand.demand_trends(sizes[None], [self.num_estimation_candidates])[
                0
            ]
        return self._deltas[key]

    def computed_delta(self) -> float | None:
        """Delta_t at the configured p if the policy already paid for it, else None."""
        return self.delta() if self.config.top_p in self._counts else None

    def entropy_delta(self) -> float:
        """Delta_t with the entropy ratio instead of the top-p working set (Table 2 ablation)."""
        return demand.demand_trend(
            demand.entropy_ratio(self.attention("short")),
            demand.entropy_ratio(self.attention("long")),
        )

    def scores(self) -> torch.Tensor:
        """Importance s = max(a^S, a^L) (Eq. 9) of the selection candidates, ``[L, Hkv, N - R]``.

        Each view's attention is normalized over the selection candidates.
        """
        attn = self._selection_attention
        return importance(attn[0], attn[1])

    def accumulated_attention(self) -> torch.Tensor | None:
        """H2O-style accumulated attention ``[L, Hkv, N]`` if the view records it, else None
        (both worlds record it for a policy with ``needs_accumulated_attention``)."""
        sums = self.view.accumulated_attention()
        self._read_missing_sums |= sums is None
        return None if sums is None else sums.clone()

    def recent_queries(self, window: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The post-RoPE queries of the last ``window`` tokens the request computed in this
        residency, ``[L, W', Hq, d]`` fp32, and their positions ``[W']`` (ascending, the last
        t - 1; ``W' < window`` early on or after a prefix hit); None when the view keeps none
        (both worlds keep them for a policy with ``needs_recent_queries >= window``)."""
        got = self._recent_queries(_window(window, "recent_queries"), "recent_queries")
        return None if got is None else (got[0].clone(), got[1].clone())

    def window_attention(self, window: int) -> torch.Tensor | None:
        """SnapKV's observation-window attention ``[L, Hkv, N]`` fp32 over every resident slot:
        the causal softmax weights of each of the last ``window`` queries, summed over them and
        over each KV head's query group (``core.observation.window_attention``); None when the
        view keeps no recent queries."""
        window = _window(window, "window_attention")
        if window not in self._windows:
            got = self._recent_queries(window, "window_attention")
            self._windows[window] = (
                None
                if got is None
                else observation.window_attention(
                    got[0],
                    got[1],
                    self.view.keys(),
                    self.view.positions(),
                    self.view.softmax_scale,
                )
            )
        attn = self._windows[window]
        return None if attn is None else attn.clone()

    def _recent_queries(self, window: int, method: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The view's last ``window`` queries, within what the policy declared.

        NOTE: the simulator's trace views hold every query and the engine keeps only the
        declared ring: the declaration, not the view, says what a policy gets."""
        declared = self.num_recent_queries
        if declared is not None and 0 < declared < window:
            raise ConfigError(
                f"BoundaryContext.{method}({window}): the policy's needs_recent_queries is "
                f"{declared}, so both worlds keep only its last {declared} queries; a policy "
                f"that reads {window} sets needs_recent_queries to at least {window}"
            )
        got = None if declared == 0 else self.view.recent_queries(window)
        self._read_missing_queries |= got is None
        return got

    def positions(self) -> torch.Tensor:
        """Absolute positions held by each slot, ``[L, Hkv, N]``."""
        # NOTE: copies (as accumulated_attention's): a view may hand out its own storage (the
        # simulator's do), which a policy changing the tensor in place would corrupt.
        return self.view.positions().clone()


def missing_sums_hint(ctx: BoundaryContext) -> str:
    """For an error raised by a policy: a hint when it read sums or recent queries the view
    does not keep."""
    hints = []
    if getattr(ctx, "_read_missing_sums", False):  # a context of another class: none
        hints.append(
            " -- accumulated_attention() was None here: a policy that reads it sets "
            "needs_accumulated_attention = True"
        )
    if getattr(ctx, "_read_missing_queries", False):
        hints.append(
            " -- recent_queries() / window_attention() was None here: a policy that reads "
            "them sets needs_recent_queries to its window"
        )
    return "".join(hints)


def _window(window: int, method: str) -> int:
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ConfigError(
            f"BoundaryContext.{method}(window): the window must be a positive integer, "
            f"got {window!r}"
        )
    return window


class BoundaryBatch:
    """Contexts of the requests that reach their capacity boundaries in the same step.

    The first time one of them reads its top-p sizes or Delta_t (``working_set_ratio``,
    ``delta``), they are computed for every member still at that boundary: one padded sort and
    one host sync for all of them instead of one each. Each member's numbers are the ones it
    gets alone (``demand.working_set_counts``, ``demand.demand_trends``). A member whose request
    has moved on (compacted, preempted: its view no longer holds the context's tokens or query
    state) is left out. The engine builds one per decode step
    (``CapacityController.prepare``); a context without a batch computes its own.
    """

    #: Most padded attention entries sorted at once; more members are split into groups.
    max_elements: int = 1 << 24
    #: Sort members of different candidate counts together, zero-padded (None: yes). False
    #: sorts only equal counts together: fewer padded entries, one sort per count.
    pad: bool | None = None

    def __init__(self) -> None:
        self._contexts: list[BoundaryContext] = []
        self._pending: dict[object, BoundaryContext] = {}

    def __len__(self) -> int:
        return len(self._contexts)

    def add(self, ctx: BoundaryContext) -> None:
        if ctx.request_id in self._pending:
            raise ValueError(f"request {ctx.request_id!r} is already in this boundary batch")
        ctx.batch = self
        self._contexts.append(ctx)
        self._pending[ctx.request_id] = ctx

    def take(self, request_id: object) -> BoundaryContext | None:
        """The context prepared for ``request_id`` (once), or None."""
        return self._pending.pop(request_id, None)

    def fill(self, p: float, asking: BoundaryContext, deltas: bool) -> None:
        """Top-p sizes (and with ``deltas`` Delta_t) at ``p`` of every live member lacking them."""
        cache = "_deltas" if deltas else "_counts"
        todo = [
            c
            for c in self._contexts
            if p not in getattr(c, cache) and (c is asking or _still_at_boundary(c))
        ]
        boundary_signals.fill_estimation([c for c in todo if p not in c._counts])
        groups = self._groups(todo)
        stacked = []
        for group in groups:
            missing = [c for c in group if p not in c._counts]
            if missing:
                counts = demand.working_set_counts(_attention_of(missing), p)
                for c, k in zip(missing, counts, strict=True):
                    c._counts[p] = k
            if len(missing) < len(group):
                counts = torch.stack([c._counts[p] for c in group])
            stacked.append(counts)
        if deltas:
            members = [c for group in groups for c in group]
            trends = demand.demand_trends(stacked, [c.num_estimation_candidates for c in members])
            for c, d in zip(members, trends, strict=True):
                c._deltas[p] = d

    def _groups(self, todo: list[BoundaryContext]) -> list[list[BoundaryContext]]:
        """``todo`` in groups sorted together, by candidate count, each within ``max_elements``
        padded entries; without ``pad`` only equal candidate counts share a group."""
        groups: list[list[BoundaryContext]] = []
        pad = self.pad is not False
        widest = 0
        for c in sorted(todo, key=lambda c: c.num_estimation_candidates):
            n = c.num_estimation_candidates
            rows = 2 * c.view.num_layers * c.view.num_kv_heads
            if (
                groups
                and (pad or n == widest)
                and (len(groups[-1]) + 1) * max(widest, n) * rows <= self.max_elements
            ):
                groups[-1].append(c)
            else:
                groups.append([c])
            widest = max(widest, n) if pad and len(groups[-1]) > 1 else n
        return groups


def _attention_of(contexts: list[BoundaryContext]) -> list[torch.Tensor] | torch.Tensor:
    """The estimation attention of ``contexts``: through their views' batched fast path when it
    answers (queries and attention of all in one call, the attention zero-padded
    ``[R, 2, L, Hkv, N_max]``), else each its own."""
    fresh = all(
        "_queries" not in vars(c) and "_estimation_attention" not in vars(c) for c in contexts
    )
    view_class = type(contexts[0].view)
    if fresh and len(contexts) > 1 and all(type(c.view) is view_class for c in contexts):
        counts = [c.num_estimation_candidates for c in contexts]
        signals = view_class.batch_boundary_signals(
            [c.view for c in contexts], [c.position for c in contexts], counts
        )
        if signals is not None:
            queries, padded = signals
            for i, (c, n) in enumerate(zip(contexts, counts, strict=True)):
                c.__dict__["_queries"] = queries[i]
                c.__dict__["_estimation_attention"] = padded[i, ..., :n]
            return padded
    return [c._estimation_attention for c in contexts]


def _still_at_boundary(ctx: BoundaryContext) -> bool:
    view = ctx.view
    return view.has_query_state and view.num_tokens == ctx.num_tokens


# Cached signals a policy can reach (``attention()`` returns a view of the first) by name.
_CACHED_TENSORS = {
    "_estimation_attention": "attention()",
    "_selection_attention": "scores()",
    "_queries": "the rotated query summaries",
    "_logits": "the summary logits",
}


def changed_signals(ctx: BoundaryContext, fresh: BoundaryContext) -> list[str]:
    """The signals ``ctx`` has cached that differ from ``fresh``'s, a new context of the same
    boundary: a policy modified in place a tensor the context returned (``attention()``,
    ``working_set_ratio()``), so the context now answers differently. Used by the conformance
    kit's ``no-mutation`` rule; computes on ``fresh`` only what ``ctx`` computed."""
    changed = [
        label
        for name, label in _CACHED_TENSORS.items()
        if name in vars(ctx) and not _same(vars(ctx)[name], getattr(fresh, name))
    ]
    changed += [
        f"top-p sizes (p={p})"
        for p, sizes in ctx._counts.items()
        if not _same(sizes, fresh._size_pair(p))
    ]
    changed += [
        f"working_set_ratio(p={p})"
        for p, ratios in ctx._ratios.items()
        if not _same(ratios, fresh._ratio_pair(p))
    ]
    changed += [
        f"delta(p={p})"
        for p, delta in ctx._deltas.items()
        if not _same(torch.tensor(delta), torch.tensor(fresh.delta(p)))
    ]
    return changed


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool(
        torch.isclose(a, b, rtol=0.0, atol=0.0, equal_nan=True).all()
    )


def _view_index(view: str, method: str) -> int:
    try:
        return VIEWS.index(view)
    except ValueError:
        raise ConfigError(
            f"BoundaryContext.{method}(view): the attention view must be 'short' "
            f"or 'long', got {view!r}"
        ) from None
