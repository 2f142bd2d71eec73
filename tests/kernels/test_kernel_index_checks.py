"""The wrappers check the values of their index tensors before any launch.

Every index argument of every public wrapper: a value the kernel would read or write out of
bounds (or, for ``keep``, one that breaks its contract) is refused with an error that names the
argument, the index and the value, and nothing is written. So is an index that two programs
would write through (a repeated store slot, query-state slot, accumulated page or compaction
destination page): the error names the argument, both entries and the value. Valid edge values
(-1 padding, repeated too, the last page, slot or position, empty contexts, garbage where the
kernel never reads, a page shared where nothing writes it twice) still pass and still match the
reference. On CUDA the module turns the checks on (``set_index_checks``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable

import pytest
import torch
from kernel_helpers import DEVICE, ON_CUDA, gen, randn

from growpage.kernels import _utils as kernel_utils
from growpage.kernels import (
    accumulate_attention,
    boundary_queries_batch,
    compact_kv,
    demand_attention,
    demand_attention_batch,
    paged_decode_attention,
    reference,
    set_index_checks,
    store_kv,
    update_query_state,
)

D = 16
PAGE = 4
NUM_PAGES = 5
SLOTS = 3  # query-state pool size M
ATOL, RTOL = 2e-5, 1e-5


@pytest.fixture(autouse=True)
def checks_on():
    previous = set_index_checks(True)  # needed on CUDA only: the interpreter always checks
    yield
    set_index_checks(previous)


def ints(rows: list, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    return torch.tensor(rows, dtype=dtype, device=DEVICE)


def with_value(t: torch.Tensor, index: tuple[int, ...], value: int) -> torch.Tensor:
    t = t.clone()
    t[index] = value
    return t


def refused(
    call: Callable[[], object],
    match: str,
    *tensors: torch.Tensor,
    exc: type[Exception] = AssertionError,
) -> None:
    """``call`` raises ``exc`` matching ``match`` and leaves ``tensors`` bitwise unchanged."""
    before = [t.clone() for t in tensors]
    with pytest.raises(exc, match=match):
        call()
    for old, new in zip(before, tensors, strict=True):
        assert torch.equal(old, new), "a tensor changed before the error"


# --- paged_decode_attention -------------------------------------------------------------------


def decode_case():
    g = gen(20)
    q = randn(2, 2, D, g=g)
    k_cache, v_cache = randn(NUM_PAGES, PAGE, 1, D, g=g), randn(NUM_PAGES, PAGE, 1, D, g=g)
    state = randn(SLOTS, 2, 2, D, g=g)
    out = torch.full_like(q, 7.0)
    args = dict(
        block_tables=ints([[3, 0, -1], [1, 4, 2]]),
        context_lens=ints([5, 9]),
        slot_ids=ints([0, 2]),
        is_first=ints([1, 0]),
    )
    return q, k_cache, v_cache, state, out, args


DECODE_BAD = [
    pytest.param(
        "block_tables",
        (0, 1),
        NUM_PAGES,
        r"block_tables\[0, 1\] = 5 \(within context_lens\[0\] = 5\): expected -1 "
        r"\(no page\) or a page id in \[0, 5\)",
        id="page-past-pool",
    ),
    pytest.param(
        "block_tables",
        (1, 2),
        -2,
        r"block_tables\[1, 2\] = -2 \(within "
        r"context_lens\[1\] = 9\)",
        id="page-below-minus-1",
    ),
    pytest.param(
        "context_lens",
        (1,),
        -1,
        r"context_lens\[1\] = -1: expected a context length in \[0, 12\] "
        r"\(block_tables rows hold 3 pages of 4 tokens\)",
        id="negative-length",
    ),
    pytest.param(
        "context_lens",
        (1,),
        3 * PAGE + 1,
        r"context_lens\[1\] = 13: expected a context length in \[0, 12\]",
        id="longer-than-table",
    ),
    pytest.param(
        "slot_ids",
        (1,),
        SLOTS,
        r"slot_ids\[1\] = 3: expected -1 \(row skipped\) or "
        r"a query-state slot in \[0, 3\)",
        id="slot-past-pool",
    ),
    pytest.param("slot_ids", (0,), -2, r"slot_ids\[0\] = -2", id="slot-below-minus-1"),
    pytest.param(
        "slot_ids",
        (0,),
        2,
        r"slot_ids\[0\] = slot_ids\[1\] = 2: expected each "
        r"query-state slot updated by one row at most \(only -1, row skipped, may "
        r"repeat\)",
        id="repeated-slot",
    ),
]


@pytest.mark.parametrize(("name", "index", "value", "match"), DECODE_BAD)
@pytest.mark.parametrize("splits", [1, 2])
def test_decode_refuses_a_bad_index(
    name: str, index: tuple, value: int, match: str, splits: int
) -> None:
    q, k_cache, v_cache, state, out, args = decode_case()
    args[name] = with_value(args[name], index, value)
    refused(
        lambda: paged_decode_attention(
            q,
            k_cache,
            v_cache,
            args["block_tables"],
            args["context_lens"],
            out=out,
            q_pre=q,
            query_state=state,
            slot_ids=args["slot_ids"],
            is_first=args["is_first"],
            num_splits=splits,
        ),
        match,
        out,
        state,
        k_cache,
        v_cache,
    )


def test_decode_refuses_a_bad_index_without_the_ema() -> None:
    q, k_cache, v_cache, _, out, args = decode_case()
    tables = with_value(args["block_tables"], (1, 1), NUM_PAGES)
    refused(
        lambda: paged_decode_attention(q, k_cache, v_cache, tables, args["context_lens"], out=out),
        r"block_tables\[1, 1\] = 5",
        out,
    )


def test_decode_refuses_a_page_id_an_int32_cast_would_hide() -> None:
    """2**32 + 1 in an int64 table: the kernel offsets with the int64 value."""
    q, k_cache, v_cache, _, out, args = decode_case()
    tables = with_value(args["block_tables"].long(), (0, 0), 2**32 + 1)
    refused(
        lambda: paged_decode_attention(q, k_cache, v_cache, tables, args["context_lens"], out=out),
        r"block_tables\[0, 0\] = 4294967297",
        out,
    )


def test_decode_accepts_the_edges_it_handles() -> None:
    """The last page id; -1 inside a context (skipped); garbage past a context and in an empty
    row (never read); a context that fills its whole table; EMA slots -1 and M - 1."""
    g = gen(21)
    q = randn(3, 2, D, g=g)
    k_cache, v_cache = randn(NUM_PAGES, PAGE, 1, D, g=g), randn(NUM_PAGES, PAGE, 1, D, g=g)
    state = randn(SLOTS, 2, 2, D, g=g)
    tables = ints([[4, -1, 0, 99], [99, -7, 5, 1000], [1, 2, 3, 0]])
    lens = ints([11, 0, 16])
    slot_ids, is_first = ints([2, -1, 0]), ints([0, 1, 1])
    expected_state = state.clone()
    reference.update_query_state(q, expected_state, slot_ids, is_first)
    out = paged_decode_attention(
        q,
        k_cache,
        v_cache,
        tables,
        lens,
        q_pre=q,
        query_state=state,
        slot_ids=slot_ids,
        is_first=is_first,
        num_splits=2,
    )
    # attention ignores slot order: row 0 is the reference over page 4 and 3 tokens of page 0
    row0 = reference.paged_decode_attention(q[:1], k_cache, v_cache, ints([[4, 0]]), ints([7]))
    row2 = reference.paged_decode_attention(q[2:], k_cache, v_cache, tables[2:], ints([16]))
    torch.testing.assert_close(out[:1], row0, atol=ATOL, rtol=RTOL)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    torch.testing.assert_close(out[2:], row2, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(state, expected_state, atol=ATOL, rtol=RTOL)


# --- store_kv and update_query_state ----------------------------------------------------------


@pytest.mark.parametrize(
    ("slots", "match"),
    [
        pytest.param(
            [0, 6, 1],
            r"slot_mapping\[1\] = 6: expected -1 \(token skipped\) or a cache "
            r"slot in \[0, 6\) \(3 pages x page size 2\)",
            id="past-pool",
        ),
        pytest.param([-2, 0, 1], r"slot_mapping\[0\] = -2", id="below-minus-1"),
        pytest.param([0, 1, 2**33], r"slot_mapping\[2\] = 8589934592", id="int64-past-int32"),
        pytest.param(
            [4, -1, 4],
            r"slot_mapping\[0\] = slot_mapping\[2\] = 4: expected each cache "
            r"slot written by one token at most \(only -1, token skipped, may repeat\)",
            id="repeated-slot",
        ),
    ],
)
def test_store_kv_refuses_a_bad_slot(slots: list[int], match: str) -> None:
    g = gen(22)
    key, value = randn(3, 1, D, g=g), randn(3, 1, D, g=g)
    k_cache, v_cache = randn(3, 2, 1, D, g=g), randn(3, 2, 1, D, g=g)
    slot_mapping = ints(slots, torch.int64)
    refused(lambda: store_kv(key, value, k_cache, v_cache, slot_mapping), match, k_cache, v_cache)


@pytest.mark.parametrize("slots", [[5, -1, 0], [-1, 3, -1]], ids=["last-slot", "padding-twice"])
def test_store_kv_accepts_padding_and_the_last_slot(slots: list[int]) -> None:
    g = gen(23)
    key, value = randn(3, 1, D, g=g), randn(3, 1, D, g=g)
    k_cache, v_cache = randn(3, 2, 1, D, g=g), randn(3, 2, 1, D, g=g)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    slot_mapping = ints(slots)
    store_kv(key, value, k_cache, v_cache, slot_mapping)
    reference.store_kv(key, value, k_ref, v_ref, slot_mapping)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


@pytest.mark.parametrize(
    ("slots", "match"),
    [
        pytest.param(
            [0, SLOTS],
            r"slot_ids\[1\] = 3: expected -1 \(row skipped\) or a query-state "
            r"slot in \[0, 3\)",
            id="past-pool",
        ),
        pytest.param([-2, 1], r"slot_ids\[0\] = -2", id="below-minus-1"),
        pytest.param(
            [1, 1],
            r"slot_ids\[0\] = slot_ids\[1\] = 1: expected each query-state slot "
            r"updated by one row at most",
            id="repeated-slot",
        ),
    ],
)
def test_update_query_state_refuses_a_bad_slot(slots: list[int], match: str) -> None:
    g = gen(24)
    q_pre, state = randn(2, 2, D, g=g), randn(SLOTS, 2, 2, D, g=g)
    refused(lambda: update_query_state(q_pre, state, ints(slots), ints([1, 0])), match, state)


def test_update_query_state_accepts_padding_and_the_last_slot() -> None:
    g = gen(25)
    q_pre, state = randn(3, 2, D, g=g), randn(SLOTS, 2, 2, D, g=g)
    expected = state.clone()
    slot_ids, is_first = ints([-1, SLOTS - 1, -1]), ints([0, 0, 1])
    update_query_state(q_pre, state, slot_ids, is_first)
    reference.update_query_state(q_pre, expected, slot_ids, is_first)
    torch.testing.assert_close(state, expected, atol=ATOL, rtol=RTOL)


# --- accumulate_attention ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "index", "value", "match"),
    [
        pytest.param(
            "tables",
            (0, 1),
            NUM_PAGES,
            r"block_tables\[0, 1\] = 5 \(within "
            r"context_lens\[0\] = 5\): expected -1 \(no page\) or a page id in \[0, 5\)",
            id="page-past-pool",
        ),
        pytest.param("tables", (1, 0), -3, r"block_tables\[1, 0\] = -3", id="page-below-minus-1"),
        pytest.param(
            "lens",
            (0,),
            -4,
            r"context_lens\[0\] = -4: expected a context length in "
            r"\[0, 12\] \(block_tables rows hold 3 pages of 4 tokens\)",
            id="negative-length",
        ),
        pytest.param(
            "lens",
            (1,),
            100,
            r"context_lens\[1\] = 100: expected a context length in "
            r"\[0, 12\]",
            id="longer-than-table",
        ),
        pytest.param(
            "tables",
            (1, 2),
            3,
            r"block_tables\[0, 0\] = block_tables\[1, 2\] = 3 "
            r"\(within context_lens\[0\] = 5 and context_lens\[1\] = 9\): expected each "
            r"page at most once over all rows' contexts",
            id="page-in-two-rows",
        ),
        pytest.param(
            "tables",
            (1, 1),
            1,
            r"block_tables\[1, 0\] = block_tables\[1, 1\] = 1 "
            r"\(within context_lens\[1\] = 9\): expected each page at most once",
            id="page-twice-in-a-row",
        ),
    ],
)
def test_accumulate_refuses_a_bad_index(name: str, index: tuple, value: int, match: str) -> None:
    g = gen(26)
    q, k_cache = randn(2, 2, D, g=g), randn(NUM_PAGES, PAGE, 1, D, g=g)
    acc = randn(NUM_PAGES * PAGE, 1, g=g)
    args = dict(tables=ints([[3, 0, -1], [1, 4, 2]]), lens=ints([5, 9]))
    args[name] = with_value(args[name], index, value)
    refused(
        lambda: accumulate_attention(q, k_cache, args["tables"], args["lens"], acc),
        match,
        acc,
        k_cache,
    )


def test_accumulate_accepts_the_edges_it_handles() -> None:
    """The last page id, a context that fills its whole table, garbage past a context and in
    an empty row."""
    g = gen(27)
    q, k_cache = randn(3, 2, D, g=g), randn(NUM_PAGES, PAGE, 1, D, g=g)
    acc = randn(NUM_PAGES * PAGE, 1, g=g).abs()
    expected = acc.clone()
    tables = ints([[4, 0], [2, 99], [-7, 1000]])
    accumulate_attention(q, k_cache, tables, ints([2 * PAGE, 3, 0]), acc)
    reference.accumulate_attention(q, k_cache, tables, ints([2 * PAGE, 3, 0]), expected)
    torch.testing.assert_close(acc, expected, atol=ATOL, rtol=RTOL)


def test_unchecked_a_context_longer_than_its_table_is_clamped_not_read_past() -> None:
    """The checks refuse it (until 2026-12 they let it through, clamped, where the torch
    reference raises); without them, on a GPU, the kernels still read no table entry past the
    row: they clamp the context to the table."""
    from growpage.kernels import without_index_checks

    g = gen(33)
    q, k_cache = randn(2, 2, D, g=g), randn(NUM_PAGES, PAGE, 1, D, g=g)
    v_cache = randn(NUM_PAGES, PAGE, 1, D, g=g)
    tables, lens, full = ints([[4, 0], [2, 1]]), ints([100, 3]), ints([2 * PAGE, 3])
    acc = randn(NUM_PAGES * PAGE, 1, g=g).abs()
    expected = acc.clone()
    refused(
        lambda: accumulate_attention(q, k_cache, tables, lens, acc),
        r"context_lens\[0\] = 100: expected a context length in \[0, 8\]",
        acc,
    )
    with without_index_checks():
        out = paged_decode_attention(q, k_cache, v_cache, tables, lens, num_splits=2)
        accumulate_attention(q, k_cache, tables, lens, acc)
    torch.testing.assert_close(
        out,
        reference.paged_decode_attention(q, k_cache, v_cache, tables, full),
        atol=ATOL,
        rtol=RTOL,
    )
    reference.accumulate_attention(q, k_cache, tables, full, expected)
    torch.testing.assert_close(acc, expected, atol=ATOL, rtol=RTOL)


def test_accumulate_accepts_a_page_shared_past_a_context() -> None:
    """Page 1 in row 1's context, past row 0's 5 tokens and in an empty row: only row 1 adds
    into it. -1 repeats past the contexts."""
    g = gen(32)
    q, k_cache = randn(3, 2, D, g=g), randn(NUM_PAGES, PAGE, 1, D, g=g)
    acc = randn(NUM_PAGES * PAGE, 1, g=g).abs()
    expected = acc.clone()
    tables, lens = ints([[3, 0, 1], [1, 4, -1], [-1, -1, 1]]), ints([5, 8, 0])
    accumulate_attention(q, k_cache, tables, lens, acc)
    reference.accumulate_attention(q, k_cache, tables, lens, expected)
    torch.testing.assert_close(acc, expected, atol=ATOL, rtol=RTOL)


# --- compact_kv -------------------------------------------------------------------------------


def compaction_case():
    """``[2, L=2, 6 pages, page 2, Hkv=1, d]``; layer 0 keeps positions 1 and 4."""
    g = gen(28)
    kv_cache = randn(2, 2, 6, 2, 1, D, g=g)
    sums = randn(2, 6 * 2, 1, g=g)
    keep = ints([[[[1, 4, -1, -1]], [[0, 2, 3, -1]]]])  # [R=1, L=2, Hkv=1, K=4]
    return kv_cache, sums, ints([[0, 1, 2]]), keep


COMPACTION_BAD = [
    pytest.param(
        None,
        [0, 2, 6, -1],
        None,
        r"keep\[0, 1, 0, 2\] = 6: expected -1 \(padding\) "
        r"or a position of the source table, in \[0, 6\) \(width 3 x page size 2\)",
        id="position-past-source-table",
    ),
    pytest.param(None, [0, -2, -1, -1], None, r"keep\[0, 1, 0, 1\] = -2", id="below-minus-1"),
    pytest.param(
        None,
        [0, 3, 3, -1],
        None,
        r"keep\[0, 1, 0, 2\] = 3 after keep\[0, 1, 0, 1\] "
        r"= 3: expected each row of keep strictly ascending, then -1 padding at its "
        r"end",
        id="repeated-position",
    ),
    pytest.param(
        None,
        [2, 1, -1, -1],
        None,
        r"keep\[0, 1, 0, 1\] = 1 after keep\[0, 1, 0, 0\] "
        r"= 2",
        id="descending",
    ),
    pytest.param(
        None,
        [0, -1, 2, -1],
        None,
        r"keep\[0, 1, 0, 2\] = 2 after keep\[0, 1, 0, 1\] "
        r"= -1",
        id="padding-in-the-middle",
    ),
    pytest.param(
        None,
        [0, 2, 3, -1],
        [[3]],
        r"keep\[0, 1, 0, 2\] = 3: expected -1: entry j "
        r"goes to position j of dst_block_tables, which holds 2 \(width 1 x page size "
        r"2\)",
        id="entry-past-destination-table",
    ),
    pytest.param(
        [[0, 6, 2]],
        [0, 2, 3, -1],
        None,
        r"block_tables\[0, 1\] = 6 \(the source "
        r"page of keep\[0, 1, 0, 1\] = 2\): expected -1 \(no page\) or a page id in "
        r"\[0, 6\)",
        id="source-page-past-pool",
    ),
    pytest.param(
        None,
        [0, 2, 3, -1],
        [[3, -3, 5]],
        r"dst_block_tables\[0, 1\] = -3 \(the "
        r"destination page of keep\[0, 1, 0, 2\] = 3\)",
        id="destination-page",
    ),
    pytest.param(
        [[0, 1, 9]],
        [0, 2, 5, -1],
        None,
        r"block_tables\[0, 2\] = 9 \(the source "
        r"page of keep\[0, 0, 0, 1\] = 4\)",
        id="in-place-source-page",
    ),
]


@pytest.mark.parametrize("staged", [False, True], ids=["direct", "staged"])
@pytest.mark.parametrize(("src", "layer1", "dst", "match"), COMPACTION_BAD)
def test_compaction_refuses_a_bad_keep_or_page(src, layer1, dst, match, staged: bool) -> None:
    kv_cache, sums, tables, keep = compaction_case()
    if src is not None:
        tables = ints(src)
    keep[0, 1, 0] = ints(layer1)
    dst_tables = None if dst is None else ints(dst)
    refused(
        lambda: compact_kv(kv_cache, tables, keep, dst_tables, accumulated=sums, staged=staged),
        match,
        kv_cache,
        sums,
    )


@pytest.mark.parametrize("staged", [False, True], ids=["direct", "staged"])
@pytest.mark.parametrize("in_place", [False, True], ids=["to-new-pages", "in-place"])
def test_compaction_accepts_the_edges_it_handles(in_place: bool, staged: bool) -> None:
    """The last page id, end padding, and garbage in table columns no kept position or entry
    reads (a source column past the kept positions, destination columns past the entries)."""
    kv_cache, sums, _, keep = compaction_case()
    keep[0, 1, 0] = ints([0, 2, 3, 5])
    tables = ints([[0, 1, 5, 99]])  # column 3 (positions 6, 7) is not kept
    dst_tables = None if in_place else ints([[4, 3, -9, 77]])  # at most 4 entries: columns 0, 1
    expected, expected_sums = kv_cache.clone(), sums.clone()
    reference.compact_kv(expected, tables, keep, dst_tables, accumulated=expected_sums)
    compact_kv(kv_cache, tables, keep, dst_tables, accumulated=sums, staged=staged)
    assert torch.equal(kv_cache, expected) and torch.equal(sums, expected_sums)


def two_request_compaction():
    """``[2, L=2, 9 pages, page 2, Hkv=1, d]``, sources on pages 0-5. Destination columns
    written: request 0 columns 0-1 in layer 0, column 0 in layer 1; request 1 column 0 in layer
    0, columns 0-1 in layer 1."""
    g = gen(33)
    kv_cache = randn(2, 2, 9, 2, 1, D, g=g)
    sums = randn(2, 9 * 2, 1, g=g)
    keep = ints(
        [[[[0, 2, 3, -1]], [[1, -1, -1, -1]]], [[[1, 4, -1, -1]], [[0, 1, 2, 5]]]]
    )  # [R=2, L=2, Hkv=1, K=4]
    return kv_cache, sums, ints([[0, 1, 2], [3, 4, 5]]), keep


@pytest.mark.parametrize("staged", [False, True], ids=["direct", "staged"])
@pytest.mark.parametrize(
    ("src", "dst", "match"),
    [
        pytest.param(
            None,
            [[6, 7], [7, 8]],
            r"dst_block_tables\[0, 1\] = dst_block_tables\[1, 0\] "
            r"= 7 \(the destination page of keep\[0, 0, 0, 2\] and keep\[1, 0, 0, 0\]\): "
            r"expected each destination page at most once where the kept entries of one "
            r"layer and KV head go \(-1 may repeat\)",
            id="two-requests-layer-0",
        ),
        pytest.param(
            None,
            [[6, 7], [8, 6]],
            r"dst_block_tables\[0, 0\] = dst_block_tables\[1, 1\] "
            r"= 6 \(the destination page of keep\[0, 1, 0, 0\] and keep\[1, 1, 0, 2\]\)",
            id="two-requests-layer-1",
        ),
        pytest.param(
            None,
            [[6, 6], [8, -1]],
            r"dst_block_tables\[0, 0\] = dst_block_tables\[0, 1\] "
            r"= 6 \(the destination page of keep\[0, 0, 0, 0\] and keep\[0, 0, 0, 2\]\)",
            id="one-request",
        ),
        pytest.param(
            [[0, 1, 2], [1, 4, 5]],
            None,
            r"block_tables\[0, 1\] = block_tables\[1, 0\] = 1 "
            r"\(the destination page of keep\[0, 0, 0, 2\] and keep\[1, 0, 0, 0\]\)",
            id="in-place",
        ),
    ],
)
def test_compaction_refuses_a_destination_written_twice(src, dst, match, staged: bool) -> None:
    kv_cache, sums, tables, keep = two_request_compaction()
    if src is not None:
        tables = ints(src)
    dst_tables = None if dst is None else ints(dst)
    refused(
        lambda: compact_kv(kv_cache, tables, keep, dst_tables, accumulated=sums, staged=staged),
        match,
        kv_cache,
        sums,
    )


@pytest.mark.parametrize("staged", [False, True], ids=["direct", "staged"])
def test_compaction_accepts_a_destination_page_shared_across_layers(staged: bool) -> None:
    """Page 7 is request 0's column 1 (written in layer 0 only) and request 1's (layer 1 only);
    page 6 also sits in a column past request 1's entries, and -1 repeats there."""
    kv_cache, sums, tables, keep = two_request_compaction()
    dst_tables = ints([[6, 7, -1, 6], [8, 7, -1, -1]])
    expected, expected_sums = kv_cache.clone(), sums.clone()
    reference.compact_kv(expected, tables, keep, dst_tables, accumulated=expected_sums)
    compact_kv(kv_cache, tables, keep, dst_tables, accumulated=sums, staged=staged)
    assert torch.equal(kv_cache, expected) and torch.equal(sums, expected_sums)


