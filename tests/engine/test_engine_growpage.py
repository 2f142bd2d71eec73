"""Capacity control on the live cache: GrowPage compresses on a tiny model, prefix pages are
copied on write, any policy object runs unchanged, the Triton backend's fused EMA agrees."""

from __future__ import annotations

import attrs
import pytest
import torch
from llm_helpers import assert_all_returned, prompt, tiny_llm, tiny_model

import growpage.kernels  # noqa: F401 - sets up Triton's CPU interpreter before anything imports Triton
from growpage.core.capacity import CapacityController
from growpage.core.config import GrowPageConfig
from growpage.core.decision import Decision
from growpage.core.kv_view import DenseKVView
from growpage.core.pages import PagePool
from growpage.core.request import RequestState
from growpage.engine.sampling_params import SamplingParams
from growpage.policies import CapacityPolicy, GrowPagePolicy

PROMPTS = [prompt(9, 21), prompt(17, 22), prompt(6, 23)]
LONG = SamplingParams(max_tokens=80, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def test_growpage_compresses_on_small_pages_and_output_stays_valid(model):
    llm, fullkv = tiny_llm(model, "growpage"), tiny_llm(model)
    outs = llm.generate(PROMPTS, LONG, use_tqdm=False)
    full = fullkv.generate(PROMPTS, LONG, use_tqdm=False)
    events = llm.last_stats.events
    assert events["compress"] > 0 and events["decided_grow"] + events["decided_compress"] > 0
    for out, ref in zip(outs, full, strict=True):
        assert len(out.token_ids) == 80 and all(0 <= t < 128 for t in out.token_ids)
        # Every boundary is recorded; compress & hold keeps the page count.
        pages = [p for _, p, _ in out.trajectory]
        assert len(out.trajectory) == out.events["boundaries"]
        assert pages == sorted(pages) and pages[-1] < ref.trajectory[-1][1]
        first = out.trajectory[[a for _, _, a in out.trajectory].index("compress")][0]
        n = first - len(out.prompt_token_ids) + 1  # identical up to the first compression
        assert out.token_ids[:n] == ref.token_ids[:n]
    assert llm.last_stats.avg_kv_budget < fullkv.last_stats.avg_kv_budget
    # Capacity control is timed: a part of the call, counted once per call.
    assert 0 < llm.last_stats.boundary_s < llm.last_stats.total_s
    assert llm.engine.kv.boundary_s == pytest.approx(llm.last_stats.boundary_s)
    assert "boundary time" in llm.last_stats.table()
    assert_all_returned(llm)


@attrs.define
class PositionsAtBoundaries(GrowPagePolicy):
    """GrowPage that notes, at each boundary it decides, the request's prompt length, its
    capacity and the positions every slot holds."""

    seen: list = attrs.field(factory=list)

    def decide(self, ctx):
        self.seen.append((ctx.num_prompt_tokens, ctx.capacity, ctx.positions()))
        return super().decide(ctx)


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_a_protected_prompt_survives_every_compression_and_the_floor_holds(model, prefix_caching):
    policy = PositionsAtBoundaries(tau=1.0)  # always compresses once the floor is reached
    llm = tiny_llm(
        model, policy, protect_prompt=True, floor_tokens=6, enable_prefix_caching=prefix_caching
    )
    outs = llm.generate(PROMPTS, LONG, use_tqdm=False)
    assert llm.last_stats.events["compress"] > 3 * 5
    lengths = {len(o.prompt_token_ids) for o in outs}
    for prompt_len, capacity, positions in policy.seen:
        assert prompt_len in lengths
        assert (positions[..., :prompt_len] == torch.arange(prompt_len)).all()
        assert capacity - 4 >= prompt_len + 6  # a compression keeps the prompt and the floor
    stats = llm.last_stats
    assert 0 < stats.avg_kv_above_prompt < stats.avg_kv_budget
    assert stats.avg_kv_budget - stats.avg_kv_above_prompt <= max(lengths)
    assert_all_returned(llm)


def test_generation_longer_than_the_pool_compresses_instead_of_failing(model):
    llm = tiny_llm(model, "growpage", kv_pages=8)  # 32 tokens of KV
    out = llm.generate(
        [prompt(10, 5)], SamplingParams(max_tokens=100, ignore_eos=True), use_tqdm=False
    )[0]
    assert len(out.token_ids) == 100
    assert out.events["compress"] > 0 and llm.last_stats.max_pages_used <= 8
    assert_all_returned(llm)


def test_compression_copies_shared_prefix_pages_and_leaves_them_intact(model):
    shared = prompt(24, 30)
    prompts = [shared + prompt(3, 31), shared + prompt(5, 32), shared + prompt(2, 33)]
    policy = {"budget_tokens": 32}
    off = tiny_llm(model, "fixed", policy_kwargs=policy, enable_prefix_caching=False)
    expected = [o.token_ids for o in off.generate(prompts, LONG, use_tqdm=False)]
    on = tiny_llm(model, "fixed", policy_kwargs=policy)
    on.generate([shared], SamplingParams(max_tokens=1), use_tqdm=False)  # caches the prefix
    kv = on.engine.kv
    cached = kv.pool.match_prefix(shared)
    assert len(cached) == 6
    before = kv.cache[:, :, cached].clone()
    # Two requests share the 6 cached pages; each compression while a page is shared must
    # copy it first, or the other request (and the outputs) would change.
    outs = on.generate(prompts[:2], LONG, use_tqdm=False)
    assert [o.token_ids for o in outs] == expected[:2]
    assert on.last_stats.events["cow_pages"] > 0 and on.last_stats.prefix_hit_tokens == 48
    # A page compacted in place by its last holder left the prefix cache; what is still cached
    # is untouched, so a later request that hits it decodes exactly as without caching.
    for i, page in enumerate(cached):
        if kv.pool.is_cached(page):
            assert torch.equal(kv.cache[:, :, page], before[:, :, i])
    assert on.generate(prompts[2:], LONG, use_tqdm=False)[0].token_ids == expected[2]
    assert_all_returned(on)


@attrs.define
class AlternatingPolicy(CapacityPolicy):
    """A user policy: grow at every other boundary, read Delta_t at each."""

    name = "alternating"
    deltas: list[float] = attrs.field(factory=list)

    def decide(self, ctx) -> Decision:
        self.deltas.append(ctx.delta())
        return Decision.GROW if (ctx.position // ctx.page_size) % 2 else Decision.COMPRESS


def test_the_same_policy_object_runs_in_the_engine_and_on_a_dense_view(model):
    policy = AlternatingPolicy()
    llm = tiny_llm(model, policy)
    outs = llm.generate(PROMPTS, LONG, use_tqdm=False)
    assert llm.policy is policy and len(policy.deltas) > 0
    assert all(-1 <= d <= 1 for d in policy.deltas)
    decided = sum(o.events["decided_grow"] + o.events["decided_compress"] for o in outs)
    assert decided == len(policy.deltas)
    # ... and unchanged over the core's dense view (the simulator's world).
    config = GrowPageConfig(page_size=4, recent_window=2)
    pool = PagePool(16, 4)
    view = DenseKVView(2, 4, 2, 16, model.config.rope, capacity=8)
    view.extend(torch.randn(2, 2, 8, 16), torch.arange(8))
    view.set_queries(torch.randn(2, 2, 4, 16), torch.randn(2, 4, 16))
    state = RequestState("dense", pool.allocate(2), num_tokens=8, position=8)
    outcome = CapacityController(policy, pool, config).on_boundary(state, view)
    assert outcome.decision is Decision.COMPRESS and state.num_tokens == 4


def test_triton_backend_with_fused_query_state_matches_torch():
    from growpage.kernels._utils import is_interpreter

    if not (torch.cuda.is_available() or is_interpreter()):
        pytest.skip("Triton can run neither on CUDA nor in the CPU interpreter here")
    model = tiny_model()  # the LLM installs its backend on the model: use a private one
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    ref = tiny_llm(model, GrowPagePolicy()).generate(PROMPTS[:1], params, use_tqdm=False)
    llm = tiny_llm(model, GrowPagePolicy(), attention_backend="triton")
    assert llm.engine.runner.fuses_query_state
    outs = llm.generate(PROMPTS[:1], params, use_tqdm=False)
    assert outs[0].events["compress"] > 0
    assert outs[0].token_ids == ref[0].token_ids and outs[0].trajectory == ref[0].trajectory


@attrs.define
class LoggingGrowPage(GrowPagePolicy):
    """GrowPage that logs ``(position, delta, decision)`` at every boundary it decides."""

    name = "logging-growpage"
    log: list[tuple[int, float, str]] = attrs.field(factory=list)

    def decide(self, ctx) -> Decision:
        decision = super().decide(ctx)
        self.log.append((ctx.position, ctx.delta(), decision.value))
        return decision


SETTINGS = [
    {},
    {"summary_start": "average", "beta_long": 0.95},
    {"protect_prompt": True, "floor_tokens": 6},
]


@pytest.mark.parametrize("settings", SETTINGS)
def test_first_decision_equals_the_simulators_on_the_recorded_trace(model, tmp_path, settings):
    """Engine and simulator see the same KV and query summaries at the first policy boundary
    (afterwards the engine's future tokens attend to compressed KV, the trace's do not), with
    the paper's settings, the bias-corrected summaries, and a protected prompt with a floor."""
    from growpage.core.trace_set import TraceSet
    from growpage.sim.replay import ReplayOptions, replay_trace

    recorder = tiny_llm(model, record_traces=tmp_path / "set")
    outs = recorder.generate(
        PROMPTS, SamplingParams(max_tokens=40, ignore_eos=True), use_tqdm=False
    )
    traces = TraceSet(tmp_path / "set")
    for out in outs:
        engine, sim = LoggingGrowPage(), LoggingGrowPage()
        tiny_llm(model, engine, **settings).score([out.prompt_token_ids], [out.token_ids])
        replay_trace(
            traces.read(out.request_id),
            sim,
            GrowPageConfig(page_size=4, recent_window=2, **settings),
            ReplayOptions(fidelity_queries=0),
        )
        (pos, delta, decision), (sim_pos, sim_delta, sim_decision) = engine.log[0], sim.log[0]
        assert (pos, decision) == (sim_pos, sim_decision)
        assert delta == pytest.approx(sim_delta, abs=0.02)  # the trace is stored in fp16


@attrs.define
class RecordingGrowPage(GrowPagePolicy):
    """GrowPage that notes every Delta_t it decides on, by request and position."""

    seen: dict = attrs.field(factory=dict)

    def decide(self, ctx):
        self.seen[(ctx.request_id, ctx.position)] = ctx.delta()
        return super().decide(ctx)


@pytest.mark.parametrize("kernels", [False, True])
def test_boundaries_of_one_step_share_a_batch_and_decide_as_alone(model, monkeypatch, kernels):
    """Equal prompts reach their boundaries in the same decode steps: their Delta_t comes from
    one ``BoundaryBatch`` pass, and every Delta_t, token, decision and page is what it is
    without."""
    from growpage.engine.loop.kv_manager import KVCacheManager

    prompts = [prompt(11, 40 + i) for i in range(4)]
    params = SamplingParams(max_tokens=20 if kernels else 60, ignore_eos=True)

    engines = []

    def run():
        policy = RecordingGrowPage()
        llm = tiny_llm(model, policy, kv_pages=40, boundary_kernels=kernels)
        outs = llm.generate(prompts, params, use_tqdm=False)
        engines.append(llm.engine)
        return (
            [(o.token_ids, o.trajectory, o.events) for o in outs],
            llm.last_stats.events,
            policy.seen,
        )

    sizes = []
    prepare = KVCacheManager.prepare_boundaries

    def counted(self, seqs):
        prepare(self, seqs)
        sizes.append(0 if self._batch is None else len(self._batch))

    from growpage.core import boundary_signals
    from growpage.engine.loop.paged_kv_view import EngineKVView

    batched, in_torch = [], []
    batch_signals, torch_pass = EngineKVView.batch_boundary_signals, boundary_signals._fill

    def counted_signals(views, positions, counts, *rest):
        out = batch_signals(views, positions, counts, *rest)
        batched.append(0 if out is None else out[1].shape[0])
        return out

    def counted_pass(contexts, tables, estimation):
        in_torch.append(len(contexts))
        return torch_pass(contexts, tables, estimation)

    monkeypatch.setattr(KVCacheManager, "prepare_boundaries", counted)
    monkeypatch.setattr(EngineKVView, "batch_boundary_signals", staticmethod(counted_signals))
    monkeypatch.setattr(boundary_signals, "_fill", counted_pass)
    shared, shared_events, shared_deltas = run()
    assert max(sizes) >= 3 and shared_events["compress"] > 0, (sizes, shared_events)
    assert shared_events["decided_grow"] > 0, shared_events  # both decisions, shared
    # A step's requests get their queries and attention together: with kernels those of equal
    # candidate count (one launch each), on the torch path all of them (one pass).
    assert max(batched if kernels else in_torch) >= 3, (batched, in_torch)
    assert not (in_torch if kernels else batched), (batched, in_torch)
    kv = engines[0].kv
    assert (kv.shared_steps, kv.shared_boundaries) == (sum(map(bool, sizes)), sum(sizes))
    monkeypatch.setattr(
        KVCacheManager, "prepare_boundaries", lambda self, seqs: setattr(self, "_batch", None)
    )
    alone, alone_events, alone_deltas = run()
    assert len(set(shared_deltas.values())) > 4  # distinct requests, distinct signals
    assert shared_deltas == alone_deltas
    assert shared == alone and shared_events == alone_events
