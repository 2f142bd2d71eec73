"""SnapKV at decoding time in the engine (``growpage.engine.loop.recent_queries``).

Two oracles. The ring: after every step each running request's ``recent_queries`` must be its
last W computed queries (the ones the model ran, caught from the step capture by this test)
rotated to their positions, through chunked prefill, decode, preemption and recompute, prefix
hits and the static (CUDA-graph style) decode path. The simulator: a replay of each request's
recorded rows (``TraceView``) takes the same decisions and keeps the same positions as the
engine did, boundary by boundary.
"""

from __future__ import annotations

import attrs
import pytest
import torch
from h2o_helpers import RowRecorder
from llm_helpers import assert_all_returned, prompt, tiny_llm, tiny_model

import growpage.engine.loop.model_runner as model_runner_module
import growpage.kernels  # noqa: F401  (turns the interpreter on without CUDA)
from growpage.core.observation import rotate_queries
from growpage.engine.modeling.step_context import StepCapture
from growpage.engine.sampling_params import SamplingParams
from growpage.policies import SnapKVPolicy
from growpage.sim.replay import replay_trace

pytestmark = pytest.mark.usefixtures("one_thread")

WINDOW = 6


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@attrs.frozen
class Seen:
    """One decided boundary: what the policy read and what it kept (as positions)."""

    request_id: str
    position: int
    decision: str
    query_positions: tuple[int, ...]
    window_attention: torch.Tensor
    kept: torch.Tensor | None = None


@attrs.define
class SpySnapKV(SnapKVPolicy):
    """SnapKV logging every boundary it decides and the positions each compression keeps."""

    log: list = attrs.field(factory=list)

    def decide(self, ctx):
        decision = super().decide(ctx)
        _, positions = ctx.recent_queries(self.window)
        self.log.append(
            Seen(
                str(ctx.request_id),
                ctx.position,
                decision.value,
                tuple(positions.tolist()),
                ctx.window_attention(self.window).cpu(),
            )
        )
        return decision

    def select(self, ctx, keep):
        slots = super().select(ctx, keep)
        i = max(
            i
            for i, s in enumerate(self.log)
            if (s.request_id, s.position) == (str(ctx.request_id), ctx.position)
        )
        kept = torch.gather(ctx.positions(), 2, slots.to(ctx.device)).cpu()
        self.log[i] = attrs.evolve(self.log[i], kept=kept)
        return slots

    def seen(self, request_id):
        return [s for s in self.log if s.request_id == request_id]


class QueryLog:
    """Every query the model computes, per request and position (the last computation wins),
    caught where the model hands it to the step capture."""

    def __init__(self, llm, monkeypatch) -> None:
        self.llm = llm
        self.rows: dict[str, dict[int, torch.Tensor]] = {}
        self._step: dict[int, torch.Tensor] = {}
        record, run, log = StepCapture.record, llm.engine.runner.run, self

        def recording(capture, layer_idx, q, k, v):
            record(capture, layer_idx, q, k, v)
            log._step[layer_idx] = q.detach().float().clone()

        def running(out):
            log._step = {}
            rows = [
                (s.request_id, range(s.state.position - n, s.state.position))
                for s, n in zip(out.seqs, out.num_new_tokens, strict=True)
            ]
            result = run(out)
            log._store(rows)
            return result

        monkeypatch.setattr(StepCapture, "record", recording)
        monkeypatch.setattr(llm.engine.runner, "run", running)

    def _store(self, rows) -> None:
        num_layers = self.llm.model.config.num_layers
        queries = torch.stack([self._step[i] for i in range(num_layers)])  # [L, T, Hq, d]
        offset = 0
        for rid, positions in rows:
            for j, p in enumerate(positions):
                self.rows.setdefault(rid, {})[p] = queries[:, offset + j]
            offset += len(positions)

    def check(self, window: int) -> list[int]:
        """Each running request's ring against its last computed queries; the windows' sizes."""
        engine = self.llm.engine
        sizes = []
        for seq in engine.scheduler.running:
            if seq.query_slot is None or seq.state.position == 0:
                continue
            got_q, got_pos = engine.kv.view(seq).recent_queries(window)
            end = seq.state.position
            start = max(end - window, seq.num_cached_tokens)
            assert got_pos.tolist() == list(range(start, end)), seq.request_id
            rows = self.rows[seq.request_id]
            pre = torch.stack([rows[p] for p in range(start, end)], dim=1)
            want = rotate_queries(self.llm.model.config.rope, pre, got_pos.cpu())
            assert torch.equal(got_q.cpu(), want), (seq.request_id, end)
            sizes.append(len(got_pos))
        return sizes


