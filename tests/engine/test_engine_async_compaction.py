"""Asynchronous compaction (paper appendix E.3, ``EngineConfig.async_compaction``): a request
whose boundary is decided as a compression sits that decode step out, compresses beside it and
rejoins; the tokens are those of the synchronous path, and no failure leaves pages behind."""

from __future__ import annotations

import pytest
import torch
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
from growpage.engine.sampling_params import SamplingParams
from growpage.errors import ConfigError, PolicyError
from growpage.policies import GrowPagePolicy

PROMPTS, LONG = DEFERRED_PROMPTS, DEFERRED_LONG


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def table_pages(llm) -> set[int]:
    return {p for seq in llm.engine.scheduler.running for p in seq.state.block_table}


def test_async_compaction_gives_the_synchronous_tokens_and_trajectories(model):
    sync = tiny_llm(model, "growpage")
    want = sync.generate(PROMPTS, LONG, use_tqdm=False)
    llm = tiny_llm(model, "growpage", async_compaction=True)
    got = llm.generate(PROMPTS, LONG, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.trajectory for o in got] == [o.trajectory for o in want]
    kv, stats = llm.engine.kv, llm.last_stats
    assert stats.events["compress"] == sync.last_stats.events["compress"] > 0
    assert kv.deferred.num_compactions == stats.events["compress"]
    # Each deferred compression costs its request one step the others decode in.
    assert stats.num_steps > sync.last_stats.num_steps
    # Deferred work is boundary time; on the CPU the step waits for all of it.
    assert 0 < kv.deferred.work_s < kv.boundary_s
    assert kv.deferred.waited_s == pytest.approx(kv.deferred.work_s)
    # The call's statistics say so too (and only for this call).
    assert stats.deferred_s == pytest.approx(kv.deferred.work_s)
    assert stats.deferred_waited_s == pytest.approx(kv.deferred.waited_s)
    assert "deferred work" in stats.table()
    assert sync.last_stats.deferred_s == 0 and "deferred" not in sync.last_stats.table()
    llm.generate(PROMPTS[:1], SamplingParams(max_tokens=3), use_tqdm=False)
    assert llm.last_stats.deferred_s == 0  # no boundary in that call
    assert llm.last_stats.boundary_s < stats.boundary_s
    assert_all_returned(llm)


@pytest.mark.parametrize(
    "policy,kwargs",
    [
        ("fixed", {"policy_kwargs": {"budget_tokens": 24}}),
        ("shrink", {}),
        ("h2o", {"policy_kwargs": {"budget_tokens": 24}}),  # H2O sums move with the deferred KV
    ],
    ids=["fixed", "shrink", "h2o"],
)
def test_every_compressing_policy_gets_its_synchronous_tokens(model, policy, kwargs):
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    sync, want, llm, got = served_both_ways(
        model, policy, PROMPTS, params, "async_compaction", **kwargs
    )
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.trajectory for o in got] == [o.trajectory for o in want]
    events = llm.last_stats.events
    assert llm.engine.kv.deferred.num_compactions == events["compress"] + events["shrink"] > 0
    assert events == sync.last_stats.events
    assert_all_returned(llm)


def test_scoring_with_async_compaction_keeps_the_decisions_and_nlls(model):
    """Teacher forcing: the same boundaries and decisions; the NLLs differ only by the float
    noise of other batch shapes (a request that compresses decodes a step later)."""
    conts = [
        o.token_ids for o in tiny_llm(model, "growpage").generate(PROMPTS, LONG, use_tqdm=False)
    ]
    want = tiny_llm(model, "growpage").score(PROMPTS, conts)
    llm = tiny_llm(model, "growpage", async_compaction=True)
    got = llm.score(PROMPTS, conts)
    assert llm.engine.kv.deferred.num_compactions > 0
    for a, b in zip(got, want, strict=True):
        assert a.trajectory == b.trajectory
        assert a.token_nlls == pytest.approx(b.token_nlls, abs=1e-4)
    assert_all_returned(llm)


