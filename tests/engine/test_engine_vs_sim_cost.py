"""The simulator prices each decode step with the KV the engine's step reads: the batch and the
sum of its context lengths, or (``padded_kv``, the torch backend's padded attention) the batch
times its longest context. A cost model that records what it is asked checks it step by step
against the context lengths of the engine's decode steps, through compressions, asynchronous
compaction and late decisions (requests sitting a step out) and preemptions."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from llm_helpers import prompt, tiny_llm, tiny_model

from growpage.engine.modeling.attention_torch import PagedTorchBackend
from growpage.engine.profiling.profile import decode_pads_kv
from growpage.engine.sampling_params import SamplingParams
from growpage.policies import resolve_policy
from growpage.sim.costmodel import CostModel, LinearCostModel
from growpage.sim.serving import SimConfig, simulate
from growpage.sim.workload_csv import WorkloadRequest


@pytest.fixture(scope="module")
def model():
    return tiny_model()


class RecordingCost(CostModel):
    """One second per decode step; records ``(num_seqs, kv_tokens)`` of every decode step it
    prices (the first call, ``simulate``'s check that decode steps cost something, is not a
    step)."""

    def __init__(self, padded_kv: bool) -> None:
        self.padded_kv = padded_kv
        self.calls: list[tuple[int, int]] = []

    def step_time(self, num_seqs, kv_tokens, prefill_tokens=0):
        return 1.0

    def decode_time(self, num_seqs, kv_tokens, num_steps):
        self.calls.extend((num_seqs, kv_tokens + num_seqs * i) for i in range(num_steps))
        return float(num_steps)

    def steps(self) -> list[tuple[int, int]]:
        assert self.calls[0] == (1, 1)  # simulate()'s check of the model
        return self.calls[1:]


def engine_decode_steps(llm, prompts, params) -> list[tuple[int, int, int]]:
    """``(num_seqs, sum, longest)`` of the context lengths of every engine decode step."""
    runner = llm.engine.runner
    prepare, seen = runner._prepare_decode, []

    def recording(out, capture):
        ctx, *rest = prepare(out, capture)
        lens = ctx.context_lens.tolist()
        seen.append((len(lens), sum(lens), max(lens)))
        return (ctx, *rest)

    runner._prepare_decode = recording
    try:
        llm.generate(prompts, params, use_tqdm=False)
    finally:
        runner._prepare_decode = prepare
    return seen


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    lengths=st.lists(st.tuples(st.integers(1, 14), st.integers(2, 40)), min_size=1, max_size=4),
    point=st.sampled_from(
        [("fullkv", {}), ("fixed", {"budget_tokens": 12}), ("fixed", {"budget_tokens": 20})]
    ),
    pages=st.sampled_from([10, 256]),
    async_compaction=st.booleans(),
    async_decisions=st.booleans(),
    chunk=st.sampled_from([4096, 5]),
)
def test_each_decode_step_is_priced_with_the_kv_the_engine_reads(
    model, lengths, point, pages, async_compaction, async_decisions, chunk
):
    policy, params = point
    pages = max([pages] + [-(-(p + o) // 4) + 1 for p, o in lengths])  # each fits alone
    llm = tiny_llm(
        model,
        policy=policy,
        policy_kwargs=params,
        kv_pages=pages,
        max_num_seqs=4,
        enable_prefix_caching=False,
        max_num_batched_tokens=chunk,
        async_compaction=async_compaction,
        async_decisions=async_decisions,
    )
    engine = engine_decode_steps(
        llm,
        [prompt(p, 100 + i) for i, (p, _) in enumerate(lengths)],
        [SamplingParams(max_tokens=o, ignore_eos=True) for _, o in lengths],
    )
    requests = [WorkloadRequest(f"r{i}", 0.0, p, o) for i, (p, o) in enumerate(lengths)]
    sim = SimConfig(
        num_kv_pages=pages,
        max_num_seqs=4,
        max_num_batched_tokens=chunk,
        admission_reserve=0.0,
        prefix_caching=False,
        async_compaction=async_compaction,
        async_decisions=async_decisions,
    )
    for padded in (False, True):
        cost = RecordingCost(padded)
        simulate(requests, resolve_policy(policy, **params), llm.config.growpage, sim, cost)
        expected = [(n, n * longest if padded else total) for n, total, longest in engine]
        assert cost.steps() == expected


def test_the_torch_backend_pads_and_the_cost_models_say_so():
    assert PagedTorchBackend.pads_decode and decode_pads_kv()
    assert not LinearCostModel().padded_kv and LinearCostModel(padded_kv=True).padded_kv
