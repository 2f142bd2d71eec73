"""``GrowPageConfig``: the capacity-control settings shared by the simulator and the engine."""

from __future__ import annotations

from typing import Any

import attrs

from growpage.errors import ConfigError


def _check(cond: bool, field: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"GrowPageConfig.{field}: {msg}")


def _open_unit(inst: object, attribute: attrs.Attribute, value: float) -> None:
    _check(0.0 < value < 1.0, attribute.name, f"must lie in (0, 1), got {value!r}")


def _beta(inst: object, attribute: attrs.Attribute, value: float) -> None:
    _check(0.0 <= value < 1.0, attribute.name, f"must lie in [0, 1), got {value!r}")


def _positive_int(inst: object, attribute: attrs.Attribute, value: int) -> None:
    _check(
        isinstance(value, int) and value > 0,
        attribute.name,
        f"must be a positive integer, got {value!r}",
    )


def _non_negative_int(inst: object, attribute: attrs.Attribute, value: int) -> None:
    _check(
        isinstance(value, int) and value >= 0,
        attribute.name,
        f"must be a non-negative integer, got {value!r}",
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

    page_size: int = attrs.field(default=256, validator=_positive_int)
    recent_window: int = attrs.field(default=16, validator=_non_negative_int)
    min_capacity: int = attrs.field(default=2, validator=_positive_int)
    beta_short: float = attrs.field(default=0.9, validator=_beta)
    beta_long: float = attrs.field(default=0.999, validator=_beta)
    top_p: float = attrs.field(default=0.99, validator=_open_unit)
    tau: float = attrs.field(default=0.0)
    k_loc: int | None = attrs.field(default=None)
    watermark: int = attrs.field(default=0, validator=_non_negative_int)

    def __attrs_post_init__(self) -> None:
        _check(
            self.recent_window < self.page_size,
            "recent_window",
            f"must be smaller than page_size ({self.page_size}), got {self.recent_window}",
        )
        _check(
            self.min_capacity >= 2,
            "min_capacity",
            f"must be at least 2 pages (a boundary needs a historical page), got {self.min_capacity}",
        )
        _check(
            self.beta_short < self.beta_long,
            "beta_short",
            f"must be smaller than beta_long ({self.beta_long}), got {self.beta_short}",
        )
        _check(
            isinstance(self.tau, (int, float)) and -1.0 <= self.tau <= 1.0,
            "tau",
            f"must be a number in [-1, 1] (delta is a difference of ratios), got {self.tau!r}",
        )
        if self.k_loc is not None:
            _check(
                isinstance(self.k_loc, int) and 0 <= self.k_loc <= self.page_size,
                "k_loc",
                f"must be an integer in [0, page_size={self.page_size}] or None, got {self.k_loc!r}",
            )

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