def test_a_compressing_request_sits_one_step_out_and_rejoins_the_next(model):
    llm = tiny_llm(model, "growpage", async_compaction=True)
    steps = watch_steps(llm)
    llm.generate(PROMPTS, LONG, use_tqdm=False)
    assert assert_sat_out_one_step(steps) == llm.engine.kv.deferred.num_compactions


def test_a_lone_request_compresses_at_once(model):
    """With nobody else to decode, a deferred compression runs at once: no step is lost."""
    sync, (want,), llm, (got,) = served_both_ways(
        model, "growpage", [prompt(10, 5)], LONG, "async_compaction", kv_pages=8
    )
    assert got.token_ids == want.token_ids and got.trajectory == want.trajectory
    assert llm.engine.kv.deferred.num_compactions == got.events["compress"] > 0
    assert llm.last_stats.num_steps == sync.last_stats.num_steps
    assert_all_returned(llm)


SHARED = prompt(24, 30)
SHARING = [SHARED + prompt(3, 31), SHARED + prompt(5, 32), SHARED + prompt(2, 33)]
FIXED = {"budget_tokens": 32}


def cached_prefix_llm(model, **kwargs):
    """A fixed-budget LLM with ``SHARED`` (6 pages) in its prefix cache."""
    llm = tiny_llm(model, "fixed", policy_kwargs=FIXED, **kwargs)
    llm.generate([SHARED], SamplingParams(max_tokens=1), use_tqdm=False)
    assert len(llm.engine.kv.pool.match_prefix(SHARED)) == 6
    return llm


