"""The whole engine on a CUDA device (skipped without one): same tokens and NLLs as on CPU.

These run in the GPU check (``benchmarks/gpu_check.py``); on CPU-only machines they skip.
"""

from __future__ import annotations

import copy

import pytest
import torch
from llm_helpers import assert_all_returned, prompt, tiny_llm, tiny_model

from growpage.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PROMPTS = [prompt(9, 31), prompt(23, 32), prompt(5, 33), prompt(40, 34)]
LONG = SamplingParams(max_tokens=48, ignore_eos=True)


@pytest.fixture(scope="module")
def cpu_model():
    return tiny_model()


def assert_same_until_the_first_compression(got, want) -> None:
    """Same decisions up to each request's first compression and the same tokens until then
    (after it, other batch shapes may change the last bits, and with them the greedy picks)."""
    for a, b in zip(got, want, strict=True):
        first = next(
            (i for i, (_, _, act) in enumerate(b.trajectory) if act == "compress"),
            len(b.trajectory),
        )
        assert a.trajectory[: first + 1] == b.trajectory[: first + 1]
        n = (
            b.trajectory[first][0] - len(b.prompt_token_ids) + 1
            if first < len(b.trajectory)
            else len(b.token_ids)
        )
        assert a.token_ids[:n] == b.token_ids[:n]


