"""Serving simulator: page conservation, determinism, and script vs trace mode."""

from __future__ import annotations

import math
import re

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from growpage import CapacityPolicy, Decision, GrowPageConfig
from growpage.errors import ConfigError
from growpage.policies import resolve_policy
from growpage.sim.costmodel import LinearCostModel, load_cost_model
from growpage.sim.serving import SimConfig, simulate
from growpage.sim.workload_csv import WorkloadRequest
from growpage.sim.workloads import resolve_workload

COST = LinearCostModel(base_s=0.01, per_seq_s=0.001, per_kv_token_s=1e-5, per_prefill_token_s=1e-4)
RELEASE = ("finish", "preempt")


def pages_in_use_over_time(events) -> list[int]:
    """Total pages held after every logged event (finish/preempt release the logged pages)."""
    held: dict[str, int] = {}
    totals = []
    for _, kind, rid, pages in events:
        if kind == "arrive":
            continue
        held[rid] = 0 if kind in RELEASE else pages
        totals.append(sum(held.values()))
    return totals


def check_conservation(result, requests, num_pages):
    assert all(total <= num_pages for total in pages_in_use_over_time(result.events))
    assert result.metrics.peak_pages <= num_pages
    result.pool.check_invariants()
    assert result.pool.num_free_pages == num_pages  # every page is back
    assert all(
        r.finish_s is not None and r.generated == r.output_tokens - 1 for r in result.requests
    )
    assert len(result.requests) == len(requests)


class Seesaw(CapacityPolicy):
    """Grow below 4 pages, shrink at 4 or more: exercises page release (no attention read)."""

    name = "seesaw"

    def decide(self, ctx):
        return Decision.GROW if ctx.num_pages < 4 else Decision.SHRINK


POLICIES = {
    "fullkv": lambda: resolve_policy("fullkv"),
    "fixed": lambda: resolve_policy("fixed", budget_tokens=12),
    "random": lambda: resolve_policy("random", grow_prob=0.5),
    "seesaw": Seesaw,
}

workloads = st.lists(
    st.tuples(st.integers(1, 24), st.integers(1, 80), st.sampled_from([0.0, 0.0, 0.3, 1.7])),
    min_size=1,
    max_size=7,
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    spec=workloads,
    pages=st.integers(3, 24),
    policy=st.sampled_from(sorted(POLICIES)),
    reserve=st.sampled_from([0.0, 0.2]),
    seats=st.integers(1, 4),
    asynchronous=st.booleans(),
    late=st.booleans(),
    prefill=st.sampled_from([(16384, True), (5, True), (13, True), (5, False)]),
)
def test_pages_are_conserved_and_runs_are_deterministic(
    spec, pages, policy, reserve, seats, asynchronous, late, prefill
):
    config = GrowPageConfig(page_size=4, recent_window=1, min_capacity=2)
    requests = [WorkloadRequest(f"r{i}", a, p, o) for i, (p, o, a) in enumerate(spec)]
    # A request alone must fit: its prompt and one more token (the first decode step's: a
    # prompt that fills its last page grows before any query summary exists), as the engine
    # requires; one that never compresses (fullkv) its whole KV, prompt + output - 1 tokens.
    assume(all(math.ceil((r.prompt_tokens + 1) / 4) <= pages for r in requests))
    if policy == "fullkv":
        assume(
            all(
                max(2, math.ceil((r.prompt_tokens + r.output_tokens - 1) / 4)) <= pages
                for r in requests
            )
        )
    chunk, chunked = prefill
    sim = SimConfig(
        num_kv_pages=pages,
        max_num_seqs=seats,
        admission_reserve=reserve,
        record_events=True,
        async_compaction=asynchronous,
        async_decisions=late,
        max_num_batched_tokens=chunk,
        chunked_prefill=chunked,
    )
    first = simulate(requests, POLICIES[policy](), config, sim, COST)
    check_conservation(first, requests, pages)
    again = simulate(requests, POLICIES[policy](), config, sim, COST)
    assert again.events == first.events and again.metrics == first.metrics


def test_growpage_script_mode_conserves_pages_under_pressure():
    config = GrowPageConfig(page_size=64, recent_window=16)
    requests = resolve_workload("tiny", seed=1)
    sim = SimConfig(num_kv_pages=30, record_events=True, num_scripts=3)
    result = simulate(requests, "growpage", config, sim, load_cost_model("a100-qwen3-8b"))
    check_conservation(result, requests, 30)
    m = result.metrics
    assert m.fallbacks > 0 and 0 < m.grow_ratio < 1
    again = simulate(requests, "growpage", config, sim, load_cost_model("a100-qwen3-8b"))
    assert again.events == result.events


