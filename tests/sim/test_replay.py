"""Per-request replay on synthetic traces where the right answer is known."""

from __future__ import annotations

import math
import re

import attrs
import pytest
import torch

from growpage import CapacityPolicy, Decision, GrowPageConfig, PagePool
from growpage.core.demand import update_query_summaries
from growpage.core.rope import rope_at
from growpage.errors import ConfigError, PolicyError
from growpage.policies import FixedBudgetPolicy, resolve_policy
from growpage.sim.ema import ema_snapshots
from growpage.sim.fidelity import FutureAttention
from growpage.sim.replay import ReplayOptions, replay_trace
from growpage.sim.signal import signal_quality
from growpage.sim.synthetic import SyntheticSpec, synthetic_trace
from growpage.sim.traceview import TraceView

B = 64
CONFIG = GrowPageConfig(page_size=B, recent_window=8)
SWITCH = SyntheticSpec(
    num_layers=2,
    num_q_heads=4,
    num_kv_heads=2,
    head_dim=32,
    prompt_len=64,
    gen_len=1536,
    schedule="switch",
)
SWITCH_AT = 64 + 1536 // 2


@pytest.fixture(scope="module")
def switch_trace():
    return synthetic_trace(SWITCH, seed=3)


@pytest.fixture(scope="module")
def random_trace():
    return synthetic_trace(
        attrs.evolve(SWITCH, schedule="random", mean_regime_len=256.0, gen_len=1000), seed=5
    )


def decided(result, start, end):
    return [r.decision for r in result.records if start <= r.position < end and r.decision]


def test_ema_snapshots_match_the_sequential_update(random_trace):
    q, p0 = random_trace.queries, random_trace.prompt_len
    positions = [p0, p0 + 1, p0 + 63, 200, 777, random_trace.num_tokens - 1]
    got = ema_snapshots(q, p0, positions, (0.9, 0.999))
    summaries = torch.zeros(q.shape[0], 2, q.shape[2], q.shape[3])
    for t in range(p0, random_trace.num_tokens):
        update_query_summaries(summaries, q[:, t], 0.9, 0.999, first=t == p0)
        if t in positions:
            torch.testing.assert_close(got[positions.index(t)], summaries, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="strictly"):
        ema_snapshots(q, p0, [p0 + 5, p0 + 5], (0.9,))


def test_zero_start_snapshots_are_the_ema_started_at_zero(random_trace):
    q, p0 = random_trace.queries, random_trace.prompt_len
    positions = [p0, p0 + 7, 300]
    got = ema_snapshots(q, p0, positions, (0.9, 0.99), zero_start=True)
    summaries = torch.zeros(q.shape[0], 2, q.shape[2], q.shape[3])
    for t in range(p0, 301):
        update_query_summaries(summaries, q[:, t], 0.9, 0.99, first=False)
        if t in positions:
            torch.testing.assert_close(got[positions.index(t)], summaries, rtol=1e-4, atol=1e-5)


def test_switch_to_diffuse_makes_growpage_grow_and_inverse_compress(switch_trace):
    options = ReplayOptions(fidelity_queries=0)
    grow = replay_trace(switch_trace, "growpage", CONFIG, options)
    inverse = replay_trace(switch_trace, "inverse", CONFIG, options)
    # Concentrated first half: Delta_t ~ 0, growpage compresses, inverse grows.
    assert set(decided(grow, 2 * B, SWITCH_AT)) == {"compress"}
    assert set(decided(inverse, 2 * B, SWITCH_AT)) == {"grow"}
    # After the switch to diffuse attention Delta_t > 0: the opposite.
    after = SWITCH_AT + B
    assert set(decided(grow, after, after + 6 * B)) == {"grow"}
    assert set(decided(inverse, after, after + 6 * B)) == {"compress"}
    assert all(r.delta > 0.3 for r in grow.records if after <= r.position < after + 4 * B)
    assert grow.max_pages > 8 and inverse.records[-1].pages_after == inverse.max_pages


def test_fullkv_never_loses_mass(random_trace):
    result = replay_trace(random_trace, "fullkv", CONFIG, ReplayOptions(fidelity_queries=8))
    assert result.events["compress"] == 0 and result.records
    assert all(
        r.mass_mean == 1.0 and r.mass_min == 1.0 and r.output_error == 0.0 for r in result.records
    )
    assert torch.equal(result.head_mass, torch.ones_like(result.head_mass))
    # Capacity grows one page per boundary; avg budget = mean capacity over decode tokens.
    caps = [
        math.ceil((t + 1) / B) * B for t in range(random_trace.prompt_len, random_trace.num_tokens)
    ]
    assert result.avg_budget == pytest.approx(sum(caps) / len(caps))


