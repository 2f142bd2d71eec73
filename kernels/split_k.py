"""Split-K helpers for flash-decoding: the static split count and the log-sum-exp merge.

Each split of a (request, query head) row leaves a normalized partial output ``o_s`` and its
log2-sum-exp ``lse_s`` (-inf when the split saw no token); the merged output is
``sum_s 2^(lse_s - m) o_s / sum_s 2^(lse_s - m)`` with ``m = max_s lse_s``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._utils import KernelInputError, cdiv, next_pow2, num_sms

LOG2E = 1.4426950408889634
# Most splits of one row; the merge reads them as one tile of this width, whatever the count,
# so the count never changes the compiled kernel.
MAX_SPLITS = 32


@triton.jit(
    do_not_specialize=[
        "num_splits",
        "stride_pb",
        "stride_ph",
        "stride_ps",
        "stride_lb",
        "stride_lh",
    ]
)
def _merge_splits_kernel(
    part_ptr,  # [B, Hq, num_splits, D] fp32 normalized partial outputs
    lse_ptr,  # [B, Hq, num_splits] fp32 log2-sum-exp per split (-inf = empty split)
    out_ptr,  # [B, Hq, D]
    num_splits,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,  # >= num_splits
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    mask_s = offs_s < num_splits
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    lse = tl.load(
        lse_ptr + b * stride_lb + h * stride_lh + offs_s, mask=mask_s, other=float("-inf")
    )
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)  # empty splits weigh 0
    part = tl.load(
        part_ptr + b * stride_pb + h * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :],
        mask=mask_s[:, None] & mask_d[None, :],
        other=0.0,
    )
    w_sum = tl.sum(w, 0)
    out = tl.sum(part * w[:, None], 0) / tl.where(w_sum > 0.0, w_sum, 1.0)
    tl.store(
        out_ptr + b * stride_ob + h * stride_oh + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=mask_d,
    )


def default_num_splits(
    num_seqs: int, num_kv_heads: int, max_context: int, device: torch.device, block_n: int
) -> int:
    """Split count from static quantities only: fill ~2 waves of SMs, >= 4 tiles per split."""
    programs = max(num_seqs * num_kv_heads, 1)
    want = cdiv(2 * num_sms(device), programs)
    most = max(max_context // (4 * block_n), 1)
    return int(max(1, min(want, most, MAX_SPLITS)))


def merge_splits(part: torch.Tensor, lse: torch.Tensor, out: torch.Tensor) -> None:
    """Merge fp32 partials ``part [B, Hq, S, d]`` and ``lse [B, Hq, S]`` into ``out [B, Hq, d]``."""
    num_seqs, num_heads, splits, head_dim = part.shape
    if not (part.stride(-1) == 1 and lse.shape == part.shape[:3] and lse.stride(-1) == 1):
        raise KernelInputError(
            f"merge_splits: part [B, Hq, S, d] and lse [B, Hq, S] with a dense last dimension "
            f"expected, got part {tuple(part.shape)} strides {part.stride()}, lse "
            f"{tuple(lse.shape)} strides {lse.stride()}"
        )
    if not (out.shape == (num_seqs, num_heads, head_dim) and out.stride(-1) == 1):
        raise KernelInputError(
            f"merge_splits: out [B, Hq, d] = {(num_seqs, num_heads, head_dim)} with a dense last "
            f"dimension expected, got {tuple(out.shape)} strides {out.stride()}"
        )
    if not (1 <= splits <= MAX_SPLITS):
        raise KernelInputError(f"split count must lie in [1, {MAX_SPLITS}], got {splits}")
    _merge_splits_kernel[(num_seqs, num_heads)](
        part,
        lse,
        out,
        splits,
        part.stride(0),
        part.stride(1),
        part.stride(2),
        lse.stride(0),
        lse.stride(1),
        out.stride(0),
        out.stride(1),
        HEAD_DIM=head_dim,
        BLOCK_S=MAX_SPLITS,
        BLOCK_D=next_pow2(head_dim),
    )
