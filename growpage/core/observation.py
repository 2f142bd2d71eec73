"""SnapKV at decoding time: scoring slots by the attention of an observation window.

The observation window is the W most recent queries of a request, each post-RoPE at its own
position. At a compression every resident slot gets the attention the window pays it,
causally (query j sees only slots holding positions up to its own), summed over the window's
queries and over the query heads of each KV head's group::

    score[l, h, n] = sum_{j < W'} sum_{g in group(h)} softmax_n(q[l, j, g] . k[l, h, n] * scale)

and a 1-D max pool of odd width along the slots ('same' padding) smooths it, so that a kept
token keeps its neighbours (SnapKV's clustering). Both worlds call these functions: the engine's
view rotates its ring of pre-RoPE queries (``growpage.engine.loop.recent_queries``), the simulator's
the rows of its trace; the same inputs give the same scores.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from growpage.core.rope import RopeConfig, apply_rope, cos_sin


def rotate_queries(
    rope: RopeConfig, queries: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """Pre-RoPE ``queries [L, n, Hq, d]`` rotated to their ``positions [n]``, fp32."""
    cos, sin = cos_sin(rope, positions, device=queries.device)  # [n, d]
    return apply_rope(queries.float(), cos[None, :, None], sin[None, :, None])


def window_attention(
    queries: torch.Tensor,
    query_positions: torch.Tensor,
    keys: torch.Tensor,
    key_positions: torch.Tensor,
    softmax_scale: float,
) -> torch.Tensor:
    """Summed causal attention of an observation window over the resident slots.

    Args:
        queries: ``[L, n, Hq, d]`` post-RoPE queries of the window.
        query_positions: ``[n]`` their absolute positions.
        keys: ``[L, Hkv, N, d]`` post-RoPE keys of the resident slots.
        key_positions: ``[L, Hkv, N]`` the position each slot holds.
        softmax_scale: the model's attention scale (``head_dim ** -0.5``).
    Returns:
        ``[L, Hkv, N]`` fp32: per slot, the softmax weights of every query that sees it, summed
        over the queries and the KV head's query group. A query that sees no slot adds nothing.
    """
    num_layers, n, num_q, d = queries.shape
    num_kv = keys.shape[1]
    if num_q % num_kv:
        raise ValueError(f"{num_q} query heads do not split into {num_kv} KV heads")
    # NOTE: contiguous fp32 operands, so that both worlds' views (a gathered copy, a dense
    # tensor) run the same kernels and get bitwise-equal scores from equal values.
    q = queries.float().contiguous().view(num_layers, n, num_kv, num_q // num_kv, d)
    k = keys.float().contiguous()
    logits = torch.einsum("lnhgd,lhsd->lhgns", q, k) * softmax_scale  # [L, Hkv, G, n, N]
    qpos = query_positions.to(key_positions.device)
    hidden = key_positions[:, :, None, :] > qpos[None, None, :, None]  # [L, Hkv, n, N]
    logits.masked_fill_(hidden[:, :, None], float("-inf"))
    return logits.softmax(dim=-1).nan_to_num_(0.0).sum(dim=(2, 3))


def max_pool(scores: torch.Tensor, kernel_size: int) -> torch.Tensor:
    """1-D max pool of odd width along the last dimension of ``scores [..., M]``, 'same'
    padding (the window is cut at both ends): ``[..., M]``."""
    if kernel_size < 1 or kernel_size % 2 == 0:
        raise ValueError(f"max_pool: kernel_size must be a positive odd integer, got {kernel_size}")
    if kernel_size == 1 or scores.shape[-1] == 0:
        return scores
    lead, m = scores.shape[:-1], scores.shape[-1]
    flat = scores.reshape(-1, 1, m)
    pooled = F.max_pool1d(flat, kernel_size, stride=1, padding=kernel_size // 2)
    return pooled.view(*lead, m)


def snapkv_scores(window_attn: torch.Tensor, num_candidates: int, kernel_size: int) -> torch.Tensor:
    """SnapKV's selection scores ``[L, Hkv, num_candidates]``: the window attention
    ``[L, Hkv, N]`` of the selection candidates (slots ``0..num_candidates-1``), max-pooled."""
    return max_pool(window_attn[..., :num_candidates].float(), kernel_size)
