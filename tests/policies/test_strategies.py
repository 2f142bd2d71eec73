"""The kit's boundaries look like real ones: per-head positions after compressions, keys and
summaries from one query history, and H2O sums that are that history's attention, exactly as
the simulator's trace replay fills them."""

import attrs
import pytest
import torch
from hypothesis import HealthCheck, given, settings

from growpage.core.rope import rope_at
from growpage.core.traces import Trace, TraceHeader
from growpage.sim.traceview import TraceView
from growpage.testing import BoundaryCase, boundary_cases
from growpage.testing.strategies import _history

CASE = BoundaryCase(
    num_layers=2,
    num_kv_heads=3,
    group_size=2,
    head_dim=8,
    page_size=4,
    recent_window=2,
    num_pages=3,
    num_free_pages=1,
    gap=8,
    seed=4,
    sharpness=1.0,
    track_accumulated=True,
)
FAST = settings(
    max_examples=25, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)


@FAST
@given(boundary_cases())
def test_positions_are_per_head_ascending_and_end_with_the_last_page(case):
    ctx = case.context()
    pos, t, b = ctx.positions(), ctx.position, case.page_size
    assert pos.shape == (case.num_layers, case.num_kv_heads, case.num_tokens)
    assert pos.dtype == torch.long and (pos >= 0).all() and (pos < t).all()
    assert (pos[..., 1:] > pos[..., :-1]).all()
    # The page decoded since the last boundary is the same in every head.
    assert torch.equal(pos[..., -b:], torch.arange(t - b, t).expand(*pos.shape[:-1], b))
    assert case.gap % b == 0  # every compression dropped whole pages


def test_heads_hold_different_positions_after_compressions():
    pos = CASE.context().positions().flatten(0, 1)
    assert len({tuple(p.tolist()) for p in pos}) == pos.shape[0]
    no_gap = attrs.evolve(CASE, gap=0).context().positions()
    assert torch.equal(no_gap, torch.arange(CASE.num_tokens).expand_as(no_gap))


@FAST
@given(boundary_cases(accumulated=True))
def test_accumulated_sums_are_the_attention_of_the_queries_run(case):
    ctx = case.context()
    acc, pos, t = ctx.accumulated_attention(), ctx.positions(), ctx.position
    assert acc.dtype == torch.float32 and (acc >= 0).all()
    # A query spreads one unit over the slots it sees: position p is seen by t - p queries.
    assert (acc <= (t - pos) + 1e-4).all()
    total = acc.sum(-1)
    assert (total <= t + 1e-3).all()
    if case.gap == 0:
        assert torch.allclose(total, torch.full_like(total, t), atol=1e-3)
    # The last slot (token t - 1) has been seen by its own query only, the current one.
    view = ctx.view
    q = rope_at(view.rope, view.current_query, t - 1)
    q = q.reshape(case.num_layers, case.num_kv_heads, case.group_size, -1)
    attn = torch.einsum("lhgd,lhnd->lhgn", q, view.keys()) * view.softmax_scale
    assert torch.allclose(acc[..., -1], attn.softmax(-1).mean(2)[..., -1], atol=1e-5)


@pytest.mark.parametrize("gap, seed", [(0, 1), (8, 4), (12, 7), (5, 3), (128, 2)])
def test_a_case_is_what_the_simulator_replays_from_its_history(gap, seed):
    """Replaying the case's history (same queries, keys, boundaries, kept slots) through the
    simulator's ``TraceView`` gives the case's view: positions, keys, summaries, sums."""
    case = attrs.evolve(CASE, gap=gap, seed=seed)
    h = _history(case)
    t, num_q = case.position, case.num_kv_heads * case.group_size
    header = TraceHeader(
        request_id="r",
        model="kit",
        num_layers=case.num_layers,
        layer_ids=range(case.num_layers),
        num_q_heads=num_q,
        num_kv_heads=case.num_kv_heads,
        head_dim=case.head_dim,
        rope=h.rope,
        softmax_scale=case.head_dim**-0.5,
        prompt_len=h.prompt_len,
        token_ids=[0] * t,
        has_values=False,
    )
    trace = Trace(header, h.queries, h.keys.permute(0, 2, 1, 3).contiguous())
    sim = TraceView(trace, case.config, track_accumulated=True)
    for position, kept in h.steps:
        sim.prepare_boundary(position)
        if kept is not None:
            sim.compact(kept, [], [])
    sim.prepare_boundary(t)
    view = case.view()
    assert torch.equal(view.positions(), sim.positions())
    assert torch.allclose(view.keys(), sim.keys())
    assert torch.allclose(view.summaries, sim.summaries, atol=1e-5)
    assert torch.equal(view.current_query, sim.current_query)
    assert torch.allclose(view.accumulated_attention(), sim.accumulated_attention(), atol=1e-4)
