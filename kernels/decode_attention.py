"""Paged decode attention (one new query token per request) with fused query-summary updates.

One program = one (request, KV head, context split): the GROUP = Hq / Hkv query heads that share
the KV head are processed together as the rows of one ``tl.dot`` tile (padded to >= 16 rows), so
each key/value is read from HBM once per KV head. Softmax is online (flash-decoding) with fp32
accumulation. Split-K: the context of each request is cut into NUM_SPLITS contiguous chunks;
every split writes a normalized partial output and its log-sum-exp, and a small second kernel
merges them. NUM_SPLITS depends only on static quantities (batch size, heads, block-table width,
SM count), so the launch shape is static and CUDA-graph capturable.

Token t of request b lives at slot ``block_tables[b, t // page_size] * page_size + t % page_size``::

    block_tables[b] = [ 7, 2, 9, -1, -1 ]      context_lens[b] = 10, page_size = 4
    tokens           0..3 | 4..7 | 8 9 . .
    physical page     7   |  2   |  9

Fused EMA (paper section 4.1): split 0 of each (request, KV head) program also updates the
short/long query summaries of its query heads from the *pre-RoPE* query ``q_pre``. The kernel
takes both queries (post-RoPE ``q`` for attention, pre-RoPE ``q_pre`` for the EMA) rather than
rotating inside, so the RoPE convention stays in ``growpage.core.rope``.

Prefill attention is not here: the engine uses torch SDPA (its torch backend) for prefill on GPU.
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
    check_float,
    check_heads,
    check_index,
    check_kv_pair,
    check_written,
    default_block_n,
    dot_in_fp32,
    index_checks_on,
    next_pow2,
)
from .query_state import (
    BETA_LONG,
    BETA_SHORT,
    _ema_update,
    check_query_state_args,
    check_slot_ids,
)
from .split_k import LOG2E, MAX_SPLITS, default_num_splits, merge_splits


# Per-step quantities (split count, table width, strides of the split scratch) and the
# addresses of the per-step index tensors stay out of the compile key, so a run compiles two
# variants (one split, several) and no more: see ``growpage.kernels.variants``.
@triton.jit(
    do_not_specialize=[
        "num_splits",
        "max_tokens",
        "stride_btb",
        "stride_ob",
        "stride_oh",
        "stride_os",
        "stride_lb",
        "stride_lh",
    ],
    do_not_specialize_on_alignment=[
        "block_tables_ptr",
        "context_lens_ptr",
        "slot_ids_ptr",
        "is_first_ptr",
        "lse_ptr",
    ],
)
def _decode_attention_kernel(
    q_ptr,  # [B, Hq, D] post-RoPE query
    k_cache_ptr,  # [num_pages, PAGE_SIZE, Hkv, D]
    v_cache_ptr,  # [num_pages, PAGE_SIZE, Hkv, D] (same strides as k_cache)
    block_tables_ptr,  # [B, max_pages] int, -1 padded
    context_lens_ptr,  # [B] int
    out_ptr,  # SPLIT: [B, Hq, num_splits, D] fp32 partials; else [B, Hq, D] output
    lse_ptr,  # [B, Hq, num_splits] fp32 log2-sum-exp of each split (SPLIT)
    q_pre_ptr,  # [B, Hq, D] pre-RoPE query (HAS_EMA)
    state_ptr,  # [M, 2, Hq, D] fp32 query-state pool of this layer (HAS_EMA)
    slot_ids_ptr,  # [B] int, -1 = no slot (HAS_EMA)
    is_first_ptr,  # [B] int (HAS_EMA)
    max_tokens,  # max_pages * PAGE_SIZE: longer context_lens are clamped (no OOB table reads)
    num_splits,  # programs along axis 2 (1 unless SPLIT)
    qk_scale,  # sm_scale * log2(e)
    beta_short,
    beta_long,
    stride_qb,
    stride_qh,
    stride_pqb,
    stride_pqh,
    stride_cp,
    stride_ct,
    stride_ch,
    stride_btb,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    stride_sm,
    stride_sv,
    stride_sh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    SPLIT: tl.constexpr,  # num_splits > 1: write partials and their log-sum-exp
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_EMA: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    offs_h = kv_head * GROUP + tl.arange(0, BLOCK_H)
    mask_h = tl.arange(0, BLOCK_H) < GROUP
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM

    if HAS_EMA:
        if split == 0:
            _ema_update(
                q_pre_ptr,
                state_ptr,
                slot_ids_ptr,
                is_first_ptr,
                b,
                offs_h,
                mask_h,
                offs_d,
                mask_d,
                beta_short,
                beta_long,
                stride_pqb,
                stride_pqh,
                stride_sm,
                stride_sv,
                stride_sh,
            )

    q = tl.load(
        q_ptr + b * stride_qb + offs_h[:, None] * stride_qh + offs_d[None, :],
        mask=mask_h[:, None] & mask_d[None, :],
        other=0.0,
    )
    if DOT_FP32:
        q = q.to(tl.float32)
    else:
        q = q.to(k_cache_ptr.dtype.element_ty)

    context_len = tl.minimum(tl.load(context_lens_ptr + b), max_tokens)
    chunk = tl.cdiv(tl.cdiv(context_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, context_len)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    head_off = kv_head * stride_ch
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        page = tl.load(
            block_tables_ptr + b * stride_btb + offs_n // PAGE_SIZE, mask=mask_n, other=-1
        )
        mask_n = mask_n & (page >= 0)
        tok_off = page.to(tl.int64) * stride_cp + (offs_n % PAGE_SIZE) * stride_ct + head_off
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(k_cache_ptr + tok_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + tok_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if DOT_FP32:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(mask_n[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # all-masked tile: no NaN
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if DOT_FP32:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    has_mass = l_i > 0.0
    out = acc / tl.where(has_mass, l_i, 1.0)[:, None]  # empty context -> zeros, not NaN
    out_mask = mask_h[:, None] & mask_d[None, :]
    if SPLIT:
        o_ptrs = (
            out_ptr
            + b * stride_ob
            + offs_h[:, None] * stride_oh
            + split * stride_os
            + offs_d[None, :]
        )
        tl.store(o_ptrs, out, mask=out_mask)
        lse = tl.where(has_mass, m_i + tl.log2(tl.where(has_mass, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + b * stride_lb + offs_h * stride_lh + split, lse, mask=mask_h)
    else:
        o_ptrs = out_ptr + b * stride_ob + offs_h[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=out_mask)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    sm_scale: float | None = None,
    out: torch.Tensor | None = None,
    *,
    q_pre: torch.Tensor | None = None,
    query_state: torch.Tensor | None = None,
    slot_ids: torch.Tensor | None = None,
    is_first: torch.Tensor | None = None,
    beta_short: float = BETA_SHORT,
    beta_long: float = BETA_LONG,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:
    """Decode attention over a paged KV cache, optionally updating the query summaries.

    Args:
        q: ``[B, Hq, d]`` post-RoPE queries (fp32/fp16/bf16).
        k_cache, v_cache: ``[num_pages, page_size, Hkv, d]`` one layer's view of the KV cache.
        block_tables: ``[B, max_pages]`` int32 physical page ids, -1 padded.
        context_lens: ``[B]`` int32 tokens to attend to (slots ``0..len-1``, current token included;
            0 = padding row, output zeros).
        sm_scale: softmax scale, default ``d ** -0.5``.
        out: optional ``[B, Hq, d]`` output buffer (dtype of ``q`` by default).
        q_pre, query_state, slot_ids, is_first: pass all four to fuse the EMA update
            (see ``update_query_state``): ``q_pre [B, Hq, d]`` pre-RoPE query,
            ``query_state [max_num_seqs, 2, Hq, d]`` fp32 layer view, ``slot_ids [B]``
            (distinct slots; -1 may repeat), ``is_first [B]``.
        num_splits: split-K factor in ``[1, 32]``; None = from static shapes
            (``default_num_splits``).
        block_n: context tile (a power of two; >= 16 on GPU); None = 64 on GPU, 16 on CPU.

    Returns:
        ``[B, Hq, d]`` attention output.
    """
    if q.dim() != 3:
        raise KernelInputError(f"q: expected [B, Hq, d], got shape {tuple(q.shape)}")
    if k_cache.dim() != 4:
        raise KernelInputError(
            f"k_cache: expected [num_pages, page_size, Hkv, d], got shape {tuple(k_cache.shape)}"
        )
    num_seqs, num_heads, head_dim = q.shape
    num_pages, page_size, num_kv_heads, d_cache = k_cache.shape
    check_float(q, "q")
    check_float(k_cache, "k_cache")
    if q.stride(-1) != 1:
        raise KernelInputError("q: last dim contiguous")
    check_kv_pair(k_cache, v_cache)
    if k_cache.stride(-1) != 1:
        raise KernelInputError("k_cache/v_cache: last dim contiguous")
    if k_cache.dtype != v_cache.dtype:
        raise KernelInputError(f"k_cache {k_cache.dtype} vs v_cache {v_cache.dtype}")
    if d_cache != head_dim:
        raise KernelInputError(f"head dim: q has {head_dim}, the cache {d_cache}")
    check_heads(num_heads, num_kv_heads)
    check_index(block_tables, 2, "block_tables")
    check_index(context_lens, 1, "context_lens")
    if not (block_tables.shape[0] == context_lens.shape[0] == num_seqs):
        raise KernelInputError(
            f"block_tables {tuple(block_tables.shape)} and context_lens "
            f"{tuple(context_lens.shape)} need one row per query ({num_seqs})"
        )
    check_device(q, k_cache, v_cache, block_tables, context_lens)
    # NOTE: everything is checked before the launch: the fused EMA writes the query state.
    if num_splits is not None:
        if not (1 <= num_splits <= MAX_SPLITS):
            raise KernelInputError(f"num_splits must lie in [1, {MAX_SPLITS}], got {num_splits}")
    if block_n is not None:
        check_block(block_n)
    if q_pre is None or query_state is None or slot_ids is None or is_first is None:
        if not (q_pre is query_state is slot_ids is is_first is None):
            raise KernelInputError("EMA args: all or none")
        has_ema = False
        q_pre, query_state, slot_ids, is_first = q, q, context_lens, context_lens  # unused
    else:
        has_ema = True
        check_query_state_args(q_pre, query_state, slot_ids, is_first)
        check_device(q, q_pre)  # the four EMA tensors are on one device (checked above)
        if q_pre.shape != q.shape:
            raise KernelInputError(f"q_pre {tuple(q_pre.shape)} vs q {tuple(q.shape)}")
        if is_first.dtype == torch.bool:
            is_first = is_first.to(torch.int32)
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    else:
        check_written(out, "out")
    if not (out.shape == q.shape and out.stride(-1) == 1):
        raise KernelInputError(
            f"out: expected {tuple(q.shape)} with a contiguous last dim, got {tuple(out.shape)}"
        )
    check_float(out, "out")
    check_device(q, out)
    if index_checks_on():
        check_context_lens(context_lens, block_tables, page_size)
        # Pages are only read (each row writes its own output row): rows may share a page.
        check_block_tables(block_tables, context_lens, page_size, num_pages)
        if has_ema:
            check_slot_ids(slot_ids, query_state.shape[0])  # written: distinct slots
    if num_seqs == 0:
        return out

    group = num_heads // num_kv_heads
    block_n = block_n or default_block_n(head_dim, k_cache.dtype)
    max_context = block_tables.shape[1] * page_size
    splits = num_splits
    if splits is None:
        splits = default_num_splits(num_seqs, num_kv_heads, max_context, q.device, block_n)
    if splits > 1:
        part = torch.empty(
            num_seqs, num_heads, splits, head_dim, dtype=torch.float32, device=q.device
        )
        lse = torch.empty(num_seqs, num_heads, splits, dtype=torch.float32, device=q.device)
        dst, dst_strides = part, (part.stride(0), part.stride(1), part.stride(2))
    else:
        lse = context_lens  # unused
        dst, dst_strides = out, (out.stride(0), out.stride(1), 0)
    scale = (sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim)) * LOG2E
    _decode_attention_kernel[(num_seqs, num_kv_heads, splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        dst,
        lse,
        q_pre,
        query_state,
        slot_ids,
        is_first,
        block_tables.shape[1] * page_size,
        splits,
        scale,
        float(beta_short),
        float(beta_long),
        q.stride(0),
        q.stride(1),
        q_pre.stride(0),
        q_pre.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        *dst_strides,
        lse.stride(0) if splits > 1 else 0,
        lse.stride(1) if splits > 1 else 0,
        *(query_state.stride()[:3] if has_ema else (0, 0, 0)),
        GROUP=group,
        HEAD_DIM=head_dim,
        PAGE_SIZE=page_size,
        SPLIT=splits > 1,
        BLOCK_H=max(MIN_DOT_DIM, next_pow2(group)),
        BLOCK_N=block_n,
        BLOCK_D=max(MIN_DOT_DIM, next_pow2(head_dim)),
        HAS_EMA=has_ema,
        DOT_FP32=dot_in_fp32(k_cache.dtype),
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if splits > 1:
        merge_splits(part, lse, out)
    return out
