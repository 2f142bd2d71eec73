"""Edge cases of the kernels at tiny shapes: odd sizes, padding, strides, extreme values, and
the wrappers' checks (bad input raises before any launch and leaves the tensors untouched)."""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import DEVICE, gen, randn

from growpage.kernels import (
    accumulate_attention,
    compact_kv,
    demand_attention,
    paged_decode_attention,
    reference,
    store_kv,
    update_query_state,
    without_index_checks,
    working_set_sizes,
)

D = 16


def tables_of(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int32, device=DEVICE)


def lens_of(lens: list[int]) -> torch.Tensor:
    return torch.tensor(lens, dtype=torch.int32, device=DEVICE)


# (page_size, head_dim, group, context lengths, splits): length 0 and 1, a context that fills its
# last page exactly, one that ends one token into a new page; page size 1 and 3, head dim 24
# (not a power of two) and 8 (under the 16-wide dot tile), more splits than pages.
DECODE_EDGES = [
    pytest.param(4, D, 2, [0, 1, 8, 9], 1, id="page4-lens0-1-full-plus1"),
    pytest.param(1, D, 1, [1, 5, 0], 3, id="page1"),
    pytest.param(3, 24, 3, [3, 4, 7], 2, id="page3-d24-gqa3"),
    pytest.param(4, 8, 2, [5, 1], 7, id="d8-more-splits-than-pages"),
]


