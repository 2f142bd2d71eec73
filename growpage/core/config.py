"""``GrowPageConfig``: the capacity-control settings shared by the simulator and the engine."""

from __future__ import annotations

from typing import Any

import attrs

from growpage.validators import (
    Check,
    check,
    in_range,
    is_int,
    non_negative_int,
    optional,
    positive_int,
)

_BETA = in_range(0, 1, hi_open=True)
_MIN_CAPACITY = Check(
    "an integer >= 2 (a boundary needs a historical page)", lambda v: is_int(v) and v >= 2
)


@attrs.frozen(kw_only=True)
class GrowPageConfig:
    """Settings of the GrowPage method (paper sections 3-4, defaults from section 5.1 / app. D).

    Attributes:
        page_size: tokens per KV page (b). The paper uses 256.
        recent_window: protected recent tokens (|R_t|), never compressed. Must be < page_size.
        min_capacity: pages below which the controller always grows (plain PagedAttention).
            At least 2, so that a boundary always has estimation candidates.
        beta_short, beta_long: EMA decays of the query summaries (Eq. 6), beta_short < beta_long.
        top_p: coverage p of the working-set size (Eq. 7).
        tau: demand threshold; GrowPage grows when delta > tau (section 3.2).
        k_loc: block-local retention quota (Eq. 10); None means page_size // 4 (64 at b=256).
        watermark: free pages the pool keeps back from policy-driven growth.
    """

    page_size: int = attrs.field(default=256, validator=positive_int)
    recent_window: int = attrs.field(default=16, validator=non_negative_int)
    min_capacity: int = attrs.field(default=2, validator=_MIN_CAPACITY)
    beta_short: float = attrs.field(default=0.9, validator=_BETA)
    beta_long: float = attrs.field(default=0.999, validator=_BETA)
    top_p: float = attrs.field(default=0.99, validator=in_range(0, 1, lo_open=True, hi_open=True))
    tau: float = attrs.field(default=0.0, validator=in_range(-1, 1))
    k_loc: int | None = attrs.field(default=None, validator=optional(non_negative_int))
    watermark: int = attrs.field(default=0, validator=non_negative_int)

    def __attrs_post_init__(self) -> None:
        b = self.page_size
        check(self, "recent_window", self.recent_window < b, f"< page_size ({b})")
        check(
            self, "beta_short", self.beta_short < self.beta_long, f"< beta_long ({self.beta_long})"
        )
        check(self, "k_loc", self.k_loc is None or self.k_loc <= b, f"<= page_size ({b})")

    @property
    def local_quota(self) -> int:
        """k_loc with its default (page_size // 4) resolved."""
        return self.page_size // 4 if self.k_loc is None else self.k_loc

    def replace(self, **changes: Any) -> GrowPageConfig:
        return attrs.evolve(self, **changes)


def fitted_recent_window(window: int, page_size: int) -> int:
    """``window``, or a quarter of the page where pages are not larger than it (the window
    must stay below the page): the window for a caller given a page size but no window."""
    return window if window < page_size else page_size // 4
