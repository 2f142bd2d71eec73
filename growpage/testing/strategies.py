"""Hypothesis strategies that build valid ``BoundaryContext``s of small random shapes."""

from __future__ import annotations

import attrs
import torch
from hypothesis import strategies as st

from growpage.core.config import GrowPageConfig
from growpage.core.context import BoundaryContext
from growpage.core.kvview import DenseKVView
from growpage.core.rope import RopeConfig


@attrs.frozen
class BoundaryCase:
    """A reproducible boundary: build the same context again with ``context()``."""

    num_layers: int
    num_kv_heads: int
    group_size: int
    head_dim: int
    page_size: int
    recent_window: int
    num_pages: int
    num_free_pages: int
    gap: int             # tokens evicted earlier: position = num_tokens + gap
    seed: int
    sharpness: float     # scale of the queries: larger means more concentrated attention
    track_accumulated: bool

    @property
    def num_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def config(self) -> GrowPageConfig:
        return GrowPageConfig(page_size=self.page_size, recent_window=self.recent_window)

    def view(self) -> DenseKVView:
        g = torch.Generator().manual_seed(self.seed)
        num_q = self.num_kv_heads * self.group_size
        rope = RopeConfig(head_dim=self.head_dim, theta=10000.0)
        view = DenseKVView(self.num_layers, num_q, self.num_kv_heads, self.head_dim, rope,
                           capacity=self.num_tokens, track_accumulated=self.track_accumulated)
        n, position = self.num_tokens, self.num_tokens + self.gap
        kept = torch.randperm(position, generator=g)[:n].sort().values
        view.extend(torch.randn(self.num_layers, self.num_kv_heads, n, self.head_dim,
                                generator=g), kept)
        if self.track_accumulated:
            view.add_attention(torch.rand(self.num_layers, self.num_kv_heads, n, generator=g))
        shape = (self.num_layers, num_q, self.head_dim)
        summaries = torch.randn(self.num_layers, 2, *shape[1:], generator=g) * self.sharpness
        current = torch.randn(*shape, generator=g) * self.sharpness
        view.set_queries(summaries, current)
        return view

    def context(self, view: DenseKVView | None = None) -> BoundaryContext:
        view = view if view is not None else self.view()
        return BoundaryContext(request_id=f"req-{self.seed}", num_tokens=self.num_tokens,
                               position=self.num_tokens + self.gap, num_pages=self.num_pages,
                               num_free_pages=self.num_free_pages, config=self.config, view=view)


@st.composite
def boundary_cases(draw: st.DrawFn, max_layers: int = 3, max_kv_heads: int = 3,
                   max_group: int = 4, page_sizes: tuple[int, ...] = (4, 8, 16),
                   max_pages: int = 6, head_dims: tuple[int, ...] = (4, 8, 16),
                   accumulated: bool | None = None) -> BoundaryCase:
    """Small random boundaries: shapes, page size, recent window, pool state and content.

    ``accumulated``: whether the view tracks H2O's accumulated attention (True for a policy
    with ``needs_accumulated_attention``, which always gets it); None draws it.
    """
    if accumulated is not None and not isinstance(accumulated, bool):
        raise TypeError(f"accumulated must be True, False or None, got {accumulated!r}")
    page_size = draw(st.sampled_from(page_sizes))
    return BoundaryCase(
        num_layers=draw(st.integers(1, max_layers)),
        num_kv_heads=draw(st.integers(1, max_kv_heads)),
        group_size=draw(st.integers(1, max_group)),
        head_dim=draw(st.sampled_from(head_dims)),
        page_size=page_size,
        recent_window=draw(st.integers(0, page_size - 1)),
        num_pages=draw(st.integers(2, max_pages)),
        num_free_pages=draw(st.integers(0, 8)),
        gap=draw(st.integers(0, 64)),
        seed=draw(st.integers(0, 2**31 - 1)),
        sharpness=draw(st.sampled_from([0.1, 1.0, 4.0])),
        track_accumulated=draw(st.booleans()) if accumulated is None else accumulated,
    )


def boundary_contexts(**kwargs: object) -> st.SearchStrategy[BoundaryContext]:
    """Valid ``BoundaryContext``s (see ``boundary_cases`` for the knobs)."""
    return boundary_cases(**kwargs).map(lambda case: case.context())
