"""H2O accumulated attention: add one decode step's attention into a per-slot fp32 sum.

One program = one (request, KV head). It reads the request's keys through the block table,
computes each query head's softmax weight ``exp(logit - lse)`` on every context slot, takes the
mean over the GROUP query heads of the KV head and adds it to that slot's sum::

    acc[slot, h] += mean_g softmax_j(q[b, h*G + g] . k[slot_j, h] * sm_scale)   j < context_len

The log-sum-exp of each (request, query head) comes from ``lse`` when given (natural log, as
a decode kernel would leave it); otherwise the kernel recomputes it in a first pass over the
keys (online max and sum), then adds the weights in a second pass.

NOTE: slot ``context_len - 1`` holds the token this query belongs to, stored in this very step,
and the query is the first one to see it: its sum is *set* there, not added, so a slot reused
after a free, a preemption or a compaction needs no clearing. Slots are owned by one request
(no prefix sharing), so programs never write the same slot and no atomics are needed.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._utils import (
    MIN_DOT_DIM,
    KernelInputError,
    check_block,
    check_block_tables,
    check_context_lens,
    check_device,
    check_distinct,
    check_float,
    check_heads,
    check_index,
    check_sums,
    default_block_n,
    dot_in_fp32,
    index_checks_on,
    next_pow2,
    pages_read,
    tile_warps,
)
from .split_k import LOG2E

_LOG2E = tl.constexpr(LOG2E)  # a global a kernel may read


# Per-step quantities (table width, context lengths), the index tensors' addresses and the
# layer view's address stay out of the compile key: an engine compiles one variant. See
# ``growpage.kernels.variants``.
@triton.jit(
    do_not_specialize=["max_tokens", "stride_btb", "stride_lb"],
    do_not_specialize_on_alignment=["block_tables_ptr", "context_lens_ptr", "lse_ptr", "acc_ptr"],
)
def _accumulate_kernel(
    q_ptr,  # [B, Hq, D] post-RoPE query
    k_cache_ptr,  # [num_pages, PAGE_SIZE, Hkv, D]
    block_tables_ptr,  # [B, max_pages] int, -1 padded
    context_lens_ptr,  # [B] int, 0 = padding row (nothing added)
    lse_ptr,  # [B, Hq] fp32 natural-log log-sum-exp (HAS_LSE)
    acc_ptr,  # [num_pages * PAGE_SIZE, Hkv] fp32 sums of this layer, updated in place
    max_tokens,  # max_pages * PAGE_SIZE: longer context_lens are clamped
    qk_scale,  # sm_scale * log2(e)
    stride_qb,
    stride_qh,
    stride_cp,
    stride_ct,
    stride_ch,
    stride_btb,
    stride_lb,
    stride_as,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_LSE: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    offs_g = tl.arange(0, BLOCK_H)
    mask_h = offs_g < GROUP
    offs_h = kv_head * GROUP + offs_g
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    q = tl.load(
        q_ptr + b * stride_qb + offs_h[:, None] * stride_qh + offs_d[None, :],
        mask=mask_h[:, None] & mask_d[None, :],
        other=0.0,
    )
    q = q.to(tl.float32) if DOT_FP32 else q.to(k_cache_ptr.dtype.element_ty)
    context_len = tl.minimum(tl.load(context_lens_ptr + b), max_tokens)
    head_off = kv_head * stride_ch

    if HAS_LSE:
        lse = tl.load(lse_ptr + b * stride_lb + offs_h, mask=mask_h, other=0.0) * _LOG2E
    else:
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        for n0 in range(0, context_len, BLOCK_N):
            s, _, _ = _logits(
                q,
                k_cache_ptr,
                block_tables_ptr,
                b,
                n0,
                context_len,
                head_off,
                offs_d,
                mask_d,
                qk_scale,
                stride_btb,
                stride_cp,
                stride_ct,
                PAGE_SIZE,
                BLOCK_N,
                DOT_FP32,
            )
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            l_i = l_i * tl.exp2(m_i - m_safe) + tl.sum(tl.exp2(s - m_safe[:, None]), 1)
            m_i = m_new
        lse = m_i + tl.log2(tl.where(l_i > 0.0, l_i, 1.0))

    for n0 in range(0, context_len, BLOCK_N):
        s, offs_n, slot = _logits(
            q,
            k_cache_ptr,
            block_tables_ptr,
            b,
            n0,
            context_len,
            head_off,
            offs_d,
            mask_d,
            qk_scale,
            stride_btb,
            stride_cp,
            stride_ct,
            PAGE_SIZE,
            BLOCK_N,
            DOT_FP32,
        )
        p = tl.where(mask_h[:, None], tl.exp2(s - lse[:, None]), 0.0)  # masked slots: 0
        mean = tl.sum(p, 0) / GROUP
        mask_n = slot >= 0
        ptrs = acc_ptr + slot * stride_as + kv_head
        old = tl.load(ptrs, mask=mask_n, other=0.0)
        old = tl.where(offs_n == context_len - 1, 0.0, old)  # the step's own token: set
        tl.store(ptrs, old + mean, mask=mask_n)


@triton.jit
def _logits(
    q,
    k_cache_ptr,
    block_tables_ptr,
    b,
    n0,
    context_len,
    head_off,
    offs_d,
    mask_d,
    qk_scale,
    stride_btb,
    stride_cp,
    stride_ct,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """Scaled log2-domain logits ``[BLOCK_H, BLOCK_N]`` of tile ``n0`` (-inf off the context),
    the tile's token indices and flat slots (-1 off the context)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask_n = offs_n < context_len
    page = tl.load(block_tables_ptr + b * stride_btb + offs_n // PAGE_SIZE, mask=mask_n, other=-1)
    mask_n = mask_n & (page >= 0)
    tok_off = page.to(tl.int64) * stride_cp + (offs_n % PAGE_SIZE) * stride_ct + head_off
    k = tl.load(
        k_cache_ptr + tok_off[:, None] + offs_d[None, :],
        mask=mask_n[:, None] & mask_d[None, :],
        other=0.0,
    )
    if DOT_FP32:
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = tl.where(mask_n[None, :], s * qk_scale, float("-inf"))
    slot = tl.where(mask_n, page.to(tl.int64) * PAGE_SIZE + offs_n % PAGE_SIZE, -1)
    return s, offs_n, slot


def check_pages_owned(
    block_tables: torch.Tensor, context_lens: torch.Tensor, page_size: int
) -> None:
    """No page in two rows' contexts, nor twice in one: each row's programs read, add to and
    write back the sums of its pages' slots (no atomics), so a page read by two rows, or in two
    tiles of one, has two writers and loses one's addition."""

    def note(first: tuple[int, ...], second: tuple[int, ...]) -> str:
        rows = dict.fromkeys((first[0], second[0]))
        return "within " + " and ".join(f"context_lens[{b}] = {int(context_lens[b])}" for b in rows)

    check_distinct(
        block_tables,
        "block_tables",
        "each page at most once over all rows' contexts (its slots' sums are "
        "added to; -1 may repeat)",
        where=lambda: pages_read(block_tables, context_lens, page_size),
        note=note,
    )


def accumulate_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    acc: torch.Tensor,
    sm_scale: float | None = None,
    lse: torch.Tensor | None = None,
    *,
    block_n: int | None = None,
    num_warps: int | None = None,
) -> None:
    """Add one decode step's attention (group mean per KV head) into ``acc`` in place.

    Args:
        q: ``[B, Hq, d]`` post-RoPE queries of the step.
        k_cache: ``[num_pages, page_size, Hkv, d]`` one layer's keys (the step's own keys stored).
        block_tables: ``[B, max_pages]`` int physical pages, -1 padded; a page at most once
            over all rows' contexts (rows own their slots: no prefix sharing).
        context_lens: ``[B]`` int slots attended (the step's token last); 0 = padding row.
        acc: ``[num_pages * page_size, Hkv]`` fp32 per-slot sums of the layer (contiguous heads).
            Slot ``context_len - 1`` of each row is set, every other context slot added to.
        sm_scale: softmax scale, default ``d ** -0.5``.
        lse: optional ``[B, Hq]`` fp32 natural-log log-sum-exp of each row (skips a pass).
    """
    if not (q.dim() == 3 and k_cache.dim() == 4):
        raise KernelInputError(
            f"q [B, Hq, d] and k_cache [num_pages, page_size, Hkv, d] expected, got shapes "
            f"{tuple(q.shape)} and {tuple(k_cache.shape)}"
        )
    num_seqs, num_heads, head_dim = q.shape
    num_pages, page_size, num_kv_heads, d_cache = k_cache.shape
    check_float(q, "q")
    check_float(k_cache, "k_cache")
    if not (q.stride(-1) == 1 and k_cache.stride(-1) == 1):
        raise KernelInputError("q, k_cache: last dim contiguous")
    if d_cache != head_dim:
        raise KernelInputError(f"head dim: q has {head_dim}, the cache {d_cache}")
    check_heads(num_heads, num_kv_heads)
    if block_n is not None:
        check_block(block_n)
    check_sums(acc, (num_pages * page_size, num_kv_heads), "acc")
    check_index(block_tables, 2, "block_tables")
    check_index(context_lens, 1, "context_lens")
    if not (block_tables.shape[0] == context_lens.shape[0] == num_seqs):
        raise KernelInputError(
            f"block_tables {tuple(block_tables.shape)} and context_lens "
            f"{tuple(context_lens.shape)} need one row per query ({num_seqs})"
        )
    if lse is not None:
        if not (lse.shape == (num_seqs, num_heads) and lse.dtype == torch.float32):
            raise KernelInputError(
                f"lse: fp32 {(num_seqs, num_heads)} expected, got {lse.dtype} {tuple(lse.shape)}"
            )
        if lse.stride(1) != 1:
            raise KernelInputError("lse: last dim contiguous")
        check_device(q, k_cache, block_tables, context_lens, acc, lse)
    else:
        check_device(q, k_cache, block_tables, context_lens, acc)
    if index_checks_on():
        check_context_lens(context_lens, block_tables, page_size)
        check_block_tables(block_tables, context_lens, page_size, num_pages)
        check_pages_owned(block_tables, context_lens, page_size)
    if num_seqs == 0:
        return
    group = num_heads // num_kv_heads
    scale = (sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim)) * LOG2E
    block_n = block_n or default_block_n(head_dim, k_cache.dtype)
    _accumulate_kernel[(num_seqs, num_kv_heads)](
        q,
        k_cache,
        block_tables,
        context_lens,
        lse if lse is not None else acc,
        acc,
        block_tables.shape[1] * page_size,
        scale,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        lse.stride(0) if lse is not None else 0,
        acc.stride(0),
        GROUP=group,
        HEAD_DIM=head_dim,
        PAGE_SIZE=page_size,
        BLOCK_H=max(MIN_DOT_DIM, next_pow2(group)),
        BLOCK_N=block_n,
        BLOCK_D=max(MIN_DOT_DIM, next_pow2(head_dim)),
        HAS_LSE=lse is not None,
        DOT_FP32=dot_in_fp32(k_cache.dtype),
        num_warps=num_warps or tile_warps(block_n, head_dim, k_cache.dtype),
    )
