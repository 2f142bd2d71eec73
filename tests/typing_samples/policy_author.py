"""What a policy author writes (docs/policy-guide.md; the README's "A policy in a few lines"),
annotated: ``mypy --strict`` must find nothing wrong here (tests/test_typing.py).

Not a test module: mypy reads it, pytest does not collect it.
"""

from __future__ import annotations

from collections.abc import Hashable

import attrs
import torch
from hypothesis import given

from growpage import (
    BoundaryContext,
    CapacityController,
    CapacityPolicy,
    Decision,
    GrowPageConfig,
    PagePool,
)
from growpage.core.selection import with_protected
from growpage.policies import register_policy, resolve_policy
from growpage.testing import boundary_contexts, check_policy


@register_policy
@attrs.define
class CappedGrowPage(CapacityPolicy):
    """GrowPage's trend signal, but never beyond ``max_pages`` pages."""

    name = "typed-capped-growpage"
    max_pages: int = attrs.field(
        default=16, validator=[attrs.validators.instance_of(int), attrs.validators.gt(1)]
    )
    tau: float = 0.0

    def decide(self, ctx: BoundaryContext) -> Decision:
        if ctx.num_pages >= self.max_pages:
            return Decision.COMPRESS
        return Decision.GROW if ctx.delta() > self.tau else Decision.COMPRESS


@attrs.define
class CachesScores(CapacityPolicy):
    """Keeps state only as a cache keyed by ``(request_id, position)``, as the guide advises."""

    name = "typed-caches-scores"
    _cache: dict[tuple[Hashable, int], torch.Tensor] = attrs.field(factory=dict)

    def decide(self, ctx: BoundaryContext) -> Decision:
        self._cache[(ctx.request_id, ctx.position)] = ctx.scores()
        return Decision.COMPRESS


@register_policy
@attrs.define
class RecentFirst(CapacityPolicy):
    """Grows while the pool has room; a compression keeps the most recent slots."""

    name = "typed-recent-first"
    fallback_to_compress = True
    min_free_pages: int = 4

    def decide(self, ctx: BoundaryContext) -> Decision:
        return Decision.GROW if ctx.num_free_pages > self.min_free_pages else Decision.COMPRESS

    def select(self, ctx: BoundaryContext, keep: int) -> torch.Tensor:
        historical = keep - ctx.recent_window
        start = ctx.num_tokens - ctx.recent_window - historical
        chosen = torch.arange(start, start + historical, device=ctx.device)
        return with_protected(
            chosen.expand(*ctx.shape, historical),
            ctx.num_tokens,
            ctx.recent_window,
            chosen_sorted=True,
        )


def build() -> list[CapacityPolicy]:
    capped: CappedGrowPage = CappedGrowPage(max_pages=8)
    registered: type[RecentFirst] = register_policy(RecentFirst)
    by_name = resolve_policy("typed-capped-growpage", max_pages=8)
    check_policy(capped)
    controller = CapacityController(
        by_name, PagePool(num_pages=64, page_size=256), GrowPageConfig()
    )
    return [capped, registered(), controller.policy]


@given(boundary_contexts(max_pages=10))
def test_compresses_at_the_cap(ctx: BoundaryContext) -> None:
    policy = CappedGrowPage(max_pages=8)
    if ctx.num_pages >= policy.max_pages:
        assert policy.decide(ctx) is Decision.COMPRESS
