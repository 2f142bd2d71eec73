"""Synthetic traces: shapes, determinism, and measured concentrated vs diffuse attention."""

from __future__ import annotations

import attrs
import pytest
import torch

from growpage.core.rope import rope_at
from growpage.core.traces import read_trace, write_trace
from growpage.errors import ConfigError
from growpage.sim.synthetic import SyntheticSpec, synthetic_trace, write_synthetic_trace_set

SMALL = SyntheticSpec(
    num_layers=2,
    num_q_heads=6,
    num_kv_heads=2,
    head_dim=32,
    prompt_len=64,
    gen_len=960,
    mean_regime_len=192,
)


def _regimes(trace):
    return trace.header.meta["regimes"]


def _sample_positions(start: int, end: int, n: int = 4) -> list[int]:
    """Positions inside ``[start, end)`` away from its edges."""
    lo, hi = start + (end - start) // 8 + 1, end - 1
    return sorted({lo + (hi - lo) * i // max(n - 1, 1) for i in range(n)})


def test_shapes_header_and_regimes_match_spec():
    spec = attrs.evolve(SMALL, with_values=False)
    trace = synthetic_trace(spec, seed=0, request_id="r")
    T = spec.prompt_len + spec.gen_len
    assert trace.queries.shape == (2, T, 6, 32) and trace.keys.shape == (2, T, 2, 32)
    assert trace.values is None and not trace.header.has_values
    h = trace.header
    assert (h.request_id, h.prompt_len, h.num_tokens, h.rope.theta) == ("r", 64, T, 10000.0)
    assert h.softmax_scale == pytest.approx(32**-0.5)
    regimes = _regimes(trace)
    assert regimes[0] == [0, 64, "prompt"] and regimes[-1][1] == T
    assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(regimes, regimes[1:], strict=False))
    assert {k for _, _, k in regimes[1:]} == {"concentrated", "diffuse"}


def test_same_seed_same_trace_different_seed_different_trace():
    a, b, c = (synthetic_trace(SMALL, seed=s) for s in (7, 7, 8))
    assert a.header == b.header
    for name in ("queries", "keys", "values"):
        assert torch.equal(getattr(a, name), getattr(b, name))
        assert not torch.equal(getattr(a, name), getattr(c, name))
    assert _regimes(a) != _regimes(c)


@pytest.mark.parametrize("theta, head_dim", [(10000.0, 64), (1e6, 128), (500000.0, 16)])
def test_switch_schedule_working_set_jumps_at_the_switch(ws_ratio, theta, head_dim):
    spec = attrs.evolve(SMALL, schedule="switch", rope_theta=theta, head_dim=head_dim)
    trace = synthetic_trace(spec, seed=1)
    switch = spec.prompt_len + spec.gen_len // 2
    assert _regimes(trace)[1:] == [[64, switch, "concentrated"], [switch, 1024, "diffuse"]]
    conc = torch.stack([ws_ratio(trace, t) for t in _sample_positions(64, switch)])
    diff = torch.stack([ws_ratio(trace, t) for t in _sample_positions(switch, 1024)])
    # Every layer and KV head: at most a few anchors vs most of the history.
    assert conc.max() < 0.05 and diff.min() > 0.6
    assert ws_ratio(trace, switch - 1).max() < 0.05 < 0.6 < ws_ratio(trace, switch + 1).min()


def test_random_schedule_regimes_are_measurably_different(ws_ratio):
    spec = attrs.evolve(SMALL, gen_len=1984)
    trace = synthetic_trace(spec, seed=3)
    by_kind: dict[str, list[torch.Tensor]] = {"concentrated": [], "diffuse": []}
    for start, end, kind in _regimes(trace)[1:]:
        if end - start >= 16:
            by_kind[kind] += [ws_ratio(trace, t) for t in _sample_positions(start, end, 2)]
    conc, diff = torch.stack(by_kind["concentrated"]), torch.stack(by_kind["diffuse"])
    assert len(conc) >= 3 and len(diff) >= 3
    assert conc.mean() < 0.02 and diff.mean() > 0.8 and conc.max() < diff.min() / 10


def _dual_ema_delta(trace, page: int, beta_s: float = 0.9, beta_l: float = 0.999):
    """Delta_t (Eq. 8) from EMA query summaries, as GrowPage estimates it (appendix E.1)."""
    q, h, p0 = trace.queries.double(), trace.header, trace.prompt_len
    short, long_ = q[:, p0].clone(), q[:, p0].clone()
    out = {}
    group = h.num_q_heads // h.num_kv_heads
    for t in range(p0 + 1, trace.num_tokens):
        short.mul_(beta_s).add_(q[:, t], alpha=1 - beta_s)
        long_.mul_(beta_l).add_(q[:, t], alpha=1 - beta_l)
        if (t - p0) % page or t < 2 * page:
            continue
        ratios = []
        keys = trace.keys[:, : t - page].double().repeat_interleave(group, dim=2)
        for summary in (short, long_):
            rms = q[:, t].pow(2).mean(-1, keepdim=True).sqrt()
            s = rope_at(h.rope, summary * rms / summary.pow(2).mean(-1, keepdim=True).sqrt(), t)
            a = (torch.einsum("lhd,lthd->lht", s, keys) * h.softmax_scale).softmax(-1)
            a = a.view(a.shape[0], h.num_kv_heads, group, -1).mean(2)
            cum = a.sort(-1, descending=True).values.cumsum(-1)
            ratios.append((((cum < 0.99).sum(-1) + 1).double() / a.shape[-1]).mean())
        out[t] = (ratios[0] - ratios[1]).item()
    return out


@pytest.mark.parametrize("schedule, sign", [("switch", 1), ("reverse_switch", -1)])
def test_dual_timescale_signal_follows_the_switch(schedule, sign):
    """GrowPage's own estimate sees the regimes: Delta > 0 into diffuse, < 0 into concentrated."""
    spec = attrs.evolve(SMALL, schedule=schedule, gen_len=1536)
    trace = synthetic_trace(spec, seed=2)
    switch = spec.prompt_len + spec.gen_len // 2
    delta = _dual_ema_delta(trace, page=64)
    before = [d for t, d in delta.items() if t < switch]
    after = [d for t, d in delta.items() if switch + 64 <= t < switch + 256]
    assert max(abs(d) for d in before) < 0.02
    assert all(sign * d > 0.3 for d in after)


def test_round_trip_through_fp16_keeps_the_attention_shape(tmp_path, ws_ratio):
    trace = synthetic_trace(attrs.evolve(SMALL, schedule="switch"), seed=4)
    back = read_trace(write_trace(tmp_path / "s.safetensors", trace))
    assert back.header == trace.header
    for t in (200, 900):
        assert torch.allclose(ws_ratio(back, t), ws_ratio(trace, t), atol=0.02)


def test_write_synthetic_trace_set(tmp_path):
    spec = attrs.evolve(SMALL, gen_len=1)
    ts = write_synthetic_trace_set(tmp_path / "set", spec, output_lens=[10, 50, 30], seed=5)
    assert [e.num_tokens for e in ts.index] == [74, 114, 94]
    assert [e.tags for e in ts.index] == [("synthetic",)] * 3
    traces = list(ts)
    assert [t.request_id for t in traces] == ["synthetic-0", "synthetic-1", "synthetic-2"]
    assert traces[1].header.meta["seed"] == 6 and traces[1].num_generated == 50


@pytest.mark.parametrize(
    "field, value",
    [
        ("num_layers", 0),
        ("head_dim", 6),
        ("head_dim", 33),
        ("num_q_heads", 3),
        ("p_concentrated", 1.5),
        ("concentration", 0.0),
        ("diffuse_std", float("inf")),
        ("schedule", "sometimes"),
        ("gen_len", 2.5),
        ("num_anchors", True),
    ],
)
def test_spec_validation(field, value):
    with pytest.raises(ConfigError, match=f"SyntheticSpec.{field}"):
        attrs.evolve(SMALL, **{field: value})


def test_spec_with_values_must_be_a_bool():
    with pytest.raises(ConfigError, match="SyntheticSpec.with_values must be True or False, got 1"):
        attrs.evolve(SMALL, with_values=1)
