"""Hypothesis strategies that build valid ``BoundaryContext``s of small random shapes.

A case is a short request history replayed as both worlds fill a KV view (``TraceView``, the
engine's cache): a prompt, then decode boundaries that grow or compress. Each compression
drops, per layer and KV head, its own slots outside the protected recent window, so heads hold
different positions, ascending, the last page the same in all. Keys are rotated to their
positions; the summaries are the EMAs of the decode queries (the current query is token
t - 1's), and H2O's accumulated sums are each past query's attention over the slots resident
when it ran, averaged over the KV head's query group and summed::

    acc[l, h, slot] = sum over queries q < t that saw the slot of  mean_g softmax(q . k)[slot]

so they are non-negative, a slot holding position p collects at most t - p, and without
compressions every (layer, head) sums to t. A view that keeps recent queries (SnapKV's
observation window) holds every query of the history, so ``recent_queries(w)`` gives the last
``min(w, t)`` of them, rotated to their positions.
"""

from __future__ import annotations

import functools
import random
from typing import Any

import attrs
import torch
from hypothesis import strategies as st

from growpage.core.boundary_context import BoundaryContext
from growpage.core.config import GrowPageConfig
from growpage.core.kv_view import DenseKVView
from growpage.core.rope import RopeConfig, apply_rope, cos_sin
from growpage.validators import is_int, non_negative_int


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
    gap: int = attrs.field(validator=non_negative_int)  # tokens evicted: position - num_tokens
    seed: int
    sharpness: float  # scale of the queries: larger means more concentrated attention
    track_accumulated: bool
    keeps_recent_queries: bool = True
    #: Leading slots kept out of compression (``GrowPageConfig.protect_prompt`` with a prompt
    #: of this many tokens); 0: the paper's setting, nothing protected but the recent window.
    protected_prefix: int = attrs.field(default=0, validator=non_negative_int)

    @property
    def num_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def position(self) -> int:
        return self.num_tokens + self.gap

    @property
    def config(self) -> GrowPageConfig:
        return GrowPageConfig(
            page_size=self.page_size,
            recent_window=self.recent_window,
            protect_prompt=self.protected_prefix > 0,
        )

    def view(self) -> DenseKVView:
        """A fresh view of this boundary (its tensors are the case's own copies)."""
        return _CaseView(self)

    def context(self, view: DenseKVView | None = None) -> BoundaryContext:
        view = view if view is not None else self.view()
        return BoundaryContext(
            request_id=f"req-{self.seed}",
            num_tokens=self.num_tokens,
            position=self.position,
            num_pages=self.num_pages,
            num_free_pages=self.num_free_pages,
            config=self.config,
            view=view,
            num_prompt_tokens=self.protected_prefix,
        )


@attrs.frozen
class _History:
    rope: RopeConfig
    keys: torch.Tensor  # [L, Hkv, t, d] post-RoPE keys of every position before t
    resident: torch.Tensor  # [L, Hkv, N] int64 positions held, ascending per (layer, head)
    summaries: torch.Tensor  # [L, 2, Hq, d] short/long EMAs of the decode queries
    current: torch.Tensor  # [L, Hq, d] token t - 1's pre-RoPE query
    queries: torch.Tensor  # [L, t, Hq, d] pre-RoPE queries of every position before t
    evicted_at: torch.Tensor  # [L, Hkv, t] boundary that dropped each position (t: never)
    prompt_len: int
    #: Earlier boundaries: (position, slots kept [L, Hkv, K] ascending) for a compression,
    #: (position, None) for a growth.
    steps: tuple[tuple[int, torch.Tensor | None], ...]


