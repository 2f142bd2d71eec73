"""The serving rules both worlds call (``growpage.core.residency``), on hand-computed cases."""

from __future__ import annotations

import pytest

from growpage.core.capacity import CapacityController
from growpage.core.config import GrowPageConfig
from growpage.core.pages import PagePool
from growpage.core.request import RequestState
from growpage.core.residency import (
    PrefixChain,
    admission_pages,
    admit,
    cached_prefix,
    can_admit,
    decides_late,
    defers_beside_step,
    fits_pool,
    pages_for,
    pick_victim,
)
from growpage.errors import PoolExhaustedError
from growpage.policies import resolve_policy
from growpage.sim.scripted import CountingView


def test_pages_for_rounds_up():
    assert [pages_for(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_fits_pool_counts_the_next_token():
    # 11 tokens + the next one take 3 pages of 4; 12 + 1 take 4.
    assert fits_pool(11, 4, 3)
    assert not fits_pool(12, 4, 3)
    assert fits_pool(12, 4, 4)


def test_the_victim_is_the_latest_admitted_whose_recompute_fits():
    # Tokens each running request would recompute, in admission order; a pool of 3 pages of 4
    # holds a recompute of at most 11 tokens.
    running = ["a", "b", "c", "d"]
    tokens = {"a": 5, "b": 9, "c": 30, "d": 12}
    fits = {r: fits_pool(tokens[r], 4, 3) for r in running}
    assert fits == {"a": True, "b": True, "c": False, "d": False}
    assert pick_victim(running, fits.__getitem__) == "b"  # d and c are skipped
    assert pick_victim(["c", "d"], fits.__getitem__) is None  # none fits: the caller waits
    assert pick_victim([], fits.__getitem__) is None
    assert pick_victim(running, lambda r: True) == "d"  # all fit: the latest admitted


def pool_with_cached_prefix() -> tuple[PagePool, list[int]]:
    """8 pages of 4 tokens, watermark 1; tokens 0..7 cached on two freed pages."""
    pool = PagePool(8, 4, watermark=1)
    pages = pool.allocate(2)
    assert pool.register_prefix(pages, list(range(8))) == 2
    pool.free(reversed(pages))
    return pool, pages


def test_deferred_work_runs_beside_a_step_only_when_another_request_decodes_in_it():
    # (requests with deferred work, the others decoding) -> whether the work is deferred.
    cases = {(0, 0): False, (0, 3): False, (2, 0): False, (1, 1): True, (3, 5): True}
    assert {c: defers_beside_step(*c) for c in cases} == cases


def test_a_prefill_takes_its_cached_leading_pages_but_never_its_last_token():
    pool, pages = pool_with_cached_prefix()
    assert cached_prefix(pool, list(range(10)), 10, 4) == pages  # 8 cached, 2 to compute
    assert cached_prefix(pool, list(range(8)), 8, 4) == pages[:1]  # the 8th is computed
    assert cached_prefix(pool, list(range(3)), 3, 4) == []  # no full page
    assert cached_prefix(pool, [9] + list(range(1, 10)), 10, 4) == []  # another first page


def test_admission_counts_new_and_revived_pages_and_keeps_the_watermark_while_others_run():
    pool, cached = pool_with_cached_prefix()
    # 10 tokens take 3 pages: 1 new, and the 2 cached ones leave the free list.
    assert admission_pages(pool, cached, 10, 4) == 3
    assert can_admit(pool, cached, 10, 4, num_running=0, reserve=7)  # alone: every page
    assert can_admit(pool, cached, 10, 4, num_running=1, reserve=4)  # 3 + 4 <= 8 - 1
    assert not can_admit(pool, cached, 10, 4, num_running=1, reserve=5)
    table = admit(pool, cached, 10, 4)
    assert table[:2] == cached and len(table) == 3
    assert [pool.refcounts[p] for p in table] == [1, 1, 1] and pool.num_free_pages == 5
    # A second request of the same prompt shares the held pages: only 1 new page.
    assert admission_pages(pool, cached, 10, 4) == 1


def test_a_failed_admission_holds_nothing():
    pool, cached = pool_with_cached_prefix()
    others = pool.allocate(5)  # 1 free page left
    assert not can_admit(pool, cached, 16, 4, num_running=1)
    with pytest.raises(PoolExhaustedError):
        admit(pool, cached, 16, 4)  # 2 cached + 2 new, 1 free
    assert [pool.refcounts[p] for p in cached] == [0, 0] and pool.num_free_pages == 3
    assert cached_prefix(pool, list(range(10)), 10, 4) == cached  # still cached
    pool.free(others)


def at_boundary(pool: PagePool, num_pages: int) -> RequestState:
    """A request holding ``num_pages`` full pages of 4 tokens (at a capacity boundary)."""
    return RequestState("r", pool.allocate(num_pages), num_tokens=4 * num_pages)


@pytest.mark.parametrize(
    "policy, num_pages, decoded, shared, late",
    [
        ("growpage", 3, True, False, True),  # the policy decides; nothing needs a preemption
        ("growpage", 1, True, False, False),  # below min_capacity = 2: a forced growth
        ("growpage", 3, False, False, False),  # no query summary yet: a forced growth
        ("growpage", 3, True, True, False),  # a compression would copy its shared page
        ("fullkv", 3, True, False, False),  # a refused growth preempts
    ],
)
def test_a_boundary_is_decided_late_only_when_no_outcome_can_preempt(
    policy, num_pages, decoded, shared, late
):
    pool = PagePool(8, 4)
    controller = CapacityController(
        resolve_policy(policy), pool, GrowPageConfig(page_size=4, recent_window=1)
    )
    state = at_boundary(pool, num_pages)
    if shared:
        pool.fork(state.block_table[:1])
    view = CountingView(state.num_tokens)
    view.decoded = decoded
    assert decides_late(controller, state, view) is late
    state.num_tokens -= 1  # a free slot: no boundary at all
    assert not decides_late(controller, state, view)


def test_a_prefix_chain_enters_full_pages_and_chains_to_an_equal_page_cached_first():
    pool = PagePool(8, 4)
    a, b = PrefixChain(), PrefixChain()
    table_a, table_b = pool.allocate(3), pool.allocate(3)
    ids_a = list(range(12))
    ids_b = list(range(4)) + [100 + i for i in range(8)]  # the same first page, then its own
    a.register(pool, table_a, ids_a, 2)
    assert (a.num_registered_pages, a.last_cached_page) == (2, table_a[1])
    a.register(pool, table_a, ids_a, 2)  # nothing new
    assert a.num_registered_pages == 2
    # b's first page equals a's, cached first: b's second page chains to a's first.
    b.register(pool, table_b, ids_b, 1)
    assert b.last_cached_page == table_a[0] and not pool.is_cached(table_b[0])
    b.register(pool, table_b, ids_b, 3)
    assert b.num_registered_pages == 3 and b.last_cached_page == table_b[2]
    assert pool.match_prefix(ids_b) == [table_a[0], table_b[1], table_b[2]]
    assert pool.match_prefix(ids_a) == table_a[:2]  # its third page was never entered
