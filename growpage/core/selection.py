"""KV selection for Compress & Hold (paper Eq. 9-10).

Indices here are *slot indices*: positions in the request's resident token order, 0..N-1, per
layer and KV head. The protected recent window is the last ``recent`` slots, identical for all
heads. A selection ``[L, Hkv, keep]`` is sorted ascending per head, so compaction preserves order.
"""

from __future__ import annotations

import torch

#: How ``block_local_topk`` finds its global top-k: ``top_slots`` (an int64 key per slot and
#: a partial top-k, 1.3-4x faster than a sort on the CPU at a boundary's shapes, measured in
#: d62f423, but a dozen operations) or one stable argsort (a launch or two on a GPU, where each
#: operation costs host time). Both give the same slots. None: ``top_slots`` on the CPU only.
keyed_top_k: bool | None = None


def importance(attn_short: torch.Tensor, attn_long: torch.Tensor) -> torch.Tensor:
    """s = max(a^S, a^L) (Eq. 9), elementwise over ``[L, Hkv, N]``."""
    return torch.maximum(attn_short, attn_long)


def with_protected(
    chosen: torch.Tensor,
    num_tokens: int,
    recent: int,
    chosen_sorted: bool = False,
    prefix: int = 0,
) -> torch.Tensor:
    """Add the protected slots to chosen historical slots and sort: the recent window, and
    the first ``prefix`` slots (the protected prompt).

    ``chosen [L, Hkv, k]`` (slots in ``[prefix, num_tokens - recent)``) ->
    ``[L, Hkv, prefix + k + recent]`` ascending.
    ``chosen_sorted``: ``chosen`` is already ascending (no sort).
    """
    lead = chosen.shape[:-1]
    window = torch.arange(num_tokens - recent, num_tokens, device=chosen.device)
    parts = [chosen, window.expand(*lead, recent)]
    if prefix:
        parts.insert(0, torch.arange(prefix, device=chosen.device).expand(*lead, prefix))
    both = torch.cat(parts, dim=-1)
    return both if chosen_sorted else both.sort(dim=-1).values


def topk_slots(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Global top-k slots of ``scores [L, Hkv, M]`` (ties broken towards earlier slots)."""
    if k == 0:
        return scores.new_zeros(*scores.shape[:-1], 0, dtype=torch.long)
    return scores.float().topk(k, dim=-1, sorted=False).indices


def block_local_topk(scores: torch.Tensor, k: int, block: int, k_loc: int) -> torch.Tensor:
    """GrowPage selection among historical candidates (Eq. 10), without the protected window.

    Every block of ``block`` consecutive candidates contributes its top ``k_loc`` (or all of it
    when shorter); the remaining budget ``k - |S_loc|`` goes to the global top-k of the rest.
    NOTE: when the local quota alone would exceed ``k`` it is lowered uniformly to
    ``k // num_blocks`` so the kept count stays exact.

    Args:
        scores: ``[L, Hkv, M]`` importance of the M selection candidates (slots 0..M-1).
        k: number of slots to keep, 0 <= k <= M.
    Returns:
        ``[L, Hkv, k]`` int64 slot indices, unique per head, ascending.
    """
    m = scores.shape[-1]
    if not 0 <= k <= m:
        raise ValueError(f"cannot keep {k} of {m} candidates")
    num_blocks = -(-m // block) if m else 0
    quota = min(k_loc, k // num_blocks) if num_blocks else 0
    s = scores.float()
    if quota > 0:
        pad = num_blocks * block - m
        padded = torch.nn.functional.pad(s, (0, pad), value=float("-inf"))
        blocks = padded.reshape(*s.shape[:-1], num_blocks, block)
        local = blocks.topk(min(quota, block), dim=-1).indices  # [L, Hkv, nb, q]
        local = local + torch.arange(num_blocks, device=s.device).unsqueeze(-1) * block
        # Local picks pushed to +inf. A short last block may pick padding slots (>= m); they
        # are cut off here.
        s = padded.scatter(-1, local.flatten(-2), float("inf"))[..., :m]
    # Local picks first (at most k of them), then the best of the rest, ties to earlier slots:
    # the first k of a stable descending sort, ascending. No ``nonzero`` (a host sync on GPUs).
    if keyed_top_k if keyed_top_k is not None else s.device.type == "cpu":
        return top_slots(s, k)
    order = s.argsort(dim=-1, descending=True, stable=True)
    return order[..., :k].sort(dim=-1).values


def top_slots(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` best slots of ``scores [..., M]`` (float32), ascending: highest score first,
    ties to earlier slots, NaN above everything (what the first ``k`` of a stable descending
    argsort hold), without sorting M.

    Each score and its slot make one int64 key, so the order is strict and a partial top-k
    finds it. A compression drops about one page of M candidates, so the smaller side is
    searched: with ``k`` near M, the ``M - k`` dropped slots, and the kept ones are the rest in
    slot order (``masked_select``: a host sync on a GPU, none on the CPU).
    """
    m = scores.shape[-1]
    drop = m - k
    if k == 0 or drop == 0:
        return torch.arange(k, device=scores.device).expand(*scores.shape[:-1], k).contiguous()
    # Order-preserving int32 image of the floats (-0.0 as +0.0, every NaN as +NaN).
    s = torch.where(scores.isnan(), float("nan"), scores + 0.0)
    bits = s.view(torch.int32)
    bits = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64)
    slots = torch.arange(m, device=scores.device)
    key = (bits << 32) | (m - 1 - slots)  # equal scores: the earlier slot ranks higher
    if k <= drop:
        return key.topk(k, dim=-1, sorted=False).indices.sort(dim=-1).values
    dropped = key.topk(drop, dim=-1, largest=False, sorted=False).indices
    kept = torch.ones(scores.shape, dtype=torch.bool, device=scores.device)
    kept.scatter_(-1, dropped, False)
    return slots.expand(scores.shape).masked_select(kept).view(*scores.shape[:-1], k)