# --- demand_attention(_batch) -----------------------------------------------------------------


def demand_case(rows: list[list[int]]):
    g = gen(29)
    queries = randn(len(rows), 2, 1, 2, D, g=g)  # [R, V, L=1, Hq=2, d]
    k_cache = randn(1, NUM_PAGES, PAGE, 1, D, g=g)  # [L, pages, page, Hkv=1, d]
    return queries, k_cache, ints(rows)


# rows: pages in columns 0..2, then Nc (column 3) and the split count (column 4)
DEMAND_ROWS = [[4, 0, -1, 6, 1], [1, 2, 3, 10, 2]]


@pytest.mark.parametrize(
    ("index", "value", "match"),
    [
        pytest.param(
            (1, 3),
            11,
            r"tables\[1, 3\] = 11: expected a candidate count in \[0, 10\] "
            r"\(max_candidates 10; meta_col 3 x page size 4\)",
            id="count-past-max",
        ),
        pytest.param((0, 3), -1, r"tables\[0, 3\] = -1: expected a candidate count", id="count<0"),
        pytest.param(
            (0, 4),
            0,
            r"tables\[0, 4\] = 0: expected a split count in \[1, 2\] "
            r"\(max_splits\)",
            id="no-split",
        ),
        pytest.param(
            (1, 4),
            3,
            r"tables\[1, 4\] = 3: expected a split count in \[1, 2\]",
            id="splits-past-max",
        ),
        pytest.param(
            (0, 1),
            NUM_PAGES,
            r"tables\[0, 1\] = 5 \(a page of row 0's 6 candidates\): "
            r"expected -1 \(no page\) or a page id in \[0, 5\)",
            id="page-past-pool",
        ),
        pytest.param(
            (1, 2),
            -2,
            r"tables\[1, 2\] = -2 \(a page of row 1's 10 candidates\)",
            id="page-below-minus-1",
        ),
    ],
)
def test_demand_batch_refuses_a_bad_table(index: tuple, value: int, match: str) -> None:
    queries, k_cache, tables = demand_case(DEMAND_ROWS)
    tables = with_value(tables, index, value)
    refused(lambda: demand_attention_batch(queries, k_cache, tables, 3, 10, 2), match, k_cache)