def test_trace_mode_matches_script_mode_when_memory_is_plentiful():
    """With no pool pressure both modes replay the same synthetic request exactly."""
    config = GrowPageConfig(page_size=32, recent_window=8)
    requests = [WorkloadRequest("a", 0.0, 40, 600)]
    results = {
        mode: simulate(
            requests,
            "growpage",
            config,
            SimConfig(num_kv_pages=100, decisions=mode, num_scripts=1, record_events=True),
            COST,
        )
        for mode in ("script", "trace")
    }
    # The script of a one-request group is a synthetic trace of the same regime dynamics but
    # not the same draw; both must stay within the pool and finish. State-driven policies
    # (fixed, random) read no attention signal: both modes decide exactly alike.
    for result in results.values():
        check_conservation(result, requests, 100)
    for policy in (resolve_policy("fixed", budget_tokens=256), resolve_policy("random")):
        events = {
            mode: simulate(
                requests,
                policy,
                config,
                SimConfig(num_kv_pages=100, decisions=mode, record_events=True),
                COST,
            ).events
            for mode in ("script", "trace")
        }
        assert events["script"] == events["trace"]


TWO = [WorkloadRequest("a", 0.0, 20, 150), WorkloadRequest("b", 0.0, 41, 400)]


def two_requests(mode: str = "script", asynchronous: bool = False, compaction_s: float = 0.0):
    """``TWO`` under fixed (48-token budget, pages of 16): a compresses every 16 tokens while
    b decodes beside it, b also after a has finished. Each step (prefill or decode) costs 1 s,
    so a request's finish time counts steps."""
    cost = LinearCostModel(base_s=1.0, compaction_s=compaction_s)
    return simulate(
        TWO,
        resolve_policy("fixed", budget_tokens=48),
        GrowPageConfig(page_size=16, recent_window=4),
        SimConfig(
            num_kv_pages=200, decisions=mode, record_events=True, async_compaction=asynchronous
        ),
        cost,
    )


def compressions_of(result, rid: str) -> list[float]:
    return [t for t, kind, who, _ in result.events if kind == "compress" and who == rid]


@pytest.mark.parametrize("mode", ["script", "trace"])
def test_async_compaction_costs_a_compressing_request_one_step_while_others_decode(mode):
    """With async compaction a request sits out one step per compression made while another
    request was decoding, and no other request waits for it (the engine's async_compaction);
    a compression with nothing else to decode runs at once."""
    runs = {flag: two_requests(mode, flag) for flag in (False, True)}
    sync, asyn = ({r.request_id: r for r in runs[f].requests} for f in (False, True))
    assert all(r.generated == r.output_tokens - 1 for r in asyn.values())
    a, b = compressions_of(runs[True], "a"), compressions_of(runs[True], "b")
    a_done = asyn["a"].finish_s
    assert len(a) >= 5 and all(t < a_done for t in a)
    b_beside_a = sum(t < a_done for t in b)
    assert 0 < b_beside_a < len(b)
    assert asyn["a"].finish_s - sync["a"].finish_s == len(a)
    assert asyn["b"].finish_s - sync["b"].finish_s == b_beside_a
    m_sync, m_async = runs[False].metrics, runs[True].metrics
    assert m_async.compresses == m_sync.compresses == len(a) + len(b)
    # b decodes last: the run lasts as many more steps as b sat out (a's were beside b's).
    assert m_async.decode_steps == m_sync.decode_steps + b_beside_a


@pytest.mark.parametrize("price", [0.5, 3.0])
def test_async_compaction_hides_compaction_behind_the_step(price):
    """A synchronous run pays every compaction's price before its step; an asynchronous one
    runs it beside the step a request sits out, which costs the longer of the two, and pays
    it in full only with nothing else to decode."""
    free_sync, free_async = two_requests(), two_requests(asynchronous=True)
    paid_sync, paid_async = two_requests(compaction_s=price), two_requests("script", True, price)
    a_done = {r.request_id: r for r in free_async.requests}["a"].finish_s
    b = compressions_of(free_async, "b")
    sat_out = len(compressions_of(free_async, "a")) + sum(t < a_done for t in b)
    alone = sum(t >= a_done for t in b)
    compactions = free_sync.metrics.compresses
    assert paid_sync.metrics.total_s == pytest.approx(
        free_sync.metrics.total_s + price * compactions
    )
    assert paid_async.metrics.total_s == pytest.approx(
        free_async.metrics.total_s + sat_out * (max(price, 1.0) - 1.0) + price * alone
    )
    assert paid_sync.metrics.boundary_s == pytest.approx(price * compactions)
    assert paid_async.metrics.boundary_s == pytest.approx(price * compactions)


