"""The engine and the serving simulator step alike: on the same workload, pool and state-driven
policy (one that reads no attention signal, so both decide alike), every request takes the same
boundary decisions in the same order, and the run takes as many steps on both sides; under
fullkv also on a pool tight enough to preempt (recompute), which both model alike, and under a
budget policy that preempts instead of falling back, whose victims may have compressed: their
recompute rebuilds the full KV on both sides. Prompts longer than a step's token budget prefill
in chunks on both sides, and each request gets its first and last tokens at the same step."""

from __future__ import annotations

import math
from collections import Counter

import attrs
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from llm_helpers import prompt, tiny_llm, tiny_model

import growpage.engine.loop.scheduler
import growpage.sim.scheduler
from growpage import Decision
from growpage.core.residency import pick_victim
from growpage.engine.sampling_params import SamplingParams
from growpage.errors import ConfigError, EngineError
from growpage.policies import FixedBudgetPolicy, resolve_policy
from growpage.sim.costmodel import LinearCostModel
from growpage.sim.serving import SimConfig, simulate
from growpage.sim.workload_csv import WorkloadRequest

KINDS = ("grow", "compress", "shrink", "fallback")


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def engine_run(model, lengths, policy, params, kv_pages, max_num_seqs, chunk=4096, **config):
    llm = tiny_llm(
        model,
        policy=policy,
        policy_kwargs=params,
        kv_pages=kv_pages,
        max_num_seqs=max_num_seqs,
        enable_prefix_caching=False,
        max_num_batched_tokens=chunk,
        **config,
    )
    prompts = [prompt(p, 100 + i) for i, (p, _) in enumerate(lengths)]
    outs = llm.generate(
        prompts, [SamplingParams(max_tokens=o, ignore_eos=True) for _, o in lengths], use_tqdm=False
    )
    per_request = [{k: o.events.get(k, 0) for k in KINDS} for o in outs]
    trajectories = [[(action, pages) for _, pages, action in o.trajectory] for o in outs]
    return llm, per_request, trajectories, [len(o.token_ids) for o in outs]


def sim_run(llm, lengths, policy, params, kv_pages, max_num_seqs, decisions="script"):
    requests = [WorkloadRequest(f"r{i}", 0.0, p, o) for i, (p, o) in enumerate(lengths)]
    sim = SimConfig(
        num_kv_pages=kv_pages,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=llm.config.max_num_batched_tokens,
        admission_reserve=0.0,
        record_events=True,
        decisions=decisions,
        prefix_caching=llm.config.enable_prefix_caching,
    )
    result = simulate(
        requests,
        resolve_policy(policy, **params),
        llm.config.growpage,
        sim,
        LinearCostModel(base_s=1.0),
    )
    counts = {r.request_id: Counter() for r in requests}
    trajectories = {r.request_id: [] for r in requests}
    for _, kind, rid, pages in result.events:
        if kind in KINDS:
            counts[rid][kind] += 1
        if kind in KINDS and kind != "fallback":
            trajectories[rid].append((kind, pages))
    return (
        result,
        [{k: counts[r.request_id][k] for k in KINDS} for r in requests],
        [trajectories[r.request_id] for r in requests],
    )