@pytest.mark.parametrize(("page_size", "head_dim", "group", "lens", "splits"), DECODE_EDGES)
def test_decode_edges_match_reference(
    page_size: int, head_dim: int, group: int, lens: list[int], splits: int
) -> None:
    g = gen(0)
    max_pages = max(-(-n // page_size) for n in lens) + 1  # a trailing unused column
    num_pages = sum(-(-n // page_size) for n in lens) + 2
    q = randn(len(lens), 2 * group, head_dim, g=g)
    k_cache = randn(num_pages, page_size, 2, head_dim, g=g)
    v_cache = randn(num_pages, page_size, 2, head_dim, g=g)
    perm = torch.randperm(num_pages, generator=g).tolist()
    rows = []
    for n in lens:
        need = -(-n // page_size)
        own, perm = perm[:need], perm[need:]
        # unused trailing entries hold real page ids (not -1): the kernel must not read them
        rows.append(own + [p for p in range(num_pages) if p not in own][: max_pages - need])
    tables = tables_of(rows)
    out = paged_decode_attention(q, k_cache, v_cache, tables, lens_of(lens), num_splits=splits)
    expected = reference.paged_decode_attention(q, k_cache, v_cache, tables, lens_of(lens))
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)
    assert torch.all(out[lens_of(lens) == 0] == 0)


def test_decode_all_rows_padded_gives_zeros() -> None:
    g = gen(1)
    q = randn(3, 2, D, g=g)
    k_cache = randn(2, 4, 1, D, g=g)
    tables = torch.full((3, 2), -1, dtype=torch.int32, device=DEVICE)
    for splits in (1, 3):
        out = paged_decode_attention(
            q, k_cache, k_cache, tables, lens_of([0, 0, 0]), num_splits=splits
        )
        assert torch.equal(out, torch.zeros_like(q))


def test_decode_strided_views() -> None:
    """q, out and the block table as strided views (rows not contiguous), int64 indices."""
    g = gen(2)
    q = randn(2, 3, D, g=g).transpose(0, 1)  # [B=3, Hq=2, d], stride(0) != Hq * d
    k_cache = randn(6, 4, 1, D, g=g)
    v_cache = randn(6, 4, 1, D, g=g)
    wide = torch.tensor([[0, 1, 9], [2, 3, 9], [4, 5, 9]], device=DEVICE)[:, :2]  # int64 slice
    lens = torch.tensor([8, 1, 6], device=DEVICE)
    out = torch.empty(2, 3, D, device=DEVICE).transpose(0, 1)
    paged_decode_attention(q, k_cache, v_cache, wide, lens, out=out, num_splits=2)
    expected = reference.paged_decode_attention(q, k_cache, v_cache, wide, lens)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_decode_large_logits_do_not_overflow_in_half(dtype: torch.dtype) -> None:
    """q . k = 160000 (past fp16's 65504): logits and softmax stay in fp32."""
    g = gen(3)
    q = torch.full((1, 2, D), 100.0, device=DEVICE).to(dtype)
    k_cache = torch.full((2, 4, 1, D), 100.0, device=DEVICE).to(dtype)
    k_cache[1, 1] = 99.0  # one key scores 1600 less, so its weight is 0
    v_cache = randn(2, 4, 1, D, g=g).to(dtype)
    tables, lens = tables_of([[0, 1]]), lens_of([7])
    out = paged_decode_attention(q, k_cache, v_cache, tables, lens, sm_scale=1.0, num_splits=2)
    expected = reference.paged_decode_attention(q, k_cache, v_cache, tables, lens, sm_scale=1.0)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)


def test_decode_ignores_nan_outside_the_context_and_propagates_it_inside() -> None:
    g = gen(4)
    q = randn(1, 2, D, g=g)
    k_cache = randn(3, 4, 1, D, g=g)
    v_cache = randn(3, 4, 1, D, g=g)
    tables, lens = tables_of([[0, 1, 2]]), lens_of([6])
    expected = reference.paged_decode_attention(q, k_cache, v_cache, tables, lens)
    k_cache[1, 2:] = float("nan")  # past the context on its last page
    v_cache[1, 2:] = float("nan")
    k_cache[2] = float("inf")  # an unused page of the table
    out = paged_decode_attention(q, k_cache, v_cache, tables, lens, num_splits=2)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)
    v_cache[0, 0] = float("nan")  # inside: the output is NaN, as the reference's would be
    out = paged_decode_attention(q, k_cache, v_cache, tables, lens)
    assert torch.isnan(out).all()


# --- decode: the checks ---------------------------------------------------------------------


def decode_case():
    g = gen(5)
    q = randn(2, 2, D, g=g)
    k_cache = randn(4, 4, 1, D, g=g)
    return q, k_cache, tables_of([[0, 1], [2, 3]]), lens_of([5, 8])


@pytest.mark.parametrize("splits", [0, -1, 33])
def test_decode_bad_split_count_raises_before_the_fused_ema(splits: int) -> None:
    q, k_cache, tables, lens = decode_case()
    state = torch.zeros(2, 2, 2, D, device=DEVICE)
    with pytest.raises(AssertionError, match=rf"num_splits must lie in \[1, 32\], got {splits}"):
        paged_decode_attention(
            q,
            k_cache,
            k_cache,
            tables,
            lens,
            num_splits=splits,
            q_pre=q,
            query_state=state,
            slot_ids=lens_of([0, 1]),
            is_first=lens_of([1, 1]),
        )
    assert torch.equal(state, torch.zeros_like(state)), "the EMA ran before the error"


def test_decode_block_must_be_a_power_of_two() -> None:
    q, k_cache, tables, lens = decode_case()
    with pytest.raises(AssertionError, match="block_n must be a power of two"):
        paged_decode_attention(q, k_cache, k_cache, tables, lens, block_n=24)


def test_decode_rejects_non_float_tensors() -> None:
    q, k_cache, tables, lens = decode_case()
    with pytest.raises(AssertionError, match="q: fp32/fp16/bf16 expected, got torch.int32"):
        paged_decode_attention(q.int(), k_cache, k_cache, tables, lens)
    with pytest.raises(AssertionError, match="k_cache: fp32/fp16/bf16 expected"):
        paged_decode_attention(q, k_cache.to(torch.int8), k_cache.to(torch.int8), tables, lens)
    with pytest.raises(AssertionError, match="out: fp32/fp16/bf16 expected"):
        paged_decode_attention(q, k_cache, k_cache, tables, lens, out=q.int())


def test_decode_names_the_layout_problem() -> None:
    q, k_cache, tables, lens = decode_case()
    with pytest.raises(AssertionError, match="3 query heads do not split evenly over 2 KV heads"):
        paged_decode_attention(
            torch.zeros(2, 3, D, device=DEVICE),
            k_cache.expand(4, 4, 2, D),
            k_cache.expand(4, 4, 2, D),
            tables,
            lens,
        )
    with pytest.raises(AssertionError, match="one row per query"):
        paged_decode_attention(q, k_cache, k_cache, tables, lens[:1])
    with pytest.raises(AssertionError, match="head dim: q has 8, the cache 16"):
        paged_decode_attention(q[..., :8], k_cache, k_cache, tables, lens)


# --- compaction -----------------------------------------------------------------------------


def compact_both(
    src: list[list[int]],
    keep: list[list[int]],
    dst: list[list[int]] | None,
    staged: bool | None = None,
    num_pages: int = 6,
) -> None:
    """Kernel vs reference on a [2, L=1, num_pages, page 2, Hkv=1, d] cache."""
    g = gen(6)
    kv_cache = randn(2, 1, num_pages, 2, 1, D, g=g)
    expected = kv_cache.clone()
    keep_t = torch.tensor(keep, dtype=torch.int32, device=DEVICE)[:, None, None, :]
    dst_t = None if dst is None else tables_of(dst)
    reference.compact_kv(expected, tables_of(src), keep_t, dst_t)
    compact_kv(kv_cache, tables_of(src), keep_t, dst_t, staged=staged)
    assert torch.equal(kv_cache, expected)


@pytest.mark.parametrize(
    ("src", "dst"),
    [
        pytest.param([[0, 1], [2, 3]], [[2, 4], [5, -1]], id="dst-of-0-is-src-of-1"),
        pytest.param([[0, 1], [2, 3]], [[4, 5], [0, -1]], id="dst-of-1-is-src-of-0"),
    ],
)
def test_compaction_picks_staging_when_requests_share_pages(src, dst) -> None:
    """Requests run concurrently: one's destination page may not be another's page."""
    compact_both(src, [[0, 1, 2, 3], [1, 3, -1, -1]], dst)
    assert not is_direct_safe_all(src, dst)


def is_direct_safe_all(src: list[list[int]], dst: list[list[int]]) -> bool:
    from growpage.kernels import is_direct_safe

    return bool(is_direct_safe(tables_of(src), tables_of(dst)).all())


def test_compaction_direct_across_disjoint_requests() -> None:
    src, dst = [[0, 1], [2, 3]], [[4, -1], [5, 3]]  # request 1 keeps page 3 at its index
    assert is_direct_safe_all(src, dst)
    compact_both(src, [[1, 2, -1], [0, 2, 3]], dst)


@pytest.mark.parametrize("staged", [None, False, True], ids=["auto", "direct", "staged"])
@pytest.mark.parametrize(
    ("keep", "dst"),
    [
        pytest.param([0, 1, 2, 3, 4, 5], None, id="identity-in-place"),
        pytest.param([0, 1, 2, 3], [[0, 1]], id="identity-prefix-to-same-pages"),
        pytest.param([1, 2, 4, 5], [[0, 1]], id="in-place-through-a-copied-table"),
    ],
)
def test_compaction_direct_safe_overlaps(keep, dst, staged) -> None:
    if dst is not None:
        assert is_direct_safe_all([[0, 1, 2]], dst)
    compact_both([[0, 1, 2]], [keep], dst, staged)


@pytest.mark.parametrize("staged", [None, True], ids=["auto", "staged"])
@pytest.mark.parametrize(
    "dst",
    [
        pytest.param([[1, 2]], id="dst-pages-earlier-in-src"),
        pytest.param([[2, 0]], id="dst-pages-both-ways"),
    ],
)
def test_compaction_shifted_overlaps(dst, staged) -> None:
    assert not is_direct_safe_all([[0, 1, 2]], dst)
    compact_both([[0, 1, 2]], [[1, 3, 4, 5]], dst, staged)


def test_compaction_never_reads_past_a_table_row() -> None:
    """A kept position past request 0's source table (or an entry past its destination table)
    must not read request 1's row of the table and move request 1's tokens. The wrapper refuses
    such a ``keep`` when it checks index values (``test_kernel_index_checks.py``); this is the
    kernel's own guard, for a GPU run that does not check them."""
    with without_index_checks():
        compaction_past_a_table_row()


def compaction_past_a_table_row() -> None:
    g = gen(7)
    kv_cache = randn(2, 1, 6, 2, 1, D, g=g)
    before = kv_cache.clone()
    src, dst = tables_of([[0], [1]]), tables_of([[2], [3]])
    keep = torch.tensor([[0, 2], [-1, -1]], dtype=torch.int32, device=DEVICE)[:, None, None]
    compact_kv(kv_cache, src, keep, dst, staged=False)
    expected = before.clone()
    expected[:, 0, 2, 0] = before[:, 0, 0, 0]  # position 0 -> entry 0; position 2 skipped
    assert torch.equal(kv_cache, expected)
    kv_cache = before.clone()
    keep = torch.tensor([[0, 1, 3], [-1, -1, -1]], dtype=torch.int32, device=DEVICE)
    compact_kv(kv_cache, tables_of([[0, 4], [1, 5]]), keep[:, None, None], dst, staged=False)
    expected = before.clone()
    expected[:, 0, 2] = before[:, 0, 0]  # entries 0, 1 -> page 2; entry 2 has no page: skipped
    assert torch.equal(kv_cache, expected)


# --- demand ---------------------------------------------------------------------------------


def test_working_set_extreme_top_p_and_ties() -> None:
    rows = torch.tensor(
        [[0.25, 0.25, 0.25, 0.25], [1.0, 0.0, 0.0, 0.0], [0.4, 0.2, 0.4, 0.0]], device=DEVICE
    )
    assert working_set_sizes(rows, 1.0).tolist() == [4, 1, 3]  # zero weights never needed
    assert working_set_sizes(rows, 1e-9).tolist() == [1, 1, 1]
    assert working_set_sizes(rows, 0.8).tolist() == [4, 1, 2]  # a tie at the top: 0.4 + 0.4
    softmax = torch.softmax(randn(3, 1000, g=gen(8)), dim=-1)  # sums to 1 - ulps in fp32
    assert working_set_sizes(softmax, 1.0).tolist() == [1000] * 3


@pytest.mark.parametrize("p", [0.0, -0.5, float("nan")])
def test_working_set_rejects_a_mass_not_above_0(p: float) -> None:
    """NaN used to give k = 1 for every row (``cumsum < nan`` is all False)."""
    rows = torch.tensor([[0.5, 0.5, 0.0]], device=DEVICE)
    with pytest.raises(ValueError, match="top-p mass p must be > 0"):
        working_set_sizes(rows, p)
    from growpage.kernels import estimate_demand

    with pytest.raises(ValueError, match="top-p mass p must be > 0"):
        estimate_demand(
            torch.zeros(2, 1, 2, D, device=DEVICE),
            torch.zeros(1, 2, 2, 1, D, device=DEVICE),
            tables_of([[0, 1]])[0],
            3,
            p=p,
        )


def test_demand_one_candidate_and_page_boundaries() -> None:
    g = gen(9)
    queries = randn(2, 1, 2, D, g=g)
    k_cache = randn(1, 4, 3, 1, D, g=g)
    table = tables_of([[2, 0, 3]])[0]
    for num_candidates in (1, 3, 4):  # one token, a full page, one past it
        for splits in (1, 3):
            out = demand_attention(queries, k_cache, table, num_candidates, num_splits=splits)
            expected = reference.demand_attention(queries, k_cache, table, num_candidates)
            torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-4)


# --- the other wrappers' checks -------------------------------------------------------------


def test_store_kv_rejects_non_float_and_mixed_caches() -> None:
    k_cache = torch.zeros(2, 4, 1, D, device=DEVICE)
    key = torch.ones(1, 1, D, device=DEVICE)
    slots = lens_of([3])
    with pytest.raises(AssertionError, match="key: fp32/fp16/bf16 expected, got torch.int64"):
        store_kv(key.long(), key, k_cache, k_cache.clone(), slots)
    with pytest.raises(AssertionError, match="k_cache torch.float32 vs v_cache torch.float16"):
        store_kv(key, key, k_cache, k_cache.half(), slots)
    assert torch.equal(k_cache, torch.zeros_like(k_cache))


def test_store_kv_strided_key_and_int64_slots() -> None:
    g = gen(10)
    qkv = randn(5, 3, D, g=g)  # a fused projection: keys are a strided view of it
    key, value = qkv[:, 1:2], qkv[:, 2:3]
    k_cache, v_cache = (
        torch.zeros(3, 3, 1, D, device=DEVICE),
        torch.zeros(3, 3, 1, D, device=DEVICE),
    )
    slots = torch.tensor([8, -1, 0, 4, 5], device=DEVICE)
    store_kv(key, value, k_cache, v_cache, slots)
    k_ref, v_ref = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    reference.store_kv(key, value, k_ref, v_ref, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def test_accumulate_and_demand_name_the_bad_argument() -> None:
    q = torch.zeros(1, 3, D, device=DEVICE)
    k_cache = torch.zeros(2, 4, 2, D, device=DEVICE)
    acc = torch.zeros(8, 2, device=DEVICE)
    tables, lens = tables_of([[0, 1]]), lens_of([5])
    with pytest.raises(AssertionError, match="3 query heads do not split evenly over 2 KV heads"):
        accumulate_attention(q, k_cache, tables, lens, acc)
    with pytest.raises(AssertionError, match="q: fp32/fp16/bf16 expected"):
        accumulate_attention(q[:, :2].int(), k_cache, tables, lens, acc)
    with pytest.raises(AssertionError, match="block_n must be a power of two"):
        accumulate_attention(q[:, :2], k_cache, tables, lens, acc, block_n=12)
    with pytest.raises(AssertionError, match="3 query heads do not split evenly over 2 KV heads"):
        demand_attention(torch.zeros(2, 1, 3, D, device=DEVICE), k_cache[None], tables[0], 5)
    with pytest.raises(AssertionError, match="q_pre: fp32/fp16/bf16 expected"):
        update_query_state(
            q.int(), torch.zeros(2, 2, 3, D, device=DEVICE), lens_of([0]), lens_of([1])
        )
    assert torch.equal(acc, torch.zeros_like(acc))


def test_boundary_queries_batch_rejects_a_negative_meta_column() -> None:
    from growpage.kernels import boundary_queries_batch

    summaries = torch.zeros(1, 2, 2, 1, D, device=DEVICE)
    meta = torch.tensor([[0, 3]], dtype=torch.int32, device=DEVICE)
    with pytest.raises(AssertionError, match="meta_col must be >= 0, got -1"):
        boundary_queries_batch(
            summaries, summaries[:, :, 0], meta, -1, torch.ones(D // 2, device=DEVICE)
        )
