"""``profile_boundaries``: boundary time by phase, without changing what the engine does."""

from __future__ import annotations

import copy

import pytest
import torch
from llm_helpers import GREEDY, prompt, tiny_llm, tiny_model

import growpage.core.capacity as capacity_module
from growpage import Decision
from growpage.core import demand
from growpage.engine.loop.paged_kv_view import EngineKVView
from growpage.engine.profiling.boundary_profile import PHASES, BoundaryPhases, profile_boundaries
from growpage.errors import PolicyError
from growpage.policies.base import CapacityPolicy

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [prompt(9 + 3 * i, seed=i) for i in range(3)]


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def squeezed(model, **kwargs):
    """growpage in a pool that forces compressions as well as decided grows."""
    return tiny_llm(model, "growpage", kv_pages=18, max_num_seqs=3, min_capacity=2, **kwargs)


def originals() -> list[object]:
    return [
        EngineKVView.__dict__[n]
        for n in ("boundary_queries", "summary_attention", "batch_boundary_signals", "compact")
    ] + [demand.working_set_counts, demand.demand_trends, capacity_module._check_selection]


@pytest.mark.parametrize("deferred", [False, True], ids=["sync", "async-compaction"])
def test_phases_account_for_every_boundary_and_change_nothing(model, deferred) -> None:
    plain = squeezed(model, async_compaction=deferred)
    expected = plain.generate(PROMPTS, GREEDY, use_tqdm=False)
    before = originals()
    llm = squeezed(model, async_compaction=deferred)
    policy = llm.engine.kv.controller.policy
    with profile_boundaries(llm) as phases:
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]
    events, stats = llm.last_stats.events, llm.last_stats
    assert events == plain.last_stats.events
    decided = sum(events[f"decided_{d.value}"] for d in Decision)
    compactions = events["compress"] + events["shrink"]
    assert events["compress"] > 0 and events["grow"] > 0, events
    assert phases.boundaries == events["boundaries"] and phases.decided == decided
    assert phases.calls["decide"] == decided
    assert phases.calls["select"] == phases.calls["check"] == compactions
    assert phases.calls["compact"] == compactions
    assert phases.calls["demand"] == 2 * decided  # the ratios, then Delta_t
    assert phases.calls["queries"] == decided  # None on the torch path, still asked for
    # Exclusive times: the phases add up to the engine's own boundary time plus the timers'
    # overhead (inclusive ones would count the nested phases twice, ``control`` all of them).
    assert stats.boundary_s <= phases.total_s <= 1.1 * stats.boundary_s + 0.005
    assert all(s >= 0 for s in phases.seconds.values())
    assert set(phases.per_decided_ms()) == set(PHASES)
    # Everything restored.
    assert originals() == before
    assert llm.engine.kv.controller.policy is policy
    assert not {"make_room", "prepare_boundaries"} & set(llm.engine.kv.__dict__)
    assert "run" not in llm.engine.kv.deferred.__dict__
    assert (llm.engine.kv.deferred.num_compactions > 0) == deferred


def test_kernel_path_charges_queries_and_attention(model) -> None:
    # On CUDA the kernels run there (no interpreter), and the phases sync the device.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    llm = squeezed(copy.deepcopy(model), boundary_kernels=True, device=device)
    with profile_boundaries(llm, sync=True) as phases:
        llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    assert phases.decided > 0 and phases.sync == (device == "cuda")
    assert phases.calls["attention"] >= phases.decided
    assert phases.seconds["queries"] > 0 and phases.seconds["attention"] > 0
    table = phases.markdown()
    assert all(f"| {p} |" in table for p in PHASES)
    assert phases.as_dict()["ms_per_decided"]["attention"] > 0


class _Broken(CapacityPolicy):
    name = "broken"

    def decide(self, ctx):
        raise RuntimeError("policy bug")


def test_patches_are_undone_when_the_run_fails(model) -> None:
    before = originals()
    llm = tiny_llm(model, _Broken(), kv_pages=18, min_capacity=2)
    kv = llm.engine.kv
    sentinel = kv.make_room
    kv.make_room = sentinel  # an instance-level wrapper that was there first survives
    with pytest.raises(
        PolicyError,
        match=r"policy broken decide\(\) raised RuntimeError: "
        "policy bug",
    ):
        with profile_boundaries(llm) as phases:
            llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    assert phases.decided == 1 and phases.calls["decide"] == 1
    assert originals() == before
    assert kv.make_room is sentinel and kv.controller.policy.name == "broken"


def test_sync_needs_cuda_and_phase_names_are_checked() -> None:
    phases = BoundaryPhases(sync=False)
    with pytest.raises(ValueError, match="unknown boundary phase"):
        phases.timed("bogus", lambda: None)
    timed = phases.timed("select", lambda x: x + 1)
    assert timed(1) == 2 and phases.calls["select"] == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_synced_profile_on_cuda(model) -> None:
    llm = squeezed(tiny_model().to("cuda"), device="cuda")
    with profile_boundaries(llm, sync=True) as phases:
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert phases.sync and phases.decided > 0


def test_with_no_decided_boundary_the_per_decided_times_are_not_made_up() -> None:
    phases = BoundaryPhases()
    phases.boundaries, phases.seconds["control"] = 3, 0.0006  # forced grows only
    assert phases.per_decided_ms() == dict.fromkeys(PHASES)
    assert "| control | 0 | n/a | 100.0% |" in phases.markdown()
    phases.decided = 2
    assert phases.per_decided_ms()["control"] == 0.3
