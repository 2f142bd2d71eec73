"""The serving rules both worlds call (``growpage.core.residency``), on hand-computed cases."""

from __future__ import annotations

from growpage.core.residency import fits_pool, pages_for, pick_victim


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