@settings(
    max_examples=20,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    lengths=st.lists(st.tuples(st.integers(1, 14), st.integers(1, 40)), min_size=1, max_size=4),
    point=st.sampled_from(
        [("fullkv", {}), ("fixed", {"budget_tokens": 12}), ("fixed", {"budget_tokens": 20})]
    ),
    max_num_seqs=st.integers(1, 4),
    decisions=st.sampled_from(["script", "trace"]),
    chunk=st.sampled_from([4096, 3, 8]),
)
def test_engine_and_simulator_take_the_same_steps_and_decisions(
    model, lengths, point, max_num_seqs, decisions, chunk
):
    policy, params = point
    llm, engine_events, engine_paths, outputs = engine_run(
        model, lengths, policy, params, 256, max_num_seqs, chunk
    )
    assert outputs == [o for _, o in lengths]
    result, sim_events, sim_paths = sim_run(
        llm, lengths, policy, params, 256, max_num_seqs, decisions
    )
    assert sim_events == engine_events
    assert sim_paths == engine_paths  # each boundary's action and the pages after it
    m = result.metrics
    assert m.prefill_steps + m.decode_steps == llm.last_stats.num_steps
    assert m.output_tokens == llm.last_stats.num_output_tokens


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    lengths=st.lists(st.tuples(st.integers(1, 14), st.integers(1, 40)), min_size=1, max_size=4),
    floor=st.sampled_from([None, 0, 5, 9]),
    protect=st.booleans(),
    budget=st.sampled_from([8, 16]),
    kv_pages=st.sampled_from([256, 14]),
    decisions=st.sampled_from(["script", "trace"]),
)
def test_the_prompt_and_the_floor_step_alike(
    model, lengths, floor, protect, budget, kv_pages, decisions
):
    """Growth below the floor and around a protected prompt: both worlds force the same
    boundaries and leave the same ones to the policy, also where the pool binds."""
    params = {"budget_tokens": budget}
    config = {"floor_tokens": floor, "protect_prompt": protect}
    llm, engine_events, engine_paths, outputs = engine_run(
        model, lengths, "fixed", params, kv_pages, 3, **config
    )
    assert outputs == [o for _, o in lengths]
    assert llm.config.growpage.floor_tokens == floor
    result, sim_events, sim_paths = sim_run(llm, lengths, "fixed", params, kv_pages, 3, decisions)
    assert sim_events == engine_events
    assert sim_paths == engine_paths
    m = result.metrics
    assert m.prefill_steps + m.decode_steps == llm.last_stats.num_steps


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    lengths=st.lists(st.tuples(st.integers(1, 14), st.integers(1, 40)), min_size=2, max_size=4),
    slack=st.integers(0, 3),
    max_num_seqs=st.integers(2, 4),
    chunk=st.sampled_from([4096, 2, 5]),
)
def test_fullkv_preempts_and_recomputes_alike_on_a_tight_pool(
    model, lengths, slack, max_num_seqs, chunk
):
    # The most demanding request alone fills the pool but for `slack` pages (its KV ends at
    # prompt + output - 1 tokens; the engine takes no fewer than min_capacity = 2), so the
    # others are preempted and recomputed.
    pages = max([math.ceil((p + o - 1) / 4) for p, o in lengths] + [2]) + slack
    llm, engine_events, engine_paths, outputs = engine_run(
        model, lengths, "fullkv", {}, pages, max_num_seqs, chunk
    )
    assert outputs == [o for _, o in lengths]
    result, sim_events, sim_paths = sim_run(llm, lengths, "fullkv", {}, pages, max_num_seqs)
    assert (sim_events, sim_paths) == (engine_events, engine_paths)
    m = result.metrics
    assert m.num_preemptions == llm.last_stats.num_preemptions
    assert m.prefill_steps + m.decode_steps == llm.last_stats.num_steps


@attrs.define
class FixedWithoutFallback(FixedBudgetPolicy):
    """``fixed``, but a refused GROW preempts (the victim may be a request that compressed)."""

    name = "fixed-without-fallback"
    fallback_to_compress = False


def compressed_victims(events) -> int:
    compressed, victims = set(), 0
    for _, kind, rid, _ in events:
        compressed.update([rid] if kind == "compress" else [])
        victims += kind == "preempt" and rid in compressed
    return victims


def assert_preempt_alike(model, lengths, pages, decisions, chunk=4096):
    policy = FixedWithoutFallback(budget_tokens=8)
    llm, engine_events, engine_paths, outputs = engine_run(
        model, lengths, policy, {}, pages, 4, chunk
    )
    assert outputs == [o for _, o in lengths]
    result, sim_events, sim_paths = sim_run(llm, lengths, policy, {}, pages, 4, decisions)
    assert (sim_events, sim_paths) == (engine_events, engine_paths)
    m = result.metrics
    assert m.num_preemptions == llm.last_stats.num_preemptions
    assert m.prefill_steps + m.decode_steps == llm.last_stats.num_steps
    return result


@pytest.mark.parametrize("decisions", ["script", "trace"])
@pytest.mark.parametrize(
    "lengths, pages",
    [
        ([(12, 22), (8, 6), (1, 12), (10, 10)], 11),
        ([(2, 14), (3, 17), (11, 22), (11, 19)], 9),
    ],
)
def test_a_victim_that_compressed_comes_back_with_its_full_kv(model, lengths, pages, decisions):
    """The engine's recompute prefills every token again, so a victim that had compressed to 3
    pages comes back on the 4 all its tokens take (a simulator that gave it back its compressed
    KV would hold 3 pages, every later boundary one page short)."""
    result = assert_preempt_alike(model, lengths, pages, decisions)
    assert compressed_victims(result.events) >= 1