class _CaseView(DenseKVView):
    """A case's view. Its accumulated sums (O(t^2) to replay) are computed on first use, so a
    policy that never reads them does not pay for them."""

    def __init__(self, case: BoundaryCase) -> None:
        h = _history(case)
        super().__init__(
            case.num_layers,
            case.num_kv_heads * case.group_size,
            case.num_kv_heads,
            case.head_dim,
            h.rope,
            capacity=case.position,
            track_accumulated=case.track_accumulated,
        )
        self._case, self._sums_due = case, False
        # As a request fills its view: every token appended, then the compactions' drops.
        super().extend(h.keys, torch.arange(case.position))
        super().compact(h.resident, [], [])
        self.set_queries(h.summaries.clone(), h.current.clone())
        self._sums_due = case.track_accumulated
        if case.keeps_recent_queries:
            self.set_recent_queries(h.queries, torch.arange(case.position))

    def _settle(self) -> None:
        if self._sums_due and self._acc is not None:
            self._sums_due = False
            h = _history(self._case)
            cos, sin = cos_sin(h.rope, torch.arange(self._case.position))
            queries = apply_rope(h.queries, cos[:, None], sin[:, None])
            sums = _accumulated(queries, h.keys, h.evicted_at, self.softmax_scale)
            self._acc[:, :, : self.num_tokens] = sums.gather(-1, h.resident)

    def extend(self, keys: torch.Tensor, positions: torch.Tensor) -> None:
        self._settle()
        super().extend(keys, positions)

    def add_attention(self, attn: torch.Tensor) -> None:
        self._settle()
        super().add_attention(attn)

    def compact(self, keep: torch.Tensor, src_pages: list[int], dst_pages: list[int]) -> None:
        self._settle()
        super().compact(keep, src_pages, dst_pages)

    def accumulated_attention(self) -> torch.Tensor | None:
        self._settle()
        return super().accumulated_attention()