def growpage_select(
    scores: torch.Tensor,
    num_tokens: int,
    recent: int,
    keep: int,
    block: int,
    k_loc: int,
    prefix: int = 0,
) -> torch.Tensor:
    """Full GrowPage selection: block-local quota + global top-k + protected recent window.

    Args:
        scores: ``[L, Hkv, num_tokens - recent]`` importance of the selection candidates.
        keep: total slots kept per head, including the ``recent`` protected ones.
        prefix: leading slots kept as well (the protected prompt); the quota's blocks then
            start after them.
    Returns:
        ``[L, Hkv, keep]`` ascending slot indices.
    """
    chosen = block_local_topk(scores[..., prefix:], keep - recent - prefix, block, k_loc)
    if prefix:
        chosen = chosen + prefix
    return with_protected(chosen, num_tokens, recent, chosen_sorted=True, prefix=prefix)


#: On the CPU a step's compressions whose candidates together exceed this many entries are
#: selected one by one (``select_slots``; the same slots): the work is arithmetic there, and one
#: padded pass over large rows is slower than each request's own. Below it one pass saves the
#: dozens of small operations every request would run. On a GPU one pass always.
CPU_BATCH_ELEMENTS = 1 << 16


def select_slots(
    scores: list[torch.Tensor],
    num_tokens: list[int],
    recent: int,
    keeps: list[int],
    block: int,
    k_loc: int,
    prefixes: list[int],
) -> torch.Tensor:
    """``growpage_select`` of R requests as ``growpage_select_batch`` returns it: in one pass,
    or on a CPU above ``CPU_BATCH_ELEMENTS`` candidate entries one request at a time."""
    entries = sum(s.numel() for s in scores)
    if scores[0].device.type == "cpu" and entries > CPU_BATCH_ELEMENTS:
        rows = [
            growpage_select(s, n, recent, k, block, k_loc, p)
            for s, n, k, p in zip(scores, num_tokens, keeps, prefixes, strict=True)
        ]
        return padded_slots(rows)
    return growpage_select_batch(scores, num_tokens, recent, keeps, block, k_loc, prefixes)


def padded_slots(rows: list[torch.Tensor]) -> torch.Tensor:
    """Selections ``[L, Hkv, K_r]`` as one ``[R, L, Hkv, max K_r]`` int64 tensor, -1 padded."""
    stacked = torch.nn.utils.rnn.pad_sequence(
        [r.to(torch.long).movedim(-1, 0) for r in rows], batch_first=True, padding_value=-1
    )
    return stacked.movedim(1, -1).contiguous()


