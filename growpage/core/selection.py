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
