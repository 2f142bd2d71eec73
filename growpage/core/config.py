"""``GrowPageConfig``: the capacity-control settings shared by the simulator and the engine."""

from __future__ import annotations

from typing import Any

import attrs

from growpage.validators import (
    Check,
    check,
    flag,
    in_range,
    is_int,
    non_negative_int,
    one_of,
    optional,
    positive_int,
)

#: How the query summaries start (``GrowPageConfig.summary_start``).
SUMMARY_STARTS = ("first", "average")
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
        protect_prompt: keep every prompt token through every compression, for every policy
            alike (the prompt's slots are never selection candidates). Off in the paper.
        floor_tokens: KV above the prompt below which every request grows without asking the
            policy: a compression never keeps fewer than ``prompt + floor_tokens`` tokens.
            None (the paper) leaves only the ``min_capacity`` pages.
        summary_start: how the query summaries start at the first decode query (appendix E.1):
            ``"first"`` (the paper) sets both EMAs to that query, so it weighs beta^n in a
            summary n queries later; ``"average"`` is the bias-corrected average, in which
            every query weighs (1 - beta) beta^(n - i), the first query included.
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
    protect_prompt: bool = attrs.field(default=False, validator=flag)
    floor_tokens: int | None = attrs.field(default=None, validator=optional(non_negative_int))
    summary_start: str = attrs.field(default="first", validator=one_of(SUMMARY_STARTS))

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

    def summary_init_weights(self) -> tuple[float, float]:
        """What the short and long summaries are set to, times the first decode query: 1 for
        the paper's start, ``1 - beta`` for the bias-corrected average (an EMA started at zero:
        the bias correction's scale factor ``1 / (1 - beta^n)`` is the same for every
        dimension of a head, and the RMS calibration (Eq. 12) removes any such factor)."""
        if self.summary_start == "first":
            return 1.0, 1.0
        return 1.0 - self.beta_short, 1.0 - self.beta_long

    def replace(self, **changes: Any) -> GrowPageConfig:
        return attrs.evolve(self, **changes)


def fitted_recent_window(window: int, page_size: int) -> int:
    """``window``, or a quarter of the page where pages are not larger than it (the window
    must stay below the page): the window for a caller given a page size but no window."""
    return window if window < page_size else page_size // 4
