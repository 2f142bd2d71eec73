"""KV store vs the naive reference: slot -1 skipped, dtype cast on store, layer views."""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import DEVICE, DTYPE_IDS, DTYPES, ON_CUDA, gen, randn

from growpage.kernels import reference, store_kv

HEAD_DIM = 128 if ON_CUDA else 32


@pytest.mark.parametrize("num_kv_heads", [1, 3], ids=lambda h: f"hkv{h}")
@pytest.mark.parametrize("page_size", [4, 16], ids=lambda p: f"page{p}")
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_store_matches_reference(dtype: torch.dtype, page_size: int, num_kv_heads: int) -> None:
    g = gen(0)
    num_pages = 5
    cache = randn(2, 2, num_pages, page_size, num_kv_heads, HEAD_DIM, dtype=dtype, g=g)
    k_cache, v_cache = cache[0, 1], cache[1, 1]  # a layer's view of the full cache
    num_slots = num_pages * page_size
    slots = torch.randperm(num_slots, generator=g)[:7].to(torch.int32)
    slots[[1, 4]] = -1  # padding tokens
    slot_mapping = slots.to(DEVICE)
    key = randn(7, num_kv_heads, HEAD_DIM, dtype=dtype, g=g)
    value = randn(7, num_kv_heads, HEAD_DIM, dtype=dtype, g=g)
    expected = cache.clone()
    store_kv(key, value, k_cache, v_cache, slot_mapping)
    reference.store_kv(key, value, expected[0, 1], expected[1, 1], slot_mapping)
    assert torch.equal(cache, expected)
    written = slot_mapping[slot_mapping >= 0].long()
    assert torch.equal(
        k_cache.reshape(num_slots, num_kv_heads, HEAD_DIM)[written], key[slot_mapping >= 0]
    )


def test_store_casts_to_cache_dtype() -> None:
    g = gen(1)
    k_cache = torch.zeros(3, 4, 2, HEAD_DIM, dtype=torch.bfloat16, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    key = randn(2, 2, HEAD_DIM, g=g)  # fp32 activations into a bf16 cache
    value = randn(2, 2, HEAD_DIM, g=g)
    slot_mapping = torch.tensor([5, 11], dtype=torch.int64, device=DEVICE)
    store_kv(key, value, k_cache, v_cache, slot_mapping)
    # within one bf16 ulp: the interpreter truncates on downcast, the GPU rounds to nearest
    torch.testing.assert_close(k_cache[1, 1].float(), key[0], atol=0, rtol=2**-7)
    torch.testing.assert_close(v_cache[2, 3].float(), value[1], atol=0, rtol=2**-7)
    for cache in (k_cache, v_cache):
        touched = cache.flatten(2).ne(0).any(-1).flatten().nonzero().flatten()
        assert touched.tolist() == [5, 11], "only the two mapped slots may change"


def test_store_all_padding_and_empty_are_noops() -> None:
    k_cache = torch.ones(2, 4, 1, HEAD_DIM, device=DEVICE)
    v_cache = torch.ones_like(k_cache)
    key = torch.zeros(3, 1, HEAD_DIM, device=DEVICE)
    store_kv(key, key, k_cache, v_cache, torch.full((3,), -1, dtype=torch.int32, device=DEVICE))
    store_kv(key[:0], key[:0], k_cache, v_cache, torch.zeros(0, dtype=torch.int32, device=DEVICE))
    assert torch.all(k_cache == 1) and torch.all(v_cache == 1)