def test_demand_batch_count_is_bounded_by_the_page_columns() -> None:
    """Nc past meta_col * page_size would read the counts as page ids."""
    queries, k_cache, tables = demand_case(DEMAND_ROWS)
    tables = with_value(tables, (1, 3), 13)
    refused(
        lambda: demand_attention_batch(queries, k_cache, tables, 3, 12, 2),
        r"tables\[1, 3\] = 13: expected a candidate count in \[0, 12\]",
        k_cache,
    )


def test_demand_refuses_a_bad_page_of_its_block_table() -> None:
    queries, k_cache, _ = demand_case(DEMAND_ROWS)
    refused(
        lambda: demand_attention(queries[0], k_cache, ints([4, 5, -1]), 6),
        r"block_table\[1\] = 5: expected -1 \(no page\) or a page id in \[0, 5\)",
        k_cache,
    )


def test_demand_accepts_the_edges_it_handles() -> None:
    """The last page id, garbage past a row's candidates and in a row with none (zeros)."""
    rows = [[4, 99, 77, 4, 1], [1, 2, 3, 10, 2], [-3, 1000, 5, 0, 1]]
    queries, k_cache, tables = demand_case(rows)
    out = demand_attention_batch(queries, k_cache, tables, 3, 10, 2)
    for r, (row, width) in enumerate(zip(rows, (4, 10), strict=False)):
        expected = reference.demand_attention(queries[r], k_cache, tables[r, :3], row[3])
        torch.testing.assert_close(out[r, ..., :width], expected, atol=1e-6, rtol=1e-4)
        assert torch.equal(out[r, ..., width:], torch.zeros_like(out[r, ..., width:]))
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    single = demand_attention(queries[0], k_cache, ints([4, 99]), 4)
    torch.testing.assert_close(single, out[0, ..., :4], atol=1e-6, rtol=1e-4)


