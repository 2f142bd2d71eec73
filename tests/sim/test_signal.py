"""Spearman / sign agreement / growth-advantage buckets (paper Fig. 6 and 7)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from growpage.sim.records import BoundaryRecord
from growpage.sim.signal import rankdata, signal_quality, spearman


def record(delta, change, adv, adv_err=None):
    return BoundaryRecord(
        position=0,
        action="grow",
        decision="grow",
        fallback=False,
        pages_before=2,
        pages_after=3,
        tokens_after=128,
        delta=delta,
        future_change=change,
        advantage=adv,
        advantage_error=adv_err,
    )


def test_rankdata_averages_ties():
    assert rankdata([10, 20, 20, 5]).tolist() == [2.0, 3.5, 3.5, 1.0]
    assert rankdata([3, 3, 3]).tolist() == [2.0, 2.0, 2.0]


@pytest.mark.parametrize(
    "x, y, rho",
    [
        ([1, 2, 3, 4], [10, 20, 30, 40], 1.0),
        ([1, 2, 3, 4], [4, 3, 2, 1], -1.0),
        ([1, 2, 3, 4, 5], [1, 4, 9, 16, 25], 1.0),  # monotone, not linear
        ([1, 2, 3, 4, 5], [2, 1, 4, 3, 5], 0.8),
    ],
)
def test_spearman_known_values(x, y, rho):
    assert spearman(x, y) == pytest.approx(rho)


def test_spearman_matches_pearson_of_ranks_with_ties():
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 5, 40), rng.integers(0, 5, 40)
    expected = np.corrcoef(rankdata(x), rankdata(y))[0, 1]
    assert spearman(x, y) == pytest.approx(expected)
    assert math.isnan(spearman([1, 1, 1], [1, 2, 3])) and math.isnan(spearman([1], [2]))


def test_signal_quality_sign_agreement_and_buckets():
    records = [
        record(-0.2, -0.5, 0.00),
        record(-0.003, 0.1, 0.01, 0.02),
        record(0.002, 0.2, 0.05),
        record(0.3, 0.4, 0.20, 0.3),
        record(0.4, None, 0.30),
        record(None, 0.1, None),
    ]
    q = signal_quality(records)
    assert q.num_boundaries == 4
    assert q.sign_agreement == 0.75  # -0.003 vs +0.1 disagrees
    assert q.spearman == pytest.approx(1.0)
    counts = {(b.low, b.high): (b.count, b.mean_advantage) for b in q.buckets}
    assert counts[(-math.inf, -0.05)] == (1, 0.0)
    assert counts[(-0.005, 0.0)] == (1, 0.01)
    assert counts[(0.0, 0.005)] == (1, 0.05)
    assert counts[(0.05, math.inf)] == (2, pytest.approx(0.25))
    assert sum(b.count for b in q.buckets) == 5


def test_the_printed_signal_line_says_why_rho_is_missing():
    """Until 2026-12 it printed 'Spearman rho = nan, sign agreement = nan%'."""
    from growpage.commands.sim import _signal_table
    from growpage.sim.signal import SignalQuality

    def head(q: SignalQuality) -> str:
        return _signal_table(q).splitlines()[0]

    nan = float("nan")
    assert head(SignalQuality(1, nan, nan, ())) == (
        "Delta_t vs future demand change: Spearman rho = n/a (too few boundaries) over 1 boundary"
    )
    assert head(SignalQuality(0, nan, nan, ())).endswith(
        "n/a (too few boundaries) over 0 boundaries"
    )
    assert head(SignalQuality(7, nan, 0.0, ())) == (
        "Delta_t vs future demand change: Spearman rho = n/a (a constant signal), sign "
        "agreement = 0.0% over 7 boundaries"
    )
    assert head(SignalQuality(62, 0.121, 0.516, ())) == (
        "Delta_t vs future demand change: Spearman rho = 0.121, sign agreement = 51.6% over 62 "
        "boundaries"
    )
