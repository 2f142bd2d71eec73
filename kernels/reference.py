"""Naive torch references for every kernel: loops and gathers, fp32 maths, no cleverness.

Tests compare each Triton kernel against the function of the same name here.
"""

from __future__ import annotations

import math

import torch

from growpage.core.demand import rms_calibrate
from growpage.core.rope import apply_rope

from .query_state import BETA_LONG, BETA_SHORT


def token_slots(block_table: torch.Tensor, num_tokens: int, page_size: int) -> torch.Tensor:
    """Physical slots ``[num_tokens]`` (int64) of tokens ``0..num_tokens-1`` of one request."""
    t = torch.arange(num_tokens, device=block_table.device)
    return block_table[t // page_size].long() * page_size + t % page_size


def flat_cache(cache: torch.Tensor) -> torch.Tensor:
    """``[num_pages, page_size, Hkv, d]`` -> ``[num_slots, Hkv, d]`` view."""
    return cache.reshape(-1, *cache.shape[2:])


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    sm_scale: float | None = None,
) -> torch.Tensor:
    """``q [B, Hq, d]`` -> ``[B, Hq, d]``, one request and one head at a time."""
    num_seqs, num_heads, head_dim = q.shape
    group, scale, rows = _paged_rows(q, k_cache, block_tables, context_lens, sm_scale)
    out = torch.zeros(num_seqs, num_heads, head_dim, dtype=torch.float32, device=q.device)
    for b, slots, k in rows:
        v = flat_cache(v_cache)[slots].float()
        for h in range(num_heads):
            scores = k[:, h // group] @ q[b, h].float() * scale
            out[b, h] = torch.softmax(scores, dim=0) @ v[:, h // group]
    return out.to(q.dtype)


def update_query_state(
    q_pre: torch.Tensor,
    state: torch.Tensor,
    slot_ids: torch.Tensor,
    is_first: torch.Tensor,
    beta_short: float = BETA_SHORT,
    beta_long: float = BETA_LONG,
) -> None:
    """Eq. 6 in place on ``state [M, 2, Hq, d]``; first step sets both EMAs to ``q_pre``."""
    for b in range(q_pre.shape[0]):
        slot = int(slot_ids[b])
        if slot < 0:
            continue
        q = q_pre[b].float()
        if bool(is_first[b]):
            state[slot, 0] = q
            state[slot, 1] = q
        else:
            state[slot, 0] = beta_short * state[slot, 0] + (1 - beta_short) * q
            state[slot, 1] = beta_long * state[slot, 1] + (1 - beta_long) * q


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``key/value [N, Hkv, d]`` at ``slot_mapping [N]``; slot -1 is skipped."""
    for i in range(key.shape[0]):
        slot = int(slot_mapping[i])
        if slot < 0:
            continue
        page, off = divmod(slot, k_cache.shape[1])
        k_cache[page, off] = key[i]
        v_cache[page, off] = value[i]


def compact_kv(
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    keep: torch.Tensor,
    dst_block_tables: torch.Tensor | None = None,
    accumulated: torch.Tensor | None = None,
) -> None:
    """Gather ``keep [R, L, Hkv, K]`` logical positions into logical ``0..K-1`` of the dst tables.

    Reads everything before writing anything, so any overlap of source and destination is fine.
    ``kv_cache`` is ``[2, L, num_pages, page_size, Hkv, d]``; -1 in ``keep`` is skipped.
    ``accumulated [L, num_pages * page_size, Hkv]`` (optional) moves alike.
    """
    dst_tables = block_tables if dst_block_tables is None else dst_block_tables
    page_size = kv_cache.shape[3]
    num_layers, num_kv_heads = keep.shape[1], keep.shape[2]
    staged = []
    for r in range(keep.shape[0]):
        for layer in range(num_layers):
            flat = kv_cache[:, layer].reshape(2, -1, *kv_cache.shape[4:])  # [2, slots, Hkv, d]
            for h in range(num_kv_heads):
                idx = keep[r, layer, h]
                idx = idx[idx >= 0]
                src = token_slots(block_tables[r], int(idx.max()) + 1 if len(idx) else 0, page_size)
                dst = token_slots(dst_tables[r], len(idx), page_size)
                sums = None if accumulated is None else accumulated[layer, src[idx.long()], h]
                staged.append((layer, h, dst, flat[:, src[idx.long()], h].clone(), sums))
    for layer, h, dst, values, sums in staged:
        flat = kv_cache[:, layer].reshape(2, -1, *kv_cache.shape[4:])
        flat[:, dst, h] = values
        if accumulated is not None and sums is not None:  # sums is None exactly when it is
            accumulated[layer, dst, h] = sums


def demand_attention(
    queries: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    num_candidates: int,
    sm_scale: float | None = None,
) -> torch.Tensor:
    """Per-KV-head attention over the first ``num_candidates`` tokens of one request.

    Args:
        queries: ``[V, L, Hq, d]`` calibrated, RoPE-rotated query summaries (V views: short, long).
        k_cache: ``[L, num_pages, page_size, Hkv, d]`` keys of all layers (``kv_cache[0]``).
        block_table: ``[max_pages]`` the request's pages.

    Returns:
        ``[V, L, Hkv, Nc]`` fp32: mean over each KV head's query heads of their softmax rows.
    """
    num_views, num_layers, num_heads, head_dim = queries.shape
    page_size, num_kv_heads = k_cache.shape[2], k_cache.shape[3]
    group = num_heads // num_kv_heads
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim)
    slots = token_slots(block_table, num_candidates, page_size)
    out = torch.zeros(num_views, num_layers, num_kv_heads, num_candidates, device=queries.device)
    for layer in range(num_layers):
        k = flat_cache(k_cache[layer])[slots].float()  # [Nc, Hkv, d]
        for h in range(num_heads):
            scores = queries[:, layer, h].float() @ k[:, h // group].T * scale  # [V, Nc]
            out[:, layer, h // group] += torch.softmax(scores, dim=-1) / group
    return out


def working_set_sizes(attention: torch.Tensor, p: float) -> torch.Tensor:
    """Top-p working-set size (Eq. 7): smallest k whose k largest weights reach p; int64."""
    rows = attention.reshape(-1, attention.shape[-1]).tolist()
    sizes = []
    for row in rows:
        total, k = 0.0, 0
        for w in sorted(row, reverse=True):
            total, k = total + w, k + 1
            if total >= p:
                break
        sizes.append(k)
    return torch.tensor(sizes, dtype=torch.int64).reshape(attention.shape[:-1]).to(attention.device)


def boundary_queries(
    summaries: torch.Tensor,
    current: torch.Tensor,
    slot: int,
    position: int,
    inv_freq: torch.Tensor,
    eps: float = 1e-12,
) -> torch.Tensor:
    """``[2, L, Hq, d]``: per view ``rope_at(cfg, rms_calibrate(s, cur), position)`` of ``slot``.

    ``rope_at`` math spelled out with ``inv_freq`` in place of the config (same fp32 angles).
    """
    cur = current[:, slot]
    angles = inv_freq * float(position)
    angles = torch.cat([angles, angles])
    cos, sin = angles.cos(), angles.sin()
    views = [apply_rope(rms_calibrate(summaries[:, slot, v], cur, eps), cos, sin) for v in (0, 1)]
    return torch.stack(views)


def accumulate_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    acc: torch.Tensor,
    sm_scale: float | None = None,
) -> None:
    """Add ``q [B, Hq, d]``'s softmax over each row's context, averaged over each KV head's
    query heads, into ``acc [num_slots, Hkv]``; the row's last slot is set, not added."""
    num_heads = q.shape[1]
    group, scale, rows = _paged_rows(q, k_cache, block_tables, context_lens, sm_scale)
    for b, slots, k in rows:
        acc[slots[-1]] = 0.0
        for h in range(num_heads):
            weights = torch.softmax(k[:, h // group] @ q[b, h].float() * scale, dim=0)
            acc[slots, h // group] += weights / group


def _paged_rows(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    sm_scale: float | None,
) -> tuple[int, float, list[tuple[int, torch.Tensor, torch.Tensor]]]:
    """``(group, scale, rows)``: per request with a context, ``(b, slots [n], keys [n, Hkv, d]
    fp32)`` read through its block table."""
    num_seqs, num_heads, head_dim = q.shape
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim)
    rows = []
    for b in range(num_seqs):
        n = int(context_lens[b])
        if n:
            slots = token_slots(block_tables[b], n, page_size)
            rows.append((b, slots, flat_cache(k_cache)[slots].float()))
    return num_heads // num_kv_heads, scale, rows
