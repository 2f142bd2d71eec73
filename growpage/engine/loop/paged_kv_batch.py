"""Several requests' boundaries over the paged KV cache at once: the batched forms of
``EngineKVView``'s reads and of its compaction (``KVView.batch_query_states``, ``batch_keys``,
``compact_batch``, which the view class answers with these).

Every request is given with its block table and slot count at its boundary: a compression
booked in its step (``core.compaction_batch``) has already moved its request's state to the
pages and count after it, while its KV still sits where the boundary left it.

Compaction of R requests, kept slot j of request r, layer l, KV head h::

    source  cache[., l, src_table[r][keep[r,l,h,j] // b] * b + keep[r,l,h,j] % b, h]
    target  cache[., l, dst_table[r][j // b] * b + j % b, h]          j < K_r

All sources are read (one ``index_select``) before any target is written (one
``index_copy_``): a page that one request released and another got as a copy-on-write target
in the same step holds the first one's slots until they are read.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, cast

import torch

from growpage.core.kv_view import CompactionJob
from growpage.core.selection import padded_slots
from growpage.engine.loop.transfer import to_device

if TYPE_CHECKING:
    from growpage.engine.loop.paged_kv_view import EngineKVView


def query_states(views: list[EngineKVView]) -> tuple[torch.Tensor, torch.Tensor]:
    """``[R, 2, L, Hq, d]`` summaries and ``[R, L, Hq, d]`` current queries of ``views``
    (one read of the query-state pool)."""
    pool = views[0].query_pool
    for v in views:
        if v.seq.query_slot is None:
            raise RuntimeError(f"{v.seq.request_id!r} has no query-state slot")
    slots = to_device([v.seq.query_slot for v in views], torch.long, pool.summaries.device)
    summaries = pool.summaries.index_select(1, slots).permute(1, 2, 0, 3, 4).contiguous()
    current = pool.current.index_select(1, slots).permute(1, 0, 2, 3).contiguous()
    return summaries, current


def keys(views: list[EngineKVView], tables: list[list[int]], num_tokens: list[int]) -> torch.Tensor:
    """Post-RoPE keys ``[R, L, Hkv, max(num_tokens), d]`` of the requests, read through
    ``tables`` in one gather: request r's first ``num_tokens[r]`` slots, then what page 0
    holds (``KVView.batch_keys``)."""
    first = views[0]
    most = max(num_tokens)
    slots = flat_slots(tables, most, first.page_size, first.device)  # [R, N_max]
    flat = first.kv_cache[0].flatten(1, 2)  # [L, slots, Hkv, d]
    gathered = flat.index_select(1, slots.flatten())  # [L, R * N_max, Hkv, d]
    num_layers, _, num_kv, d = gathered.shape
    return gathered.view(num_layers, len(views), most, num_kv, d).permute(1, 0, 3, 2, 4)


def flat_slots(
    tables: list[list[int]], num_slots: int, page_size: int, device: torch.device
) -> torch.Tensor:
    """``[R, num_slots]`` cache slots of slots ``0..num_slots-1`` of each table (a table too
    short for them: page 0 past its end)."""
    width = max(-(-num_slots // page_size), 1)
    table = to_device([_padded(t, width, 0) for t in tables], torch.long, device)
    page, offset = _page_and_offset(num_slots, page_size, device)
    return table[:, page] * page_size + offset


def compact(jobs: list[CompactionJob], keep: torch.Tensor) -> None:
    """Run ``jobs`` (``EngineKVView``s of one cache; ``keep`` their slots ``[R, L, Hkv,
    K_max]``, -1 past each job's), keys, values and H2O sums alike, then set each request's
    kept positions."""
    first = cast("EngineKVView", jobs[0].view)
    keep = keep.to(first.device)
    if first.use_kernels:
        _compact_with_kernel(first, jobs, keep)
    else:
        _compact_in_torch(first, jobs, keep)
    _set_positions(jobs, keep)


def _compact_in_torch(first: EngineKVView, jobs: list[CompactionJob], keep: torch.Tensor) -> None:
    """Cache rows (layer, slot, KV head) of every kept entry, read in one ``index_select`` and
    written in one ``index_copy_`` per cache half."""
    num, num_layers, num_kv, most = keep.shape
    device, b = first.device, first.page_size
    width = max(max(len(j.source) for j in jobs), -(-most // b))
    tables = [_padded(j.source, width, 0) for j in jobs] + [
        _padded(j.target, width, 0) for j in jobs
    ]
    pages = to_device(tables, torch.long, device).view(2, num, width)
    kept = keep.clamp(min=0)
    src = pages[0].gather(1, (kept // b).view(num, -1)).view_as(kept) * b + kept % b
    page, offset = _page_and_offset(most, b, device)
    dst = (pages[1][:, page] * b + offset).view(num, 1, 1, most)
    per_layer = first.kv_cache.shape[2] * b * num_kv  # cache rows of one layer
    base = _row_base(num_layers, num_kv, per_layer, device)  # [1, L, Hkv, 1]: layer and head
    valid = keep >= 0
    read = (src * num_kv + base).masked_select(valid)
    write = (dst * num_kv + base).masked_select(valid)
    for half in first.kv_cache:  # keys, values: [L * slots * Hkv, d] rows
        rows = half.view(-1, first.head_dim)
        rows.index_copy_(0, write, rows.index_select(0, read))
    if first.accumulated is not None:  # [L, slots * Hkv]: the same rows
        sums = first.accumulated.view(-1)
        sums.index_copy_(0, write, sums.index_select(0, read))


def _padded(values: list[int], width: int, fill: int) -> list[int]:
    return list(values[:width]) + [fill] * (width - len(values[:width]))


@functools.lru_cache(maxsize=64)
def _page_and_offset(
    num_slots: int, page_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(i // page_size, i % page_size)`` for ``i < num_slots`` (cached: no work per step)."""
    idx = torch.arange(num_slots, device=device)
    return idx // page_size, idx % page_size


@functools.lru_cache(maxsize=16)
def _row_base(num_layers: int, num_kv: int, per_layer: int, device: torch.device) -> torch.Tensor:
    """``[1, L, Hkv, 1]``: ``l * per_layer + h``, a cache row's layer and KV head part."""
    layer = torch.arange(num_layers, device=device).view(1, -1, 1, 1) * per_layer
    return layer + torch.arange(num_kv, device=device).view(1, 1, -1, 1)


def _compact_with_kernel(
    first: EngineKVView, jobs: list[CompactionJob], keep: torch.Tensor
) -> None:
    """One ``compact_kv`` launch for every job; staged when some job cannot copy in place or
    one job's target page is another's source (the direct route runs requests at once)."""
    from growpage.engine.loop.paged_kv_view import direct_copy_safe
    from growpage.kernels import compact_kv

    width = max(len(j.source) for j in jobs)
    rows = [list(j.source) + [-1] * (width - len(j.source)) for j in jobs]
    rows += [list(j.target) + [-1] * (width - len(j.target)) for j in jobs]
    tables = to_device(rows, torch.int32, first.device)
    staged = not all(direct_copy_safe(j.source, j.target) for j in jobs) or _crossed(jobs)
    compact_kv(
        first.kv_cache,
        tables[: len(jobs)],
        keep.to(first.device),
        tables[len(jobs) :],
        accumulated=first.accumulated,
        staged=staged,
    )


def _crossed(jobs: list[CompactionJob]) -> bool:
    """Whether a page is one job's target and another job's source."""
    sources = [set(j.source) for j in jobs]
    return any(
        page in src
        for i, job in enumerate(jobs)
        for page in job.target
        for k, src in enumerate(sources)
        if k != i
    )


def _set_positions(jobs: list[CompactionJob], keep: torch.Tensor) -> None:
    """Each request's kept positions (``Sequence.kept_positions``): the positions its kept
    slots held at its boundary (``Sequence.slot_positions``: its earlier kept positions, then
    consecutive ones from its tail start; slot i holds position i before any compaction). Its
    tail then starts at the boundary's position."""
    seqs = [cast("EngineKVView", job.view).seq for job in jobs]
    positions = keep
    held = [seq.kept_positions for seq in seqs]
    if any(h is not None for h in held):
        num, num_layers, num_kv, _ = keep.shape
        none = keep.new_zeros(num_layers, num_kv, 0)
        olds = padded_slots([h if h is not None else none for h in held]).to(keep.device)
        meta = [
            (0, 0) if h is None else (h.shape[-1], seq.tail_start)
            for h, seq in zip(held, seqs, strict=True)
        ]
        counts, tails = torch.tensor(meta, device=keep.device).view(num, 2, 1, 1, 1).unbind(1)
        kept = keep.clamp(min=0)
        earlier = olds.gather(-1, torch.minimum(kept, counts - 1).clamp(min=0))
        positions = torch.where(kept < counts, earlier, tails + kept - counts)
    for r, (job, seq) in enumerate(zip(jobs, seqs, strict=True)):
        seq.kept_positions = positions[r, :, :, : job.keep.shape[-1]]
        seq.tail_start = job.position
        job.view.__dict__.pop("_keys", None)
        job.view.__dict__.pop("_demand_table", None)
