"""``BoundaryContext``: everything a policy may look at when a request hits its capacity boundary.

The same class serves the simulator and the engine; only the ``KVView`` behind it differs.
Signals are computed on first use and cached, so a policy pays only for what it reads.

Candidate sets over the resident slots ``0..N-1`` (b = page size, R = recent window)::

    slots:      0 ................................ N-b-1 | N-b ....... N-R-1 | N-R ... N-1
    estimation: [----------- candidates C_t ----------]   (most recent page excluded)
    selection:  [------------------------ candidates -------------------]   (protected R kept)
"""

from __future__ import annotations

import functools

import torch

from growpage.core import demand
from growpage.core.config import GrowPageConfig
from growpage.core.kvview import KVView
from growpage.core.rope import rope_at
from growpage.core.selection import importance
from growpage.errors import ConfigError

VIEWS = ("short", "long")


class BoundaryContext:
    """Read-only snapshot of one request at a capacity boundary, with lazily computed signals.

    Attributes:
        request_id: the request's id.
        num_tokens: resident tokens N (all ``num_pages * page_size`` slots are used).
        position: absolute position of the token that needs a slot (the current query's).
        num_pages: pages held P.
        num_free_pages: free pages in the pool right now.
        config: the ``GrowPageConfig`` in force.
        view: the KV view (read it; never change it).
    """

    def __init__(self, request_id: object, num_tokens: int, position: int, num_pages: int,
                 num_free_pages: int, config: GrowPageConfig, view: KVView) -> None:
        self.request_id = request_id
        self.num_tokens = num_tokens
        self.position = position
        self.num_pages = num_pages
        self.num_free_pages = num_free_pages
        self.config = config
        self.view = view
        self._ratios: dict[float, torch.Tensor] = {}   # p -> [2, L, Hkv]
        self._deltas: dict[float, float] = {}          # p -> Delta_t (one host sync each)

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
        keys = self.view.keys().float()
        views, num_layers, _, d = self._queries.shape
        q = self._queries.reshape(views, num_layers, self.view.num_kv_heads, -1, d)
        return torch.einsum("vlhgd,lhnd->vlhgn", q, keys) * self.view.softmax_scale

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
            raise ConfigError(f"BoundaryContext.{method}(p): the coverage must be a number in "
                              f"(0, 1] or None (config.top_p), got {p!r}")
        return float(p)

    def _ratio_pair(self, p: float) -> torch.Tensor:
        """``[2, L, Hkv]`` working-set ratios of both views at ``p``: one sort for both."""
        if p not in self._ratios:
            self._ratios[p] = demand.working_set_ratio(self._estimation_attention, p)
        return self._ratios[p]

    def delta(self, p: float | None = None) -> float:
        """Demand trend Delta_t = r^S - r^L averaged over layers and KV heads (Eq. 8).

        ``p``: coverage in (0, 1]; None means ``config.top_p``."""
        key = self._coverage(p, "delta")
        if key not in self._deltas:
            ratios = self._ratio_pair(key)
            self._deltas[key] = demand.demand_trend(ratios[0], ratios[1])
        return self._deltas[key]

    def computed_delta(self) -> float | None:
        """Delta_t at the configured p if the policy already paid for it, else None."""
        return self.delta() if self.config.top_p in self._ratios else None

    def entropy_delta(self) -> float:
        """Delta_t with the entropy ratio instead of the top-p working set (Table 2 ablation)."""
        return demand.demand_trend(demand.entropy_ratio(self.attention("short")),
                                   demand.entropy_ratio(self.attention("long")))

    def scores(self) -> torch.Tensor:
        """Importance s = max(a^S, a^L) (Eq. 9) of the selection candidates, ``[L, Hkv, N - R]``.

        Each view's attention is normalized over the selection candidates.
        """
        attn = self._selection_attention
        return importance(attn[0], attn[1])

    def accumulated_attention(self) -> torch.Tensor | None:
        """H2O-style accumulated attention ``[L, Hkv, N]`` if the view records it, else None."""
        return self.view.accumulated_attention()

    def positions(self) -> torch.Tensor:
        """Absolute positions held by each slot, ``[L, Hkv, N]``."""
        return self.view.positions()


# Cached signals a policy can reach (``attention()`` returns a view of the first) by name.
_CACHED_TENSORS = {"_estimation_attention": "attention()", "_selection_attention": "scores()",
                   "_queries": "the rotated query summaries", "_logits": "the summary logits"}


def changed_signals(ctx: BoundaryContext, fresh: BoundaryContext) -> list[str]:
    """The signals ``ctx`` has cached that differ from ``fresh``'s, a new context of the same
    boundary: a policy modified in place a tensor the context returned (``attention()``,
    ``working_set_ratio()``), so the context now answers differently. Used by the conformance
    kit's ``no-mutation`` rule; computes on ``fresh`` only what ``ctx`` computed."""
    changed = [label for name, label in _CACHED_TENSORS.items()
               if name in vars(ctx) and not _same(vars(ctx)[name], getattr(fresh, name))]
    changed += [f"working_set_ratio(p={p})" for p, ratios in ctx._ratios.items()
                if not _same(ratios, fresh._ratio_pair(p))]
    changed += [f"delta(p={p})" for p, delta in ctx._deltas.items()
                if not _same(torch.tensor(delta), torch.tensor(fresh.delta(p)))]
    return changed


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool(torch.isclose(a, b, rtol=0.0, atol=0.0,
                                                     equal_nan=True).all())


def _view_index(view: str, method: str) -> int:
    try:
        return VIEWS.index(view)
    except ValueError:
        raise ConfigError(f"BoundaryContext.{method}(view): the attention view must be 'short' "
                          f"or 'long', got {view!r}") from None
