"""KV compaction vs the naive (read-all-then-write) reference, including in-place overlap."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kernel_helpers import DEVICE, ON_CUDA, gen, randn

from growpage.kernels import compact_kv, is_direct_safe, reference

LAYERS, KV_HEADS = 2, 2
HEAD_DIM = 64 if ON_CUDA else 16


def make_keep(lens: list[int], counts: list[int], g: torch.Generator) -> torch.Tensor:
    """``[R, L, Hkv, max(counts)]`` ascending random subsets, -1 padded; (0, 0) keeps a prefix."""
    keep = torch.full((len(lens), LAYERS, KV_HEADS, max(counts)), -1, dtype=torch.int32)
    for r, (n, k) in enumerate(zip(lens, counts, strict=True)):
        for layer in range(LAYERS):
            for h in range(KV_HEADS):
                pick = torch.arange(k) if layer == h == 0 else torch.randperm(n, generator=g)[:k]
                keep[r, layer, h, :k] = pick.sort().values.to(torch.int32)
    return keep.to(DEVICE)


def run_both(
    kv_cache: torch.Tensor,
    tables: torch.Tensor,
    keep: torch.Tensor,
    dst: torch.Tensor | None,
    staged: bool | None,
) -> None:
    expected = kv_cache.clone()
    reference.compact_kv(expected, tables, keep, dst)
    compact_kv(kv_cache, tables, keep, dst, staged=staged)
    assert torch.equal(kv_cache, expected)


CASES = [
    pytest.param(torch.float32, 4, False, id="fp32-page4-direct"),
    pytest.param(torch.bfloat16, 4, True, id="bf16-page4-staged"),
    pytest.param(torch.float16, 16, False, id="fp16-page16-direct"),
    pytest.param(torch.float32, 16, True, id="fp32-page16-staged"),
]


@pytest.mark.parametrize(("dtype", "page_size", "staged"), CASES)
def test_in_place_overlapping(dtype: torch.dtype, page_size: int, staged: bool) -> None:
    """Two requests, same pages as source and destination, different keep counts."""
    g = gen(0)
    lens = [3 * page_size, 2 * page_size + 3]
    counts = [2 * page_size, page_size + 1]
    kv_cache = randn(2, LAYERS, 7, page_size, KV_HEADS, HEAD_DIM, dtype=dtype, g=g)
    tables = torch.tensor([[4, 0, 6, -1], [2, 5, 1, -1]], dtype=torch.int32, device=DEVICE)
    keep = make_keep(lens, counts, g)
    run_both(kv_cache, tables, keep, None, staged)


@pytest.mark.parametrize("staged", [False, True], ids=["direct", "staged"])
def test_into_fresh_and_partly_reused_pages(staged: bool) -> None:
    """Request 0 moves to fresh pages; request 1 keeps page 5 at its index, replaces the others."""
    g = gen(1)
    page_size = 4
    kv_cache = randn(2, LAYERS, 10, page_size, KV_HEADS, HEAD_DIM, g=g)
    src = torch.tensor([[4, 0, 6], [2, 5, 1]], dtype=torch.int32, device=DEVICE)
    dst = torch.tensor([[7, 8, -1], [9, 5, -1]], dtype=torch.int32, device=DEVICE)
    assert bool(is_direct_safe(src, dst).all())
    keep = make_keep([12, 10], [8, 6], g)
    run_both(kv_cache, src, keep, dst, staged)


def test_permuted_overlap_falls_back_to_staging() -> None:
    """Destination reuses source pages at other indices: the direct route would clobber reads."""
    g = gen(2)
    page_size = 4
    kv_cache = randn(2, LAYERS, 6, page_size, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, g=g)
    src = torch.tensor([[3, 1, 4]], dtype=torch.int32, device=DEVICE)
    dst = torch.tensor([[4, 3, -1]], dtype=torch.int32, device=DEVICE)
    assert is_direct_safe(src, dst).tolist() == [False]
    assert is_direct_safe(src, src).tolist() == [True]
    keep = make_keep([12], [8], g)
    run_both(kv_cache, src, keep, dst, None)  # auto -> staged


def test_staging_in_layer_chunks() -> None:
    g = gen(3)
    kv_cache = randn(2, LAYERS, 4, 4, KV_HEADS, HEAD_DIM, g=g)
    tables = torch.tensor([[2, 0, 3]], dtype=torch.int32, device=DEVICE)
    keep = make_keep([11], [7], g)
    expected = kv_cache.clone()
    reference.compact_kv(expected, tables, keep)
    compact_kv(kv_cache, tables, keep, staged=True, max_stage_bytes=1)  # one layer per chunk
    assert torch.equal(kv_cache, expected)


@settings(
    max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
@given(data=st.data(), page_size=st.sampled_from([2, 4]), num_pages=st.integers(1, 4))
def test_in_place_property(data: st.DataObject, page_size: int, num_pages: int) -> None:
    """Any ascending keep set, compacted in place, equals the read-everything-first result."""
    n = data.draw(st.integers(1, num_pages * page_size), label="context")
    keep = torch.empty(
        1, LAYERS, KV_HEADS, data.draw(st.integers(1, n), label="keep"), dtype=torch.int32
    )
    for layer in range(LAYERS):
        for h in range(KV_HEADS):
            picked = data.draw(
                st.sets(st.integers(0, n - 1), min_size=keep.shape[-1], max_size=keep.shape[-1])
            )
            keep[0, layer, h] = torch.tensor(sorted(picked), dtype=torch.int32)
    kv_cache = randn(2, LAYERS, num_pages, page_size, KV_HEADS, HEAD_DIM, g=gen(n))
    tables = torch.randperm(num_pages, generator=gen(num_pages)).to(torch.int32)[None]
    run_both(kv_cache, tables.to(DEVICE), keep.to(DEVICE), None, False)


@pytest.mark.parametrize("staged", [False, True], ids=["direct", "staged"])
def test_cache_strides_not_multiples_of_16(staged: bool) -> None:
    """A cache whose layer and K/V strides are not multiples of 16 (head dim 17, 7 pages of 3):
    the kernel is told so (ALIGN 1) and moves the same bits as the reference; the staging
    buffer, padded, stays aligned whatever the kept count."""
    g = gen(5)
    kv_cache = randn(2, LAYERS, 7, 3, KV_HEADS, 17, g=g)
    assert kv_cache.stride(1) % 16 and kv_cache.stride(0) % 16
    tables = torch.tensor([[4, 0, 6, -1], [2, 5, 1, 3]], dtype=torch.int32, device=DEVICE)
    keep = make_keep([9, 11], [5, 7], g)
    run_both(kv_cache, tables, keep, None, staged)
