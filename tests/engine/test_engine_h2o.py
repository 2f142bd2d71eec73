"""H2O accumulated attention in the engine (``growpage.engine.modeling.accumulation``).

The oracle is the simulator: ``TraceView`` replays each request's computed rows (recorded in
fp32 from the same run) with the engine's own decisions, and its sums must equal what the
policy read in the engine at every boundary: prompt queries counted, group mean per KV head,
sums moved by compaction, restarted by a recompute, never leaking from a freed page.
"""

from __future__ import annotations

import pytest
import torch
from h2o_helpers import RowRecorder, SpyH2O, SumsReadingGrowPage, check_against_simulator
from llm_helpers import assert_all_returned, prompt, tiny_llm, tiny_model

import growpage.engine.modeling.attention as attention_module
import growpage.engine.modeling.attention_torch as attention_torch_module
import growpage.kernels  # noqa: F401  (turns the interpreter on without CUDA)
from growpage.core.config import GrowPageConfig
from growpage.engine.config import EngineConfig
from growpage.engine.loop.kv_manager import KVCacheManager
from growpage.engine.loop.model_runner import ModelRunner
from growpage.engine.loop.scheduler import SchedulerOutput
from growpage.engine.loop.sequence import Sequence
from growpage.engine.sampling_params import SamplingParams
from growpage.kernels.variants import record_variants

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [prompt(11, 60), prompt(6, 61), prompt(17, 62)]
PARAMS = SamplingParams(max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def spy_llm(model, spy: SpyH2O, **kwargs):
    kwargs.setdefault("max_num_batched_tokens", 8)  # prompts prefill in chunks
    return tiny_llm(model, policy=spy, **kwargs)


def test_sums_equal_the_simulators_replay(model):
    spy = SpyH2O(budget_tokens=16)
    llm = spy_llm(model, spy)
    assert not llm.config.enable_prefix_caching and not llm.engine.kv.prefix_caching
    rows = RowRecorder(llm, spy)
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert llm.last_stats.events["compress"] >= 9
    for out, p in zip(outs, PROMPTS, strict=True):
        first = spy.seen(out.request_id)[0]
        # Before any compaction every query so far (prompt included) adds one unit per
        # (layer, KV head): group mean of softmax rows.
        expected = torch.full(first.sums.shape[:2], float(first.position))
        torch.testing.assert_close(first.sums.sum(-1), expected, rtol=1e-5, atol=1e-4)
        assert check_against_simulator(llm, spy, rows, out.request_id, len(p)) >= 4
    assert sum(s.keep is not None for s in spy.log) >= 9  # compactions were replayed too
    assert_all_returned(llm)


@pytest.mark.parametrize("use_kernels", [False, True], ids=["torch", "kernels"])
@pytest.mark.parametrize("pages", ["same", "copy_on_write", "swapped"])
def test_compaction_moves_the_sums_with_the_keys(use_kernels, pages):
    """Each kept slot's sum lands where its key lands; dropped slots' sums are gone."""
    model = tiny_model().to(DEVICE)
    config = EngineConfig(
        growpage=GrowPageConfig(page_size=4, recent_window=2),
        kv_pages=24,
        device=DEVICE,
        dtype=torch.float32,  # the tiny model's (CUDA's default would be bf16)
    )
    kv = KVCacheManager(model.config, config, SumsReadingGrowPage())
    assert config.enable_prefix_caching and not kv.prefix_caching  # refused: slots private
    kv.pool.allocate(9)  # the request's pages come from the middle of the cache
    seq = Sequence(0, "r", prompt(12, 63), SamplingParams())
    kv.admit(seq)
    seq.state.num_tokens = seq.state.position = 12
    ModelRunner(model, kv).run(SchedulerOutput(True, (seq,), (12,)))
    view = kv.view(seq, use_kernels=use_kernels)
    sums, keys = view.accumulated_attention(), view.keys().clone()
    assert sums.shape == (2, 2, 12) and torch.all(sums > 0)
    torch.testing.assert_close(sums.sum(-1).cpu(), torch.full((2, 2), 12.0))  # 12 queries
    keep = (
        torch.stack(
            [
                torch.randperm(12, generator=torch.Generator().manual_seed(i))[:8].sort().values
                for i in range(4)
            ]
        )
        .view(2, 2, 8)
        .to(DEVICE)
    )
    src = list(seq.state.block_table)
    dst = {
        "same": src,
        "copy_on_write": [src[0], *kv.pool.allocate(2)],
        "swapped": [src[1], src[0], src[2]],
    }[pages]
    view.compact(keep, src, dst)
    seq.state.block_table, seq.state.num_tokens = dst, 8
    after = kv.view(seq, use_kernels=use_kernels)
    assert torch.equal(after.keys(), torch.gather(keys, 2, keep[..., None].expand(-1, -1, -1, 16)))
    assert torch.equal(after.accumulated_attention(), torch.gather(sums, 2, keep))


def test_recording_changes_no_decision_or_token(model):
    """Recording the sums has no side effect: the same policy with and without them gives the
    same tokens, decisions and trajectories."""
    plain = tiny_llm(model, "growpage", enable_prefix_caching=False)
    recording = tiny_llm(model, SumsReadingGrowPage(), enable_prefix_caching=False)
    assert recording.engine.kv.accumulated is not None
    outs = [llm.generate(PROMPTS, PARAMS, use_tqdm=False) for llm in (plain, recording)]
    assert [o.token_ids for o in outs[0]] == [o.token_ids for o in outs[1]]
    assert [o.trajectory for o in outs[0]] == [o.trajectory for o in outs[1]]
    assert plain.last_stats.events == recording.last_stats.events
    assert plain.last_stats.events["compress"] > 0


def test_a_policy_without_sums_allocates_and_runs_nothing_extra(model, monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("accumulation path taken without a policy that reads the sums")

    for module, name in (
        (attention_module, "add_prefill"),
        (attention_module, "add_decode"),
        (attention_torch_module, "add_decode"),
        (attention_torch_module, "group_attention"),
    ):
        monkeypatch.setattr(module, name, forbidden)
    llm = tiny_llm(model, "h2o", policy_kwargs={"budget_tokens": 16})
    with pytest.raises(AssertionError, match="accumulation path"):
        llm.generate(PROMPTS[:1], PARAMS, use_tqdm=False)  # the patch does bite
    llm = tiny_llm(model, "growpage")
    kv = llm.engine.kv
    assert kv.accumulated is None and llm.engine.runner.accumulation is None
    assert kv.prefix_caching and llm.config.enable_prefix_caching
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert llm.last_stats.events["compress"] > 0 and all(len(o.token_ids) == 24 for o in outs)
    seq = Sequence(9, "x", [3, 4, 5], SamplingParams())
    assert kv.view(seq).accumulated_attention() is None


def test_freed_pages_start_their_sums_from_zero(model):
    """Request B in pages that request A left dirty reads the sums B reads on a fresh engine."""
    a, b = prompt(13, 64), prompt(9, 65)
    spy = SpyH2O(budget_tokens=16)
    llm = spy_llm(model, spy, kv_pages=5)
    llm.generate([a], PARAMS, use_tqdm=False)
    kv = llm.engine.kv
    dirty = {slot // 4 for slot in kv.accumulated.sum(dim=(0, 2)).nonzero().flatten().tolist()}
    llm.generate([b], PARAMS, use_tqdm=False)
    fresh_spy = SpyH2O(budget_tokens=16)
    spy_llm(model, fresh_spy, kv_pages=5).generate([b], PARAMS, use_tqdm=False)
    reused, fresh = spy.log[len(spy.log) - len(fresh_spy.log) :], fresh_spy.log
    assert len(fresh) >= 4 and dirty & {p for s in reused for p in s.pages}
    for s, f in zip(reused, fresh, strict=True):
        assert s.position == f.position and torch.equal(s.positions, f.positions)
        torch.testing.assert_close(s.sums, f.sums, atol=1e-6, rtol=1e-6)


def test_preempted_requests_restart_their_sums(model):
    """After a recompute the sums are those of a request that prefilled all its tokens."""
    spy = SpyH2O(budget_tokens=16)
    llm = spy_llm(model, spy, kv_pages=16, max_num_seqs=6)
    rows = RowRecorder(llm, spy)
    prompts = [prompt(5 + 3 * i, 100 + i) for i in range(5)]
    params = [SamplingParams(max_tokens=16 + 2 * i, ignore_eos=True) for i in range(5)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.last_stats.num_preemptions > 0
    for out, p in zip(outs, prompts, strict=True):
        compared = check_against_simulator(llm, spy, rows, out.request_id, len(p))
        if out.num_preemptions:
            assert out.request_id in rows.restarts and compared >= 1
    assert_all_returned(llm)


def test_triton_backend_gives_the_torch_backends_sums():
    """The accumulation kernel (under the interpreter without CUDA) and the kernel compaction
    against the torch backend: same tokens, decisions and sums; the warm-up launches every
    kernel variant the run needs."""
    prompts, params = PROMPTS[:2], SamplingParams(max_tokens=14, ignore_eos=True)
    torch_spy, triton_spy = SpyH2O(budget_tokens=12), SpyH2O(budget_tokens=12)
    expected = spy_llm(
        tiny_model(), torch_spy, device=DEVICE, attention_backend="torch", boundary_kernels=False
    ).generate(prompts, params, use_tqdm=False)
    with record_variants() as at_start:
        llm = spy_llm(
            tiny_model(),
            triton_spy,
            device=DEVICE,
            attention_backend="triton",
            boundary_kernels=True,
            warmup=True,
            cuda_graphs=False,
            async_compaction=False,
        )  # the torch backend's path: eager, synchronous
    counts = llm.engine.warmup_report.variants
    assert counts["accumulate"] == 1 and counts["compact"] == 3, counts
    with record_variants() as serving:
        outs = llm.generate(prompts, params, use_tqdm=False)
    assert serving.new_since(at_start) == {}, serving.new_since(at_start)
    assert [o.token_ids for o in outs] == [o.token_ids for o in expected]
    assert len(triton_spy.log) == len(torch_spy.log) >= 6
    assert sum(s.keep is not None for s in triton_spy.log) >= 4
    for got, want in zip(triton_spy.log, torch_spy.log, strict=True):
        assert (got.request_id, got.position) == (want.request_id, want.position)
        assert torch.equal(got.positions.cpu(), want.positions.cpu())
        torch.testing.assert_close(got.sums.cpu(), want.sums.cpu(), atol=1e-4, rtol=1e-4)
    assert_all_returned(llm)


def test_static_decode_pads_without_touching_the_sums():
    """CUDA-graph decode (static buffers; eager on CPU): padding rows have length 0, so the
    accumulation kernel adds nothing for them; same tokens and the same sums everywhere."""
    from growpage.engine.loop.cuda_graphs import DecodeGraphs

    prompts, params = (
        [prompt(5 + 4 * i, 70 + i) for i in range(3)],
        SamplingParams(max_tokens=10, ignore_eos=True),
    )
    llms = []
    for graphs in (False, True):
        llm = tiny_llm(
            tiny_model(),
            policy=SpyH2O(budget_tokens=12),
            max_num_seqs=4,
            kv_pages=40,
            device=DEVICE,
            attention_backend="triton",
            boundary_kernels=True,
            cuda_graphs=graphs and DEVICE == "cuda",
            async_compaction=False,
        )
        llm.engine.model.backend.num_splits = 1
        if graphs and DEVICE == "cpu":
            llm.engine.runner.graphs = DecodeGraphs(llm.engine.runner, 4, capture=False)
        llms.append((llm, llm.generate(prompts, params, use_tqdm=False)))
    (eager, want), (static, got) = llms
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert {b for b, _ in static.engine.runner.graphs._entries} == {4}  # 3 rows + 1 padding
    torch.testing.assert_close(
        static.engine.kv.accumulated, eager.engine.kv.accumulated, atol=1e-5, rtol=0
    )
    assert static.engine.kv.accumulated.abs().sum() > 0