@settings(
    max_examples=10,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    lengths=st.lists(
        st.tuples(st.one_of(st.integers(1, 4), st.integers(8, 14)), st.integers(6, 24)),
        min_size=2,
        max_size=4,
    ),
    slack=st.integers(0, 2),
    chunk=st.sampled_from([4096, 3]),
)
def test_a_budget_policy_without_fallback_preempts_alike(model, lengths, slack, chunk):
    # The engine admits a request only when its full KV fits (the policy never falls back), so
    # the pool holds the longest one whole, plus `slack`; short prompts grow, long ones
    # compress at 2 pages' budget, and the growths find the pool full.
    pages = max(math.ceil((p + o - 1) / 4) for p, o in lengths) + slack
    assert_preempt_alike(model, lengths, pages, "script", chunk)


def no_victim_above(num_pages):
    """``pick_victim`` for a pool where no request holding more than ``num_pages`` pages can
    be recomputed (a stand-in for a request that compressed past the pool's size)."""

    def pick(running, can_recompute):
        fits = lambda r: len(r.state.block_table) <= num_pages and can_recompute(r)  # noqa: E731
        return pick_victim(running, fits)

    return pick


def test_a_victim_that_cannot_be_recomputed_is_skipped_alike(model, monkeypatch):
    """Both worlds skip a victim whose recompute cannot fit (``residency.pick_victim``) and take
    the next latest admitted, or the request waits at its boundary (the simulator's request
    sits the step out); when every running request waits, both stop with an error."""
    pick = no_victim_above(3)
    monkeypatch.setattr(growpage.engine.loop.scheduler, "pick_victim", pick)
    monkeypatch.setattr(growpage.sim.scheduler, "pick_victim", pick)
    lengths = [(12, 22), (8, 6), (1, 12), (10, 10)]
    llm, engine_events, engine_paths, outputs = engine_run(model, lengths, "fullkv", {}, 11, 4)
    assert outputs == [o for _, o in lengths]
    result, sim_events, sim_paths = sim_run(llm, lengths, "fullkv", {}, 11, 4)
    assert (sim_events, sim_paths) == (engine_events, engine_paths)
    assert result.metrics.num_preemptions == llm.last_stats.num_preemptions == 2
    assert result.metrics.prefill_steps + result.metrics.decode_steps == llm.last_stats.num_steps
    # Here a request waits until every other one does too: nothing can go on.
    lengths = [(2, 14), (3, 17), (11, 22), (11, 19)]
    with pytest.raises(EngineError, match="cannot make progress"):
        engine_run(model, lengths, "fullkv", {}, 9, 4)
    with pytest.raises(ConfigError, match="cannot make progress"):
        sim_run(llm, lengths, "fullkv", {}, 9, 4)


def engine_token_steps(llm, lengths):
    """Step the engine by hand over prompts of ``lengths``: ``step_to_the_end``'s answer."""
    return step_to_the_end(
        llm.engine, [(f"r{i}", prompt(p, 100 + i), o) for i, (p, o) in enumerate(lengths)]
    )


def step_to_the_end(engine, requests):
    """Add ``(request id, prompt ids, output tokens)`` and step until all finish; per request,
    the step (1-based) of its first and of its last token. Returns also the sequences."""
    seqs = [
        engine.add_request(rid, ids, SamplingParams(max_tokens=o, ignore_eos=True))
        for rid, ids, o in requests
    ]
    first, last, step = {}, {}, 0
    while engine.has_unfinished():
        engine.step()
        step += 1
        for s in seqs:
            if s.num_output_tokens and s.request_id not in first:
                first[s.request_id] = step
            if s.is_finished and s.request_id not in last:
                last[s.request_id] = step
    return first, last, seqs