@functools.lru_cache(maxsize=64)
def _history(case: BoundaryCase) -> _History:
    """The request history behind ``case``: built once, copied into every view of it."""
    b, n, t = case.page_size, case.num_tokens, case.position
    num_l, num_kv, group, d = case.num_layers, case.num_kv_heads, case.group_size, case.head_dim
    g = torch.Generator().manual_seed(case.seed)
    rng = random.Random(case.seed)
    rope = RopeConfig(head_dim=d, theta=10000.0)
    # Boundaries: the first when the prompt's pages fill, then one per page of new tokens; a
    # compression drops `b` slots per head (one drop of gap % b first when the gap is uneven).
    drops = [case.gap % b] * bool(case.gap % b) + [b] * (case.gap // b)
    start_pages = rng.randint(min(2, case.num_pages), case.num_pages)
    actions = drops + [0] * (case.num_pages - start_pages)  # 0: grow
    rng.shuffle(actions)
    prompt = max(
        1,
        rng.randint((start_pages - 1) * b + 1, start_pages * b - 1)
        if b > 1
        else start_pages * b - 1,
    )
    time = start_pages * b  # position of the next boundary
    resident = torch.arange(time).expand(num_l, num_kv, time)
    evicted_at = torch.full((num_l, num_kv, t), t)  # a query at q sees p iff p <= q < this
    steps: list[tuple[int, torch.Tensor | None]] = []
    for drop in actions:
        steps.append((time, None))
        if drop:
            movable = resident.shape[-1] - case.recent_window
            if drop > movable:
                raise ValueError(f"{case}: cannot drop {drop} of {movable} unprotected slots")
            order = torch.rand(num_l, num_kv, movable, generator=g).argsort(dim=-1)
            kept = order[..., drop:].sort(dim=-1).values
            gone = resident.gather(-1, order[..., :drop])
            evicted_at.scatter_(-1, gone, time)
            kept = torch.cat(
                [kept, torch.arange(movable, resident.shape[-1]).expand(num_l, num_kv, -1)], dim=-1
            )
            resident = resident.gather(-1, kept)
            steps[-1] = (time, kept)
        added = drop or b
        new = torch.arange(time, time + added).expand(num_l, num_kv, added)
        resident = torch.cat([resident, new], dim=-1)
        time += added
    assert time == t and resident.shape[-1] == n, (time, resident.shape)
    raw_keys = torch.randn(num_l, num_kv, t, d, generator=g)
    queries = torch.randn(num_l, t, num_kv * group, d, generator=g) * case.sharpness
    cos, sin = cos_sin(rope, torch.arange(t))
    keys = apply_rope(raw_keys, cos, sin)  # [L, Hkv, t, d]
    summaries = torch.stack(
        [
            _ema(queries[:, prompt:], beta)
            for beta in (case.config.beta_short, case.config.beta_long)
        ],
        1,
    )
    return _History(
        rope,
        keys,
        resident.contiguous(),
        summaries,
        queries[:, t - 1],
        queries,
        evicted_at,
        prompt,
        tuple(steps),
    )


def _ema(queries: torch.Tensor, beta: float) -> torch.Tensor:
    """``[L, Hq, d]`` EMA of ``queries [L, n, Hq, d]``, initialized to the first one."""
    count = queries.shape[1]
    weights = (1 - beta) * beta ** torch.arange(count - 1, -1, -1, dtype=torch.float64)
    weights[0] = beta ** (count - 1)
    return torch.einsum("n,lnhd->lhd", weights.float(), queries)


def _accumulated(
    queries: torch.Tensor,
    keys: torch.Tensor,
    evicted_at: torch.Tensor,
    scale: float,
    chunk: int = 128,
) -> torch.Tensor:
    """``[L, Hkv, t]`` per position: each query's softmax over the positions it saw (its own
    and earlier ones not yet evicted), mean over the query group, summed over queries.
    ``queries [L, t, Hq, d]`` rotated, ``keys [L, Hkv, t, d]``; ``chunk`` queries at a time."""
    num_l, t, _, d = queries.shape
    num_kv = keys.shape[1]
    q = queries.reshape(num_l, t, num_kv, -1, d)
    total = torch.zeros(num_l, num_kv, t)
    for lo in range(0, t, chunk):
        when = torch.arange(lo, min(lo + chunk, t))
        logits = torch.einsum("lqhgd,lhpd->lhgqp", q[:, lo : lo + chunk], keys) * scale
        seen = (when[None, None, :, None] < evicted_at[:, :, None, :]) & (
            torch.arange(t)[None, :] <= when[:, None]
        )  # [L, Hkv, q, p]
        bias = torch.zeros(seen.shape).masked_fill_(~seen, float("-inf"))
        weights = (logits + bias[:, :, None]).softmax(dim=-1)
        total += weights.sum(dim=(2, 3)) / weights.shape[2]
    return total


def boundary_cases(
    max_layers: int = 3,
    max_kv_heads: int = 3,
    max_group: int = 4,
    page_sizes: tuple[int, ...] = (4, 8, 16),
    max_pages: int = 6,
    head_dims: tuple[int, ...] = (4, 8, 16),
    accumulated: bool | None = None,
    max_compressions: int = 4,
    recent_queries: bool | None = None,
    protected_prompt: bool | None = False,
) -> st.SearchStrategy[BoundaryCase]:
    """Small random boundaries: shapes, page size, recent window, pool state and a history of
    up to ``max_compressions`` earlier compressions (each dropped one page of tokens).

    ``protected_prompt``: True gives every boundary a protected prompt
    (``GrowPageConfig.protect_prompt``, ``ctx.num_protected_prefix`` leading slots a selection
    keeps), None draws it, False (default) gives none.

    ``accumulated``: whether the view tracks H2O's accumulated attention (True for a policy
    with ``needs_accumulated_attention``, which always gets it); None draws it.
    ``recent_queries``: whether the view keeps the recent queries (True for a policy with
    ``needs_recent_queries``, which always gets them); None draws it. A knob out of
    range is a ``ValueError`` (``TypeError`` for a wrong type) here, before anything is drawn.
    """
    for knob, value, low in (
        ("max_layers", max_layers, 1),
        ("max_kv_heads", max_kv_heads, 1),
        ("max_group", max_group, 1),
        ("max_compressions", max_compressions, 0),
    ):
        check_knob("boundary_cases", knob, value, low)
    check_knob(
        "boundary_cases",
        "max_pages",
        max_pages,
        2,
        " (the policy decides boundaries from min_capacity, 2 pages, on)",
    )
    for knob, values, even in (("page_sizes", page_sizes, False), ("head_dims", head_dims, True)):
        check_sizes("boundary_cases", knob, values)
        for v in values:
            check_knob(
                "boundary_cases", knob, v, 2 if even else 1, " (RoPE rotates pairs)" if even else ""
            )
            if even and v % 2:
                raise ValueError(
                    f"boundary_cases: {knob} must hold even integers (RoPE "
                    f"rotates pairs), got {v!r}"
                )
    for knob, flag in (
        ("accumulated", accumulated),
        ("recent_queries", recent_queries),
        ("protected_prompt", protected_prompt),
    ):
        if flag is not None and not isinstance(flag, bool):
            raise TypeError(f"{knob} must be True, False or None, got {flag!r}")
    return _boundary_cases(
        max_layers,
        max_kv_heads,
        max_group,
        tuple(page_sizes),
        max_pages,
        tuple(head_dims),
        accumulated,
        max_compressions,
        recent_queries,
        protected_prompt,
    )


def check_knob(strategy: str, knob: str, value: object, low: int, why: str = "") -> None:
    """A strategy's integer knob: ``TypeError`` when it is not an integer, ``ValueError`` when
    it is below ``low`` (the same for every strategy of the kit)."""
    if not is_int(value):
        raise TypeError(f"{strategy}: {knob} must be an integer, got {value!r}")
    if value < low:
        raise ValueError(f"{strategy}: {knob} must be at least {low}{why}, got {value!r}")


def check_sizes(strategy: str, knob: str, values: object) -> None:
    """A strategy's knob of sizes to draw from: ``TypeError`` when it is not a tuple or list,
    ``ValueError`` when it is empty (its values are then checked with ``check_knob``)."""
    if not isinstance(values, (tuple, list)):
        raise TypeError(f"{strategy}: {knob} must be a tuple of integers, got {values!r}")
    if not values:
        raise ValueError(f"{strategy}: {knob} must not be empty")


@st.composite
def _boundary_cases(
    draw: st.DrawFn,
    max_layers: int,
    max_kv_heads: int,
    max_group: int,
    page_sizes: tuple[int, ...],
    max_pages: int,
    head_dims: tuple[int, ...],
    accumulated: bool | None,
    max_compressions: int,
    recent_queries: bool | None,
    protected_prompt: bool | None,
) -> BoundaryCase:
    page_size = draw(st.sampled_from(page_sizes))
    case = BoundaryCase(
        num_layers=draw(st.integers(1, max_layers)),
        num_kv_heads=draw(st.integers(1, max_kv_heads)),
        group_size=draw(st.integers(1, max_group)),
        head_dim=draw(st.sampled_from(head_dims)),
        page_size=page_size,
        recent_window=draw(st.integers(0, page_size - 1)),
        num_pages=draw(st.integers(2, max_pages)),
        num_free_pages=draw(st.integers(0, 8)),
        gap=draw(st.integers(0, max_compressions)) * page_size,
        seed=draw(st.integers(0, 2**31 - 1)),
        sharpness=draw(st.sampled_from([0.1, 1.0, 4.0])),
        track_accumulated=draw(st.booleans()) if accumulated is None else accumulated,
        keeps_recent_queries=draw(st.booleans()) if recent_queries is None else recent_queries,
    )
    if protected_prompt is False:
        return case
    # Drawn last, so the draws above are those of a kit without it. A protected prompt that
    # the smallest keep asked for (a shrink's, from 3 pages) still holds with the window.
    pages = case.num_pages
    least_keep = (pages - 2 if pages >= 3 else pages - 1) * page_size
    most = least_keep - case.recent_window
    if most < 1:
        return case
    sizes = st.integers(1, most)
    prefix = draw(sizes if protected_prompt else st.one_of(st.just(0), sizes))
    return attrs.evolve(case, protected_prefix=prefix)


def boundary_contexts(**kwargs: Any) -> st.SearchStrategy[BoundaryContext]:
    """Valid ``BoundaryContext``s (see ``boundary_cases`` for the knobs)."""
    return boundary_cases(**kwargs).map(lambda case: case.context())
