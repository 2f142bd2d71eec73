"""Late boundaries (``EngineConfig.async_decisions``, beyond the paper): a request at a boundary
its policy decides sits that decode step out, and its decision and action run beside the
forward (``DeferredBoundaries.run``). Its inputs are the ones it would have had at once,
so its decisions and tokens are the synchronous engine's; only where no outcome could need a
preemption (``DeferredBoundaries.decides_late``)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from llm_helpers import (
    DEFERRED_LONG,
    DEFERRED_PROMPTS,
    assert_all_returned,
    assert_left_at_their_boundaries,
    assert_sat_out_one_step,
    engine_and_simulator_steps,
    fail_the_first_step_with_deferred_work,
    prompt,
    served_both_ways,
    tiny_llm,
    tiny_model,
    watch_steps,
)

import growpage.kernels  # noqa: F401 - sets up Triton's CPU interpreter before anything imports Triton
from growpage import Decision
from growpage.engine.config import EngineConfig
from growpage.engine.sampling_params import SamplingParams
from growpage.errors import ConfigError, PolicyError
from growpage.policies import GrowPagePolicy

PROMPTS, LONG = DEFERRED_PROMPTS, DEFERRED_LONG


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def decided(events: dict) -> int:
    return sum(events.get(f"decided_{d.value}", 0) for d in Decision)


def test_late_decisions_give_the_synchronous_tokens_and_trajectories(model):
    sync, want, llm, got = served_both_ways(model, "growpage", PROMPTS, LONG, "async_decisions")
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.trajectory for o in got] == [o.trajectory for o in want]
    kv, stats = llm.engine.kv, llm.last_stats
    assert stats.events == sync.last_stats.events
    events = stats.events
    assert events["compress"] > 0 and events["decided_grow"] > 0, events
    # Every decided boundary was decided late (the pool never ran short, nothing is shared);
    # its compression ran with it, not as a deferred compaction of its own.
    assert kv.deferred.num_decisions == decided(events) > 0 and kv.deferred.num_compactions == 0
    assert stats.num_steps > sync.last_stats.num_steps  # each costs its request one step
    # Filing a late boundary while scheduling is boundary time too, outside the deferred part.
    assert 0 < kv.deferred.work_s < kv.boundary_s
    assert_all_returned(llm)


@pytest.mark.parametrize(
    "policy,kwargs",
    [
        ("fixed", {"policy_kwargs": {"budget_tokens": 24}}),
        ("shrink", {}),
        ("random", {"policy_kwargs": {"grow_prob": 0.5, "seed": 3}}),
        ("h2o", {"policy_kwargs": {"budget_tokens": 24}}),  # its sums: unchanged while sitting out
    ],
    ids=["fixed", "shrink", "random", "h2o"],
)
def test_every_deciding_policy_gets_its_synchronous_tokens(model, policy, kwargs):
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    sync, want, llm, got = served_both_ways(
        model, policy, PROMPTS, params, "async_decisions", **kwargs
    )
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.trajectory for o in got] == [o.trajectory for o in want]
    assert llm.last_stats.events == sync.last_stats.events
    assert llm.engine.kv.deferred.num_decisions == decided(llm.last_stats.events) > 0
    assert_all_returned(llm)


def test_a_deciding_request_sits_one_step_out_and_rejoins_the_next(model):
    llm = tiny_llm(model, "growpage", async_decisions=True)
    steps = watch_steps(llm)
    llm.generate(PROMPTS, LONG, use_tqdm=False)
    assert assert_sat_out_one_step(steps) == llm.engine.kv.deferred.num_decisions


def test_steps_with_several_late_boundaries_share_one_batch(model):
    """Requests whose boundaries fall in the same step are decided together beside it (one
    ``BoundaryBatch``), as they would be while scheduling."""
    same = [prompt(12, 40 + i) for i in range(4)]  # equal lengths: boundaries in one step
    sync, want, llm, got = served_both_ways(model, "growpage", same, LONG, "async_decisions")
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    kv = llm.engine.kv
    assert kv.shared_boundaries == sync.engine.kv.shared_boundaries > 0
    assert kv.deferred.num_decisions == decided(llm.last_stats.events)


def test_a_lone_request_decides_at_once(model):
    """With nobody else to decode, its late boundary runs at once: no step is lost."""
    sync, (want,), llm, (got,) = served_both_ways(
        model, "growpage", [prompt(10, 5)], LONG, "async_decisions", kv_pages=8
    )
    assert got.token_ids == want.token_ids and got.trajectory == want.trajectory
    assert llm.engine.kv.deferred.num_decisions == decided(got.events) > 0
    assert llm.last_stats.num_steps == sync.last_stats.num_steps
    assert_all_returned(llm)


def test_a_tight_pool_falls_back_beside_the_step(model):
    """Growth refused beside the step (the pool ran short): the request compresses instead,
    never preempted for its late boundary; every request finishes, every page comes back."""
    llm = tiny_llm(model, "growpage", kv_pages=22, max_num_seqs=4, async_decisions=True)
    outs = llm.generate(PROMPTS, LONG, use_tqdm=False)
    assert all(len(o.token_ids) == 80 for o in outs)
    events = llm.last_stats.events
    assert events["fallback"] > 0 and llm.engine.kv.deferred.num_decisions > 0, events
    assert_all_returned(llm)


def test_fullkv_never_decides_late(model):
    """A policy that does not fall back to compressing would need a preemption when growth is
    refused: its boundaries stay synchronous."""
    sync, want, llm, got = served_both_ways(
        model, "fullkv", PROMPTS, LONG, "async_decisions", kv_pages=30
    )
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert llm.engine.kv.deferred.num_decisions == 0 and llm.last_stats.num_preemptions > 0
    assert_all_returned(llm)


SHARED = prompt(24, 30)
SHARING = [SHARED + prompt(3, 31), SHARED + prompt(5, 32), SHARED + prompt(2, 33)]


def test_shared_prefix_pages_keep_the_boundary_synchronous(model):
    """A request holding shared (prefix-cached) pages may need copy-on-write pages to
    compress, which only scheduling can settle: that boundary is decided at once. After the
    copy its pages are its own, and its later boundaries are decided late."""

    def cached(**kwargs):
        llm = tiny_llm(model, "fixed", policy_kwargs={"budget_tokens": 32}, **kwargs)
        llm.generate([SHARED], SamplingParams(max_tokens=1), use_tqdm=False)
        return llm

    sync = cached()
    want = sync.generate(SHARING, LONG, use_tqdm=False)
    llm = cached(async_decisions=True)
    got = llm.generate(SHARING, LONG, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    events = llm.last_stats.events
    assert events["cow_pages"] == sync.last_stats.events["cow_pages"] > 0
    assert 0 < llm.engine.kv.deferred.num_decisions < decided(events)
    assert_all_returned(llm)


def test_a_failed_step_leaves_late_requests_at_their_boundary(model):
    want = [
        o.token_ids
        for o in tiny_llm(model, "growpage", async_decisions=True).generate(
            PROMPTS, LONG, use_tqdm=False
        )
    ]
    llm = tiny_llm(model, "growpage", async_decisions=True)
    seqs: list = []
    seen = fail_the_first_step_with_deferred_work(llm, PROMPTS, LONG, seqs)
    assert_left_at_their_boundaries(llm, seen)
    while llm.engine.has_unfinished():  # the next steps decide them as if nothing happened
        llm.engine.step()
    # ... and the failed step's decodes run again: a clean run's tokens
    assert [seq.output_token_ids for seq in seqs] == want
    assert_all_returned(llm)


class FailingLate(GrowPagePolicy):
    """Decides normally until its fifth decision, then raises."""

    calls = 0

    def decide(self, ctx):
        FailingLate.calls += 1
        if FailingLate.calls == 5:
            raise RuntimeError("policy bug")
        return super().decide(ctx)


def test_a_policy_error_beside_the_step_aborts_cleanly(model):
    FailingLate.calls = 0
    llm = tiny_llm(model, FailingLate(), async_decisions=True)
    with pytest.raises(PolicyError, match="policy bug"):
        llm.generate(PROMPTS, LONG, use_tqdm=False)
    assert llm.engine.kv.deferred.num_pending == 0
    assert_all_returned(llm)


def test_async_decisions_must_be_a_bool():
    with pytest.raises(ConfigError, match="async_decisions must be True or False"):
        EngineConfig(async_decisions=None)


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    lengths=st.lists(st.tuples(st.integers(1, 14), st.integers(2, 40)), min_size=1, max_size=4),
    point=st.sampled_from([("growpage", {}), ("fixed", {"budget_tokens": 12}), ("shrink", {})]),
    kv_pages=st.sampled_from([6, 8, 12, 256]),
    max_num_seqs=st.integers(1, 4),
)
def test_late_boundaries_serve_any_workload_as_the_synchronous_engine(
    model, lengths, point, kv_pages, max_num_seqs
):
    """Random workloads, pools from tight to ample: every request gets all its tokens, every
    page comes back, and each request's decisions are the synchronous engine's as long as the
    pool never refused a growth or forced a preemption in either (the free pages a decision
    reads, and the order growths are served in, are the only inputs a step's delay changes)."""
    policy, params = point
    prompts = [prompt(p, 200 + i) for i, (p, _) in enumerate(lengths)]
    sampling = [SamplingParams(max_tokens=o, ignore_eos=True) for _, o in lengths]
    runs = []
    for late in (False, True):
        llm = tiny_llm(
            model,
            policy,
            policy_kwargs=params,
            kv_pages=kv_pages,
            max_num_seqs=max_num_seqs,
            min_capacity=2,
            async_decisions=late,
        )
        try:
            outs = llm.generate(prompts, sampling, use_tqdm=False)
        except ConfigError as exc:  # a request that cannot fit the pool alone: both refuse
            assert "cannot" in str(exc) or "needs" in str(exc), exc
            return
        assert [len(o.token_ids) for o in outs] == [o for _, o in lengths]
        assert_all_returned(llm)
        runs.append((llm, outs))
    (sync, want), (llm, got) = runs
    pressure = [
        x.last_stats.events.get("fallback", 0) + x.last_stats.num_preemptions for x in (sync, llm)
    ]
    if not any(pressure):
        assert [o.trajectory for o in got] == [o.trajectory for o in want]
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert llm.last_stats.events == sync.last_stats.events


@pytest.mark.parametrize("policy,kwargs", [("fixed", {"budget_tokens": 12}), ("fullkv", {})])
def test_the_simulator_predicts_the_steps_late_boundaries_add(model, policy, kwargs):
    """The serving simulator's async_decisions (a request whose boundary was decided sits the
    next step out) adds exactly the decode steps the engine's adds, for a state-driven
    policy; none for a policy that never falls back to compressing."""
    runs = engine_and_simulator_steps(model, policy, kwargs, "async_decisions")
    engine_steps = {flag: stats.num_steps for flag, (stats, _) in runs.items()}
    sim_steps = {flag: m.prefill_steps + m.decode_steps for flag, (_, m) in runs.items()}
    assert engine_steps == sim_steps
    added = engine_steps[True] - engine_steps[False]
    assert (added > 5) if policy == "fixed" else added == 0
