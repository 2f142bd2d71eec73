"""The output error of a finite trace is finite, however large its values (fp32 / bf16 range)."""

from __future__ import annotations

import math

import attrs
import pytest
import torch

from growpage import GrowPageConfig
from growpage.core.rope import rope_at
from growpage.core.traces import Trace
from growpage.policies import resolve_policy
from growpage.sim.fidelity import FutureAttention
from growpage.sim.replay import ReplayOptions, replay_trace
from growpage.sim.synthetic import SyntheticSpec, synthetic_trace
from growpage.sim.traceview import TraceView

B = 16
CONFIG = GrowPageConfig(page_size=B, recent_window=4)
SPEC = SyntheticSpec(
    num_layers=2,
    num_q_heads=4,
    num_kv_heads=2,
    head_dim=16,
    prompt_len=32,
    gen_len=96,
    mean_regime_len=32.0,
)


@pytest.fixture(scope="module")
def trace() -> Trace:
    return synthetic_trace(SPEC, seed=1)


def _scaled(trace: Trace, scale: float) -> Trace:
    assert trace.values is not None
    return Trace(
        header=trace.header, queries=trace.queries, keys=trace.keys, values=trace.values * scale
    )


def _future(trace: Trace) -> tuple[FutureAttention, torch.Tensor]:
    """Future attention after boundary 64 of a view that kept every third token."""
    view = TraceView(trace, CONFIG)
    view.write_until(64)
    keep = torch.arange(0, 64, 3).expand(SPEC.num_layers, SPEC.num_kv_heads, -1)
    view.compact(keep, [], [])
    return FutureAttention.compute(view, 64, 64 + B, 4), view.positions()


# 1e20: its squares overflow float32; 1e37: |o - o_hat| itself can pass float32's 3.4e38.
@pytest.mark.parametrize("scale", [1e20, 2.0**100, 1e37])
def test_output_error_scales_with_the_values_and_stays_finite(trace, scale):
    future, resident = _future(trace)
    big_future, big_resident = _future(_scaled(trace, scale))
    err = future.output_error(resident)
    big = big_future.output_error(big_resident)
    assert err is not None and big is not None and bool((err > 0).any())
    assert bool(torch.isfinite(big).all())
    # |o - o_hat| is linear in the values: the error of the scaled trace is the scaled error
    torch.testing.assert_close(big.double(), err.double() * scale, rtol=1e-5, atol=0.0)


def test_output_error_of_normal_values_is_as_before(trace):
    future, resident = _future(trace)
    drop = future.dropped(resident)
    lost = future._lost_per_head(drop).unsqueeze(-1)
    full = torch.matmul(future.probs, future.values)
    approx = (full - torch.matmul(future.probs * drop.unsqueeze(-2), future.values)) / (
        1.0 - lost
    ).clamp_min(1e-12)
    expected = future._group_mean((full - approx).norm(dim=-1))  # the plain float32 formula
    err = future.output_error(resident)
    assert err is not None
    torch.testing.assert_close(err.double(), expected.double(), rtol=1e-6, atol=0.0)
    assert float(future.output_error(torch.arange(64 + B).expand(2, 2, -1)).abs().max()) == 0.0
    assert float(future.output_error(torch.arange(64).expand(2, 2, -1)).abs().max()) == 0.0


def test_replay_of_a_trace_with_huge_values_reports_a_finite_output_error(trace):
    policy = resolve_policy("fixed", budget_tokens=48)
    options = ReplayOptions(fidelity_queries=4)
    normal = replay_trace(trace, policy, CONFIG, options)
    huge = replay_trace(
        _scaled(trace, 1e20), resolve_policy("fixed", budget_tokens=48), CONFIG, options
    )
    assert normal.output_error is not None and normal.output_error > 0
    assert huge.output_error is not None and math.isfinite(huge.output_error)
    assert huge.output_error == pytest.approx(normal.output_error * 1e20, rel=1e-5)
    # the values do not enter the decisions nor the attention mass
    assert [attrs.astuple(r)[:7] for r in huge.records] == [
        attrs.astuple(r)[:7] for r in normal.records
    ]
    assert huge.mass_mean == normal.mass_mean


def test_output_error_when_the_dropped_tokens_held_almost_all_the_mass():
    """One anchor token takes all but ~1e-8 of the attention and is dropped: the retained
    output is the renormalized average of the tokens left, and its error is at most
    2 max|v| (Theorem 3.1). It used to be computed as (o - lost output) / (1 - lost mass) in
    float32, where both differences cancel to rounding noise: errors of thousands."""
    spec = SyntheticSpec(
        num_layers=1,
        num_q_heads=2,
        num_kv_heads=1,
        head_dim=16,
        prompt_len=40,
        gen_len=48,
        schedule="concentrated",
        concentration=22.0,
        num_anchors=1,
    )
    trace = synthetic_trace(spec, seed=0)
    assert trace.values is not None
    t = 64
    anchors = (trace.keys[0, :t, 0].abs().amax(-1) > 10).nonzero().flatten()
    assert len(anchors) >= 1
    keep = torch.tensor([p for p in range(t) if p not in anchors.tolist()])
    view = TraceView(trace, CONFIG)
    view.write_until(t)
    view.compact(keep.expand(1, 1, -1), [], [])
    future = FutureAttention.compute(view, t, t + B, 4)
    err = future.output_error(view.positions())
    assert err is not None
    h = trace.header
    expected = torch.zeros(1, 1, future.num_queries, dtype=torch.float64)
    kept_mass = []
    for qi, p in enumerate(future.positions.tolist()):
        q = rope_at(h.rope, trace.queries[0, p].double(), p)  # [Hq, d]
        k, v = trace.keys[0, : p + 1, 0].double(), trace.values[0, : p + 1, 0].double()
        attn = (q @ k.T * h.softmax_scale).softmax(-1)  # [Hq, p + 1]
        kept = torch.ones(p + 1, dtype=torch.bool)
        kept[anchors] = False
        approx = (attn * kept) @ v / (attn * kept).sum(-1, keepdim=True)
        expected[0, 0, qi] = (attn @ v - approx).norm(dim=-1).mean()
        kept_mass.append(float((attn * kept).sum(-1).max()))
    assert max(kept_mass) < 1e-6  # the case in point
    assert float(err.max()) <= 2 * float(trace.values.abs().max())
    torch.testing.assert_close(err, expected, rtol=1e-3, atol=0.0)
