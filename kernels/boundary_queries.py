"""Boundary query summaries: RMS calibration (Eq. 12) and RoPE alignment in one launch.

At a KV capacity boundary the demand estimator needs, for one request, its two query summaries
(short and long EMA of the *pre-RoPE* queries, see ``query_state``) turned into queries that can
be scored against the cached, already rotated keys (paper appendix E.1):

1. RMS calibration (Eq. 12): each (layer, head) summary row ``x`` is rescaled to the RMS of the
   request's current query row ``q``: ``x * (rms(q) / max(rms(x), eps))`` with
   ``rms(v) = sqrt(mean_d(v**2))``. EMAs of unit-ish vectors shrink; this restores their scale.
2. RoPE alignment: the calibrated row is rotated to the current absolute ``position`` with the
   rotate-half convention of ``growpage.core.rope``: ``angles = inv_freq * position`` (an fp32
   product, as ``rope_at`` computes it), ``cos/sin`` of ``[angles, angles]`` and
   ``out = x * cos + rotate_half(x) * sin`` with ``rotate_half([x1, x2]) = [-x2, x1]``.

Output ``[2, L, Hq, d]`` fp32 (view 0 short, 1 long) is the ``queries`` input of
``demand.demand_attention``. The torch path is ``rope_at(cfg, rms_calibrate(s, cur), position)``
per view (``growpage.core.boundary_context``); this kernel replaces its ~30 small ops with one launch.

One program per (layer, block of query heads, request) handles both views: it loads the current
rows once, then per view the rows and their rotate-half partners (permuted offsets
``(d + D/2) % D`` and a sign), and computes cos/sin in fp32 in the kernel. Any even head dim
works (masked to the next power of two). Each request's slot and position come from a small
int32 table on the device, so one launch serves every request at a boundary in a step
(``boundary_queries_batch``).
"""

from __future__ import annotations

import operator

import torch
import triton
import triton.language as tl

from ._utils import (
    KernelInputError,
    at,
    cdiv,
    check_device,
    check_values,
    index_checks_on,
    next_pow2,
)

NUM_VIEWS = 2
# Elements of one [BLOCK_H, BLOCK_D] tile: bounds the heads per program for large head dims.
_TILE_ELEMS = 4096


