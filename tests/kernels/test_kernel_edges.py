"""Edge cases of the kernels at tiny shapes: odd sizes, padding, strides, extreme values, and
the wrappers' checks (bad input raises before any launch and leaves the tensors untouched)."""

from __future__ import annotations

import pytest
import torch
from growpage.kernels import (
    accumulate_attention,
    compact_kv,
    demand_attention,
    paged_decode_attention,
    reference,
    store_kv,
    update_query_state,
    working_set_sizes,
)
from kernel_helpers import DEVICE, gen, randn

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
def test_decode_edges_match_reference(page_size: int, head_dim: int, group: int,
                                      lens: list[int], splits: int) -> None:
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
        out = paged_decode_attention(q, k_cache, k_cache, tables, lens_of([0, 0, 0]),
                                     num_splits=splits)
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
        paged_decode_attention(q, k_cache, k_cache, tables, lens, num_splits=splits, q_pre=q,
                               query_state=state, slot_ids=lens_of([0, 1]),
                               is_first=lens_of([1, 1]))
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
        paged_decode_attention(torch.zeros(2, 3, D, device=DEVICE), k_cache.expand(4, 4, 2, D),
                               k_cache.expand(4, 4, 2, D), tables, lens)
    with pytest.raises(AssertionError, match="one row per query"):
        paged_decode_attention(q, k_cache, k_cache, tables, lens[:1])
    with pytest.raises(AssertionError, match="head dim: q has 8, the cache 16"):
        paged_decode_attention(q[..., :8], k_cache, k_cache, tables, lens)
