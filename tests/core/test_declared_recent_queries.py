"""A policy gets the recent queries it declares (``needs_recent_queries``), whatever its view
keeps: the simulator's trace views hold every query and the engine keeps only the declared
ring, so the controller's context, not the view, says what the policy reads."""

import pytest
import torch

from growpage import (
    CapacityController,
    CapacityPolicy,
    Decision,
    GrowPageConfig,
    PagePool,
    PolicyError,
    RequestState,
)
from growpage.testing import BoundaryCase

B, R = 8, 3
CASE = BoundaryCase(
    num_layers=2,
    num_kv_heads=2,
    group_size=2,
    head_dim=8,
    page_size=B,
    recent_window=R,
    num_pages=4,
    num_free_pages=0,
    gap=5,
    seed=3,
    sharpness=1.0,
    track_accumulated=False,
    keeps_recent_queries=True,  # the view holds every query, as the simulator's do
)


class ReadsQueries(CapacityPolicy):
    """Reads its last ``window`` queries; declares ``declared`` of them."""

    def __init__(self, window: int, declared: int, method: str = "recent_queries") -> None:
        self.window, self.declared, self.method = window, declared, method
        self.seen: list[object] = []

    @property
    def needs_recent_queries(self) -> int:
        return self.declared

    def decide(self, ctx):
        got = getattr(ctx, self.method)(self.window)
        self.seen.append(got)
        if got is None:
            raise TypeError("'NoneType' object is not subscriptable")
        return Decision.COMPRESS


def boundary(policy):
    config = GrowPageConfig(page_size=B, recent_window=R, min_capacity=2)
    pool = PagePool(10, B)
    ctrl = CapacityController(policy, pool, config)
    pages = CASE.num_pages
    state = RequestState("r0", pool.allocate(pages), num_tokens=pages * B, position=CASE.position)
    return ctrl, state, pool


@pytest.mark.parametrize("method", ["recent_queries", "window_attention"])
def test_a_policy_that_declares_none_gets_none_though_the_view_keeps_them(method):
    policy = ReadsQueries(4, declared=0, method=method)
    ctrl, state, pool = boundary(policy)
    free = pool.num_free_pages
    with pytest.raises(PolicyError, match="sets needs_recent_queries to its window"):
        ctrl.on_boundary(state, CASE.view())
    assert policy.seen == [None] and pool.num_free_pages == free


@pytest.mark.parametrize("method", ["recent_queries", "window_attention"])
def test_a_window_past_the_declared_one_is_refused_naming_the_declaration(method):
    policy = ReadsQueries(8, declared=4, method=method)
    ctrl, state, _ = boundary(policy)
    says = (
        rf"policy ReadsQueries decide\(\) raised ConfigError: BoundaryContext.{method}\(8\): "
        "the policy's needs_recent_queries is 4"
    )
    with pytest.raises(PolicyError, match=says) as failed:
        ctrl.on_boundary(state, CASE.view())
    assert failed.value.request_id == "r0" and policy.seen == []


def test_a_declared_window_reads_what_the_view_keeps():
    policy = ReadsQueries(4, declared=4)
    ctrl, state, _ = boundary(policy)
    ctrl.on_boundary(state, CASE.view())
    queries, positions = policy.seen[0]
    expected = CASE.context().recent_queries(4)  # the kit's context: the view decides
    assert torch.equal(positions, expected[1]) and torch.equal(queries, expected[0])
    assert positions.tolist() == list(range(CASE.position - 4, CASE.position))
