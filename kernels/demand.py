"""Demand estimation at a capacity boundary (paper section 3.2, appendix E.1).

Input: one request's calibrated, RoPE-rotated query summaries ``[V, L, Hq, d]`` (V = 2 views:
short, long; calibration and rotation happen in ``growpage.core``) and its first Nc tokens
(the estimation candidates) read through its block table. Output: per view, layer and KV head
the attention distribution over the candidates, ``[V, L, Hkv, Nc]`` fp32, where a KV head's
distribution is the mean of its query heads' softmax rows (native GQA mapping).

Two kernels, keys read from HBM once:

1. ``_demand_logits_kernel``, one program per (layer, KV head, candidate split): all V * GROUP
   query rows of the KV head in one fp32 ``tl.dot`` tile (tf32x3 on GPU: boundary-only work,
   so accuracy of the distributions wins over speed); writes log2-scaled logits to a scratch
   ``[V, L, Hq, Nc]`` fp32 and per-split running max / sum.
2. ``_demand_normalize_kernel``: merges the split statistics into a log-sum-exp per row, turns
   the logits into probabilities and averages each view's GROUP rows.

Top-p working-set sizes (Eq. 7) stay in torch (``working_set_sizes``: sort + cumsum);
``estimate_demand`` bundles the distributions, sizes, Δt (Eq. 8) and the scores of Eq. 9.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ._utils import (
    MIN_DOT_DIM,
    STRIDE_ALIGN,
    TILE_BYTES,
    KernelInputError,
    at,
    cdiv,
    check_block,
    check_device,
    check_float,
    check_heads,
    check_index,
    check_values,
    default_block_n,
    index_checks_on,
    is_interpreter,
    next_pow2,
    num_sms,
    page_range,
    stride_align,
)
from .split_k import LOG2E

# Most candidate splits per (layer, KV head); the merge reads one tile of this width.
MAX_SPLITS = 16


# Per-boundary quantities (request count, layer count, table width and meta column, scratch
# strides that follow the candidate counts, table address) and the cache's layer stride (it
# follows the pool size) stay out of the compile key: see ``growpage.kernels.variants``.
_PER_CALL = [
    "num_layers",
    "meta_col",
    "stride_tr",
    "stride_kl",
    "stride_qr",
    "stride_lr",
    "stride_lv",
    "stride_ll",
    "stride_lh",
    "stride_mr",
    "stride_mv",
    "stride_ml",
    "stride_mh",
    "stride_or",
    "stride_ov",
    "stride_ol",
    "stride_oh",
    "max_candidates",
]


@triton.jit(do_not_specialize=_PER_CALL[:13], do_not_specialize_on_alignment=["table_ptr"])
def _demand_logits_kernel(
    q_ptr,  # [R, V, L, Hq, D] calibrated, rotated query summaries
    k_cache_ptr,  # [L, num_pages, PAGE_SIZE, Hkv, D] keys of all layers
    table_ptr,  # [R, >= meta_col + 2] int32: the request's pages, then at meta_col Nc, splits
    logits_ptr,  # [R, V, L, Hq, Nc_max] fp32 scratch: log2-scaled logits
    max_ptr,  # [R, V, L, Hq, MAX_SPLITS] fp32 running max per split
    sum_ptr,  # [R, V, L, Hq, MAX_SPLITS] fp32 sum of exp2(logit - max) per split
    num_layers,
    meta_col,
    qk_scale,  # sm_scale * log2(e)
    stride_tr,
    stride_kl,
    stride_kp,
    stride_kt,
    stride_kh,
    stride_qr,
    stride_qv,
    stride_ql,
    stride_qh,
    stride_lr,
    stride_lv,
    stride_ll,
    stride_lh,
    stride_mr,
    stride_mv,
    stride_ml,
    stride_mh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    NUM_VIEWS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    CACHE_ALIGN: tl.constexpr,  # stride_kl a multiple of it (_utils.stride_align)
    SCRATCH_ALIGN: tl.constexpr,  # stride_lr, stride_lv, stride_ll, stride_lh likewise
):
    # The same values, known to be multiples (vector loads and stores; see _utils.STRIDE_ALIGN).
    stride_kl = stride_kl // CACHE_ALIGN * CACHE_ALIGN
    stride_lr = stride_lr // SCRATCH_ALIGN * SCRATCH_ALIGN
    stride_lv = stride_lv // SCRATCH_ALIGN * SCRATCH_ALIGN
    stride_ll = stride_ll // SCRATCH_ALIGN * SCRATCH_ALIGN
    stride_lh = stride_lh // SCRATCH_ALIGN * SCRATCH_ALIGN
    request = tl.program_id(0) // num_layers
    layer = tl.program_id(0) % num_layers
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    table = table_ptr + request.to(tl.int64) * stride_tr
    num_candidates = tl.load(table + meta_col)
    num_splits = tl.load(table + meta_col + 1)
    rows = tl.arange(0, BLOCK_R)  # row = view * GROUP + g
    mask_r = rows < NUM_VIEWS * GROUP
    view = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    q = tl.load(
        q_ptr
        + request * stride_qr
        + view[:, None] * stride_qv
        + layer * stride_ql
        + head[:, None] * stride_qh
        + offs_d[None, :],
        mask=mask_r[:, None] & mask_d[None, :],
        other=0.0,
    )
    q = q.to(tl.float32)
    k_base = k_cache_ptr + layer.to(tl.int64) * stride_kl + kv_head * stride_kh
    l_rows = (
        logits_ptr
        + request.to(tl.int64) * stride_lr
        + view * stride_lv
        + layer * stride_ll
        + head * stride_lh
    )  # [BLOCK_R]

    # A split past this request's count gets an empty range (its statistics are never read).
    chunk = tl.cdiv(tl.cdiv(num_candidates, num_splits), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, num_candidates)
    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        page = tl.load(table + offs_n // PAGE_SIZE, mask=mask_n, other=-1)
        mask_n = mask_n & (page >= 0)
        k_off = page.to(tl.int64) * stride_kp + (offs_n % PAGE_SIZE) * stride_kt
        k = tl.load(
            k_base + k_off[:, None] + offs_d[None, :],
            mask=mask_n[:, None] & mask_d[None, :],
            other=0.0,
        )
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision=DOT_PRECISION)
        s = tl.where(mask_n[None, :], s * qk_scale, float("-inf"))
        tl.store(
            l_rows[:, None] + offs_n[None, :], s, mask=mask_r[:, None] & (offs_n < end)[None, :]
        )
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        l_i = l_i * tl.exp2(m_i - m_safe) + tl.sum(tl.exp2(s - m_safe[:, None]), 1)
        m_i = m_new
    stat = request * stride_mr + view * stride_mv + layer * stride_ml + head * stride_mh + split
    tl.store(max_ptr + stat, m_i, mask=mask_r)
    tl.store(sum_ptr + stat, l_i, mask=mask_r)


@triton.jit(do_not_specialize=_PER_CALL, do_not_specialize_on_alignment=["table_ptr"])
def _demand_normalize_kernel(
    table_ptr,  # [R, >= meta_col + 2] int32 (only Nc and the split count are read)
    logits_ptr,  # [R, V, L, Hq, Nc_max] fp32 log2-scaled logits
    max_ptr,  # [R, V, L, Hq, MAX_SPLITS] fp32
    sum_ptr,  # [R, V, L, Hq, MAX_SPLITS] fp32
    out_ptr,  # [R, V, L, Hkv, Nc_max] fp32 attention distributions, zero past each Nc
    num_layers,
    meta_col,
    stride_tr,
    stride_lr,
    stride_lv,
    stride_ll,
    stride_lh,
    stride_mr,
    stride_mv,
    stride_ml,
    stride_mh,
    stride_or,
    stride_ov,
    stride_ol,
    stride_oh,
    max_candidates,
    GROUP: tl.constexpr,
    NUM_VIEWS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_S: tl.constexpr,  # >= every split count
    BLOCK_N: tl.constexpr,
    SCRATCH_ALIGN: tl.constexpr,  # stride_lr, stride_lv, stride_ll, stride_lh multiples of it
):
    stride_lr = stride_lr // SCRATCH_ALIGN * SCRATCH_ALIGN
    stride_lv = stride_lv // SCRATCH_ALIGN * SCRATCH_ALIGN
    stride_ll = stride_ll // SCRATCH_ALIGN * SCRATCH_ALIGN
    stride_lh = stride_lh // SCRATCH_ALIGN * SCRATCH_ALIGN
    request = tl.program_id(0) // num_layers
    layer = tl.program_id(0) % num_layers
    kv_head = tl.program_id(1)
    offs_n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    table = table_ptr + request.to(tl.int64) * stride_tr
    num_candidates = tl.load(table + meta_col)
    num_splits = tl.load(table + meta_col + 1)
    mask_n = offs_n < num_candidates
    rows = tl.arange(0, BLOCK_R)
    mask_r = rows < NUM_VIEWS * GROUP
    view = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    offs_s = tl.arange(0, BLOCK_S)
    stat = (request * stride_mr + view * stride_mv + layer * stride_ml + head * stride_mh)[
        :, None
    ] + offs_s[None, :]
    stat_mask = mask_r[:, None] & (offs_s < num_splits)[None, :]
    m_s = tl.load(max_ptr + stat, mask=stat_mask, other=float("-inf"))
    l_s = tl.load(sum_ptr + stat, mask=stat_mask, other=0.0)
    m = tl.max(m_s, 1)
    m = tl.where(m == float("-inf"), 0.0, m)
    total = tl.sum(l_s * tl.exp2(m_s - m[:, None]), 1)
    lse = m + tl.log2(tl.where(total > 0.0, total, 1.0))
    logits = tl.load(
        logits_ptr
        + (
            request.to(tl.int64) * stride_lr
            + view * stride_lv
            + layer * stride_ll
            + head * stride_lh
        )[:, None]
        + offs_n[None, :],
        mask=mask_r[:, None] & mask_n[None, :],
        other=float("-inf"),
    )
    p = tl.exp2(logits - lse[:, None]) / GROUP  # 0 past this request's candidates
    out = out_ptr + request.to(tl.int64) * stride_or + layer * stride_ol + kv_head * stride_oh
    for v in tl.static_range(NUM_VIEWS):
        mean = tl.sum(tl.where((view == v)[:, None], p, 0.0), 0)
        tl.store(out + v * stride_ov + offs_n, mean, mask=offs_n < max_candidates)


def demand_splits(
    num_candidates: int,
    num_layers: int,
    num_kv_heads: int,
    device: torch.device,
    block_n: int | None = None,
) -> int:
    """Candidate splits of one request's demand attention: enough programs to fill the device
    twice over, at least 4 blocks of candidates per split, at most ``MAX_SPLITS``. A request
    gets the same count alone or in a batch, so its distributions are the same bits."""
    block_n = block_n or (16 if is_interpreter() else 64)
    want = cdiv(2 * num_sms(device), num_layers * num_kv_heads)
    return max(1, min(want, cdiv(num_candidates, 4 * block_n), MAX_SPLITS))


def demand_attention(
    queries: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    num_candidates: int,
    sm_scale: float | None = None,
    *,
    num_splits: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """Per-KV-head attention distributions of the query summaries over the candidates.

    Args:
        queries: ``[V, L, Hq, d]`` calibrated, RoPE-rotated summaries (V=2: short, long).
        k_cache: ``[L, num_pages, page_size, Hkv, d]`` keys of all layers (``kv_cache[0]``).
        block_table: ``[max_pages]`` int32 the request's pages; candidates are its logical
            tokens ``0..num_candidates-1`` (the caller excludes the most recent page).
        num_candidates: Nc >= 1.

    Returns:
        ``[V, L, Hkv, Nc]`` fp32; each row sums to 1. One request of ``demand_attention_batch``
        (its table and counts go to the device in one small copy).
    """
    check_index(block_table, 1, "block_table")
    check_demand_ranks(queries, 4, k_cache)
    num_layers, page_size, num_kv_heads = queries.shape[1], k_cache.shape[2], k_cache.shape[3]
    most = block_table.shape[0] * page_size
    if not (0 < num_candidates <= most):
        raise KernelInputError(
            f"num_candidates must lie in [1, {most}] (block_table width {block_table.shape[0]} x "
            f"page size {page_size}), got {num_candidates}"
        )
    if num_splits is None:
        num_splits = demand_splits(
            num_candidates, num_layers, num_kv_heads, queries.device, block_n
        )
    if not (1 <= num_splits <= MAX_SPLITS):
        raise KernelInputError(f"num_splits must lie in [1, {MAX_SPLITS}], got {num_splits}")
    meta = torch.tensor([num_candidates, num_splits], dtype=torch.int32)
    table = torch.cat([block_table.to(torch.int32), meta.to(block_table.device)])[None]
    return _demand_attention_batch(
        queries[None],
        k_cache,
        table,
        block_table.shape[0],
        num_candidates,
        num_splits,
        sm_scale,
        block_n,
        block_table,
    )[0]


def demand_attention_batch(
    queries: torch.Tensor,
    k_cache: torch.Tensor,
    tables: torch.Tensor,
    meta_col: int,
    max_candidates: int,
    max_splits: int,
    sm_scale: float | None = None,
    *,
    block_n: int | None = None,
) -> torch.Tensor:
    """``demand_attention`` of R requests in two launches.

    Args:
        queries: ``[R, V, L, Hq, d]`` calibrated, rotated summaries of each request.
        k_cache: ``[L, num_pages, page_size, Hkv, d]``.
        tables: ``[R, W]`` int32, one row per request: its pages (``-1`` padded) in columns
            ``0..meta_col-1``, its candidate count Nc_r at ``meta_col`` and its split count
            (``demand_splits``, at most ``MAX_SPLITS``) at ``meta_col + 1``. Columns past
            those are not read (a row may carry more counts for another call).
        max_candidates: ``max(Nc_r)``, the output width (host value: no device read).
        max_splits: ``max`` of the split counts in ``tables``, in ``[1, MAX_SPLITS]``.

    Returns:
        ``[R, V, L, Hkv, max_candidates]`` fp32: row r holds request r's distributions over its
        Nc_r candidates, then zeros.
    """
    return _demand_attention_batch(
        queries, k_cache, tables, meta_col, max_candidates, max_splits, sm_scale, block_n, None
    )


def check_demand_ranks(queries: torch.Tensor, ndim: int, k_cache: torch.Tensor) -> None:
    shape = "[V, L, Hq, d]" if ndim == 4 else "[R, V, L, Hq, d]"
    if queries.dim() != ndim:
        raise KernelInputError(f"queries: expected {shape}, got shape {tuple(queries.shape)}")
    if k_cache.dim() != 5:
        raise KernelInputError(
            f"k_cache: expected [L, num_pages, page_size, Hkv, d] (all layers' keys), got shape "
            f"{tuple(k_cache.shape)}"
        )


def check_demand_tables(
    tables: torch.Tensor,
    meta_col: int,
    page_size: int,
    num_pages: int,
    max_candidates: int,
    max_splits: int,
) -> None:
    """Each row's candidate count in ``[0, min(max_candidates, meta_col * page_size)]``, its
    split count in ``[1, max_splits]``, and the pages of its candidates -1 or in the cache
    (columns past a row's candidates are not read and may hold anything)."""
    most = min(max_candidates, meta_col * page_size)
    counts = tables[:, meta_col]
    check_values(
        counts,
        "tables",
        0,
        most + 1,
        f"a candidate count in [0, {most}] (max_candidates {max_candidates}; "
        f"meta_col {meta_col} x page size {page_size})",
        label=lambda i: at("tables", (i[0], meta_col)),
    )
    check_values(
        tables[:, meta_col + 1],
        "tables",
        1,
        max_splits + 1,
        f"a split count in [1, {max_splits}] (max_splits)",
        label=lambda i: at("tables", (i[0], meta_col + 1)),
    )

    def read() -> torch.Tensor:
        columns = torch.arange(meta_col, device=tables.device)
        return columns[None, :] < ((counts + page_size - 1) // page_size)[:, None]

    def note(index: tuple[int, ...]) -> str:
        return f"a page of row {index[0]}'s {int(counts[index[0]])} candidates"

    check_values(
        tables[:, :meta_col], "tables", -1, num_pages, page_range(num_pages), where=read, note=note
    )


def _demand_attention_batch(
    queries: torch.Tensor,
    k_cache: torch.Tensor,
    tables: torch.Tensor,
    meta_col: int,
    max_candidates: int,
    max_splits: int,
    sm_scale: float | None,
    block_n: int | None,
    block_table: torch.Tensor | None,
) -> torch.Tensor:
    """``block_table``: ``demand_attention``'s, whose pages fill the one row of ``tables`` and
    whose candidate and split counts were checked on the host: its values are checked instead
    of the table's (before the cast to int32, which could wrap a large page id)."""
    check_demand_ranks(queries, 5, k_cache)
    num_req, num_views, num_layers, num_heads, head_dim = queries.shape
    _, _, page_size, num_kv_heads, d_cache = k_cache.shape
    if not (k_cache.shape[0] == num_layers and d_cache == head_dim):
        raise KernelInputError(
            f"queries {tuple(queries.shape)} vs k_cache {tuple(k_cache.shape)}: expected the same "
            f"layer count L and head dim d"
        )
    check_heads(num_heads, num_kv_heads)
    check_float(k_cache, "k_cache")
    check_float(queries, "queries")
    if not (queries.stride(-1) == 1 and k_cache.stride(-1) == 1):
        raise KernelInputError("queries, k_cache: last dim contiguous")
    if block_n is not None:
        check_block(block_n)
    check_index(tables, 2, "tables")
    if tables.dtype != torch.int32:
        raise KernelInputError(f"tables: int32 expected, got {tables.dtype}")
    if meta_col < 0:
        raise KernelInputError(f"meta_col must be >= 0, got {meta_col}")
    if not (tables.shape[0] == num_req and tables.shape[1] >= meta_col + 2):
        raise KernelInputError(
            f"tables: expected [{num_req}, >= {meta_col + 2}], got {tuple(tables.shape)}"
        )
    if not (0 < max_candidates <= meta_col * page_size):
        raise KernelInputError(
            f"max_candidates must lie in [1, {meta_col * page_size}] (meta_col {meta_col} x page "
            f"size {page_size}), got {max_candidates}"
        )
    if not (1 <= max_splits <= MAX_SPLITS):
        raise KernelInputError(f"max_splits must lie in [1, {MAX_SPLITS}], got {max_splits}")
    check_device(queries, k_cache, tables)
    # NOTE: no repeat checks: the tables are only read, and every write goes to the output and
    # scratch rows of the program's own (request, layer, head), so rows may share pages.
    if index_checks_on():
        num_pages = k_cache.shape[1]
        if block_table is None:
            check_demand_tables(tables, meta_col, page_size, num_pages, max_candidates, max_splits)
        else:
            check_values(
                block_table[: cdiv(max_candidates, page_size)],
                "block_table",
                -1,
                num_pages,
                page_range(num_pages),
            )
    group = num_heads // num_kv_heads
    device = queries.device
    # fp32 caches keep the bf16 tile's key count (2x its bytes): no spill at head dim 128
    block_n = block_n or default_block_n(head_dim, k_cache.dtype, fp32_tile_bytes=2 * TILE_BYTES)
    # Scratch rows padded to a multiple of STRIDE_ALIGN (never read past max_candidates): its
    # strides are then multiples of it whatever the candidate count (vector stores and loads).
    width = cdiv(max_candidates, STRIDE_ALIGN) * STRIDE_ALIGN
    logits = torch.empty(num_req, num_views, num_layers, num_heads, width, device=device)
    scratch_align = stride_align(*logits.stride()[:4])
    row_max = torch.empty(num_req, num_views, num_layers, num_heads, MAX_SPLITS, device=device)
    row_sum = torch.empty_like(row_max)
    out = torch.empty(num_req, num_views, num_layers, num_kv_heads, max_candidates, device=device)
    scale = (sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim)) * LOG2E
    # fp32 operands: fp16/bf16 keys are exact in tf32, and tf32x3 keeps the fp32 query's precision.
    precision = "ieee" if k_cache.dtype == torch.float32 or is_interpreter() else "tf32x3"
    block_r = max(MIN_DOT_DIM, next_pow2(num_views * group))
    _demand_logits_kernel[(num_req * num_layers, num_kv_heads, max_splits)](
        queries,
        k_cache,
        tables,
        logits,
        row_max,
        row_sum,
        num_layers,
        meta_col,
        scale,
        tables.stride(0),
        *k_cache.stride()[:4],
        *queries.stride()[:4],
        *logits.stride()[:4],
        *row_max.stride()[:4],
        GROUP=group,
        HEAD_DIM=head_dim,
        PAGE_SIZE=page_size,
        NUM_VIEWS=num_views,
        BLOCK_R=block_r,
        BLOCK_N=block_n,
        BLOCK_D=max(MIN_DOT_DIM, next_pow2(head_dim)),
        DOT_PRECISION=precision,
        CACHE_ALIGN=stride_align(k_cache.stride(0)),
        SCRATCH_ALIGN=scratch_align,
    )
    norm_block = 64 if is_interpreter() else 256
    _demand_normalize_kernel[
        (num_req * num_layers, num_kv_heads, cdiv(max_candidates, norm_block))
    ](
        tables,
        logits,
        row_max,
        row_sum,
        out,
        num_layers,
        meta_col,
        tables.stride(0),
        *logits.stride()[:4],
        *row_max.stride()[:4],
        *out.stride()[:4],
        max_candidates,
        GROUP=group,
        NUM_VIEWS=num_views,
        BLOCK_R=block_r,
        BLOCK_S=MAX_SPLITS,
        BLOCK_N=norm_block,
        SCRATCH_ALIGN=scratch_align,
    )
    return out


def working_set_sizes(attention: torch.Tensor, p: float) -> torch.Tensor:
    """Top-p working-set size (Eq. 7) per row of ``attention [..., Nc]``: int64 ``[...]``.

    The smallest k such that the k largest weights sum to at least p (clamped to Nc: p > 1
    gives Nc); ``ValueError`` for ``p <= 0`` or NaN. Ties do not change k.
    """
    if not p > 0.0:
        raise KernelInputError(f"top-p mass p must be > 0, got {p!r}")
    ordered = attention.sort(dim=-1, descending=True).values
    below = (ordered.cumsum(dim=-1) < p).sum(dim=-1)
    return (below + 1).clamp(max=attention.shape[-1])


class DemandSignals(NamedTuple):
    """What one boundary event needs (paper Eqs. 7-9); tensors on the cache's device."""

    attention: torch.Tensor  # [V, L, Hkv, Nc] fp32 distributions (view 0 short, 1 long)
    working_set: torch.Tensor  # [V, L, Hkv] int64 top-p sizes K^x
    ratio: torch.Tensor  # [V] fp32 mean over (layer, KV head) of K^x / Nc
    delta: torch.Tensor  # [] fp32 r^S - r^L (> tau: grow)
    scores: torch.Tensor  # [L, Hkv, Nc] fp32 max over views (selection importance)


def estimate_demand(
    queries: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    num_candidates: int,
    p: float = 0.99,
    sm_scale: float | None = None,
) -> DemandSignals:
    """``demand_attention`` plus the top-p sizes, Δt and scores, without a host sync.
    ``p > 0`` (``ValueError`` otherwise, NaN included, before any launch)."""
    if not p > 0.0:
        raise KernelInputError(f"top-p mass p must be > 0, got {p!r}")
    attention = demand_attention(queries, k_cache, block_table, num_candidates, sm_scale)
    sizes = working_set_sizes(attention, p)
    ratio = (sizes.float() / num_candidates).flatten(1).mean(dim=1)
    return DemandSignals(attention, sizes, ratio, ratio[0] - ratio[-1], attention.amax(dim=0))