def step_all(llm, log: QueryLog, prompts, params) -> list[int]:
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params[i] if isinstance(params, list) else params)
    sizes = []
    while engine.has_unfinished():
        engine.step()
        sizes += log.check(WINDOW)
    assert_all_returned(llm)
    return sizes


def snapkv_llm(model, **kwargs):
    kwargs.setdefault("max_num_batched_tokens", 8)  # prompts prefill in chunks
    return tiny_llm(
        model,
        SnapKVPolicy(budget_tokens=16, window=WINDOW, kernel_size=3),
        **kwargs,
    )


def test_the_ring_holds_the_last_queries_through_prefill_and_decode(model, monkeypatch):
    llm = snapkv_llm(model, enable_prefix_caching=False)
    log = QueryLog(llm, monkeypatch)
    prompts = [prompt(11, 60), prompt(3, 61), prompt(17, 62)]
    sizes = step_all(llm, log, prompts, SamplingParams(max_tokens=20, ignore_eos=True))
    assert llm.engine.kv.recent.queries.shape == (2, 64, WINDOW, 4, 16)
    assert min(sizes) < WINDOW and sizes.count(WINDOW) > 30  # a 3-token prompt starts short


class SnapKVWithoutFallback(SnapKVPolicy):
    """A refused growth preempts instead of compressing: requests that compressed are
    preempted and recomputed."""

    name = "snapkv-without-fallback"
    fallback_to_compress = False


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_a_recompute_refills_the_ring_from_its_prefill(model, monkeypatch, prefix_caching):
    policy = SnapKVWithoutFallback(budget_tokens=16, window=WINDOW, kernel_size=3)
    llm = tiny_llm(
        model,
        policy,
        kv_pages=9,
        max_num_seqs=4,
        max_num_batched_tokens=8,
        enable_prefix_caching=prefix_caching,
    )
    log = QueryLog(llm, monkeypatch)
    prompts = [prompt(2 + 3 * i, 100 + i) for i in range(4)]
    params = [SamplingParams(max_tokens=16 + 2 * i, ignore_eos=True) for i in range(4)]
    step_all(llm, log, prompts, params)
    assert llm.engine.scheduler.num_preemptions > 0
    assert (llm.engine.kv.prefix_hit_tokens > 0) == prefix_caching


def test_a_prefix_hit_starts_the_window_after_the_cached_tokens(model, monkeypatch):
    """Cached prompt pages ran no query in this residency: the window starts after them.
    (One request at a time, none compresses: a page compacted in place leaves the cache.)"""
    llm = snapkv_llm(model, max_num_seqs=1, max_num_batched_tokens=64)
    log = QueryLog(llm, monkeypatch)
    shared = prompt(16, 70)
    prompts = [shared + [3], shared + [4], shared + [5, 6]]
    sizes = step_all(llm, log, prompts, SamplingParams(max_tokens=4, ignore_eos=True))
    assert llm.engine.kv.prefix_hit_tokens == 32 and llm.last_stats is None
    # The first computed all 17 prompt tokens; the others 1 and 2 after 16 cached ones.
    assert sizes == [6, 6, 6, 1, 2, 3, 2, 3, 4]  # checked after each step but the last


def test_the_static_decode_path_writes_the_ring():
    """CUDA-graph style decode (static buffers, bucket rows; eager on the CPU): only the
    batch's rows reach the ring, at their own slots and positions."""
    from growpage.engine.loop.cuda_graphs import DecodeGraphs

    llm = snapkv_llm(
        tiny_model(),
        max_num_seqs=4,
        kv_pages=40,
        attention_backend="triton",
        boundary_kernels=True,
        cuda_graphs=False,
        async_compaction=False,
        enable_prefix_caching=False,
    )
    llm.engine.model.backend.num_splits = 1
    llm.engine.runner.graphs = DecodeGraphs(llm.engine.runner, 4, capture=False)
    with pytest.MonkeyPatch.context() as mp:
        log = QueryLog(llm, mp)
        prompts = [prompt(5 + 4 * i, 80 + i) for i in range(3)]
        sizes = step_all(llm, log, prompts, SamplingParams(max_tokens=10, ignore_eos=True))
    assert {b for b, _ in llm.engine.runner.graphs._entries} == {4}  # 3 rows + 1 padding
    assert sizes.count(WINDOW) > 10