@pytest.mark.parametrize("price", [0.5, 3.0])
def test_late_boundaries_hide_decision_and_compaction_behind_the_step(price):
    """async_decisions: every request whose boundary was decided (here all compress: growth
    up to fixed's budget is forced, below min_capacity) sits the next step out while its
    decision and compaction run beside it; the step costs the longer of the two, and with
    nothing else to decode the boundary is paid in full. The boundary time is the same as the
    synchronous run's."""

    def run(late: bool, boundary_s: float) -> object:
        cost = LinearCostModel(base_s=1.0, boundary_s=boundary_s, compaction_s=boundary_s)
        return simulate(
            TWO,
            resolve_policy("fixed", budget_tokens=48),
            GrowPageConfig(page_size=16, recent_window=4, min_capacity=3),
            SimConfig(num_kv_pages=200, record_events=True, async_decisions=late),
            cost,
        )

    free, paid = run(True, 0.0), run(True, price)
    sync_paid = run(False, price)
    a_done = {r.request_id: r for r in free.requests}["a"].finish_s
    b = compressions_of(free, "b")
    sat_out = len(compressions_of(free, "a")) + sum(t < a_done for t in b)
    alone = sum(t >= a_done for t in b)
    per_boundary = 2 * price  # one decision and one compaction each
    assert paid.metrics.total_s == pytest.approx(
        free.metrics.total_s + sat_out * (max(per_boundary, 1.0) - 1.0) + per_boundary * alone
    )
    assert paid.metrics.boundary_s == pytest.approx(sync_paid.metrics.boundary_s)
    assert paid.metrics.total_s < sync_paid.metrics.total_s
    assert free.metrics.compresses == sync_paid.metrics.compresses
    assert free.metrics.grows == free.metrics.forced_grows  # no decided growth


@pytest.mark.parametrize(
    "chunked, first",
    [
        (True, {"long": 3.0, "a": 4.0, "b": 4.0}),  # 10 + 10 + 10 of "long", then "a" and "b"
        (False, {"long": 1.0, "a": 2.0, "b": 2.0}),  # "long" whole and alone, then "a" and "b"
    ],
)
def test_without_chunked_prefill_a_long_prompt_runs_whole_and_alone(chunked, first):
    """Chunked prefill (the default, as the engine) splits a prompt over steps of
    ``max_num_batched_tokens`` tokens; ``chunked_prefill=False`` is nano-vLLM's prefill: whole
    prompts, the next waiting for a step with room for it, one over the budget alone."""
    requests = [
        WorkloadRequest("long", 0.0, 30, 2),
        WorkloadRequest("a", 0.0, 6, 2),
        WorkloadRequest("b", 0.0, 4, 2),
    ]
    sim = SimConfig(
        num_kv_pages=64, max_num_batched_tokens=10, admission_reserve=0.0, chunked_prefill=chunked
    )
    result = simulate(
        requests,
        "fullkv",
        GrowPageConfig(page_size=4, recent_window=1),
        sim,
        LinearCostModel(base_s=1.0),
    )
    assert {r.request_id: r.first_token_s for r in result.requests} == first
    assert result.metrics.prefill_steps == (4 if chunked else 2)


def test_a_later_chunk_pays_for_the_kv_it_attends_to():
    """A prefill step's price reads, besides its tokens, the KV its chunks' requests computed in
    earlier steps, as a decode step reads its resident KV: 30 prompt tokens in chunks of 10 at
    1 s a token and 0.5 s a KV token take 10 + (10 + 5) + (10 + 10) s."""
    cost = LinearCostModel(base_s=0.0, per_kv_token_s=0.5, per_prefill_token_s=1.0)
    config = GrowPageConfig(page_size=4, recent_window=1)
    for chunked, ttft in ((True, 45.0), (False, 30.0)):
        sim = SimConfig(num_kv_pages=64, max_num_batched_tokens=10, chunked_prefill=chunked)
        result = simulate([WorkloadRequest("r", 0.0, 30, 1)], "fullkv", config, sim, cost)
        assert result.requests[0].ttft_s == ttft


