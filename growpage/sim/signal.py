"""Signal quality of Delta_t (paper section 5.3, Fig. 6 and 7), from replay records.

* Fig. 6: Delta_t at each boundary against the future demand change (working-set ratio of the
  next page's queries minus the current page's, full KV): Spearman rank correlation and sign
  agreement.
* Fig. 7: the counterfactual growth advantage ``loss(compress) - loss(grow)`` over the next page,
  grouped by Delta_t bucket (loss = 1 - retained mass, or the attention-output error).

Spearman's rho is computed here (average ranks for ties, Pearson correlation of the ranks), so no
scipy is needed.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import attrs
import numpy as np

from growpage.sim.records import BoundaryRecord

DELTA_EDGES = (-math.inf, -0.05, -0.01, -0.005, 0.0, 0.005, 0.01, 0.05, math.inf)


def rankdata(x: Sequence[float] | np.ndarray) -> np.ndarray:
    """Ranks 1..n of ``x``, ties sharing their average rank (scipy's ``rankdata`` default)."""
    x = np.asarray(x, dtype=np.float64)
    n = len(x)
    order = np.argsort(x, kind="mergesort")
    ordered = x[order]
    starts = np.concatenate([[0], np.flatnonzero(np.diff(ordered)) + 1])
    ends = np.concatenate([starts[1:], [n]])
    ranks = np.empty(n)
    ranks[order] = np.repeat((starts + ends + 1) / 2.0, ends - starts)
    return ranks


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman's rho; NaN when fewer than two points or either side is constant."""
    if len(x) != len(y):
        raise ValueError(f"spearman needs equal lengths, got {len(x)} and {len(y)}")
    if len(x) < 2:
        return math.nan
    rx, ry = rankdata(x), rankdata(y)
    rx, ry = rx - rx.mean(), ry - ry.mean()
    denom = math.sqrt(float((rx * rx).sum() * (ry * ry).sum()))
    return float((rx * ry).sum() / denom) if denom else math.nan


@attrs.frozen
class BucketStat:
    """Growth advantage of the boundaries whose Delta_t lies in ``[low, high)``."""

    low: float
    high: float
    count: int
    mean_advantage: float | None  # retained-mass loss
    mean_advantage_error: float | None  # output-error loss


@attrs.frozen
class SignalQuality:
    """Fig. 6 and Fig. 7 numbers over a set of boundaries."""

    num_boundaries: int
    spearman: float
    sign_agreement: float
    buckets: tuple[BucketStat, ...]

    def as_dict(self) -> dict:
        return attrs.asdict(self)


def _mean(xs: list[float]) -> float | None:
    return float(np.mean(xs)) if xs else None


def signal_quality(
    records: Iterable[BoundaryRecord], edges: Sequence[float] = DELTA_EDGES
) -> SignalQuality:
    """Signal quality of the records that carry Delta_t (pool them across traces freely)."""
    with_delta = [(r.delta, r) for r in records if r.delta is not None]
    paired = [(d, r.future_change) for d, r in with_delta if r.future_change is not None]
    deltas = [d for d, _ in paired]
    changes = [c for _, c in paired]
    agree = float(np.mean(np.sign(deltas) == np.sign(changes))) if paired else math.nan
    buckets = []
    for low, high in zip(edges[:-1], edges[1:], strict=True):
        inside = [
            (r.advantage, r.advantage_error)
            for d, r in with_delta
            if low <= d < high and r.advantage is not None
        ]
        buckets.append(
            BucketStat(
                low,
                high,
                len(inside),
                _mean([a for a, _ in inside]),
                _mean([e for _, e in inside if e is not None]),
            )
        )
    return SignalQuality(len(paired), spearman(deltas, changes), agree, tuple(buckets))