@pytest.mark.parametrize("policy, params", [("fullkv", {}), ("fixed", {"budget_tokens": 8})])
@pytest.mark.parametrize(
    "lengths, chunk, max_num_seqs",
    [
        ([(14, 5), (9, 3), (2, 6)], 4, 4),  # a prompt over four steps, the next shares one
        ([(13, 2), (1, 7), (11, 4)], 5, 2),  # a seat frees while the third still waits
        ([(6, 9), (6, 9), (6, 9)], 6, 3),  # one prompt a step exactly
    ],
)
def test_chunked_prefill_gives_each_request_its_tokens_at_the_same_steps(
    model, policy, params, lengths, chunk, max_num_seqs
):
    """A prompt longer than what is left of a step's token budget prefills in chunks on both
    sides (not whole, alone, in one step): at one second a step, each request's first and last
    tokens come at the same step in both."""
    llm = tiny_llm(
        model,
        policy=policy,
        policy_kwargs=params,
        max_num_seqs=max_num_seqs,
        enable_prefix_caching=False,
        max_num_batched_tokens=chunk,
    )
    first, last, _ = engine_token_steps(llm, lengths)
    result, _, _ = sim_run(llm, lengths, policy, params, 256, max_num_seqs)
    assert {r.request_id: round(r.first_token_s) for r in result.requests} == first
    assert {r.request_id: round(r.finish_s) for r in result.requests} == last
    m = result.metrics
    assert m.prefill_steps + m.decode_steps == max(last.values())
    assert m.prefill_steps >= math.ceil(sum(p for p, _ in lengths) / chunk)


def shared_prompts(spec):
    """Engine prompts and simulator requests of ``spec``: ``(group, shared, prompt, output)``
    per request, its first ``shared`` tokens those of its group's prefix (None: no prefix) and
    the rest its own (the first of them unique to it, so no two prompts are equal)."""
    prefixes = {g: prompt(16, 500 + k) for k, g in enumerate("abc")}
    prompts, requests = [], []
    for i, (group, shared, p, o) in enumerate(spec):
        shared = min(shared, p - 1) if group else 0
        own = [3 + i] + prompt(p - shared - 1, 100 + i)
        prompts.append((prefixes[group][:shared] if group else []) + own)
        requests.append(
            WorkloadRequest(
                f"r{i}", 0.0, p, o, prefix=group if shared else None, prefix_tokens=shared
            )
        )
    return prompts, requests


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    spec=st.lists(
        st.tuples(
            st.sampled_from([None, "a", "a", "a", "b"]),
            st.integers(4, 16),
            st.integers(1, 18),
            st.integers(1, 24),
        ),
        min_size=2,
        max_size=5,
    ),
    point=st.sampled_from(
        [
            ("fullkv", {}),
            ("fixed", {"budget_tokens": 8}),
            ("fixed", {"budget_tokens": 16}),
            ("snapkv", {"budget_tokens": 12, "window": 4}),  # keeps prefix caching on
        ]
    ),
    slack=st.sampled_from([0, 0, 1, 200]),
    max_num_seqs=st.integers(1, 4),
    chunk=st.sampled_from([4096, 3, 8]),
    decisions=st.sampled_from(["script", "trace"]),
    flags=st.sampled_from(
        [
            {},
            {},
            {"async_compaction": True},
            {"async_decisions": True},
            {"async_compaction": True, "async_decisions": True},
        ]
    ),
)
def test_prefix_caching_shares_and_recomputes_alike(
    model, spec, point, slack, max_num_seqs, chunk, decisions, flags
):
    """With prefix caching (the engine's default) a request whose leading pages are cached, a
    shared prefix or its own pages after a preemption, takes them instead of computing them,
    in the engine and the simulator alike: the same cached tokens, the same boundary decisions
    and each request's first and last tokens at the same step. Also with asynchronous compaction and late boundaries, where a request
    holding a shared page is decided at once, and under SnapKV (a budget that reads the recent
    queries; prefix caching stays on for it)."""
    policy, params = point
    need = [math.ceil((p + (o - 1 if policy == "fullkv" else 1)) / 4) for _, _, p, o in spec]
    result = assert_serves_alike(
        model, spec, policy, params, max(need + [2]) + slack, max_num_seqs, chunk, decisions, flags
    )
    event(f"prefix hits: {result.metrics.prefix_hit_tokens > 0}")
    event(f"preemptions: {result.metrics.num_preemptions > 0}")