def growpage_select_batch(
    scores: list[torch.Tensor],
    num_tokens: list[int],
    recent: int,
    keeps: list[int],
    block: int,
    k_loc: int,
    prefixes: list[int],
) -> torch.Tensor:
    """``growpage_select`` of R requests in one pass (their boundaries of one step).

    Args:
        scores: R tensors ``[L, Hkv, num_tokens[r] - recent]`` (same ``L, Hkv``).
        keeps, prefixes: per request, as ``growpage_select``'s ``keep`` and ``prefix``.
    Returns:
        ``[R, L, Hkv, max(keeps)]`` int64: row r's first ``keeps[r]`` slots are exactly
        ``growpage_select(scores[r], num_tokens[r], recent, keeps[r], block, k_loc,
        prefixes[r])``, the rest -1.

    The same choices on the same values: each block of each request goes through one ``topk``
    with its own quota (requests are grouped by quota), and the global step keeps the first
    ``k`` of one stable descending sort (what ``block_local_topk`` keeps either way), so ties
    and NaN fall as they do alone::

        slots of r:  [ prefix | candidates (blocks of ``block``) | recent window ]
        kept:          all      local quota + best of the rest       all
    """
    device = scores[0].device
    sizes = [s.shape[-1] - p for s, p in zip(scores, prefixes, strict=True)]
    ks = [k - recent - p for k, p in zip(keeps, prefixes, strict=True)]
    if any(not 0 <= k <= m for k, m in zip(ks, sizes, strict=True)):
        raise ValueError(f"cannot keep {ks} of {sizes} candidates")
    blocks = [-(-m // block) if m else 0 for m in sizes]
    quotas = [min(k_loc, k // nb, block) if nb else 0 for k, nb in zip(ks, blocks, strict=True)]
    width = max(max(blocks) * block, 1)
    # Per request: candidates, kept, prefix, slots, kept slots (one host-to-device copy).
    meta = torch.tensor(list(zip(sizes, ks, prefixes, num_tokens, keeps, strict=True)))
    size, k, prefix, slots, keep = meta.to(device).view(len(scores), 5, 1, 1, 1).unbind(1)
    cands = _candidates(scores, prefixes, width)  # [R, L, Hkv, W], -inf past each's own
    cands = _local_picks(cands, quotas, block, size)
    order = cands.sort(dim=-1, descending=True, stable=True).indices
    rank = torch.arange(width, device=device) < k  # the first k of the order
    kept = torch.zeros(cands.shape, dtype=torch.bool, device=device)
    kept.scatter_(-1, order, rank.expand_as(order))
    return _kept_slots(kept, prefix, slots, keep, recent, max(keeps), max(prefixes))


def _candidates(scores: list[torch.Tensor], prefixes: list[int], width: int) -> torch.Tensor:
    """Each request's selection candidates (past its prefix) as ``[R, L, Hkv, width]`` fp32,
    -inf past its own."""
    rows = [s[..., p:].float().movedim(-1, 0) for s, p in zip(scores, prefixes, strict=True)]
    stacked = torch.nn.utils.rnn.pad_sequence(
        rows, batch_first=True, padding_value=float("-inf")
    ).movedim(1, -1)
    return torch.nn.functional.pad(stacked, (0, width - stacked.shape[-1]), value=float("-inf"))


def _local_picks(
    cands: torch.Tensor, quotas: list[int], block: int, sizes: torch.Tensor
) -> torch.Tensor:
    """Each request's block-local picks (``block_local_topk``'s first step, block by block
    with its own quota) set to +inf; a pick past the request's candidates (its last block is
    short) stays -inf, as ``block_local_topk`` cuts it off."""
    tiles = cands.view(*cands.shape[:-1], -1, block)
    offsets = torch.arange(tiles.shape[-2], device=cands.device).unsqueeze(-1) * block
    out = cands
    for quota in sorted(set(quotas) - {0}):
        rows = [r for r, q in enumerate(quotas) if q == quota]
        every = len(rows) == len(quotas)
        index = None if every else torch.tensor(rows, device=cands.device)
        part = tiles if index is None else tiles.index_select(0, index)
        picks = (part.topk(quota, dim=-1).indices + offsets).flatten(-2)
        inside = picks < (sizes if index is None else sizes.index_select(0, index))
        fill = torch.where(inside, float("inf"), float("-inf"))
        if index is None:
            return cands.scatter(-1, picks, fill)
        out = out.index_copy(0, index, out.index_select(0, index).scatter(-1, picks, fill))
    return out


def _kept_slots(
    kept: torch.Tensor,
    prefix: torch.Tensor,
    num_tokens: torch.Tensor,
    keep: torch.Tensor,
    recent: int,
    most: int,
    most_prefix: int,
) -> torch.Tensor:
    """``with_protected`` of every row: the prefix, the kept candidates (past the prefix), the
    recent window; ``[R, L, Hkv, most]`` ascending, -1 past each row's ``keep``."""
    num, num_layers, num_kv, width = kept.shape
    device = kept.device
    span = width + most_prefix + recent
    slot = torch.arange(span, device=device)
    window = num_tokens - recent
    if most_prefix:  # each row's candidates start at its prefix
        index = (slot - prefix).clamp(0, width - 1).expand(-1, num_layers, num_kv, -1)
        candidate = (slot >= prefix) & (slot < window) & kept.gather(-1, index)
        mask = (slot < prefix) | candidate
    else:  # candidates are slots 0.. (a row keeps none past its own)
        mask = torch.nn.functional.pad(kept, (0, span - width))
    mask = mask | ((slot >= window) & (slot < num_tokens))
    # Kept slot s goes to column (kept before it); the others to a spare column, cut off.
    # No masked_select: its output size would be a host sync on a GPU.
    column = torch.where(mask, mask.cumsum(dim=-1) - 1, most)
    out = torch.full((num, num_layers, num_kv, most + 1), -1, dtype=torch.long, device=device)
    out.scatter_(-1, column, slot.expand_as(column))
    return out[..., :most]