@pytest.mark.parametrize("budget", [128, 320, 512])
def test_fixed_never_exceeds_its_budget(random_trace, budget):
    result = replay_trace(
        random_trace,
        resolve_policy("fixed", budget_tokens=budget),
        CONFIG,
        ReplayOptions(fidelity_queries=0),
    )
    assert result.max_pages * B == budget // B * B  # grows to the budget, never beyond
    assert all(r.pages_after * B <= budget for r in result.records)
    assert result.avg_budget <= budget


def test_compression_loses_mass_and_fidelity_matches_brute_force(random_trace):
    result = replay_trace(
        random_trace,
        resolve_policy("fixed", budget_tokens=256),
        CONFIG,
        ReplayOptions(fidelity_queries=4),
    )
    assert result.mass_mean < 1.0 and all(
        0 <= r.mass_min <= r.mass_mean <= 1 for r in result.records
    )
    # Brute force at one boundary: rebuild the view, compress, and score each query alone.
    view = TraceView(random_trace, CONFIG)
    view.write_until(512)
    keep = torch.arange(0, 512, 2).expand(2, 2, -1)  # every other token
    view.compact(keep, [], [])
    future = FutureAttention.compute(view, 512, 512 + B, 4)
    lost = future.lost_mass(view.positions())  # [L, Hkv, Q]
    h = random_trace.header
    for qi, t in enumerate(future.positions.tolist()):
        q = rope_at(h.rope, random_trace.queries[:, t], t).view(2, 2, 2, -1)  # [L, Hkv, G, d]
        k = view.keys_by_head[:, :, : t + 1]
        attn = (torch.einsum("lhgd,lhkd->lhgk", q, k) * h.softmax_scale).softmax(-1).mean(2)
        dropped = torch.ones(t + 1, dtype=torch.bool)
        dropped[512:] = False
        dropped[keep[0, 0]] = False
        torch.testing.assert_close(lost[..., qi], attn[..., dropped].sum(-1), rtol=1e-4, atol=1e-5)


def test_signals_see_the_switch(switch_trace):
    result = replay_trace(
        switch_trace, "growpage", CONFIG, ReplayOptions(fidelity_queries=4, signals=True)
    )
    at_switch = [r for r in result.records if SWITCH_AT <= r.position < SWITCH_AT + B]
    assert at_switch and at_switch[0].future_change > 0.3  # demand jumps at the switch
    later = [r for r in result.records if r.position >= SWITCH_AT + B]
    assert all(r.delta > 0 for r in later[:4])
    assert all(
        r.advantage is not None and r.advantage >= -1e-6 for r in result.records if r.decision
    )


def test_a_shared_pool_can_refuse_growth_or_stop_the_replay(random_trace):
    pool = PagePool(6, B)
    always_grow = FixedBudgetPolicy(budget_tokens=10**6)  # wants pages, falls back when refused
    result = replay_trace(
        random_trace, always_grow, CONFIG, ReplayOptions(fidelity_queries=0), pool=pool
    )
    assert result.max_pages == 6 and result.events["fallback"] > 0 and not result.preempted
    assert pool.num_free_pages == 6
    # fullkv never compresses: a refused page stops the replay (the request would be preempted).
    full = replay_trace(
        random_trace, "fullkv", CONFIG, ReplayOptions(fidelity_queries=0), pool=PagePool(6, B)
    )
    assert full.preempted and full.events["fallback"] == 0 and full.events["compress"] == 0
    tight = PagePool(2, B)
    tight.allocate(1)  # someone else holds a page: the forced growth cannot happen
    stopped = replay_trace(random_trace, "fullkv", CONFIG, pool=tight)
    assert stopped.preempted and stopped.records[-1].action == "preempt"


def test_replay_options_are_validated():
    with pytest.raises(ConfigError, match="fidelity_queries"):
        ReplayOptions(fidelity_queries=-1)
    with pytest.raises(ConfigError, match="signals"):
        ReplayOptions(fidelity_queries=0, signals=True)
    # Flags are True or False: "false" read as on until 2026-12.
    for field, value in (("output_error", "false"), ("signals", 1), ("release", None)):
        with pytest.raises(
            ConfigError,
            match=re.escape(f"ReplayOptions.{field} must be True or False, got {value!r}"),
        ):
            ReplayOptions(**{field: value})


