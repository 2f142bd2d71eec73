"""KV compaction (Compress & Hold): gather each (layer, KV head)'s kept positions to the front.

For request r, layer l and KV head h, ``keep[r, l, h]`` lists K logical token positions
(ascending, -1 padded at the end) read through the source block table; entry j is written to
logical position j through the destination block table. Different (l, h) pairs keep different
tokens but the same count, so decode attention over ``0..K-1`` stays valid::

    before  pos: 0  1  2  3 | 4  5  6  7        keep[l, h] = [0, 2, 3, 6]
    after   pos: 0  2  3  6 | .  .  .  .        (one page of free slots)

Two routes:

* direct (default): one program per (request, layer, KV head) walks its tiles in order; each
  tile loads all its sources, barriers, then stores (no software pipelining, so no async copy
  can still be reading a source when another thread of the program stores over it). In place
  this is safe because ``keep[j'] >= j' > j`` for every later entry, so a write to position j
  never hits a source that is still to be read; entries with ``keep[j] == j`` are not moved.
  NOTE: keep must be ascending. Valid when every page present in both tables sits at the same index
  in both (in place, fresh pages, or partly reused pages kept in position); see
  ``is_direct_safe``.
* staged: gather every kept token into a staging buffer, then scatter it; correct for any
  overlap. Layers go in chunks so the buffer stays under ``max_stage_bytes``.

With ``accumulated`` (the engine's H2O sums, ``[L, num_pages * page_size, Hkv]`` fp32) each
kept slot's sum moves in the same program, on the same route, as its key and value.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._utils import (
    STRIDE_ALIGN,
    TILE_BYTES,
    KernelInputError,
    at,
    cdiv,
    check_device,
    check_float,
    check_index,
    check_sums,
    check_values,
    check_written,
    default_block_n,
    first_repeat,
    first_true,
    index_checks_on,
    next_pow2,
    page_range,
    stride_align,
    values_in,
)


# Per-boundary quantities (kept count, table widths, strides that follow the kept count, layer
# chunk start), the cache strides that follow the pool size and the tables' addresses stay out
# of the compile key: the engine compiles the three routes (direct, stage-out, stage-in) once.
# See ``growpage.kernels.variants``.
@triton.jit(
    do_not_specialize=[
        "num_keep",
        "layer0",
        "src_tokens",
        "dst_tokens",
        "stride_ckv",
        "stride_cl",
        "stride_sbt",
        "stride_dbt",
        "stride_kr",
        "stride_kl",
        "stride_kh",
        "stride_sr",
        "stride_sl",
        "stride_sh",
        "stride_skv",
        "stride_qr",
        "stride_ql",
        "stride_qh",
    ],
    do_not_specialize_on_alignment=["src_bt_ptr", "dst_bt_ptr", "keep_ptr"],
)
def _compact_kernel(
    cache_ptr,  # [2, L, num_pages, PAGE_SIZE, Hkv, D] KV cache (all layers)
    src_bt_ptr,  # [R, max_pages] int source block tables, -1 padded
    dst_bt_ptr,  # [R, max_pages_dst] int destination block tables, -1 padded
    keep_ptr,  # [R, L, Hkv, K] int logical positions to keep, ascending, -1 padded
    stage_ptr,  # [R, Lc, Hkv, 2, K, D] staging buffer (READ_STAGE or WRITE_STAGE)
    acc_ptr,  # [L, num_pages * PAGE_SIZE, Hkv] fp32 accumulated attention (HAS_ACC)
    acc_stage_ptr,  # [R, Lc, Hkv, K] fp32 staging of the sums (HAS_ACC, staged route)
    num_keep,
    layer0,  # first layer of this launch's layer chunk
    src_tokens,  # source table width * PAGE_SIZE: later positions are skipped (no OOB table reads)
    dst_tokens,  # destination table width * PAGE_SIZE: likewise
    stride_ckv,
    stride_cl,
    stride_cp,
    stride_ct,
    stride_ch,
    stride_sbt,
    stride_dbt,
    stride_kr,
    stride_kl,
    stride_kh,
    stride_sr,
    stride_sl,
    stride_sh,
    stride_skv,
    stride_sk,
    stride_al,
    stride_as,
    stride_qr,
    stride_ql,
    stride_qh,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    READ_STAGE: tl.constexpr,
    WRITE_STAGE: tl.constexpr,
    IN_PLACE: tl.constexpr,  # same table for source and destination: keep[j] == j moves nothing
    HAS_ACC: tl.constexpr,  # move each kept slot's accumulated attention along with its K/V
    CACHE_ALIGN: tl.constexpr,  # stride_ckv, stride_cl multiples of it (_utils.stride_align)
    STAGE_ALIGN: tl.constexpr,  # stride_sr, stride_sl, stride_sh, stride_skv likewise
):
    # The same values, known to be multiples (vector loads and stores; see _utils.STRIDE_ALIGN).
    stride_ckv = stride_ckv // CACHE_ALIGN * CACHE_ALIGN
    stride_cl = stride_cl // CACHE_ALIGN * CACHE_ALIGN
    stride_sr = stride_sr // STAGE_ALIGN * STAGE_ALIGN
    stride_sl = stride_sl // STAGE_ALIGN * STAGE_ALIGN
    stride_sh = stride_sh // STAGE_ALIGN * STAGE_ALIGN
    stride_skv = stride_skv // STAGE_ALIGN * STAGE_ALIGN
    r = tl.program_id(0)
    chunk_layer = tl.program_id(1)
    h = tl.program_id(2)
    layer = layer0 + chunk_layer
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    cache_base = cache_ptr + layer.to(tl.int64) * stride_cl + h * stride_ch
    stage_base = stage_ptr + r * stride_sr + chunk_layer * stride_sl + h * stride_sh
    keep_base = keep_ptr + r * stride_kr + layer * stride_kl + h * stride_kh
    acc_base = acc_ptr + layer.to(tl.int64) * stride_al + h
    acc_stage_base = acc_stage_ptr + r * stride_qr + chunk_layer * stride_ql + h * stride_qh
    for j0 in range(0, num_keep, BLOCK_N):
        offs_j = j0 + tl.arange(0, BLOCK_N)
        pos = tl.load(keep_base + offs_j, mask=offs_j < num_keep, other=-1)
        mask = (pos >= 0) & (pos < src_tokens) & (offs_j < dst_tokens)
        if IN_PLACE:
            mask = mask & (pos != offs_j)
        if READ_STAGE:
            src = stage_base + offs_j.to(tl.int64) * stride_sk
            src_kv = stride_skv
            acc_src = acc_stage_base + offs_j
        else:
            page = tl.load(src_bt_ptr + r * stride_sbt + pos // PAGE_SIZE, mask=mask, other=-1)
            mask = mask & (page >= 0)
            src = cache_base + page.to(tl.int64) * stride_cp + (pos % PAGE_SIZE) * stride_ct
            src_kv = stride_ckv
            acc_src = acc_base + (page.to(tl.int64) * PAGE_SIZE + pos % PAGE_SIZE) * stride_as
        if WRITE_STAGE:
            dst = stage_base + offs_j.to(tl.int64) * stride_sk
            dst_kv = stride_skv
            acc_dst = acc_stage_base + offs_j
        else:
            page = tl.load(dst_bt_ptr + r * stride_dbt + offs_j // PAGE_SIZE, mask=mask, other=-1)
            mask = mask & (page >= 0)
            dst = cache_base + page.to(tl.int64) * stride_cp + (offs_j % PAGE_SIZE) * stride_ct
            dst_kv = stride_ckv
            acc_dst = acc_base + (page.to(tl.int64) * PAGE_SIZE + offs_j % PAGE_SIZE) * stride_as
        mask2 = mask[:, None] & mask_d[None, :]
        k = tl.load(src[:, None] + offs_d[None, :], mask=mask2)
        v = tl.load(src[:, None] + src_kv + offs_d[None, :], mask=mask2)
        if HAS_ACC:
            a = tl.load(acc_src, mask=mask)
        # NOTE: every source of this tile is read before any of its destinations is written.
        tl.debug_barrier()
        tl.store(dst[:, None] + offs_d[None, :], k, mask=mask2)
        tl.store(dst[:, None] + dst_kv + offs_d[None, :], v, mask=mask2)
        if HAS_ACC:
            tl.store(acc_dst, a, mask=mask)


def is_direct_safe(block_tables: torch.Tensor, dst_block_tables: torch.Tensor) -> torch.Tensor:
    """Per request (``[R]`` bool): every page in both of its tables sits at the same index in
    both, and none of its pages is a destination page of another request or one of its own
    destination pages a page of another (the requests' programs run concurrently)."""
    src = block_tables[:, None, :].long()
    dst = dst_block_tables[:, :, None].long()
    same_page = (dst == src) & (dst >= 0)  # [R, dst_idx, src_idx]
    n_dst, n_src = same_page.shape[1:]
    diag = torch.eye(n_dst, n_src, dtype=torch.bool, device=same_page.device)
    return ~(same_page & ~diag).flatten(1).any(dim=1) & ~_shared_with_writers(
        block_tables, dst_block_tables
    )


def _shared_with_writers(
    block_tables: torch.Tensor, dst_block_tables: torch.Tensor
) -> torch.Tensor:
    """Per request (``[R]`` bool): one of its pages is a destination page of another request,
    or one of its destination pages is a page of another."""
    num_reqs, device = block_tables.shape[0], block_tables.device
    if num_reqs < 2:
        return torch.zeros(num_reqs, dtype=torch.bool, device=device)
    rows = torch.arange(num_reqs, device=device)
    pages = torch.cat([block_tables.flatten(), dst_block_tables.flatten()]).long()
    owner = torch.cat(
        [
            rows.repeat_interleave(block_tables.shape[1]),
            rows.repeat_interleave(dst_block_tables.shape[1]),
        ]
    )
    # NOTE: 0/1 integers, not bools: CUDA's scatter_reduce has no bool kernel.
    written = torch.zeros_like(pages)
    written[block_tables.numel() :] = 1
    valid = pages >= 0
    pages, owner, written = pages[valid], owner[valid], written[valid]
    unique, index = torch.unique(pages, return_inverse=True)
    lo = torch.full_like(unique, num_reqs).scatter_reduce(0, index, owner, "amin")
    hi = torch.full_like(unique, -1).scatter_reduce(0, index, owner, "amax")
    hit = torch.zeros_like(unique).scatter_reduce(0, index, written, "amax")
    conflict = ((lo != hi) & (hit > 0)).long()[index]  # per table entry
    return (
        torch.zeros(num_reqs, dtype=torch.long, device=device).scatter_reduce(
            0, owner, conflict, "amax"
        )
        > 0
    )


def check_keep(
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    keep: torch.Tensor,
    dst_block_tables: torch.Tensor | None,
) -> None:
    """The values ``compact_kv`` relies on: each row of ``keep`` strictly ascending positions of
    the source table, then -1 padding; no kept entry past the destination table; and the page
    ids the kernel reads (the source pages of kept positions, the destination pages of kept
    entries) -1 or in the cache. Other table entries are not read and may hold anything."""
    num_pages, page_size = kv_cache.shape[2], kv_cache.shape[3]
    dst_name = "block_tables" if dst_block_tables is None else "dst_block_tables"
    dst_tables = block_tables if dst_block_tables is None else dst_block_tables
    src_width, dst_width = block_tables.shape[1], dst_tables.shape[1]
    src_tokens, dst_tokens = src_width * page_size, dst_width * page_size
    check_values(
        keep,
        "keep",
        -1,
        src_tokens,
        f"-1 (padding) or a position of the source table, in [0, {src_tokens}) "
        f"(width {src_width} x page size {page_size})",
    )
    num_reqs, num_layers, num_heads, num_keep = keep.shape
    if num_keep > 1:
        prev, this = keep[..., :-1], keep[..., 1:]
        index = first_true((this >= 0) & ((prev < 0) | (this <= prev)))
        if index is not None:
            after = (*index[:3], index[3] + 1)
            raise KernelInputError(
                f"{at('keep', after)} = {int(keep[after])} after {at('keep', index)} = "
                f"{int(keep[index])}: expected each row of keep strictly ascending, then -1 "
                f"padding at its end"
            )
    if num_keep > dst_tokens:
        check_values(
            keep[..., dst_tokens:],
            "keep",
            -1,
            0,
            f"-1: entry j goes to position j of {dst_name}, which holds {dst_tokens} "
            f"(width {dst_width} x page size {page_size})",
            label=lambda i: at("keep", (*i[:3], i[3] + dst_tokens)),
        )
    if values_in(block_tables, -1, num_pages) and values_in(dst_tables, -1, num_pages):
        return
    # Some table holds a bad page id: is it one the kernel reads?
    keep = keep.long()
    kept = keep >= 0
    if not bool(kept.any()):
        return
    rows = torch.arange(num_reqs, device=keep.device)[:, None, None, None]
    entries = torch.arange(num_keep, device=keep.device)
    for table, name, column, what in (
        (
            block_tables,
            "block_tables",
            torch.where(kept, keep // page_size, 0),
            "the source page of",
        ),
        (
            dst_tables,
            dst_name,
            torch.where(kept, entries // page_size, 0),
            "the destination page of",
        ),
    ):
        page = table[rows, column].long()
        index = first_true(kept & ((page < -1) | (page >= num_pages)))
        if index is not None:
            raise KernelInputError(
                f"{at(name, (index[0], int(column[index])))} = {int(page[index])} ({what} "
                f"{at('keep', index)} = {int(keep[index])}): expected {page_range(num_pages)}"
            )


def check_destinations(
    kv_cache: torch.Tensor, keep: torch.Tensor, dst_tables: torch.Tensor, name: str
) -> None:
    """No two kept entries written to one slot: entry ``j`` of row ``r`` (layer ``l``, KV head
    ``h``) goes to position ``j`` of destination row ``r``, so a page at two destination columns
    (of one row or two) that both receive entries of one (layer, KV head) has two writers, in
    concurrent programs or tiles: either's key and value stays. Run after ``check_keep``
    (entries a kept prefix of each row, inside the table; their pages in the cache)."""
    # Cheap first: the whole table, then the columns any (layer, KV head) writes. Distinct is
    # the rule (each request its own pages); only a repeat needs the exact, per (layer, KV
    # head) look.
    if first_repeat(dst_tables) is None:
        return
    num_pages, page_size = kv_cache.shape[2], kv_cache.shape[3]
    columns = torch.arange(dst_tables.shape[1], device=keep.device)
    written = ((keep >= 0).sum(dim=-1) + page_size - 1) // page_size  # [R, L, Hkv] columns
    if first_repeat(dst_tables, columns < written.flatten(1).amax(dim=1)[:, None]) is None:
        return
    num_layers, num_heads = keep.shape[1:3]
    plane = torch.arange(num_layers * num_heads, device=keep.device).view(num_layers, num_heads)
    pages = dst_tables[:, None, None, :].long()  # [R, 1, 1, W]
    key = torch.where(pages >= 0, plane[None, :, :, None] * num_pages + pages, -1)
    found = first_repeat(key, columns < written[..., None])  # [R, L, Hkv, W]
    if found is None:
        return
    (r1, layer, head, c1), (r2, _, _, c2) = found
    raise KernelInputError(
        f"{at(name, (r1, c1))} = {at(name, (r2, c2))} = {int(dst_tables[r1, c1])} (the "
        f"destination page of {at('keep', (r1, layer, head, c1 * page_size))} and "
        f"{at('keep', (r2, layer, head, c2 * page_size))}): expected each destination page at "
        f"most once where the kept entries of one layer and KV head go (-1 may repeat)"
    )


def compact_kv(
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    keep: torch.Tensor,
    dst_block_tables: torch.Tensor | None = None,
    *,
    accumulated: torch.Tensor | None = None,
    staged: bool | None = None,
    block_n: int | None = None,
    max_stage_bytes: int = 1 << 30,
) -> None:
    """Compact kept KV entries of R requests, in place or into destination pages.

    Args:
        kv_cache: ``[2, L, num_pages, page_size, Hkv, d]`` the whole KV cache (K then V).
        block_tables: ``[R, max_pages]`` int32 source pages of each request, -1 padded.
        keep: ``[R, L, Hkv, K]`` int32/int64 strictly ascending logical positions to keep,
            -1 padded at the end (a request keeping fewer tokens than K), every kept entry
            inside both tables (``check_keep``; checked under the interpreter, and on a GPU only
            with ``GROWPAGE_CHECK_INDICES=1``, as the check syncs). Unchecked, a position past
            the source table or an entry ``j`` past the destination table is skipped (the
            kernel never reads past a table row), and a -1 in the middle leaves a hole where
            the reference would close it up.
        dst_block_tables: ``[R, max_pages_dst]`` destination pages; None = in place. A page
            at most once among the columns that receive kept entries of one (layer, KV head),
            over all requests (``check_destinations``, checked like ``keep``).
        accumulated: optional ``[L, num_pages * page_size, Hkv]`` fp32 per-slot sums (H2O
            accumulated attention), moved exactly like the keys and values.
        staged: force the staging route (True) or the direct route (False); None picks direct
            unless ``is_direct_safe`` fails for some request (that check syncs with the GPU).
    """
    if not (kv_cache.dim() == 6 and kv_cache.shape[0] == 2):
        raise KernelInputError(
            f"kv_cache: expected [2, L, num_pages, page_size, Hkv, d], got shape "
            f"{tuple(kv_cache.shape)}"
        )
    num_layers, page_size, num_kv_heads, head_dim = (kv_cache.shape[1], *kv_cache.shape[3:])
    if kv_cache.stride(-1) != 1:
        raise KernelInputError("kv_cache: last dim contiguous")
    check_float(kv_cache, "kv_cache")  # as the other wrappers: a KV cache is fp32/fp16/bf16
    check_written(kv_cache, "kv_cache")
    if accumulated is not None:
        expected = (num_layers, kv_cache.shape[2] * page_size, num_kv_heads)
        check_sums(accumulated, expected, "accumulated")
        check_device(kv_cache, accumulated)
    check_index(block_tables, 2, "block_tables")
    check_index(keep, 4, "keep")
    num_reqs, num_keep = keep.shape[0], keep.shape[3]
    if keep.shape[1:3] != (num_layers, num_kv_heads):
        raise KernelInputError(
            f"keep: expected [R, L={num_layers}, Hkv={num_kv_heads}, K] (the cache's), got shape "
            f"{tuple(keep.shape)}"
        )
    if block_tables.shape[0] != num_reqs:
        raise KernelInputError(
            f"block_tables: {block_tables.shape[0]} rows, keep has {num_reqs} requests"
        )
    dst_tables = block_tables if dst_block_tables is None else dst_block_tables
    check_index(dst_tables, 2, "dst_block_tables")
    if dst_tables.shape[0] != num_reqs:
        raise KernelInputError(
            f"dst_block_tables: {dst_tables.shape[0]} rows, keep has {num_reqs} requests"
        )
    check_device(kv_cache, block_tables, dst_tables, keep)
    if index_checks_on():
        check_keep(kv_cache, block_tables, keep, dst_block_tables)
        check_destinations(
            kv_cache,
            keep,
            dst_tables,
            "block_tables" if dst_block_tables is None else "dst_block_tables",
        )
    if num_reqs == 0 or num_keep == 0:
        return
    if staged is None:
        staged = dst_block_tables is not None and not bool(
            is_direct_safe(block_tables, dst_tables).all()
        )
    block_n = block_n or default_block_n(
        head_dim, kv_cache.dtype, tile_bytes=2 * TILE_BYTES, fp32_tile_bytes=2 * TILE_BYTES
    )

    in_place = dst_block_tables is None or dst_block_tables is block_tables

    has_acc = accumulated is not None
    acc = accumulated if accumulated is not None else kv_cache  # unused without sums
    cache_align = stride_align(*kv_cache.stride()[:2])

    def launch(
        stage: torch.Tensor, acc_stage: torch.Tensor, layer0: int, num: int, read: bool, write: bool
    ) -> None:
        _compact_kernel[(num_reqs, num, num_kv_heads)](
            kv_cache,
            block_tables,
            dst_tables,
            keep,
            stage,
            acc,
            acc_stage,
            num_keep,
            layer0,
            block_tables.shape[1] * page_size,
            dst_tables.shape[1] * page_size,
            *kv_cache.stride()[:2],
            *kv_cache.stride()[2:5],
            block_tables.stride(0),
            dst_tables.stride(0),
            *keep.stride()[:3],
            *stage.stride()[:5],
            *(acc.stride()[:2] if has_acc else (0, 0)),
            *(acc_stage.stride()[:3] if has_acc else (0, 0, 0)),
            PAGE_SIZE=page_size,
            HEAD_DIM=head_dim,
            BLOCK_N=block_n,
            BLOCK_D=next_pow2(head_dim),
            READ_STAGE=read,
            WRITE_STAGE=write,
            IN_PLACE=in_place and not (read or write),
            HAS_ACC=has_acc,
            CACHE_ALIGN=cache_align,
            STAGE_ALIGN=stride_align(*stage.stride()[:4]),
            num_stages=1,  # NOTE: no software pipelining: loads must not slide past the barrier
        )

    if not staged:
        dummy = kv_cache.new_empty(1, 1, 1, 1, 1, 1)
        launch(dummy, acc, 0, num_layers, False, False)
        return
    # The kept axis padded to a multiple of STRIDE_ALIGN: every stage stride is then one, so the
    # stage's loads and stores are vector ones whatever the kept count (one compiled variant).
    width = cdiv(num_keep, STRIDE_ALIGN) * STRIDE_ALIGN
    per_layer = (
        num_reqs * num_kv_heads * width * (2 * head_dim * kv_cache.element_size() + 4 * has_acc)
    )
    chunk = max(1, min(num_layers, max_stage_bytes // per_layer))
    stage = kv_cache.new_empty(num_reqs, chunk, num_kv_heads, 2, width, head_dim)
    acc_stage = acc.new_empty(num_reqs, chunk, num_kv_heads, num_keep) if has_acc else acc
    for layer0 in range(0, num_layers, chunk):
        num = min(chunk, num_layers - layer0)
        launch(stage, acc_stage, layer0, num, False, True)
        launch(stage, acc_stage, layer0, num, True, False)
