"""The prompt and the floor (GrowPageConfig.protect_prompt, floor_tokens): what the controller
forces, what every built-in selection keeps, and what it refuses from a policy."""

import attrs
import pytest
import torch

from growpage import (
    Action,
    CapacityController,
    CapacityPolicy,
    Decision,
    GrowPageConfig,
    PagePool,
    PolicyError,
    RequestState,
)
from growpage.core.capacity import forced_growth_pages, min_kept_tokens
from growpage.policies import resolve_policy
from growpage.testing import BoundaryCase

B, R = 8, 3


@attrs.define
class Scripted(CapacityPolicy):
    """Answers ``decision`` every time and records the contexts it saw."""

    name = "scripted"
    decision: Decision = Decision.COMPRESS
    seen: list = attrs.field(factory=list)

    def decide(self, ctx):
        self.seen.append(ctx)
        return self.decision


def setup(policy, pages, prompt, track=False, **config):
    case = BoundaryCase(
        num_layers=2,
        num_kv_heads=2,
        group_size=2,
        head_dim=8,
        page_size=B,
        recent_window=R,
        num_pages=pages,
        num_free_pages=0,
        gap=0,
        seed=5,
        sharpness=2.0,
        track_accumulated=track,
    )
    pool = PagePool(32, B)
    ctrl = CapacityController(policy, pool, GrowPageConfig(page_size=B, recent_window=R, **config))
    state = RequestState(
        "r0",
        pool.allocate(pages),
        num_tokens=pages * B,
        position=pages * B,
        num_prompt_tokens=prompt,
    )
    return ctrl, state, case.view()


def test_min_kept_and_forced_pages_follow_the_settings():
    paper = GrowPageConfig(page_size=B, recent_window=R)
    assert min_kept_tokens(paper, 20) == 0 and forced_growth_pages(paper, 20) == 2
    protect = paper.replace(protect_prompt=True)
    assert min_kept_tokens(protect, 20) == 23  # the prompt and the recent window
    assert forced_growth_pages(protect, 20) == 4  # a compression from 4 pages keeps 24 >= 23
    floor = paper.replace(floor_tokens=12)
    assert min_kept_tokens(floor, 20) == 32 and forced_growth_pages(floor, 20) == 5
    both = paper.replace(floor_tokens=1, protect_prompt=True)
    assert min_kept_tokens(both, 20) == 23  # the window is the larger of the two


@pytest.mark.parametrize("pages, asked", [(3, False), (4, True)])
def test_a_protected_prompt_grows_freely_until_a_compression_can_keep_it(pages, asked):
    policy = Scripted()
    ctrl, state, view = setup(policy, pages, prompt=20, protect_prompt=True)
    out = ctrl.on_boundary(state, view)
    assert bool(policy.seen) == asked
    assert out.action is (Action.COMPRESS if asked else Action.GROW)
    assert ctrl.events.forced_grow == (0 if asked else 1)


def test_the_floor_grows_freely_then_asks_the_policy():
    policy = Scripted()
    for pages in (2, 3, 4):  # a compression would keep 8, 16, 24 < 20 + 12
        ctrl, state, view = setup(policy, pages, prompt=20, floor_tokens=12)
        assert ctrl.grows_freely(state) and not ctrl.will_decide(state, view)
        assert ctrl.on_boundary(state, view).action is Action.GROW
    assert not policy.seen
    ctrl, state, view = setup(policy, 5, prompt=20, floor_tokens=12)
    assert ctrl.on_boundary(state, view).action is Action.COMPRESS and len(policy.seen) == 1


def test_the_defaults_are_the_papers_the_prompt_is_evictable():
    policy = resolve_policy("fixed", budget_tokens=8)
    ctrl, state, view = setup(policy, 3, prompt=20)
    out = ctrl.on_boundary(state, view)
    assert out.action is Action.COMPRESS
    assert ((view.positions() < 20).sum(-1) < 20).all()  # 16 slots kept: prompt ones lost