# --- boundary_queries_batch -------------------------------------------------------------------


def boundary_case():
    g = gen(30)
    summaries, current = randn(1, SLOTS, 2, 2, D, g=g), randn(1, SLOTS, 2, D, g=g)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(D // 2, device=DEVICE) / (D // 2)))
    return summaries, current, inv_freq


@pytest.mark.parametrize(
    ("index", "value", "match"),
    [
        pytest.param(
            (1, 1),
            SLOTS,
            r"meta\[1, 1\] = 3: expected a query-state slot in \[0, 3\)",
            id="slot-past-pool",
        ),
        pytest.param((0, 1), -1, r"meta\[0, 1\] = -1: expected a query-state slot", id="slot<0"),
        pytest.param((0, 2), -1, r"meta\[0, 2\] = -1: expected a position >= 0", id="position<0"),
    ],
)
def test_boundary_queries_batch_refuses_a_bad_meta(index: tuple, value: int, match: str) -> None:
    summaries, current, inv_freq = boundary_case()
    meta = with_value(ints([[-99, 2, 5], [-99, 0, 7]]), index, value)  # column 0 is not read
    refused(
        lambda: boundary_queries_batch(summaries, current, meta, 1, inv_freq),
        match,
        summaries,
        current,
        exc=ValueError,
    )


def test_boundary_queries_batch_accepts_the_last_slot_and_position_0() -> None:
    summaries, current, inv_freq = boundary_case()
    out = boundary_queries_batch(
        summaries, current, ints([[-99, SLOTS - 1, 0], [-99, 0, 7]]), 1, inv_freq
    )
    for r, (slot, position) in enumerate([(SLOTS - 1, 0), (0, 7)]):
        expected = reference.boundary_queries(summaries, current, slot, position, inv_freq)
        torch.testing.assert_close(out[r], expected, atol=ATOL, rtol=RTOL)


# --- the repeat search -------------------------------------------------------------------------


@pytest.mark.parametrize("scan_on_host", [True, False], ids=["host-scan", "sort"])
def test_first_repeat_finds_the_first_repeated_value_and_its_first_copy(
    scan_on_host: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Against a row-major scan, on random small tensors with -1 padding, with and without a
    mask of the entries to search; both routes (a host scan for small tensors, a sort)."""
    monkeypatch.setattr(kernel_utils, "SCAN_ON_HOST", 1000 if scan_on_host else 0)
    g = gen(34)
    for case in range(300):
        shape = (
            int(torch.randint(1, 4, (1,), generator=g)),
            int(torch.randint(1, 6, (1,), generator=g)),
        )
        t = torch.randint(-1, 8 if case % 2 else 30, shape, generator=g)
        mask = torch.rand(shape, generator=g) < 0.7 if case % 3 else None
        seen: dict[int, tuple[int, ...]] = {}
        expected = None
        for flat, value in enumerate(t.flatten().tolist()):
            index = kernel_utils.unravel(flat, shape)
            if value < 0 or (mask is not None and not bool(mask[index])):
                continue
            if value in seen:
                expected = (seen[value], index)
                break
            seen[value] = index
        found = kernel_utils.first_repeat(t.to(DEVICE), None if mask is None else mask.to(DEVICE))
        assert found == expected, (t, mask)


# --- when the checks run ----------------------------------------------------------------------


def test_index_checks_switch() -> None:
    assert set_index_checks(False) is True  # the fixture turned them on
    assert kernel_utils.index_checks_on() is (not ON_CUDA)  # the interpreter always checks
    assert set_index_checks(True) is False
    assert kernel_utils.index_checks_on() is True


@pytest.mark.parametrize(("value", "on"), [("1", True), ("true", True), ("0", False), ("", False)])
def test_index_checks_env_flag(monkeypatch: pytest.MonkeyPatch, value: str, on: bool) -> None:
    monkeypatch.setenv(kernel_utils.CHECK_INDICES_ENV, value)
    assert kernel_utils.env_flag(kernel_utils.CHECK_INDICES_ENV) is on


def test_index_checks_env_var_read_at_import() -> None:
    code = "from growpage.kernels import _utils as u; print(u._CHECK_ON_DEVICE)"
    env = dict(os.environ, GROWPAGE_CHECK_INDICES="1")
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "True", proc.stderr[-2000:]


def test_without_index_checks_suspends_them_for_a_block() -> None:
    """For tools that count a GPU run's host work on the CPU: nothing is checked inside."""
    from growpage.kernels import without_index_checks

    with without_index_checks():
        with without_index_checks():
            assert kernel_utils.index_checks_on() is False
        assert kernel_utils.index_checks_on() is False
        g = gen(31)
        k_cache = randn(3, 2, 1, D, g=g)
        with pytest.raises(AssertionError, match="one slot per token"):  # shapes still checked
            store_kv(k_cache[0, :1], k_cache[0, :1], k_cache, k_cache.clone(), ints([0, 1]))
    assert kernel_utils.index_checks_on() is True
