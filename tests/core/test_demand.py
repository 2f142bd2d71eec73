"""Demand maths against the paper's equations (Eq. 2-8, 12, Theorem 3.1)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from growpage.core import demand


def dist(seed: int, n: int, temp: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g, dtype=torch.float64) * temp).softmax(-1)


def brute_force_demand(a: torch.Tensor, p: float) -> int:
    total = 0.0
    for k, w in enumerate(sorted(a.tolist(), reverse=True), start=1):
        total += w
        if total >= p * (1 - 1e-6):
            return k
    return len(a)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10**6), st.integers(1, 40), st.floats(0.05, 0.999), st.floats(0.1, 5))
def test_coverage_demand_is_minimal_top_k(seed, n, p, temp):
    a = dist(seed, n, temp)
    k = int(demand.coverage_demand(a, p))
    assert k == brute_force_demand(a, p)
    top = a.sort(descending=True).values
    assert top[:k].sum() >= p * (1 - 1e-6)
    if k > 1:
        assert top[: k - 1].sum() < p


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10**6), st.integers(2, 40), st.floats(0.01, 0.98), st.floats(0.001, 0.02))
def test_coverage_demand_monotone_in_p(seed, n, p, step):
    a = dist(seed, n, 2.0)
    assert demand.coverage_demand(a, p) <= demand.coverage_demand(a, min(p + step, 1.0))


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10**6), st.integers(2, 30), st.integers(1, 8), st.floats(0.1, 4.0))
def test_theorem_3_1_bound_holds_for_random_values(seed, n, d, v_max):
    g = torch.Generator().manual_seed(seed)
    a = dist(seed, n, 2.0)
    keep = torch.rand(n, generator=g) < 0.5
    keep[torch.randint(n, (1,), generator=g)] = True
    v = torch.randn(n, d, generator=g, dtype=torch.float64)
    v = (
        v
        / v.norm(dim=-1, keepdim=True)
        * v_max
        * torch.rand(n, 1, generator=g, dtype=torch.float64)
    )
    full = (a.unsqueeze(-1) * v).sum(0)
    err = (full - demand.renormalized_output(a, v, keep).double()).norm()
    bound = demand.worst_case_error(demand.retained_mass(a, keep).double(), v_max)
    assert err <= bound + 1e-9


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10**6), st.integers(2, 30), st.floats(0.1, 4.0))
def test_theorem_3_1_bound_is_reached_by_opposite_values(seed, n, v_max):
    g = torch.Generator().manual_seed(seed)
    a = dist(seed, n, 2.0)
    keep = torch.rand(n, generator=g) < 0.5
    keep[0], keep[-1] = True, False
    u = torch.tensor([0.6, 0.8], dtype=torch.float64)
    v = torch.where(keep.unsqueeze(-1), -v_max * u, v_max * u)  # paper's construction (app. C)
    full = (a.unsqueeze(-1) * v).sum(0)
    err = float((full - demand.renormalized_output(a, v, keep).double()).norm())
    m = float(demand.retained_mass(a, keep))
    assert err == pytest.approx(2 * v_max * (1 - m), rel=1e-5, abs=1e-6)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10**6), st.integers(1, 25), st.floats(0.05, 1.9))
def test_worst_case_capacity_equals_coverage_demand(seed, n, delta_frac):
    # C_wc_delta by exhaustive search over subset sizes with the exact worst-case error of Eq. 5.
    v_max = 1.5
    delta = delta_frac * v_max
    a = dist(seed, n, 2.0)
    top = a.sort(descending=True).values
    brute = next(
        k for k in range(1, n + 1) if 2 * v_max * (1 - float(top[:k].sum())) <= delta * (1 + 1e-6)
    )
    assert int(demand.worst_case_capacity(a, delta, v_max)) == brute


def test_worst_case_capacity_rejects_bad_tolerance():
    with pytest.raises(ValueError, match="delta"):
        demand.worst_case_capacity(dist(0, 4), 3.0, 1.0)


def test_working_set_ratio_range_and_extremes():
    uniform = torch.full((2, 3, 50), 1 / 50)
    onehot = torch.zeros(2, 3, 50)
    onehot[..., 7] = 1
    assert torch.allclose(demand.working_set_ratio(uniform, 0.9), torch.full((2, 3), 0.9))
    assert torch.allclose(demand.working_set_ratio(onehot, 0.99), torch.full((2, 3), 1 / 50))
    rand = torch.rand(4, 2, 33).softmax(-1)
    r = demand.working_set_ratio(rand, 0.9)
    assert ((r > 0) & (r <= 1)).all()


def test_entropy_ratio_extremes():
    uniform = torch.full((10,), 0.1)
    onehot = torch.zeros(10)
    onehot[3] = 1
    assert float(demand.entropy_ratio(uniform)) == pytest.approx(1.0)
    assert float(demand.entropy_ratio(onehot)) == pytest.approx(0.1)


def test_demand_trend_is_antisymmetric():
    rs, rl = torch.rand(3, 2), torch.rand(3, 2)
    assert demand.demand_trend(rs, rl) == pytest.approx(-demand.demand_trend(rl, rs))
    assert demand.demand_trend(rs, rl) == pytest.approx(float(rs.mean() - rl.mean()))


def test_ema_update_matches_eq6_and_first_step_initializes():
    s = torch.randn(3, 2, 4, 8)  # stale values from a previous owner of the slot
    q1, q2 = torch.randn(3, 4, 8), torch.randn(3, 4, 8)
    demand.update_query_summaries(s, q1, 0.9, 0.999, first=True)
    assert torch.equal(s[:, 0], q1) and torch.equal(s[:, 1], q1)
    demand.update_query_summaries(s, q2, 0.9, 0.999, first=False)
    assert torch.allclose(s[:, 0], 0.9 * q1 + 0.1 * q2)
    assert torch.allclose(s[:, 1], 0.999 * q1 + 0.001 * q2)


def test_rms_calibration_matches_eq12():
    summary, query = torch.randn(2, 3, 16) * 0.1, torch.randn(2, 3, 16) * 5
    out = demand.rms_calibrate(summary, query)
    rms = lambda x: x.pow(2).mean(-1).sqrt()  # noqa: E731
    assert torch.allclose(rms(out), rms(query), rtol=1e-5)
    # Direction is unchanged: calibration only rescales each head.
    cos = torch.nn.functional.cosine_similarity(out, summary, dim=-1)
    assert torch.allclose(cos, torch.ones_like(cos), atol=1e-5)


def test_group_attention_is_mean_of_group_softmaxes():
    q, k = torch.randn(2, 6, 8), torch.randn(2, 3, 10, 8)
    out = demand.group_attention(q, k, 8**-0.5)
    for h in range(6):
        ref = (q[:, h : h + 1] @ k[:, h // 2].transpose(-1, -2) * 8**-0.5).softmax(-1)[:, 0]
        if h % 2 == 0:
            acc = ref
        else:
            assert torch.allclose(out[:, h // 2], (acc + ref) / 2, atol=1e-6)
    assert torch.allclose(out.sum(-1), torch.ones(2, 3))
    assert math.isclose(float(out.min()), float(out.min()))  # finite


@settings(max_examples=80, deadline=None)
@given(
    st.integers(0, 10**6),
    st.integers(1, 700),
    st.sampled_from(["plain", "ties", "zeros", "signed zeros", "nan", "inf"]),
    st.sampled_from([0.5, 0.9, 0.99, 1.0]),
)
def test_descending_rows_and_their_counts_are_torchs_sort(seed, n, kind, p):
    """numpy's sort on the CPU gives the rows torch's descending sort gives (NaN first), so
    the top-p counts taken from them are torch's, bit for bit."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(3, 2, n, generator=g)
    if kind == "ties":
        x = (x * 4).floor() / 4
    elif kind == "zeros":
        x[x < 0.5] = 0.0
    elif kind == "signed zeros":
        x[x < 0.5] = -0.0
        x[x > 0.8] = 0.0
    elif kind == "nan":
        x[1, 0, seed % n] = float("nan")
    elif kind == "inf":
        x[0, 1, seed % n] = float("inf")
    with torch.inference_mode():
        got = demand.descending(x)
        want = x.sort(dim=-1, descending=True).values
    assert got.shape == want.shape and got.dtype == want.dtype and got.is_contiguous()
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(nan=0.0), want.nan_to_num(nan=0.0))
    cum = want.cumsum(dim=-1)
    torchs = (cum < p * cum[..., -1:] * (1.0 - 1e-6)).sum(dim=-1) + 1
    assert torch.equal(demand.working_set_counts(x, p), torchs)


def test_descending_leaves_other_dtypes_to_torch():
    x = torch.tensor([[0.25, 1.0, 0.5]], dtype=torch.float64)
    assert torch.equal(demand.descending(x), torch.tensor([[1.0, 0.5, 0.25]], dtype=torch.float64))
    assert demand.descending(x.half()).dtype == torch.float16
