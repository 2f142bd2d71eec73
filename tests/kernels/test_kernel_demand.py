"""Demand estimation vs the naive reference: GQA-averaged distributions and top-p sizes."""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import DEVICE, DTYPES, ON_CUDA, covering_grid, gen, make_block_tables, randn

from growpage.kernels import demand_attention, estimate_demand, reference, working_set_sizes

LAYERS, KV_HEADS = 2, 2
HEAD_DIM = 128 if ON_CUDA else 32
# distributions are computed from fp32 queries against exact keys: tight for every cache dtype
ATOL = {torch.float32: 1e-6, torch.float16: 2e-5, torch.bfloat16: 2e-5}
PAGE_SIZES = [4, 16, 256] if ON_CUDA else [4, 16]


def make_case(dtype: torch.dtype, group: int, page_size: int, num_tokens: int, seed: int = 0):
    g = gen(seed)
    num_pages = -(-num_tokens // page_size) + 2
    k_cache = randn(LAYERS, num_pages, page_size, KV_HEADS, HEAD_DIM, dtype=dtype, g=g)
    # summaries are fp32, scaled so that some heads are concentrated and some diffuse
    scale = torch.tensor([0.3, 3.0]).repeat_interleave(LAYERS * KV_HEADS * group // 2 + 1)
    queries = randn(2, LAYERS, KV_HEADS * group, HEAD_DIM, g=g)
    queries *= scale[: LAYERS * KV_HEADS * group].view(LAYERS, -1)[None, :, :, None].to(DEVICE)
    table = make_block_tables([num_tokens], page_size, num_pages, num_pages, g)[0]
    return queries, k_cache, table


def candidate_counts(page_size: int) -> list[int]:
    """Nc = 1, a multiple of the page size, a partial last page."""
    return [1, 2 * page_size, page_size + 3] + ([3001] if ON_CUDA else [])


GRID = covering_grid(DTYPES, [1, 3, 8], PAGE_SIZES, full=False)  # compile time on CUDA


@pytest.mark.parametrize(("dtype", "group", "page_size"), GRID)
def test_demand_matches_reference(dtype: torch.dtype, group: int, page_size: int) -> None:
    counts = candidate_counts(page_size)
    queries, k_cache, table = make_case(dtype, group, page_size, max(counts))
    for num_candidates in counts:
        attn = demand_attention(queries, k_cache, table, num_candidates, num_splits=2)
        expected = reference.demand_attention(queries, k_cache, table, num_candidates)
        assert attn.shape == (2, LAYERS, KV_HEADS, num_candidates) and attn.dtype == torch.float32
        torch.testing.assert_close(attn, expected, atol=ATOL[dtype], rtol=1e-4)
        torch.testing.assert_close(attn.sum(-1), torch.ones_like(attn[..., 0]))


@pytest.mark.parametrize("splits", [None, 1, 5], ids=lambda s: f"splits{s}")
def test_demand_split_count_does_not_matter(splits: int | None) -> None:
    queries, k_cache, table = make_case(torch.float16, 3, 4, 37, seed=1)
    attn = demand_attention(queries, k_cache, table, 37, num_splits=splits, sm_scale=0.2)
    expected = reference.demand_attention(queries, k_cache, table, 37, sm_scale=0.2)
    torch.testing.assert_close(attn, expected, atol=2e-5, rtol=1e-4)


def test_working_set_sizes() -> None:
    attn = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.25, 0.25, 0.25, 0.25], [1.0, 0.0, 0.0, 0.0]])
    assert working_set_sizes(attn, 0.8).tolist() == [2, 4, 1]
    assert working_set_sizes(attn, 0.99).tolist() == [4, 4, 1]
    assert working_set_sizes(attn, 1.5).tolist() == [4, 4, 4], "clamped to Nc"
    queries, k_cache, table = make_case(torch.float32, 3, 4, 40, seed=2)
    dist = demand_attention(queries, k_cache, table, 40)
    for p in (0.5, 0.9, 0.99):
        assert torch.equal(working_set_sizes(dist, p), reference.working_set_sizes(dist, p))
    sizes = working_set_sizes(dist, 0.9)
    assert sizes.shape == (2, LAYERS, KV_HEADS) and sizes.min() >= 1 and sizes.max() <= 40


def test_estimate_demand_bundles_eqs_7_to_9() -> None:
    queries, k_cache, table = make_case(torch.bfloat16, 3, 4, 30, seed=3)
    signals = estimate_demand(queries, k_cache, table, 30, p=0.9)
    expected = reference.demand_attention(queries, k_cache, table, 30)
    torch.testing.assert_close(signals.attention, expected, atol=2e-5, rtol=1e-4)
    sizes = reference.working_set_sizes(signals.attention, 0.9)
    assert torch.equal(signals.working_set, sizes)
    ratio = sizes.float().div(30).mean(dim=(1, 2))
    torch.testing.assert_close(signals.ratio, ratio)
    torch.testing.assert_close(signals.delta, ratio[0] - ratio[1])
    assert torch.equal(signals.scores, torch.maximum(signals.attention[0], signals.attention[1]))


@pytest.mark.parametrize(
    ("dtype", "group"), [(torch.float32, 3), (torch.bfloat16, 8), (torch.float16, 1)]
)
def test_batch_gives_each_request_its_own_distributions(dtype: torch.dtype, group: int) -> None:
    """Ragged candidate counts and split counts, -1 padded tables, extra columns: each row is
    that request's reference distribution, zeros after it, and the same bits as alone."""
    from growpage.kernels import demand_attention_batch, demand_splits

    page = 4
    counts, splits = [9, 1, 23], [2, 1, 3]
    g = gen(7)
    k_cache = randn(LAYERS, 20, page, KV_HEADS, HEAD_DIM, dtype=dtype, g=g)
    queries = randn(3, 2, LAYERS, KV_HEADS * group, HEAD_DIM, g=g)
    pages = make_block_tables(counts, page, 20, 7, g)
    # meta columns (Nc, splits) at 7, then a second pair a caller may keep for another call
    meta = torch.tensor(
        [[n, s, 99, 99] for n, s in zip(counts, splits, strict=True)], dtype=torch.int32
    )
    tables = torch.cat([pages, meta.to(DEVICE)], dim=1)
    out = demand_attention_batch(queries, k_cache, tables, 7, max(counts), max(splits))
    assert out.shape == (3, 2, LAYERS, KV_HEADS, max(counts))
    for r, (n, s) in enumerate(zip(counts, splits, strict=True)):
        expected = reference.demand_attention(queries[r], k_cache, pages[r], n)
        torch.testing.assert_close(out[r, ..., :n], expected, atol=ATOL[dtype], rtol=1e-4)
        assert not out[r, ..., n:].any()
        alone = demand_attention(queries[r], k_cache, pages[r], n, num_splits=s)
        assert torch.equal(out[r, ..., :n], alone)
    assert demand_splits(1, LAYERS, KV_HEADS, torch.device(DEVICE)) == 1
    with pytest.raises(AssertionError, match="max_splits"):
        demand_attention_batch(queries, k_cache, tables, 7, max(counts), 0)
    with pytest.raises(AssertionError, match="tables"):
        demand_attention_batch(queries, k_cache, tables[:, :8], 7, max(counts), 3)
