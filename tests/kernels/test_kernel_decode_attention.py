"""Paged decode attention vs the naive reference, and the fused query-summary (EMA) update."""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import (
    DEVICE,
    DTYPE_IDS,
    DTYPES,
    ON_CUDA,
    assert_close,
    gen,
    make_block_tables,
    randn,
)

from growpage.kernels import (
    KernelInputError,
    paged_decode_attention,
    reference,
    set_index_checks,
    update_query_state,
    without_index_checks,
)

NUM_KV_HEADS = 2
HEAD_DIM = 128 if ON_CUDA else 32
GROUPS = [1, 3, 8]
PAGE_SIZES = [4, 16, 256] if ON_CUDA else [4, 16]
SPLITS = [None, 4] if ON_CUDA else [1, 3]  # None: the static default (1 at small shapes)


def context_lens_for(page_size: int) -> list[int]:
    """Ragged: length 1, a multiple of the page size, a partial last page, an empty row."""
    if ON_CUDA:
        return [1, 4 * page_size, 3 * page_size + 5, 0, 1777]
    return [1, 2 * page_size, page_size + 3, 0]


def make_case(dtype: torch.dtype, group: int, page_size: int, seed: int = 0):
    g = gen(seed)
    lens = context_lens_for(page_size)
    max_pages = max(-(-n // page_size) for n in lens) + 2  # extra -1 padding columns
    num_pages = sum(-(-n // page_size) for n in lens) + 3
    num_heads = NUM_KV_HEADS * group
    q = randn(len(lens), num_heads, HEAD_DIM, dtype=dtype, g=g)
    k_cache = randn(num_pages, page_size, NUM_KV_HEADS, HEAD_DIM, dtype=dtype, g=g)
    v_cache = randn(num_pages, page_size, NUM_KV_HEADS, HEAD_DIM, dtype=dtype, g=g)
    tables = make_block_tables(lens, page_size, num_pages, max_pages, g)
    context_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    return q, k_cache, v_cache, tables, context_lens


@pytest.mark.parametrize("splits", SPLITS, ids=lambda s: f"splits{s}")
@pytest.mark.parametrize("page_size", PAGE_SIZES, ids=lambda p: f"page{p}")
@pytest.mark.parametrize("group", GROUPS, ids=lambda r: f"gqa{r}")
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_decode_matches_reference(
    dtype: torch.dtype, group: int, page_size: int, splits: int | None
) -> None:
    q, k_cache, v_cache, tables, lens = make_case(dtype, group, page_size)
    out = paged_decode_attention(q, k_cache, v_cache, tables, lens, num_splits=splits)
    expected = reference.paged_decode_attention(q, k_cache, v_cache, tables, lens)
    assert out.dtype == dtype and out.shape == q.shape
    assert_close(out, expected, dtype)
    assert torch.all(out[lens == 0] == 0), "empty context must give zeros, not NaN"


def test_decode_custom_scale_and_out_buffer() -> None:
    q, k_cache, v_cache, tables, lens = make_case(torch.float32, 3, 4, seed=1)
    out = torch.full_like(q, float("nan"))
    result = paged_decode_attention(q, k_cache, v_cache, tables, lens, sm_scale=0.3, out=out)
    assert result.data_ptr() == out.data_ptr()
    expected = reference.paged_decode_attention(q, k_cache, v_cache, tables, lens, sm_scale=0.3)
    assert_close(out, expected, torch.float32)


def test_decode_odd_head_dim_and_overlong_context() -> None:
    """head_dim 24 (masked to a 32 block); unchecked, context_lens beyond the table are clamped
    to it (the index checks refuse them)."""
    g = gen(9)
    k_cache = randn(6, 4, 2, 24, g=g)
    v_cache = randn(6, 4, 2, 24, g=g)
    q = randn(2, 6, 24, g=g)
    tables = torch.tensor([[5, 1], [0, 3]], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([7, 8], dtype=torch.int32, device=DEVICE)
    out = paged_decode_attention(q, k_cache, v_cache, tables, lens, num_splits=2)
    assert_close(
        out, reference.paged_decode_attention(q, k_cache, v_cache, tables, lens), torch.float32
    )
    previous = set_index_checks(True)  # on CUDA they are off unless asked for
    try:
        with pytest.raises(KernelInputError, match=r"context_lens\[0\] = 107"):
            paged_decode_attention(q, k_cache, v_cache, tables, lens + 100)
    finally:
        set_index_checks(previous)
    with without_index_checks():
        overlong = paged_decode_attention(q, k_cache, v_cache, tables, lens + 100)
    assert_close(
        overlong,
        reference.paged_decode_attention(q, k_cache, v_cache, tables, torch.full_like(lens, 8)),
        torch.float32,
    )


def test_decode_reads_layer_view_of_full_cache() -> None:
    """The engine passes ``cache[0, l], cache[1, l]`` of the ``[2, L, pages, ...]`` tensor."""
    q, k_cache, v_cache, tables, lens = make_case(torch.float16, 8, 4, seed=2)
    cache = torch.zeros(2, 3, *k_cache.shape, dtype=k_cache.dtype, device=DEVICE)
    cache[0, 1], cache[1, 1] = k_cache, v_cache
    out = paged_decode_attention(q, cache[0, 1], cache[1, 1], tables, lens, num_splits=2)
    assert_close(
        out, reference.paged_decode_attention(q, k_cache, v_cache, tables, lens), torch.float16
    )


def ema_inputs(num_seqs: int, num_heads: int, seed: int):
    g = gen(seed)
    state = randn(5, 2, num_heads, HEAD_DIM, g=g)
    state[3] = float("nan")  # stale garbage from a previous owner of slot 3
    q_pre = randn(num_seqs, num_heads, HEAD_DIM, dtype=torch.bfloat16, g=g)
    pad = num_seqs - 4
    slot_ids = torch.tensor([3, -1, 0, 4] + [-1] * pad, dtype=torch.int32, device=DEVICE)
    is_first = torch.tensor([True, False, False, True] + [False] * pad, device=DEVICE)
    return q_pre, state, slot_ids, is_first


@pytest.mark.parametrize("splits", [1, 3], ids=lambda s: f"splits{s}")
@pytest.mark.parametrize("group", [1, 3], ids=lambda r: f"gqa{r}")
def test_fused_ema_first_step_then_update(group: int, splits: int) -> None:
    q, k_cache, v_cache, tables, lens = make_case(torch.bfloat16, group, 4, seed=3)
    q_pre, state, slot_ids, is_first = ema_inputs(q.shape[0], q.shape[1], seed=4)
    expected_state = state.clone()
    ema = dict(q_pre=q_pre, query_state=state, slot_ids=slot_ids)
    # step 1: slots 3 and 4 initialize (stale NaN overwritten), slot 0 updates, row 1 skipped
    out = paged_decode_attention(
        q, k_cache, v_cache, tables, lens, num_splits=splits, is_first=is_first, **ema
    )
    reference.update_query_state(q_pre, expected_state, slot_ids, is_first)
    torch.testing.assert_close(state, expected_state, equal_nan=True)
    assert not state[3].isnan().any() and torch.equal(state[3, 0], q_pre[0].float())
    assert torch.equal(state[1], expected_state[1]), "untouched slot changed"
    assert_close(
        out, reference.paged_decode_attention(q, k_cache, v_cache, tables, lens), torch.bfloat16
    )
    # step 2: every live slot updates once (split 0 only), with beta_short / beta_long
    not_first = torch.zeros_like(is_first)
    paged_decode_attention(
        q, k_cache, v_cache, tables, lens, num_splits=splits, is_first=not_first, **ema
    )
    reference.update_query_state(q_pre, expected_state, slot_ids, not_first)
    torch.testing.assert_close(state, expected_state, equal_nan=True)


def test_fused_equals_unfused_ema() -> None:
    q, k_cache, v_cache, tables, lens = make_case(torch.float16, 8, 16, seed=5)
    q_pre, state, slot_ids, is_first = ema_inputs(q.shape[0], q.shape[1], seed=6)
    q_pre = torch.cat([q_pre, q_pre], dim=-1)[..., :HEAD_DIM]  # strided view, as from a fused qkv
    is_first = is_first.to(torch.int32)
    unfused = state.clone()
    fused_out = paged_decode_attention(
        q,
        k_cache,
        v_cache,
        tables,
        lens,
        q_pre=q_pre,
        query_state=state,
        slot_ids=slot_ids,
        is_first=is_first,
        beta_short=0.5,
        beta_long=0.75,
    )
    plain_out = paged_decode_attention(q, k_cache, v_cache, tables, lens)
    update_query_state(q_pre, unfused, slot_ids, is_first, beta_short=0.5, beta_long=0.75)
    torch.testing.assert_close(state, unfused, equal_nan=True, atol=0, rtol=0)
    torch.testing.assert_close(fused_out, plain_out, atol=0, rtol=0)


def test_standalone_ema_matches_reference() -> None:
    q_pre, state, slot_ids, is_first = ema_inputs(4, 6, seed=7)
    expected = state.clone()
    for step in range(3):
        first = is_first if step == 0 else torch.zeros_like(is_first)
        update_query_state(q_pre * (step + 1), state, slot_ids, first)
        reference.update_query_state(q_pre * (step + 1), expected, slot_ids, first)
    torch.testing.assert_close(state, expected, equal_nan=True)


def test_rejects_bad_layouts() -> None:
    q, k_cache, v_cache, tables, lens = make_case(torch.float32, 1, 4, seed=8)
    with pytest.raises(AssertionError):
        paged_decode_attention(q, k_cache, v_cache, tables.float(), lens)
    with pytest.raises(AssertionError):
        paged_decode_attention(q[:, :1], k_cache, v_cache, tables, lens)  # Hq not a multiple
    with pytest.raises(AssertionError):
        paged_decode_attention(q, k_cache, v_cache, tables, lens, q_pre=q)  # partial EMA args