def test_the_simulator_replays_the_same_decisions_and_kept_positions(model):
    """Each request's computed rows, replayed in the simulator (``replay_trace`` over a
    ``TraceView``) under the same policy: the same boundaries and decisions, the same
    observation windows, the same window attention and the same kept positions per layer and
    KV head, at every boundary."""
    spy = SpySnapKV(budget_tokens=16, window=WINDOW, kernel_size=3)
    llm = tiny_llm(model, spy, max_num_batched_tokens=8, enable_prefix_caching=False)
    rows = RowRecorder(llm, spy)
    prompts = [prompt(11, 90), prompt(6, 91), prompt(17, 92)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=28, ignore_eos=True), use_tqdm=False)
    assert llm.last_stats.events["compress"] >= 12 and llm.last_stats.events["fallback"] == 0
    for out, p in zip(outs, prompts, strict=True):
        sim_spy = SpySnapKV(budget_tokens=16, window=WINDOW, kernel_size=3)
        result = replay_trace(rows.trace(out.request_id, len(p)), sim_spy, llm.config.growpage)
        assert [(r.position, r.pages_after, r.action) for r in result.records] == [
            tuple(t) for t in out.trajectory
        ]
        engine_seen, sim_seen = spy.seen(out.request_id), sim_spy.seen(out.request_id)
        assert len(engine_seen) == len(sim_seen) >= 4
        for e, s in zip(engine_seen, sim_seen, strict=True):
            assert (e.position, e.decision, e.query_positions) == (
                s.position,
                s.decision,
                s.query_positions,
            )
            torch.testing.assert_close(e.window_attention, s.window_attention, rtol=0, atol=1e-6)
            assert (e.kept is None) == (s.kept is None)
            if e.kept is not None:
                assert torch.equal(e.kept, s.kept), (out.request_id, e.position)


def test_a_policy_without_recent_queries_keeps_and_writes_none(model, monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("the recent-query ring was written without a policy reading it")

    monkeypatch.setattr(model_runner_module, "prefill_rows", forbidden)
    with pytest.raises(AssertionError, match="ring was written"):  # the patch does bite
        snapkv_llm(model).generate([prompt(5, 1)], SamplingParams(max_tokens=2), use_tqdm=False)
    llm = tiny_llm(model, "fixed", policy_kwargs={"budget_tokens": 16})
    assert llm.engine.kv.recent is None
    outs = llm.generate([prompt(9, 2)], SamplingParams(max_tokens=20, ignore_eos=True))
    assert len(outs[0].token_ids) == 20 and llm.last_stats.events["compress"] > 0
    seq = llm.engine.add_request("x", [3, 4, 5], SamplingParams())
    assert llm.engine.kv.view(seq).recent_queries(4) is None


def test_the_engine_refuses_a_window_wider_than_its_ring(model):
    policy = SnapKVPolicy(budget_tokens=16, window=4)
    llm = tiny_llm(model, policy)
    policy.window = 8  # after the engine sized its ring
    with pytest.raises(Exception, match="keeps the last 4 queries"):
        llm.generate([prompt(9, 3)], SamplingParams(max_tokens=20, ignore_eos=True))


def test_the_simulator_starts_the_window_after_a_prefix_hit_as_the_engine(model):
    """A shared prompt prefix: the engine's later requests take 16 cached tokens and compute
    only their own 2, so their first windows are short; the serving simulator (trace mode,
    prefix caching on) gives the policy the same query positions at the same boundaries."""
    from growpage.sim.costmodel import LinearCostModel
    from growpage.sim.serving import SimConfig, simulate
    from growpage.sim.workload_csv import WorkloadRequest

    shared = prompt(16, 500)
    prompts = [shared + [3 + i] + prompt(1, 100 + i) for i in range(3)]
    engine_spy = SpySnapKV(budget_tokens=16, window=WINDOW, kernel_size=3)
    llm = tiny_llm(model, engine_spy, max_num_seqs=3, max_num_batched_tokens=8)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    for i, p in enumerate(prompts):
        llm.engine.add_request(f"r{i}", p, params)
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert llm.engine.kv.prefix_hit_tokens == 32
    sim_spy = SpySnapKV(budget_tokens=16, window=WINDOW, kernel_size=3)
    sim = SimConfig(
        num_kv_pages=llm.config.kv_pages,
        max_num_seqs=3,
        max_num_batched_tokens=8,
        admission_reserve=0.0,
        decisions="trace",
    )
    requests = [
        WorkloadRequest(f"r{i}", 0.0, 18, 20, prefix="a", prefix_tokens=16) for i in range(3)
    ]
    result = simulate(requests, sim_spy, llm.config.growpage, sim, LinearCostModel(base_s=1.0))
    assert result.metrics.prefix_hit_tokens == 32

    def windows(spy):
        return sorted((s.request_id, s.position, s.query_positions) for s in spy.log)

    assert windows(sim_spy) == windows(engine_spy)
    firsts = [spy_log[0] for spy_log in (engine_spy.seen("r1"), engine_spy.seen("r2"))]
    assert all(s.query_positions == (16, 17, 18, 19) for s in firsts)  # 4 < WINDOW
