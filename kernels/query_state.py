"""Dual-timescale query summaries (paper Eq. 6 and 11): in-place EMA update of the query-state pool.

The pool is ``[L, max_num_seqs, 2, Hq, d]`` fp32 (index 0 = short EMA, 1 = long EMA); a layer's
view ``pool[l]`` is ``[max_num_seqs, 2, Hq, d]``. The input is the *pre-RoPE* (post q-norm) query.
On a request's first decode step both summaries are set to ``q`` instead of updated, which
overwrites the stale values of the slot's previous owner.

``_ema_update`` is also inlined into the paged decode-attention kernel (the fused path);
``update_query_state`` is the standalone (unfused) launch.
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
    check_values,
    check_written,
    index_checks_on,
    next_pow2,
)

BETA_SHORT = 0.9
BETA_LONG = 0.999


@triton.jit
def _ema_update(
    q_pre_ptr,  # [B, Hq, D] pre-RoPE query
    state_ptr,  # [M, 2, Hq, D] fp32 query-state pool of one layer
    slot_ids_ptr,  # [B] int, -1 = no slot (skip)
    is_first_ptr,  # [B] int, != 0 -> initialize instead of update
    b,
    offs_h,  # [BLOCK_H] query-head indices
    mask_h,  # [BLOCK_H]
    offs_d,  # [BLOCK_D]
    mask_d,  # [BLOCK_D]
    beta_short,
    beta_long,
    stride_qb,
    stride_qh,
    stride_sm,
    stride_sv,
    stride_sh,
):
    slot = tl.load(slot_ids_ptr + b).to(tl.int64)
    if slot >= 0:
        first = tl.load(is_first_ptr + b)
        mask = mask_h[:, None] & mask_d[None, :]
        q = tl.load(
            q_pre_ptr + b * stride_qb + offs_h[:, None] * stride_qh + offs_d[None, :],
            mask=mask,
            other=0.0,
        ).to(tl.float32)
        s_ptrs = state_ptr + slot * stride_sm + offs_h[:, None] * stride_sh + offs_d[None, :]
        old_s = tl.load(s_ptrs, mask=mask, other=0.0)
        old_l = tl.load(s_ptrs + stride_sv, mask=mask, other=0.0)
        # NOTE: tl.where, not arithmetic blending: stale slots may hold NaN/inf garbage.
        new_s = tl.where(first != 0, q, beta_short * old_s + (1.0 - beta_short) * q)
        new_l = tl.where(first != 0, q, beta_long * old_l + (1.0 - beta_long) * q)
        tl.store(s_ptrs, new_s, mask=mask)
        tl.store(s_ptrs + stride_sv, new_l, mask=mask)


# The index tensors' addresses (slices of a step's metadata) stay out of the compile key.
@triton.jit(do_not_specialize_on_alignment=["slot_ids_ptr", "is_first_ptr"])
def _update_query_state_kernel(
    q_pre_ptr,  # [B, Hq, D] pre-RoPE query
    state_ptr,  # [M, 2, Hq, D] fp32
    slot_ids_ptr,  # [B] int
    is_first_ptr,  # [B] int
    beta_short,
    beta_long,
    stride_qb,
    stride_qh,
    stride_sm,
    stride_sv,
    stride_sh,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    _ema_update(
        q_pre_ptr,
        state_ptr,
        slot_ids_ptr,
        is_first_ptr,
        b,
        offs_h,
        offs_h < NUM_HEADS,
        offs_d,
        offs_d < HEAD_DIM,
        beta_short,
        beta_long,
        stride_qb,
        stride_qh,
        stride_sm,
        stride_sv,
        stride_sh,
    )


def check_query_state_args(
    q_pre: torch.Tensor, state: torch.Tensor, slot_ids: torch.Tensor, is_first: torch.Tensor
) -> None:
    if not (q_pre.dim() == 3 and q_pre.stride(-1) == 1):
        raise KernelInputError("q_pre: [B, Hq, d], last dim contiguous")
    check_float(q_pre, "q_pre")
    if not (state.dim() == 4 and state.shape[1] == 2):
        raise KernelInputError("state: [max_num_seqs, 2, Hq, d]")
    if not (state.dtype == torch.float32 and state.stride(-1) == 1):
        raise KernelInputError("state: fp32, last dim dense")
    check_written(state, "state")
    if state.shape[2:] != q_pre.shape[1:]:
        raise KernelInputError(f"state {tuple(state.shape)} vs {tuple(q_pre.shape)}")
    check_index(slot_ids, 1, "slot_ids")
    if not (is_first.dim() == 1 and is_first.dtype in (torch.int32, torch.int64, torch.bool)):
        raise KernelInputError(
            f"is_first: [B] int32/int64/bool expected, got {is_first.dtype} {tuple(is_first.shape)}"
        )
    # NOTE: the kernels read is_first[b] at offset b; a bool one is converted (a dense copy).
    if not (is_first.dtype == torch.bool or is_first.stride(0) == 1):
        raise KernelInputError(f"is_first: must be contiguous, got stride {is_first.stride(0)}")
    if not (slot_ids.shape[0] == is_first.shape[0] == q_pre.shape[0]):
        raise KernelInputError("one slot/flag per request")
    check_device(q_pre, state, slot_ids, is_first)


def check_slot_ids(slot_ids: torch.Tensor, num_slots: int) -> None:
    """Each row's query-state slot: -1 (row skipped) or a slot of the pool, and no slot used
    by two rows: each row's program reads, updates and writes its slot's summaries, so two rows
    of one slot race (either's update, or a mix, stays, never both)."""
    check_values(
        slot_ids,
        "slot_ids",
        -1,
        num_slots,
        f"-1 (row skipped) or a query-state slot in [0, {num_slots})",
    )
    check_distinct(
        slot_ids,
        "slot_ids",
        "each query-state slot updated by one row at most (only -1, row skipped, may repeat)",
    )


def update_query_state(
    q_pre: torch.Tensor,
    state: torch.Tensor,
    slot_ids: torch.Tensor,
    is_first: torch.Tensor,
    beta_short: float = BETA_SHORT,
    beta_long: float = BETA_LONG,
) -> None:
    """Update one layer's query summaries in place (unfused launch).

    Args:
        q_pre: ``[B, Hq, d]`` pre-RoPE (post q-norm) decode queries, any float dtype.
        state: ``[max_num_seqs, 2, Hq, d]`` fp32 layer view of the query-state pool.
        slot_ids: ``[B]`` int32 slot per request, each slot at most once; -1 skips the row
            (static-batch padding, may repeat).
        is_first: ``[B]`` int32/bool; set both summaries to ``q`` on a request's first decode step.
    """
    check_query_state_args(q_pre, state, slot_ids, is_first)
    if index_checks_on():
        check_slot_ids(slot_ids, state.shape[0])
    if is_first.dtype == torch.bool:
        is_first = is_first.to(torch.int32)
    num_seqs, num_heads, head_dim = q_pre.shape
    if num_seqs == 0:
        return
    _update_query_state_kernel[(num_seqs,)](
        q_pre,
        state,
        slot_ids,
        is_first,
        float(beta_short),
        float(beta_long),
        q_pre.stride(0),
        q_pre.stride(1),
        state.stride(0),
        state.stride(1),
        state.stride(2),
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=max(2, next_pow2(num_heads)),
        BLOCK_D=next_pow2(head_dim),
    )