def on_cuda(model, policy: str, backend: str, **kwargs):
    return tiny_llm(
        copy.deepcopy(model), policy, device="cuda", attention_backend=backend, **kwargs
    )


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fullkv_greedy_tokens_and_nll_match_cpu(cpu_model, backend):
    want = tiny_llm(copy.deepcopy(cpu_model)).generate(PROMPTS, LONG, use_tqdm=False)
    llm = on_cuda(cpu_model, "fullkv", backend)
    got = llm.generate(PROMPTS, LONG, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    conts = [o.token_ids for o in want]
    ref = tiny_llm(copy.deepcopy(cpu_model)).score(PROMPTS, conts)
    out = llm.score(PROMPTS, conts)
    for a, b in zip(out, ref, strict=True):
        assert a.token_nlls == pytest.approx(b.token_nlls, abs=2e-3)
    assert_all_returned(llm)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("policy", ["growpage", "fixed"])
def test_capacity_control_on_cuda_matches_cpu_decisions(cpu_model, backend, policy):
    kwargs = {"policy_kwargs": {"budget_tokens": 24}} if policy == "fixed" else {}
    cpu = tiny_llm(copy.deepcopy(cpu_model), policy, kv_pages=40, **kwargs)
    want = cpu.generate(PROMPTS, LONG, use_tqdm=False)
    llm = on_cuda(cpu_model, policy, backend, kv_pages=40, **kwargs)
    got = llm.generate(PROMPTS, LONG, use_tqdm=False)
    assert llm.last_stats.events["compress"] > 0
    assert llm.last_stats.boundary_s > 0
    for a, b in zip(got, want, strict=True):
        assert len(a.token_ids) == 48
        # Same decisions up to the first compaction at least (later, float noise may differ).
        first = next(
            (i for i, (_, _, act) in enumerate(b.trajectory) if act == "compress"),
            len(b.trajectory),
        )
        assert a.trajectory[: first + 1] == b.trajectory[: first + 1]
    assert_all_returned(llm)


def test_preemption_and_prefix_caching_on_cuda(cpu_model):
    shared = prompt(16, 40)
    prompts = [shared + p for p in PROMPTS]
    want = tiny_llm(copy.deepcopy(cpu_model)).generate(prompts, LONG, use_tqdm=False)
    llm = on_cuda(cpu_model, "fullkv", "triton", kv_pages=30)
    got = llm.generate(prompts, LONG, use_tqdm=False)
    assert llm.last_stats.num_preemptions > 0 and llm.last_stats.prefix_hit_tokens > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert_all_returned(llm)


def test_queued_host_to_device_copies_arrive_intact():
    """``to_device`` queues pinned copies (no host sync); many in a row, then used at once."""
    from growpage.engine.loop.transfer import to_device

    device = torch.device("cuda")
    rows = [[i, i + 1, -1] for i in range(64)]
    copies = [to_device(rows[: i + 1], torch.int32, device) for i in range(64)]
    for i, t in enumerate(copies):
        assert t.device.type == "cuda" and t.dtype == torch.int32
        assert t.cpu().tolist() == rows[: i + 1]
    mask = to_device([True, False], torch.bool, device)
    assert mask.cpu().tolist() == [True, False]


@pytest.mark.parametrize("backend,graphs", [("torch", False), ("triton", False), ("triton", True)])
def test_async_compaction_on_cuda(cpu_model, backend, graphs):
    """Compressions on a side stream beside the forward: the decisions are the synchronous
    run's (until float noise from other batch shapes may part them), the stall is part of the
    deferred time, nothing is left behind."""
    params = SamplingParams(max_tokens=80, ignore_eos=True)
    sync = on_cuda(cpu_model, "growpage", backend, cuda_graphs=graphs, async_compaction=False)
    want = sync.generate(PROMPTS, params, use_tqdm=False)
    llm = on_cuda(cpu_model, "growpage", backend, cuda_graphs=graphs, async_compaction=True)
    got = llm.generate(PROMPTS, params, use_tqdm=False)
    kv = llm.engine.kv
    assert kv.deferred.num_compactions == llm.last_stats.events["compress"] > 0
    assert 0 <= kv.deferred.waited_s <= kv.deferred.work_s < kv.boundary_s
    assert all(len(a.token_ids) == 80 for a in got)
    assert_same_until_the_first_compression(got, want)
    assert_all_returned(llm)


def test_deferred_compressions_overlap_a_long_forward_on_cuda(cpu_model):
    """Each step with deferred compressions gets ~0.1 s of extra device work queued behind its
    forward: the compressions (on their side stream) finish long before it, so the step waits
    for none of them, and their time does not include the wait for the forward."""
    params = SamplingParams(max_tokens=80, ignore_eos=True)
    llm = on_cuda(cpu_model, "growpage", "triton", async_compaction=True, cuda_graphs=False)
    llm.generate(PROMPTS, params, use_tqdm=False)  # compiles and caches everything first
    engine, kv = llm.engine, llm.engine.kv
    run, slowed = engine.runner.run, []

    def slow_forward(out):
        result = run(out)
        if kv.deferred.num_pending:
            torch.cuda._sleep(200_000_000)  # ~0.1 s of device time on the main stream
            slowed.append(out)
        return result

    engine.runner.run = slow_forward
    before = (kv.deferred.work_s, kv.deferred.waited_s)
    llm.generate(PROMPTS, params, use_tqdm=False)
    deferred, stall = kv.deferred.work_s - before[0], kv.deferred.waited_s - before[1]
    assert slowed and deferred > 0
    assert stall <= 0.1 * deferred + 1e-3 * len(slowed), (stall, deferred, len(slowed))
    assert deferred < 0.05 * len(slowed) + 0.05, (deferred, len(slowed))  # not the 0.1 s waits
    assert_all_returned(llm)


def test_defaults_on_cuda_are_graphs_and_async_compaction_with_the_same_tokens(cpu_model):
    """``LLM(device="cuda")`` with nothing else asked for: the Triton backend, CUDA-graph
    decode and compressions beside the step; the tokens and decisions are the eager,
    synchronous engine's (up to the first compression, after which batch shapes differ)."""
    params = SamplingParams(max_tokens=80, ignore_eos=True)
    llm = tiny_llm(copy.deepcopy(cpu_model), "growpage", device="cuda")
    assert (llm.config.cuda_graphs, llm.config.async_compaction) == (True, True)
    assert llm.engine.runner.model.backend.name == "triton"
    got = llm.generate(PROMPTS, params, use_tqdm=False)
    plain = on_cuda(cpu_model, "growpage", "triton", cuda_graphs=False, async_compaction=False)
    want = plain.generate(PROMPTS, params, use_tqdm=False)
    assert llm.engine.runner.graphs.num_captured > 0
    assert llm.engine.kv.deferred.num_compactions == llm.last_stats.events["compress"] > 0
    assert_same_until_the_first_compression(got, want)
    assert_all_returned(llm)


@pytest.mark.parametrize("graphs", [False, True])
def test_late_boundaries_on_cuda(cpu_model, graphs):
    """Whole boundaries decided on the side stream beside the forward (async_decisions): the
    synchronous run's decisions and tokens (until other batch shapes may part them), every
    decided boundary late, nothing left behind."""
    params = SamplingParams(max_tokens=80, ignore_eos=True)
    sync = on_cuda(cpu_model, "growpage", "triton", cuda_graphs=graphs, async_compaction=False)
    want = sync.generate(PROMPTS, params, use_tqdm=False)
    llm = on_cuda(cpu_model, "growpage", "triton", cuda_graphs=graphs, async_decisions=True)
    got = llm.generate(PROMPTS, params, use_tqdm=False)
    kv, events = llm.engine.kv, llm.last_stats.events
    decided = sum(events.get(f"decided_{d}", 0) for d in ("grow", "compress", "shrink"))
    assert kv.deferred.num_decisions == decided > 0 and events["compress"] > 0
    assert 0 <= kv.deferred.waited_s <= kv.deferred.work_s <= kv.boundary_s
    assert all(len(a.token_ids) == 80 for a in got)
    assert_same_until_the_first_compression(got, want)
    assert_all_returned(llm)
