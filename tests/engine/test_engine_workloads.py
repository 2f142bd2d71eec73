"""Random workloads (hypothesis): whatever the pool size, batching, chunking and prefix sharing,
``fullkv`` greedy output equals an unconstrained run, every request finishes and every page
and query slot comes back; compressing policies keep the same bookkeeping."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from llm_helpers import assert_all_returned, prompt, tiny_llm, tiny_model

from growpage.engine.sampling_params import SamplingParams

MODEL = tiny_model()
SHARED = prompt(12, 99)


@st.composite
def workloads(draw):
    n = draw(st.integers(1, 6))
    prompts = [
        (SHARED if draw(st.booleans()) else []) + prompt(draw(st.integers(1, 14)), s)
        for s in draw(st.lists(st.integers(0, 1000), min_size=n, max_size=n))
    ]
    max_tokens = draw(st.lists(st.integers(1, 24), min_size=n, max_size=n))
    return prompts, max_tokens


def run(policy: str, prompts, max_tokens, **kwargs):
    llm = tiny_llm(MODEL, policy, **kwargs)
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in max_tokens]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == max_tokens
    assert_all_returned(llm)
    return [o.token_ids for o in outs], llm


SETTINGS = settings(
    max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)


@settings(SETTINGS, max_examples=25)
@given(workloads(), st.integers(13, 24), st.integers(1, 4), st.sampled_from([3, 8, 64]))
def test_fullkv_output_is_independent_of_memory_and_batching(
    workload, kv_pages, max_num_seqs, chunk
):
    prompts, max_tokens = workload
    expected, _ = run("fullkv", prompts, max_tokens, enable_prefix_caching=False)
    got, llm = run(
        "fullkv",
        prompts,
        max_tokens,
        kv_pages=kv_pages,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=chunk,
    )
    assert got == expected
    assert llm.last_stats.max_pages_used <= kv_pages


@pytest.mark.parametrize("policy", ["growpage", "random", "shrink"])
@SETTINGS
@given(workload=workloads(), kv_pages=st.integers(10, 24))
def test_compressing_policies_keep_the_bookkeeping(policy, workload, kv_pages):
    prompts, max_tokens = workload
    kwargs = {"policy_kwargs": {"min_capacity_tokens": 8}} if policy == "shrink" else {}
    _, llm = run(policy, prompts, max_tokens, kv_pages=kv_pages, max_num_seqs=3, **kwargs)
    events = llm.last_stats.events
    assert events["boundaries"] >= events["grow"] + events["compress"] + events["shrink"]


@pytest.mark.parametrize("policy", ["growpage", "shrink"])
@SETTINGS
@given(workload=workloads(), kv_pages=st.integers(10, 24), max_num_seqs=st.integers(2, 4))
def test_async_compaction_keeps_the_bookkeeping(policy, workload, kv_pages, max_num_seqs):
    """Compressions deferred to beside the decode step, under pool pressure, prefix sharing and
    preemption: every request finishes, every page and slot comes back, and every compression
    that was decided ran exactly once (none left pending, none run twice)."""
    prompts, max_tokens = workload
    kwargs = {"policy_kwargs": {"min_capacity_tokens": 8}} if policy == "shrink" else {}
    _, llm = run(
        policy,
        prompts,
        max_tokens,
        kv_pages=kv_pages,
        max_num_seqs=max_num_seqs,
        async_compaction=True,
        **kwargs,
    )
    events, kv = llm.last_stats.events, llm.engine.kv
    assert kv.deferred.num_pending == 0
    assert kv.deferred.num_compactions == events["compress"] + events["shrink"]