def test_shared_prefix_pages_are_copied_on_write_when_the_compression_is_deferred(model):
    """Requests sharing cached pages: the deferred compressions take their copy-on-write pages
    while scheduling, the shared pages stay intact and the tokens are the synchronous ones."""
    sync = cached_prefix_llm(model)
    want = sync.generate(SHARING, LONG, use_tqdm=False)
    llm = cached_prefix_llm(model, async_compaction=True)
    kv = llm.engine.kv
    cached = kv.pool.match_prefix(SHARED)
    before = kv.cache[:, :, cached].clone()
    got = llm.generate(SHARING, LONG, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert llm.last_stats.events["cow_pages"] == sync.last_stats.events["cow_pages"] > 0
    assert kv.deferred.num_compactions == llm.last_stats.events["compress"]
    for i, page in enumerate(cached):
        if kv.pool.is_cached(page):
            assert torch.equal(kv.cache[:, :, page], before[:, :, i])
    assert_all_returned(llm)


def test_preempting_a_request_whose_compression_is_pending_cancels_it(model):
    llm = cached_prefix_llm(model, async_compaction=True)
    engine = llm.engine
    for i, ids in enumerate(SHARING):  # shared pages: pending compressions hold COW pages
        engine.add_request(str(i), ids, LONG)
    for _ in range(200):
        out = engine.scheduler.schedule()
        pending = [s for s in engine.scheduler.running if engine.kv.deferred.is_deferred(s)]
        if pending and any(p.fresh for _, p in engine.kv.deferred._items.values()):
            break
        engine.update(out, *engine.runner.run(out))
        engine.kv.deferred.run()
    else:
        pytest.fail("no compression with copy-on-write pages was deferred")
    victim = pending[0]
    before = (victim.state.num_tokens, list(victim.state.block_table))
    assert (victim.state.num_tokens, victim.state.block_table) == before
    engine.scheduler.preempt(victim)
    assert not engine.kv.deferred.is_deferred(victim) and victim.state.block_table == []
    # The victim's copy-on-write pages went back: the pool holds exactly the tables' pages.
    assert engine.kv.pool.num_used_pages == len(table_pages(llm))
    engine.runner.run(out)
    engine.kv.deferred.run()
    engine.kv.pool.check_invariants()
    engine.abort_all()
    assert_all_returned(llm)


def test_a_failed_step_cancels_its_pending_compressions(model):
    llm = tiny_llm(model, "growpage", async_compaction=True)
    engine, run = llm.engine, llm.engine.runner.run
    state = {}

    def failing(out):
        if engine.kv.deferred.num_pending:
            state["pending"] = [
                (s, s.state.num_tokens, list(s.state.block_table))
                for s in engine.scheduler.running
                if engine.kv.deferred.is_deferred(s)
            ]
            raise RuntimeError("device lost")
        return run(out)

    engine.runner.run = failing
    with pytest.raises(RuntimeError, match="device lost"):
        llm.generate(PROMPTS, LONG, use_tqdm=False)
    assert state["pending"] and engine.kv.deferred.num_pending == 0
    assert_all_returned(llm)


def test_a_failed_step_leaves_pending_requests_unchanged_for_the_next(model):
    """A step that fails after scheduling (here: the forward) cancels its pending compressions:
    their requests stay at their boundaries, and their copy-on-write pages are free again."""
    llm = cached_prefix_llm(model, async_compaction=True)
    seen = fail_the_first_step_with_deferred_work(llm, SHARING, LONG)
    assert_left_at_their_boundaries(llm, seen)
    assert llm.engine.kv.pool.num_used_pages == len(table_pages(llm))
    llm.engine.abort_all()
    assert_all_returned(llm)


@pytest.mark.parametrize("policy, kwargs", [("fixed", {"budget_tokens": 12}), ("growpage", {})])
def test_stepping_on_after_a_failed_step_serves_a_clean_run_s_tokens(model, policy, kwargs):
    """The failed step's pending compressions are cancelled and its decodes given back: the
    next steps compress and decode them again, and the tokens are a clean run's."""
    want = [
        o.token_ids
        for o in tiny_llm(model, policy, policy_kwargs=kwargs, async_compaction=True).generate(
            PROMPTS, LONG, use_tqdm=False
        )
    ]
    llm = tiny_llm(model, policy, policy_kwargs=kwargs, async_compaction=True)
    seqs: list = []
    fail_the_first_step_with_deferred_work(llm, PROMPTS, LONG, seqs)
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert [seq.output_token_ids for seq in seqs] == want
    assert_all_returned(llm)


class BadSelection(GrowPagePolicy):
    """Always compresses and selects out-of-range slots."""

    def decide(self, ctx):
        from growpage.core.decision import Decision

        return Decision.COMPRESS

    def select(self, ctx, keep):
        num_layers, num_kv = ctx.shape
        return torch.full((num_layers, num_kv, keep), ctx.num_tokens + 5, dtype=torch.long)


def test_a_bad_selection_in_a_deferred_compression_aborts_cleanly(model):
    llm = tiny_llm(model, BadSelection(), async_compaction=True, min_capacity=2)
    with pytest.raises(PolicyError, match="out of range"):
        llm.generate(PROMPTS, LONG, use_tqdm=False)
    assert llm.engine.kv.deferred.num_pending == 0
    assert_all_returned(llm)


def test_async_compaction_must_be_a_bool():
    from growpage.engine.config import EngineConfig

    with pytest.raises(ConfigError, match="async_compaction"):
        EngineConfig(async_compaction="yes")


def test_the_simulator_predicts_the_steps_async_compaction_adds(model):
    """The serving simulator's async_compaction (a compacting request sits the next step out)
    adds exactly the decode steps the engine's adds, for a state-driven policy."""
    runs = engine_and_simulator_steps(model, "fixed", {"budget_tokens": 12}, "async_compaction")
    engine_steps, sim_steps = {}, {}
    for flag, (stats, metrics) in runs.items():
        engine_steps[flag] = stats.num_steps
        sim_steps[flag] = metrics.prefill_steps + metrics.decode_steps
        assert metrics.compresses == stats.events["compress"]
    # Both prefill the three prompts (the longest output 90 tokens) in one step, which gives
    # each its first token, and then decode o - 1 steps for o output tokens.
    assert engine_steps[False] == sim_steps[False] == 1 + 90 - 1
    added = engine_steps[True] - engine_steps[False]
    assert added > 5 and sim_steps[True] - sim_steps[False] == added
