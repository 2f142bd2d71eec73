"""BoundaryContext: signals match the reference maths, are lazy, and respond to the summaries."""

import pytest
import torch

from growpage.core import demand
from growpage.core.boundary_context import BoundaryContext
from growpage.core.rope import rope_at
from growpage.testing import BoundaryCase

CASE = BoundaryCase(
    num_layers=2,
    num_kv_heads=2,
    group_size=3,
    head_dim=8,
    page_size=8,
    recent_window=3,
    num_pages=4,
    num_free_pages=5,
    gap=7,
    seed=11,
    sharpness=1.0,
    track_accumulated=False,
)


def test_attention_matches_reference_pipeline():
    ctx = CASE.context()
    view = ctx.view
    qs = view.query_state()
    n_est = CASE.num_tokens - CASE.page_size
    for name, summary in (("short", qs.short), ("long", qs.long)):
        q = rope_at(view.rope, demand.rms_calibrate(summary, qs.current), ctx.position)
        ref = demand.group_attention(q, view.keys()[:, :, :n_est], view.softmax_scale)
        got = ctx.attention(name)
        assert got.shape == (2, 2, n_est)
        assert torch.allclose(got, ref, atol=1e-6)
        assert torch.allclose(got.sum(-1), torch.ones(2, 2), atol=1e-5)
        assert torch.equal(ctx.working_set_ratio(name), demand.working_set_ratio(ref, 0.99))


def test_scores_are_max_over_selection_candidates():
    ctx = CASE.context()
    s = ctx.scores()
    assert s.shape == (2, 2, CASE.num_tokens - CASE.recent_window)
    view = ctx.view
    qs = view.query_state()
    ref = [
        demand.group_attention(
            rope_at(view.rope, demand.rms_calibrate(x, qs.current), ctx.position),
            view.keys()[:, :, : s.shape[-1]],
            view.softmax_scale,
        )
        for x in (qs.short, qs.long)
    ]
    assert torch.allclose(s, torch.maximum(*ref), atol=1e-6)


def test_signals_are_lazy_and_cached():
    ctx = CASE.context()
    calls = []
    keys = ctx.view.keys
    ctx.view.keys = lambda: calls.append(1) or keys()
    assert not calls  # building a context computes nothing
    ctx.delta()
    assert "_selection_attention" not in vars(ctx)  # delta() did not pay for scores
    ctx.delta()
    ctx.working_set_ratio("long")
    ctx.scores()
    assert len(calls) == 1  # the KV view was read once for all signals


def sharp_vs_flat_context(swap: bool) -> BoundaryContext:
    ctx = CASE.context()
    view = ctx.view
    view._keys[:, :, 2] *= 6.0  # a distinct "anchor" key
    # Short summary points (after RoPE at the current position) at one key: concentrated.
    target = view.keys()[:, :, 2].repeat_interleave(CASE.group_size, dim=1) * 20.0
    sharp = rope_at(view.rope, target, -ctx.position)
    flat = torch.zeros_like(sharp)  # calibrates to zero: uniform attention
    short, long = (flat, sharp) if swap else (sharp, flat)
    view.set_queries(torch.stack([short, long], dim=1), sharp)
    return ctx


def test_delta_sign_follows_concentration_and_flips_on_swap():
    concentrating = sharp_vs_flat_context(swap=False)
    expanding = sharp_vs_flat_context(swap=True)
    assert concentrating.delta() < -0.5
    assert expanding.delta() == pytest.approx(-concentrating.delta())
    assert concentrating.attention("short")[..., 2].min() > 0.9


def test_bad_view_name():
    with pytest.raises(ValueError, match="short"):
        CASE.context().attention("medium")


@pytest.mark.parametrize(
    "call",
    [
        lambda ctx: ctx.attention("medium"),
        lambda ctx: ctx.working_set_ratio("medium"),
        lambda ctx: ctx.working_set_ratio("short", p=2.0),
        lambda ctx: ctx.working_set_ratio("short", p="0.9"),
        lambda ctx: ctx.delta(0.0),
        lambda ctx: ctx.delta(float("nan")),
        lambda ctx: ctx.delta(True),
    ],
    ids=["view", "ratio-view", "p>1", "p-str", "p=0", "p-nan", "p-bool"],
)
def test_bad_signal_arguments_are_config_errors_naming_the_argument(call):
    """A policy's bad argument is the library's own error (the CLI prints it as one line)
    naming the method and argument, and leaves the context's caches clean."""
    from growpage.errors import ConfigError

    ctx = CASE.context()
    with pytest.raises(
        ConfigError,
        match=r"BoundaryContext\.(attention|working_set_ratio|delta)"
        r".*(view|p)",
    ):
        call(ctx)
    assert not ctx._ratios and not ctx._deltas
    assert ctx.delta() == CASE.context().delta()
