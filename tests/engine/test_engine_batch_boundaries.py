"""The engine's boundaries of one step in one pass (``core.compaction_batch``): tokens, decisions,
trajectories, events and kept positions are those of the request-by-request path
(``KVCacheManager.compacts_together = False``), on the torch path and the kernel path, with
prefix sharing, a tight pool, a protected prompt and the deferred options."""

from __future__ import annotations

import pytest
import torch
from llm_helpers import prompt, tiny_llm, tiny_model

from growpage.core import compaction_batch
from growpage.engine.loop.kv_manager import KVCacheManager
from growpage.engine.loop.paged_kv_view import EngineKVView
from growpage.engine.sampling_params import SamplingParams

RUN = compaction_batch.CompactionBatch.run
COMPACT = EngineKVView.compact_batch


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def served(model, together: bool, prompts, params, monkeypatch, **kwargs):
    """Every request's tokens, trajectory, events and final kept positions, the run's events,
    and the number of steps whose compressions ran together."""
    monkeypatch.setattr(KVCacheManager, "compacts_together", together)
    llm = tiny_llm(model, **kwargs)
    engine = llm.engine
    if not isinstance(params, list):
        params = [params] * len(prompts)
    seqs = [
        engine.add_request(str(i), ids, p)
        for i, (ids, p) in enumerate(zip(prompts, params, strict=True))
    ]
    positions = {}
    release = engine.kv.release

    def noted(seq):  # a finished request's kept positions, before they are forgotten
        kept = seq.kept_positions
        positions[seq.request_id] = None if kept is None else kept.clone()
        release(seq)

    monkeypatch.setattr(engine.kv, "release", noted)
    batched = []

    def counted(self):
        batched.append(len(self))
        return RUN(self)

    monkeypatch.setattr(compaction_batch.CompactionBatch, "run", counted)
    while engine.has_unfinished():
        engine.step()
    rows = [
        (s.output_token_ids, s.state.trajectory, s.state.events.as_dict(), positions[s.request_id])
        for s in seqs
    ]
    return rows, engine.kv.controller.events.as_dict(), batched


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is not None and b is not None and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


SETTINGS = {
    "growpage": dict(policy="growpage"),
    "fixed": dict(policy="fixed", policy_kwargs={"budget_tokens": 24}),
    "shrink": dict(policy="shrink", policy_kwargs={"min_capacity_tokens": 8}),
    "h2o": dict(policy="h2o", policy_kwargs={"budget_tokens": 24}),
    "snapkv": dict(policy="snapkv", policy_kwargs={"budget_tokens": 24, "window": 4}),
    "prompt-protected": dict(policy="growpage", protect_prompt=True, floor_tokens=4),
    "tight-pool": dict(policy="growpage", kv_pages=22),
    # Three at a time: the fourth shares the first's head pages, so their compressions copy
    # them first.
    "prefix-hits": dict(policy="growpage", max_num_seqs=3),
    "async-compaction": dict(policy="growpage", async_compaction=True),
    "async-decisions": dict(
        policy="fixed", policy_kwargs={"budget_tokens": 24}, async_decisions=True
    ),
}


@pytest.mark.parametrize("name", list(SETTINGS))
def test_a_steps_compressions_together_change_nothing(model, monkeypatch, name):
    # Equal prompt lengths put several requests at a boundary in the same steps.
    head = prompt(8, 99)
    prompts = [head + prompt(7, 10 + i) for i in range(6)]
    params = [SamplingParams(max_tokens=40, ignore_eos=True) for _ in prompts]
    # The second leaves after two tokens: the next admission hits the first's two cached
    # pages (its head, registered first) while the first still holds them.
    params[1] = SamplingParams(max_tokens=2, ignore_eos=True)
    kwargs = SETTINGS[name]
    alone, alone_events, none = served(model, False, prompts, params, monkeypatch, **kwargs)
    together, events, batched = served(model, True, prompts, params, monkeypatch, **kwargs)
    assert not none and max(batched) >= 2, batched  # steps of several compressions ran
    assert events == alone_events and events["compress"] + events["shrink"] > 0
    assert same(together, alone)
    if name == "tight-pool":
        assert events["fallback"] > 0 or events["preempt_needed"] > 0, events
    if name == "prefix-hits":
        assert events["cow_pages"] > 0, events


def test_on_two_threads_as_on_one(model, monkeypatch):
    prompts = [prompt(11, 40 + i) for i in range(5)]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = served(model, False, prompts, params, monkeypatch, policy="growpage")
        torch.set_num_threads(2)
        two = served(model, True, prompts, params, monkeypatch, policy="growpage")
    finally:
        torch.set_num_threads(before)
    assert two[2] and same(one[:2], two[:2])


def test_the_kernel_path_compacts_a_step_in_one_launch(model, monkeypatch):
    prompts = [prompt(11, 50 + i) for i in range(4)]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    calls = []

    def counted(jobs, keep):
        calls.append(len(jobs))
        return COMPACT(jobs, keep)

    kwargs = dict(policy="growpage", boundary_kernels=True, kv_pages=40)
    alone, alone_events, _ = served(model, False, prompts, params, monkeypatch, **kwargs)
    monkeypatch.setattr(EngineKVView, "compact_batch", staticmethod(counted))
    together, events, batched = served(model, True, prompts, params, monkeypatch, **kwargs)
    assert calls == [n for n in batched if n] and max(calls) >= 2, (calls, batched)
    assert events == alone_events and same(together, alone)