@pytest.mark.parametrize(
    ("field", "value", "what"),
    [
        ("page_size", 0, "a positive integer"),
        ("fidelity_queries", 0, "a positive integer"),
        ("baseline_budget", -5, "a positive integer or None"),
        ("shrink_min_tokens", 2.5, "a positive integer"),
        ("bootstrap", -1, "an integer >= 0"),
        ("seed", True, "an integer >= 0"),
        ("budgets", (256, 0), "a non-empty tuple, each item a positive integer"),
    ],
)
def test_real_trace_settings_are_validated(field, value, what):
    """Until 2026-12 only the budgets were checked: bootstrap -1 meant none, a page size of 0
    failed deep inside the analysis."""
    from growpage.sim.realtrace import RealTraceSettings

    with pytest.raises(
        ConfigError,
        match=re.escape(f"RealTraceSettings.{field} must be {what}, got {value!r}"),
    ):
        RealTraceSettings(**{field: value})
    assert RealTraceSettings(baseline_budget=None).baseline_budget is None


def test_accumulated_attention_matches_token_by_token_h2o(random_trace):
    """TraceView's catch-up at a boundary equals adding every query's attention as it comes,
    over the slots resident then (including after a compaction)."""
    trace, cfg = random_trace, CONFIG
    view = TraceView(trace, cfg, track_accumulated=True)
    h = trace.header
    group = h.num_q_heads // h.num_kv_heads

    def naive(upto: int, keys, pos, acc):
        for t in range(acc["until"], upto):
            q = rope_at(h.rope, trace.queries[:, t].float(), t)  # [L, Hq, d]
            q = q.reshape(h.num_recorded_layers, h.num_kv_heads, group, h.head_dim)
            logits = torch.einsum("lhgd,lhsd->lhgs", q, keys) * h.softmax_scale
            logits = logits.masked_fill((pos > t)[:, :, None, :], float("-inf"))
            acc["sum"] += logits.softmax(-1).nan_to_num(0.0).mean(2)
        acc["until"] = upto

    first = 2 * B
    view.prepare_boundary(first)
    keys, pos = view.keys().clone(), view.positions().clone()
    acc = {"until": 0, "sum": torch.zeros(pos.shape)}
    naive(first, keys, pos, acc)
    torch.testing.assert_close(view.accumulated_attention(), acc["sum"], atol=1e-5, rtol=1e-5)
    # Each query's attention sums to 1 per (layer, KV head).
    torch.testing.assert_close(acc["sum"].sum(-1), torch.full(pos.shape[:2], float(first)))
    keep = torch.arange(0, first, 2).expand(*pos.shape[:2], -1).contiguous()
    view.compact(keep, [], [])
    acc["sum"] = torch.gather(acc["sum"], 2, keep)
    second = first + B
    view.prepare_boundary(second)
    keys, pos = view.keys().clone(), view.positions().clone()
    acc["sum"] = torch.cat([acc["sum"], torch.zeros(*pos.shape[:2], B)], dim=-1)
    naive(second, keys, pos, acc)
    torch.testing.assert_close(view.accumulated_attention(), acc["sum"], atol=1e-5, rtol=1e-5)


def test_h2o_uses_accumulated_attention_in_replay(random_trace):
    cfg = attrs.evolve(CONFIG, min_capacity=2)
    h2o = replay_trace(random_trace, resolve_policy("h2o", budget_tokens=4 * B), cfg)
    fixed = replay_trace(random_trace, FixedBudgetPolicy(budget_tokens=4 * B), cfg)
    assert [r.decision for r in h2o.records] == [r.decision for r in fixed.records]
    assert [r.pages_after for r in h2o.records] == [r.pages_after for r in fixed.records]
    assert [r.mass_mean for r in h2o.records] != [r.mass_mean for r in fixed.records]


def test_a_policy_writing_into_what_the_context_hands_it_changes_nothing_else(random_trace):
    # ctx.positions() and ctx.accumulated_attention() used to hand out the replay view's own
    # storage: a policy changing them in place changed the replay's KV positions and sums
    # (the engine hands out copies).
    h2o_class = type(resolve_policy("h2o", budget_tokens=4 * B))

    @attrs.define
    class Vandal(h2o_class):
        name = "vandal"

        def select(self, ctx, keep):
            kept = super().select(ctx, keep)
            ctx.positions().zero_()
            ctx.accumulated_attention().fill_(-1.0)
            return kept

    cfg = attrs.evolve(CONFIG, min_capacity=2)
    plain = replay_trace(random_trace, resolve_policy("h2o", budget_tokens=4 * B), cfg)
    vandal = replay_trace(random_trace, Vandal(budget_tokens=4 * B), cfg)
    assert [r.pages_after for r in plain.records] == [r.pages_after for r in vandal.records]
    assert [r.mass_mean for r in plain.records] == [r.mass_mean for r in vandal.records]
    assert "compress" in [r.decision for r in plain.records]