def assert_serves_alike(model, spec, policy, params, pages, max_num_seqs, chunk, decisions, flags):
    """``spec`` (see ``shared_prompts``) in the engine, stepped by hand, and in the simulator at
    1 s a step: the same prefix-cache hits, each request's first and last tokens at the same
    step, the same preemptions and boundary events per request. Returns the simulator's run."""
    prompts, requests = shared_prompts(spec)
    llm = tiny_llm(
        model,
        policy=policy,
        policy_kwargs=params,
        kv_pages=pages,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=chunk,
        **flags,
    )
    engine = llm.engine
    first, last, seqs = step_to_the_end(
        engine,
        [(r.request_id, ids, r.output_tokens) for r, ids in zip(requests, prompts, strict=True)],
    )
    sim = SimConfig(
        num_kv_pages=pages,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=chunk,
        admission_reserve=0.0,
        record_events=True,
        decisions=decisions,
        **flags,
    )
    result = simulate(
        requests,
        resolve_policy(policy, **params),
        llm.config.growpage,
        sim,
        LinearCostModel(base_s=1.0),
    )
    assert result.metrics.prefix_hit_tokens == engine.kv.prefix_hit_tokens
    assert {r.request_id: round(r.first_token_s) for r in result.requests} == first
    assert {r.request_id: round(r.finish_s) for r in result.requests} == last
    events = {s.request_id: (s.num_preemptions, s.state.events.as_dict()) for s in seqs}
    sim_events = {r.request_id: (r.num_preemptions, Counter()) for r in result.requests}
    for _, kind, rid, _ in result.events:
        if kind in KINDS:
            sim_events[rid][1][kind] += 1
    assert {k: (n, {e: c.get(e, 0) for e in KINDS}) for k, (n, c) in sim_events.items()} == {
        k: (n, {e: ev.get(e, 0) for e in KINDS}) for k, (n, ev) in events.items()
    }
    return result


@pytest.mark.parametrize("decisions", ["script", "trace"])
def test_a_boundary_unshared_by_its_preemption_is_decided_late(model, decisions):
    """Late boundaries: r0's compression must copy its page shared with r2 and, the pool full,
    preempts r2 first; then nothing is shared, and the engine, asked again, files r0's boundary
    as a late one (deciding it at once would finish r1 4 steps late)."""
    result = assert_serves_alike(
        model,
        [("a", 4, 5, 10), (None, 0, 5, 10), ("a", 4, 5, 10)],
        "fixed",
        {"budget_tokens": 8},
        5,
        3,
        5,
        decisions,
        {"async_decisions": True},
    )
    assert result.metrics.num_preemptions >= 1 and result.metrics.prefix_hit_tokens > 0


@pytest.mark.parametrize("decisions", ["script", "trace"])
def test_h2o_runs_without_the_prefix_cache_as_in_the_engine(model, decisions):
    """A policy that reads accumulated attention keeps per-slot sums, which a shared page
    cannot hold: the engine turns prefix caching off for it, and so does the simulator (with
    the cache on, it would take 24 cached tokens here)."""
    result = assert_serves_alike(
        model, [("a", 12, 16, 6)] * 3, "h2o", {"budget_tokens": 16}, 64, 4, 8, decisions, {}
    )
    assert result.metrics.prefix_hit_tokens == 0


class AlwaysShrink(FixedBudgetPolicy):
    """Shrinks at every boundary it decides: pages come free in the middle of a decode run."""

    name = "always-shrink"

    def decide(self, ctx):
        return Decision.SHRINK


@pytest.mark.parametrize(
    "policy, lengths, pages, watermark",
    [
        (AlwaysShrink(), [(12, 30), (7, 2)], 4, 0),  # a shrink frees the waiting one's page
        ("fixed", [(11, 2)], 3, 1),  # alone, a request may take the watermark
        ("fixed", [(11, 2), (3, 9)], 4, 1),
    ],
    ids=["shrink-frees-a-page", "watermark-alone", "watermark-two"],
)
def test_a_waiting_request_is_admitted_at_the_engines_step(
    model, policy, lengths, pages, watermark
):
    """A page freed by a boundary admits the waiting request at the next step, as in the
    engine (waiting for the next event would be 3 steps late here), and a request admitted
    when nothing runs may use the watermark's pages, as in the engine."""
    llm = tiny_llm(
        model,
        policy=policy,
        kv_pages=pages,
        max_num_seqs=2,
        watermark=watermark,
        enable_prefix_caching=False,
    )
    first, last, _ = engine_token_steps(llm, lengths)
    result, _, _ = sim_run(llm, lengths, policy, {}, pages, 2)
    assert {r.request_id: round(r.first_token_s) for r in result.requests} == first
    assert {r.request_id: round(r.finish_s) for r in result.requests} == last