# Per-call quantities (the meta column and row stride, the layer strides, which follow the
# pool's slot count) must not pick the compiled variant.
@triton.jit(
    do_not_specialize=["meta_col", "stride_mr", "stride_sl", "stride_cl", "stride_or"],
    do_not_specialize_on_alignment=["meta_ptr"],
)
def _boundary_queries_kernel(
    summ_ptr,  # [L, M, 2, Hq, D] fp32 query-state pool (pre-RoPE summaries)
    cur_ptr,  # [L, M, Hq, D] fp32 current (last) query of each slot
    inv_freq_ptr,  # [D/2] fp32 RoPE inverse frequencies
    out_ptr,  # [R, 2, L, Hq, D] fp32 calibrated, rotated summaries
    meta_ptr,  # [R, >= meta_col + 2] int32: each request's slot and position at meta_col
    meta_col,
    stride_mr,
    eps,
    stride_sl,
    stride_sm,
    stride_sv,
    stride_sh,
    stride_cl,
    stride_cm,
    stride_ch,
    stride_or,
    stride_ov,
    stride_ol,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    layer = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    request = tl.program_id(2).to(tl.int64)
    meta = meta_ptr + request * stride_mr + meta_col
    slot = tl.load(meta).to(tl.int64)
    position = tl.load(meta + 1).to(tl.float32)  # as float(position) in ``rope_at``
    offs_d = tl.arange(0, BLOCK_D)
    half: tl.constexpr = HEAD_DIM // 2
    mask_h = offs_h < NUM_HEADS
    mask_d = offs_d < HEAD_DIM
    mask = mask_h[:, None] & mask_d[None, :]
    # rotate_half([x1, x2]) = [-x2, x1]: element i takes its partner (i + D/2) % D with a sign
    partner = (offs_d + half) % HEAD_DIM
    sign = tl.where(offs_d < half, -1.0, 1.0)

    # angles = inv_freq * position in fp32, duplicated over both halves: [angles, angles]
    inv = tl.load(inv_freq_ptr + offs_d % half, mask=mask_d, other=0.0)
    angles = inv * position
    cos = tl.cos(angles)[None, :]
    sin = (tl.sin(angles) * sign)[None, :]

    cur = tl.load(
        cur_ptr
        + layer * stride_cl
        + slot * stride_cm
        + offs_h[:, None] * stride_ch
        + offs_d[None, :],
        mask=mask,
        other=0.0,
    )
    rms_q = tl.sqrt(tl.sum(cur * cur, 1) / HEAD_DIM)  # [BLOCK_H]

    rows = offs_h[:, None] * stride_sh
    out_base = out_ptr + request * stride_or + layer * stride_ol
    for v in tl.static_range(2):
        base = summ_ptr + layer * stride_sl + slot * stride_sm + v * stride_sv + rows
        x = tl.load(base + offs_d[None, :], mask=mask, other=0.0)
        x_partner = tl.load(base + partner[None, :], mask=mask, other=0.0)
        rms_s = tl.sqrt(tl.sum(x * x, 1) / HEAD_DIM)
        scale = (rms_q / tl.maximum(rms_s, eps))[:, None]
        calibrated = x * scale
        out = calibrated * cos + (x_partner * scale) * sin
        tl.store(
            out_base + v * stride_ov + offs_h[:, None] * stride_oh + offs_d[None, :], out, mask=mask
        )


def _check_args(summaries: torch.Tensor, current: torch.Tensor, inv_freq: torch.Tensor) -> None:
    for name, t, ndim in (
        ("summaries", summaries, 5),
        ("current", current, 4),
        ("inv_freq", inv_freq, 1),
    ):
        if t.dim() != ndim:
            raise KernelInputError(f"{name}: expected {ndim} dims, got shape {tuple(t.shape)}")
        if t.dtype != torch.float32:
            raise KernelInputError(f"{name}: expected torch.float32, got {t.dtype}")
        if t.numel() and t.stride(-1) != 1:
            raise KernelInputError(f"{name}: last dimension must be contiguous")
    num_layers, num_slots, num_views, num_heads, head_dim = summaries.shape
    if num_views != NUM_VIEWS:
        raise KernelInputError(
            f"summaries: expected [L, M, 2, Hq, d], got shape {tuple(summaries.shape)}"
        )
    if current.shape != (num_layers, num_slots, num_heads, head_dim):
        raise KernelInputError(
            f"current: expected shape {(num_layers, num_slots, num_heads, head_dim)} "
            f"([L, M, Hq, d] of summaries), got {tuple(current.shape)}"
        )
    if head_dim == 0 or head_dim % 2:
        raise KernelInputError(f"head dim must be even and > 0, got {head_dim}")
    if inv_freq.shape[0] != head_dim // 2:
        raise KernelInputError(
            f"inv_freq: expected length d/2 = {head_dim // 2}, got {inv_freq.shape[0]}"
        )
    check_device(summaries, current, inv_freq)


def boundary_queries(
    summaries: torch.Tensor,
    current: torch.Tensor,
    slot: int,
    position: int,
    inv_freq: torch.Tensor,
    eps: float = 1e-12,
) -> torch.Tensor:
    """Calibrated (Eq. 12), RoPE-aligned query summaries of one request at a boundary.

    Args:
        summaries: ``[L, M, 2, Hq, d]`` fp32 query-state pool, pre-RoPE (0 short, 1 long EMA).
        current: ``[L, M, Hq, d]`` fp32 last (pre-RoPE) query of each slot.
        slot: the request's slot, ``0 <= slot < M``; no other slot is read.
        position: absolute position ``>= 0`` to rotate the summaries to.
        inv_freq: ``[d/2]`` fp32 RoPE inverse frequencies on the same device
            (``growpage.core.rope.inv_frequencies_on(cfg, device)``).
        eps: floor of a summary row's RMS (an all-zero row stays zero).

    Returns:
        ``[2, L, Hq, d]`` fp32, equal to ``rope_at(cfg, rms_calibrate(s, cur), position)`` for
        ``s`` = short and long summary. Raises ``ValueError`` on bad shapes, dtypes, slot,
        position or head dim (``KernelInputError`` from ``check_device`` on a device mismatch). One
        request of ``boundary_queries_batch`` (slot and position go to the device in one small
        copy).
    """
    _check_args(summaries, current, inv_freq)
    slot, position = operator.index(slot), operator.index(position)
    num_slots = summaries.shape[1]
    if not 0 <= slot < num_slots:
        raise KernelInputError(f"slot {slot} out of range [0, {num_slots})")
    if position < 0:
        raise KernelInputError(f"position must be >= 0, got {position}")
    if position >= 2**31:
        raise KernelInputError(f"position must be < 2**31 (an int32 on the device), got {position}")
    meta = torch.tensor([[slot, position]], dtype=torch.int32).to(summaries.device)
    return _boundary_queries_batch(summaries, current, meta, 0, inv_freq, eps, False)[0]


def boundary_queries_batch(
    summaries: torch.Tensor,
    current: torch.Tensor,
    meta: torch.Tensor,
    meta_col: int,
    inv_freq: torch.Tensor,
    eps: float = 1e-12,
) -> torch.Tensor:
    """``boundary_queries`` of R requests in one launch.

    Args:
        meta: ``[R, W]`` int32 on the device: request r's slot at ``meta_col``, in ``[0, M)``,
            and its position at ``meta_col + 1``, ``>= 0``. Other columns are not read. The
            values are checked (``ValueError``) on CPU, and on a GPU only when index checks
            are on (``GROWPAGE_CHECK_INDICES=1``: the check syncs).

    Returns:
        ``[R, 2, L, Hq, d]`` fp32.
    """
    return _boundary_queries_batch(summaries, current, meta, meta_col, inv_freq, eps, True)


def check_meta(meta: torch.Tensor, meta_col: int, num_slots: int) -> None:
    """Each request's query-state slot in ``[0, num_slots)`` and position ``>= 0``."""
    check_values(
        meta[:, meta_col],
        "meta",
        0,
        num_slots,
        f"a query-state slot in [0, {num_slots})",
        label=lambda i: at("meta", (i[0], meta_col)),
        exc=ValueError,
    )
    check_values(
        meta[:, meta_col + 1],
        "meta",
        0,
        None,
        "a position >= 0",
        label=lambda i: at("meta", (i[0], meta_col + 1)),
        exc=ValueError,
    )


def _boundary_queries_batch(
    summaries: torch.Tensor,
    current: torch.Tensor,
    meta: torch.Tensor,
    meta_col: int,
    inv_freq: torch.Tensor,
    eps: float,
    check: bool,
) -> torch.Tensor:
    """``check``: read ``meta``'s values (``boundary_queries`` checked its slot and position on
    the host)."""
    _check_args(summaries, current, inv_freq)
    if not (meta.dim() == 2 and meta.dtype == torch.int32 and meta.stride(-1) == 1):
        raise KernelInputError(
            f"meta: expected a row-contiguous [R, W] int32 tensor, got "
            f"{meta.dtype} {tuple(meta.shape)}"
        )
    if meta_col < 0:
        raise KernelInputError(f"meta_col must be >= 0, got {meta_col}")
    if meta.shape[1] < meta_col + 2:
        raise KernelInputError(f"meta: {meta.shape[1]} columns, need {meta_col + 2}")
    check_device(summaries, meta)
    # NOTE: no repeat check: a slot is only read, each request writes its own output row, so
    # two requests may read one slot.
    if check and index_checks_on():
        check_meta(meta, meta_col, summaries.shape[1])
    num_layers, _, _, num_heads, head_dim = summaries.shape
    num_req = meta.shape[0]
    out = torch.empty(
        num_req,
        NUM_VIEWS,
        num_layers,
        num_heads,
        head_dim,
        dtype=torch.float32,
        device=summaries.device,
    )
    if out.numel() == 0:
        return out
    block_d = next_pow2(head_dim)
    block_h = min(next_pow2(num_heads), max(1, _TILE_ELEMS // block_d))
    _boundary_queries_kernel[(num_layers, cdiv(num_heads, block_h), num_req)](
        summaries,
        current,
        inv_freq,
        out,
        meta,
        meta_col,
        meta.stride(0),
        float(eps),
        *summaries.stride()[:4],
        *current.stride()[:3],
        *out.stride()[:4],
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
    )
    return out