class _FailsAfter(CapacityPolicy):
    """Grows ``grows`` times, then fails the way ``how`` says."""

    name = "fails-after"

    def __init__(self, grows: int, how: str) -> None:
        self.grows, self.how = grows, how

    def decide(self, ctx):
        if self.grows:
            self.grows -= 1
            return Decision.GROW
        if self.how == "raise":
            raise ZeroDivisionError("policy bug")
        return "grow" if self.how == "nonsense" else Decision.COMPRESS

    def select(self, ctx, keep):
        return torch.zeros(*ctx.shape, keep, dtype=torch.long)  # duplicates: invalid


@pytest.mark.parametrize("how", ["raise", "nonsense", "bad-select"])
def test_a_failing_policy_leaves_a_shared_pool_as_it_was(random_trace, how):
    pool = PagePool(40, B)
    pool.allocate(3)  # another request's pages
    with pytest.raises((ZeroDivisionError, PolicyError)):
        replay_trace(
            random_trace, _FailsAfter(2, how), CONFIG, ReplayOptions(fidelity_queries=0), pool=pool
        )
    assert pool.num_free_pages == 37


def test_signals_check_the_counterfactual_selection_as_the_controller_does(random_trace):
    """With signals the replay asks select() at every decided boundary (a growth's
    counterfactual compression too): a bad selection is the same PolicyError."""

    class GrowsButSelectsBadly(CapacityPolicy):
        name = "grows-but-selects-badly"

        def decide(self, ctx):
            return Decision.GROW

        def select(self, ctx, keep):
            return torch.zeros(keep, dtype=torch.long)  # no layer/head dimensions

    with pytest.raises(PolicyError, match="grows-but-selects-badly select\\(\\): wrong shape"):
        replay_trace(
            random_trace,
            GrowsButSelectsBadly(),
            CONFIG,
            ReplayOptions(fidelity_queries=2, signals=True),
        )
    # Without signals the policy's select is never called: it only grows.
    replay_trace(random_trace, GrowsButSelectsBadly(), CONFIG, ReplayOptions(fidelity_queries=2))


def test_a_boundary_before_the_first_decode_step_of_a_residency_has_no_query_state(random_trace):
    """Past the prompt, a boundary has the summaries of the previous token, unless the request
    has not decoded since its admission (back from preemption: its recompute restarts them, as
    in the engine); the next decoded boundary has them again."""
    view = TraceView(random_trace, CONFIG)
    prompt = random_trace.prompt_len
    view.prepare_boundary(prompt)  # a prompt ending on a page: none yet
    assert not view.has_query_state
    view.prepare_boundary(prompt + 40)
    assert view.has_query_state
    view.prepare_boundary(prompt + 41, decoded=False)
    assert not view.has_query_state
    view.prepare_boundary(prompt + 42)
    assert view.has_query_state
    torch.testing.assert_close(view.current_query, random_trace.queries[:, prompt + 41].float())


def test_signals_skip_a_growth_forced_before_the_first_decode_query():
    """A prompt that fills two pages exactly: the first boundary comes before any decode query,
    so the controller grows without asking the policy. Its record used to carry the Delta_t of
    an empty query state (0.0) and a counterfactual advantage, which signal_quality then
    counted in the [0, 0.005) bucket as if the policy had decided there."""
    spec = attrs.evolve(
        SWITCH, schedule="random", mean_regime_len=128.0, prompt_len=2 * B, gen_len=6 * B
    )
    result = replay_trace(
        synthetic_trace(spec, seed=4),
        "growpage",
        CONFIG,
        ReplayOptions(fidelity_queries=4, signals=True),
    )
    first = result.records[0]
    assert (first.position, first.decision, first.action) == (2 * B, None, "grow")
    assert (first.delta, first.advantage, first.advantage_error) == (None, None, None)
    assert first.mass_mean == 1.0  # fidelity is still measured there
    decided = [r for r in result.records if r.decision is not None]
    assert decided and all(r.delta is not None and r.advantage is not None for r in decided)
    counted = sum(b.count for b in signal_quality(result.records).buckets)
    assert counted == len(decided)
