"""KV store: write the new tokens' keys and values into the paged cache.

Slot index = page * page_size + offset; slot -1 is padding and is skipped (static-shape batches).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._utils import (
    KernelInputError,
    check_device,
    check_distinct,
    check_float,
    check_index,
    check_kv_pair,
    check_values,
    check_written,
    index_checks_on,
    next_pow2,
    vector_warps,
)


# The slot mapping's address (often a slice of a step's metadata) stays out of the compile key.
@triton.jit(do_not_specialize_on_alignment=["slot_mapping_ptr"])
def _store_kv_kernel(
    key_ptr,  # [N, Hkv, D] new keys (post-RoPE)
    value_ptr,  # [N, Hkv, D] new values
    k_cache_ptr,  # [num_pages, PAGE_SIZE, Hkv, D]
    v_cache_ptr,  # [num_pages, PAGE_SIZE, Hkv, D] (same strides as k_cache)
    slot_mapping_ptr,  # [N] int, -1 = skip
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    stride_cp,
    stride_ct,
    stride_ch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    n = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + n).to(tl.int64)
    if slot >= 0:
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        mask = (offs_h < NUM_KV_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]
        k = tl.load(
            key_ptr + n * stride_kn + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask
        )
        v = tl.load(
            value_ptr + n * stride_vn + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask
        )
        dst = (slot // PAGE_SIZE) * stride_cp + (slot % PAGE_SIZE) * stride_ct
        dst_offs = dst + offs_h[:, None] * stride_ch + offs_d[None, :]
        tl.store(k_cache_ptr + dst_offs, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + dst_offs, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``key/value [N, Hkv, d]`` into ``k_cache/v_cache [num_pages, page_size, Hkv, d]``.

    Args:
        key, value: ``[N, Hkv, d]`` (last dim contiguous); cast to the cache dtype on store.
        k_cache, v_cache: one layer's views of the KV cache, identical strides.
        slot_mapping: ``[N]`` int32/int64 physical slot per token, each slot at most once;
            -1 skips the token (and may repeat).
    """
    if key.dim() != 3:
        raise KernelInputError(f"key: expected [N, Hkv, d], got shape {tuple(key.shape)}")
    num_tokens, num_kv_heads, head_dim = key.shape
    check_float(key, "key")
    check_float(value, "value")
    check_float(k_cache, "k_cache")
    if k_cache.dtype != v_cache.dtype:
        raise KernelInputError(f"k_cache {k_cache.dtype} vs v_cache {v_cache.dtype}")
    if value.shape != key.shape:
        raise KernelInputError(f"value {tuple(value.shape)} vs key {tuple(key.shape)}")
    if not (key.stride(-1) == 1 and value.stride(-1) == 1):
        raise KernelInputError("key/value: last dim contiguous")
    check_kv_pair(k_cache, v_cache)
    check_written(k_cache, "k_cache")
    if not (k_cache.dim() == 4 and k_cache.stride(-1) == 1):
        raise KernelInputError("cache: [num_pages, page_size, Hkv, d]")
    if k_cache.shape[2:] != key.shape[1:]:
        raise KernelInputError(f"cache {tuple(k_cache.shape)} vs {tuple(key.shape)}")
    check_index(slot_mapping, 1, "slot_mapping")
    if slot_mapping.shape[0] != num_tokens:
        raise KernelInputError("one slot per token")
    check_device(key, value, k_cache, v_cache, slot_mapping)
    if index_checks_on():
        num_slots = k_cache.shape[0] * k_cache.shape[1]
        check_values(
            slot_mapping,
            "slot_mapping",
            -1,
            num_slots,
            f"-1 (token skipped) or a cache slot in [0, {num_slots}) "
            f"({k_cache.shape[0]} pages x page size {k_cache.shape[1]})",
        )
        # One program per token writes its slot: two tokens of one slot race (either's key and
        # value, or a mix of the two, stays).
        check_distinct(
            slot_mapping,
            "slot_mapping",
            "each cache slot written by one token at most (only -1, token skipped, may repeat)",
        )
    if num_tokens == 0:
        return
    block_h, block_d = max(2, next_pow2(num_kv_heads)), next_pow2(head_dim)
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        PAGE_SIZE=k_cache.shape[1],
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        num_warps=vector_warps(block_h * block_d, k_cache.element_size()),
    )