def test_a_shrink_that_would_cut_into_the_floor_compresses_instead():
    policy = Scripted(Decision.SHRINK)
    ctrl, state, view = setup(policy, 5, prompt=20, floor_tokens=12)  # shrink keeps 24 < 32
    out = ctrl.on_boundary(state, view)
    assert out.action is Action.COMPRESS and ctrl.events.shrink_refused == 1
    ctrl, state, view = setup(policy, 6, prompt=20, floor_tokens=12)  # shrink keeps 32
    assert ctrl.on_boundary(state, view).action is Action.SHRINK


@pytest.mark.parametrize(
    "name, kwargs",
    [
        ("growpage", {}),
        ("fixed", {"budget_tokens": 8}),
        ("streamingllm", {"budget_tokens": 8}),
        ("h2o", {"budget_tokens": 8}),
        ("snapkv", {"budget_tokens": 8, "window": 4, "kernel_size": 3}),
        ("random", {"grow_prob": 0.0}),
    ],
)
@pytest.mark.parametrize("prompt", [1, 13, 21])
def test_every_builtin_selection_keeps_the_protected_prompt(name, kwargs, prompt):
    policy = resolve_policy(name, **kwargs)
    if name == "growpage":
        policy = attrs.evolve(policy, tau=1.0)  # always compresses
    ctrl, state, view = setup(policy, 4, prompt=prompt, track=name == "h2o", protect_prompt=True)
    before = view.positions().clone()
    out = ctrl.on_boundary(state, view)
    assert out.action is Action.COMPRESS
    after = view.positions()
    assert after.shape[-1] == 3 * B
    assert torch.equal(after[..., :prompt], before[..., :prompt])  # the prompt, in place
    assert torch.equal(after[..., -R:], before[..., -R:])  # and the recent window


def test_growpage_keeps_the_prompt_only_when_it_is_protected():
    policy = attrs.evolve(resolve_policy("growpage"), tau=1.0)
    ctrl, state, view = setup(policy, 4, prompt=13, protect_prompt=True)
    ctx = ctrl.context(state, view)
    protected = policy.select(ctx, 3 * B)
    free = CapacityController(policy, ctrl.pool, ctrl.config.replace(protect_prompt=False))
    plain = policy.select(free.context(state, view), 3 * B)
    assert (protected[..., :13] == torch.arange(13)).all()
    assert not (plain[..., :13] == torch.arange(13)).all()  # unprotected, some were dropped


class IgnoresPrompt(Scripted):
    def select(self, ctx, keep):
        slots = torch.arange(ctx.num_tokens - keep, ctx.num_tokens)
        return slots.expand(*ctx.shape, keep).clone()


def test_a_selection_that_drops_the_protected_prompt_is_refused_and_changes_nothing():
    policy = IgnoresPrompt()
    ctrl, state, view = setup(policy, 4, prompt=5, protect_prompt=True)
    before, table = view.positions().clone(), list(state.block_table)
    with pytest.raises(PolicyError, match=r"protected prompt \(first 5 slots.*slot 0 missing"):
        ctrl.on_boundary(state, view)
    assert torch.equal(view.positions(), before) and state.block_table == table
    assert state.num_tokens == 4 * B


def test_the_context_tells_the_policy_the_prompt():
    policy = Scripted()
    ctrl, state, view = setup(policy, 4, prompt=13)
    ctrl.on_boundary(state, view)
    ctx = policy.seen[0]
    assert (ctx.num_prompt_tokens, ctx.num_protected_prefix) == (13, 0)
    ctrl, state, view = setup(Scripted(), 4, prompt=13, protect_prompt=True)
    assert ctrl.context(state, view).num_protected_prefix == 13


@pytest.mark.parametrize("name", ["growpage", "fixed", "streamingllm", "h2o", "snapkv", "random"])
def test_the_builtins_conform_with_a_protected_prompt(name):
    from growpage.testing import check_policy

    check_policy(resolve_policy(name), max_examples=15, protected_prompt=True)


def test_the_kit_catches_a_selection_that_drops_the_protected_prompt():
    from growpage.testing import PolicyConformanceError, check_policy

    check_policy(IgnoresPrompt(), max_examples=15)  # fine where nothing is protected
    with pytest.raises(PolicyConformanceError, match="protected prompt") as info:
        check_policy(IgnoresPrompt(), max_examples=15, protected_prompt=True)
    assert info.value.rule == "exact-selection"