@pytest.mark.parametrize(
    "caching, hits, ttft",
    [
        (True, 24, [14.0, 18.0, 22.0]),  # r1 and r2 take the 3 cached pages, compute 2 tokens
        (False, 0, [14.0, 30.0, 46.0]),  # each computes all 14
    ],
)
def test_a_shared_prefix_is_computed_once(caching, hits, ttft):
    """Three requests, one at a time, naming one 12-token prefix on 4-token pages: the first
    computes it, the others take its 3 pages (12 tokens each) and prefill their own 2 tokens
    (1 s a prefill token, 1 s a decode step)."""
    requests = [
        WorkloadRequest(f"r{i}", 0.0, 14, 3, prefix="sys", prefix_tokens=12) for i in range(3)
    ]
    cost = LinearCostModel(base_s=0.0, per_seq_s=1.0, per_prefill_token_s=1.0)
    for decisions in ("script", "trace"):
        sim = SimConfig(
            num_kv_pages=64, max_num_seqs=1, prefix_caching=caching, decisions=decisions
        )
        result = simulate(
            requests, "fullkv", GrowPageConfig(page_size=4, recent_window=1), sim, cost
        )
        assert result.metrics.prefix_hit_tokens == hits
        assert [r.ttft_s for r in result.requests] == ttft


@pytest.mark.parametrize(
    "policy, says",
    [
        ("fullkv", "never compresses, so it needs 4 pages of 4 tokens (--kv-pages 4)"),
        ("fixed", "its prompt and first decode step need 4 pages of 4 tokens"),
    ],
)
def test_pool_too_small_for_a_prompt_is_a_config_error_before_the_run(policy, says):
    config = GrowPageConfig(page_size=4, recent_window=1)
    requests = [WorkloadRequest("small", 0.0, 4, 4), WorkloadRequest("big", 5.0, 12, 4)]
    progress = []
    with pytest.raises(ConfigError, match=f"request 'big' .*{re.escape(says)}; the pool has 2"):
        simulate(
            requests, policy, config, SimConfig(num_kv_pages=2), COST, on_progress=progress.append
        )
    assert progress == []  # refused before anything ran


@pytest.mark.parametrize(
    "field, value",
    [
        ("num_kv_pages", 0),
        ("max_num_seqs", 1.5),
        ("admission_reserve", 1.0),
        ("decisions", "magic"),
        ("chunked_prefill", 1),
    ],
)
def test_sim_config_validation_names_the_field(field, value):
    with pytest.raises(ConfigError, match=field):
        SimConfig(**{field: value})


def test_a_request_that_cannot_grow_even_alone_is_a_config_error():
    # One page: the prompt fits, but reaching min_capacity (2 pages) never can.
    config = GrowPageConfig(page_size=4, recent_window=1)
    with pytest.raises(
        ConfigError,
        match=r"needs 3 pages of 4 tokens \(--kv-pages 3\); the "
        r"pool has 1$",
    ):
        simulate(
            [WorkloadRequest("r", 0.0, 4, 8)],
            "fullkv",
            config,
            SimConfig(num_kv_pages=1, admission_reserve=0.0),
            COST,
        )
    with pytest.raises(ConfigError, match=r"need 2 pages of 4 tokens; the pool has 1$"):
        simulate(
            [WorkloadRequest("r", 0.0, 4, 8)],
            "fixed",
            config,
            SimConfig(num_kv_pages=1, admission_reserve=0.0),
            COST,
        )


def test_a_policy_that_never_compresses_leaves_the_watermark_free():
    """fullkv's growth beyond min_capacity leaves the watermark free: 3 pages of KV need a pool
    of 4 with a watermark of 1, and the error says so."""
    config = GrowPageConfig(page_size=4, recent_window=1, watermark=1)
    request = [WorkloadRequest("r", 0.0, 4, 8)]
    with pytest.raises(
        ConfigError,
        match=r"needs 3 pages of 4 tokens and the watermark's 1 "
        r"\(--kv-pages 4\); the pool has 3$",
    ):
        simulate(request, "fullkv", config, SimConfig(num_kv_pages=3, admission_reserve=0.0), COST)
    result = simulate(
        request, "fullkv", config, SimConfig(num_kv_pages=4, admission_reserve=0.0), COST
    )
    assert result.metrics.output_tokens == 8


def test_peak_pages_is_the_pool_timelines_peak_when_prefills_are_free():
    """A request done at its (free) prefill held its 10 pages for no time: the peak is what the
    pool held for a while, the peak of ``pool_timeline()`` (which ``pool.png`` draws)."""
    requests = [WorkloadRequest("r0", 0.0, 40, 1), WorkloadRequest("r1", 0.0, 4, 10)]
    result = simulate(
        requests,
        "fullkv",
        GrowPageConfig(page_size=4, recent_window=1),
        SimConfig(num_kv_pages=64, admission_reserve=0.0),
        LinearCostModel(per_seq_s=0.01),
    )
    assert result.metrics.peak_pages == max(u for _, u, _ in result.pool_timeline()) == 4
