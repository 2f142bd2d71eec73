"""CUDA-graph decode (``growpage.engine.loop.cuda_graphs``): static buffers padded to batch buckets.

On CPU the static-shape forward runs eagerly (``capture=False``) under Triton's interpreter:
it must give the ordinary decode path's tokens, decisions and cache contents, so the padding
rows write nothing. On CUDA the same checks run with real graph capture and replay.
"""

from __future__ import annotations

import random

import pytest
import torch
from llm_helpers import assert_all_returned, tiny_model

import growpage.kernels  # noqa: F401  (turns the interpreter on without CUDA)
from growpage.engine.llm import LLM
from growpage.engine.loop.cuda_graphs import DecodeGraphs, batch_buckets
from growpage.engine.sampling_params import SamplingParams
from growpage.errors import ConfigError

ON_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if ON_CUDA else "cpu"


pytestmark = pytest.mark.usefixtures("one_thread")


def test_batch_buckets():
    assert batch_buckets(1) == (1,)
    assert batch_buckets(6) == (1, 2, 4, 6)
    assert batch_buckets(20) == (1, 2, 4, 8, 16, 20)
    assert batch_buckets(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)


def kernel_llm(graphs: bool, model, policy: str = "growpage", kv_pages: int = 40, **kwargs) -> LLM:
    kwargs.setdefault("async_compaction", False)  # with graphs it would default to on
    llm = LLM(
        model,
        policy=policy,
        page_size=8,
        recent_window=2,
        kv_pages=kv_pages,
        max_num_seqs=6,
        device=DEVICE,
        dtype=torch.float32,  # CUDA's default is bf16; the eager reference here is fp32
        attention_backend="triton",
        boundary_kernels=True,
        warmup=False,
        cuda_graphs=graphs and ON_CUDA,
        **kwargs,
    )
    # One split in both runs: the static path's table width would otherwise pick another
    # split count, and the merge order would change the last bits.
    llm.engine.model.backend.num_splits = 1
    if graphs and not ON_CUDA:
        llm.engine.runner.graphs = DecodeGraphs(llm.engine.runner, 6, capture=False)
    return llm


def test_static_decode_matches_the_ordinary_path():
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 128) for _ in range(rng.randrange(4, 20))] for _ in range(5)]
    # 10, 13, 15, 12 and 12 tokens: 5 running, then 4, 2, 1 (fewer tokens keep that order).
    params = [SamplingParams(max_tokens=rng.randrange(6, 16), ignore_eos=True) for _ in prompts]
    eager = kernel_llm(False, tiny_model())
    static = kernel_llm(True, tiny_model())
    want = eager.generate(prompts, params, use_tqdm=False)
    got = static.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.trajectory for o in got] == [o.trajectory for o in want]
    events = static.last_stats.events
    assert events == eager.last_stats.events and events["compress"] > 0, events
    # Padding rows (5 requests run in a bucket of 6, then 4, 2, 1) wrote nothing anywhere.
    torch.testing.assert_close(static.engine.kv.cache, eager.engine.kv.cache, atol=1e-5, rtol=0)
    torch.testing.assert_close(
        static.engine.kv.query_pool.summaries,
        eager.engine.kv.query_pool.summaries,
        atol=1e-5,
        rtol=0,
    )
    graphs = static.engine.runner.graphs
    # The first decode steps ran in the largest bucket, later ones in smaller buckets, with
    # block tables in power-of-two width buckets.
    buckets = {bucket for bucket, _ in graphs._entries}
    assert 6 in buckets and buckets <= {1, 2, 4, 6} and len(buckets) > 1
    assert buckets == {1, 2, 4, 6}, graphs._entries  # every bucket the batch shrinks through
    widths = {width for _, width in graphs._entries}
    assert widths <= {1, 2, 4, 8} and len(widths) > 1, graphs._entries
    assert [graphs.width(n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, 16]
    assert graphs.width(10**6) == graphs.max_width <= static.engine.kv.num_pages
    if ON_CUDA:
        assert graphs.num_captured == len(graphs._entries)
    assert_all_returned(static)


def test_static_decode_with_async_compaction_matches_the_ordinary_path():
    """Requests that sit a step out for their compressions leave the static batch smaller (a
    smaller bucket, more padding rows); the tokens and the cache stay the eager path's."""
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 128) for _ in range(rng.randrange(4, 20))] for _ in range(3)]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    eager = kernel_llm(False, tiny_model(), async_compaction=True)
    static = kernel_llm(True, tiny_model(), async_compaction=True)
    want = eager.generate(prompts, params, use_tqdm=False)
    got = static.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert static.engine.kv.deferred.num_compactions == eager.engine.kv.deferred.num_compactions > 0
    torch.testing.assert_close(static.engine.kv.cache, eager.engine.kv.cache, atol=1e-5, rtol=0)
    # Three requests of equal length fill a bucket of 4: a smaller one means one sat a step out.
    buckets = {bucket for bucket, _ in static.engine.runner.graphs._entries}
    assert 4 in buckets and min(buckets) < 4, buckets
    assert_all_returned(static)


def test_cuda_graphs_refuse_a_cpu_engine():
    if ON_CUDA:
        pytest.skip("checks the CPU refusal")
    with pytest.raises(ConfigError, match="cuda_graphs needs a CUDA device"):  # before loading
        LLM(tiny_model(), page_size=8, recent_window=2, kv_pages=16, cuda_graphs=True)


def test_static_decode_through_preemption_and_prefix_hits():
    """fullkv in a pool too small for all requests: preempted requests come back (recompute,
    new query slots, cached prefix pages) and decode in the static buffers again."""
    shared = [5, 9, 11, 3, 7, 13, 17, 19, 23]  # a common prefix: one full page and a bit
    prompts = [shared + [30 + i] * (3 + i) for i in range(5)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)  # the longest needs 4 of 11 pages
    eager = kernel_llm(False, tiny_model(), policy="fullkv", kv_pages=11)
    static = kernel_llm(True, tiny_model(), policy="fullkv", kv_pages=11)
    want = eager.generate(prompts, params, use_tqdm=False)
    got = static.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert static.engine.scheduler.num_preemptions == eager.engine.scheduler.num_preemptions > 0
    assert static.engine.kv.prefix_hit_tokens == eager.engine.kv.prefix_hit_tokens > 0
    assert_all_returned(static)
