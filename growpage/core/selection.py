"""KV selection for Compress & Hold (paper Eq. 9-10).

Indices here are *slot indices*: positions in the request's resident token order, 0..N-1, per
layer and KV head. The protected recent window is the last ``recent`` slots, identical for all
heads. A selection ``[L, Hkv, keep]`` is sorted ascending per head, so compaction preserves order.
"""

from __future__ import annotations

import torch


def importance(attn_short: torch.Tensor, attn_long: torch.Tensor) -> torch.Tensor:
    """s = max(a^S, a^L) (Eq. 9), elementwise over ``[L, Hkv, N]``."""
    return torch.maximum(attn_short, attn_long)


def with_protected(chosen: torch.Tensor, num_tokens: int, recent: int,
                   chosen_sorted: bool = False) -> torch.Tensor:
    """Append the protected recent window to chosen historical slots and sort.

    ``chosen [L, Hkv, k]`` (slots < num_tokens - recent) -> ``[L, Hkv, k + recent]`` ascending.
    ``chosen_sorted``: ``chosen`` is already ascending (the window follows it; no sort).
    """
    lead = chosen.shape[:-1]
    window = torch.arange(num_tokens - recent, num_tokens, device=chosen.device)
    window = window.expand(*lead, recent)
    both = torch.cat([chosen, window], dim=-1)
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
    # Local picks first (at most k of them), then the best of the rest, ties to
    # earlier slots (stable sort); the first k of that order, ascending. No ``nonzero`` (a host
    # sync on GPUs) anywhere.
    order = s.argsort(dim=-1, descending=True, stable=True)
    return order[..., :k].sort(dim=-1).values


def growpage_select(scores: torch.Tensor, num_tokens: int, recent: int, keep: int, block: int,
                    k_loc: int) -> torch.Tensor:
    """Full GrowPage selection: block-local quota + global top-k + protected recent window.

    Args:
        scores: ``[L, Hkv, num_tokens - recent]`` importance of the selection candidates.
        keep: total slots kept per head, including the ``recent`` protected ones.
    Returns:
        ``[L, Hkv, keep]`` ascending slot indices.
    """
    chosen = block_local_topk(scores, keep - recent, block, k_loc)  # ascending
    return with_protected(chosen, num_tokens, recent, chosen_sorted=True)
