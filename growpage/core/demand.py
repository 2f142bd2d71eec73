"""Demand maths of the paper as torch functions on dense tensors.

Distributions are along the last dimension and may carry any leading batch dimensions
(typically ``[L, Hkv, N]``: layer, KV head, candidate).

GQA: a KV head's distribution is the mean of the softmax distributions of the query heads in its
group (query head ``h`` belongs to KV head ``h // (Hq // Hkv)``, the layout of Llama and Qwen3).
The mean of distributions is itself a distribution, and it is the attention mass the whole group
places on each cached token, which is what evicting that token from the KV head costs.
"""

from __future__ import annotations

import numpy as np
import torch


def coverage_demand(attn: torch.Tensor, p: float) -> torch.Tensor:
    """p-coverage attention demand D_p (Eq. 2): the fewest tokens whose mass reaches ``p``.

    Args:
        attn: ``[..., N]`` normalized attention (sums to 1 over the last dim), N >= 1.
        p: coverage in (0, 1].
    Returns:
        ``[...]`` int64 counts in [1, N].
    """
    if not 0.0 < p <= 1.0:
        raise ValueError(f"coverage p must lie in (0, 1], got {p}")
    return _sorted_coverage(attn.float(), p).clamp(max=attn.shape[-1])


def _acc(x: torch.Tensor) -> torch.Tensor:
    """At least fp32 (fp64 stays fp64) for accumulations."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def retained_mass(attn: torch.Tensor, keep_mask: torch.Tensor) -> torch.Tensor:
    """Attention mass m(S) of a retained subset (Eq. 3). ``keep_mask`` is bool ``[..., N]``."""
    return (_acc(attn) * keep_mask).sum(dim=-1)


def worst_case_error(mass: torch.Tensor | float, v_max: float) -> torch.Tensor | float:
    """Worst-case output error 2 * Vmax * (1 - m) of keeping mass ``m`` (Eq. 5, Theorem 3.1)."""
    return 2.0 * v_max * (1.0 - mass)


def renormalized_output(
    attn: torch.Tensor, values: torch.Tensor, keep_mask: torch.Tensor
) -> torch.Tensor:
    """Output of attention restricted to a subset and renormalized (Eq. 3).

    ``attn [..., N]``, ``values [..., N, d]``, ``keep_mask [..., N]`` -> ``[..., d]``.
    """
    w = _acc(attn) * keep_mask
    w = w / w.sum(dim=-1, keepdim=True)
    return (w.unsqueeze(-1) * _acc(values)).sum(dim=-2)


def worst_case_capacity(attn: torch.Tensor, delta: float, v_max: float) -> torch.Tensor:
    """C_wc_delta (Eq. 4), computed through Theorem 3.1 as D_{1 - delta / (2 Vmax)}."""
    if not 0.0 < delta < 2.0 * v_max:
        raise ValueError(f"tolerance delta must lie in (0, 2*Vmax={2 * v_max}), got {delta}")
    return coverage_demand(attn, 1.0 - delta / (2.0 * v_max))


def working_set_ratio(attn: torch.Tensor, p: float) -> torch.Tensor:
    """r = K / |C| (Eq. 7): top-p working-set size over the candidate count, in (0, 1]."""
    return coverage_demand(attn, p).float() / attn.shape[-1]


def working_set_counts(attns: list[torch.Tensor] | torch.Tensor, p: float) -> torch.Tensor:
    """``coverage_demand`` of several distributions at once: int64 ``[R, ...]`` for ``R``
    tensors ``[..., N_r]`` that share their leading shape but not their candidate count (or
    one tensor ``[R, ..., N_max]`` of them already zero-padded).

    The rows are zero-padded to the longest and sorted together (one sort and one cumsum for
    all). Padding zeros sort last and add nothing to the running sums, so each row's count is
    the one it has alone.
    """
    if not 0.0 < p <= 1.0:
        raise ValueError(f"coverage p must lie in (0, 1], got {p}")
    if isinstance(attns, torch.Tensor):
        return _sorted_coverage(attns.float(), p)
    if not attns:
        raise ValueError("working_set_counts needs at least one distribution")
    lead = attns[0].shape[:-1]
    if any(a.shape[:-1] != lead or a.shape[-1] < 1 for a in attns):
        raise ValueError(
            "distributions must share their leading shape and hold >= 1 candidate, "
            f"got {[tuple(a.shape) for a in attns]}"
        )
    if len(attns) == 1:
        padded = attns[0].float().unsqueeze(0)
    elif len({a.shape[-1] for a in attns}) == 1:
        padded = torch.stack([a.float() for a in attns])
    else:  # [R, N_max, ...] through pad_sequence, then candidates contiguous in the last dim
        padded = (
            torch.nn.utils.rnn.pad_sequence(
                [a.float().movedim(-1, 0) for a in attns], batch_first=True
            )
            .movedim(1, -1)
            .contiguous()
        )
    return _sorted_coverage(padded, p)


def _sorted_coverage(attn: torch.Tensor, p: float) -> torch.Tensor:
    """Fewest largest entries of each row of ``attn`` (fp32, possibly zero-padded) whose sum
    reaches ``p`` of the row's total."""
    cum = descending(attn).cumsum(dim=-1)
    # The last running sum is the row's total (padding adds exact zeros), so the count never
    # passes the row's own length; the relative tolerance guards against fp32 round-off just
    # below p (e.g. p = 1).
    target = p * cum[..., -1:] * (1.0 - 1e-6)
    return (cum < target).sum(dim=-1) + 1


def descending(values: torch.Tensor) -> torch.Tensor:
    """``values.sort(dim=-1, descending=True).values``; fp32 on the CPU through numpy's sort,
    several times faster there on rows of hundreds (SIMD sorting networks).

    The same tensor: a sorted row is unique but for the order of entries that compare equal,
    and those are equal values (``-0.0`` beside ``0.0`` sums alike), so a running sum over it
    is the same bits; NaN comes first, as torch puts it (numpy sorts it last, and the
    ascending row is read backwards)."""
    if values.device.type != "cpu" or values.dtype != torch.float32 or values.ndim == 0:
        return values.sort(dim=-1, descending=True).values
    ascending = np.sort(values.detach().contiguous().numpy(), axis=-1)
    out = torch.empty(values.shape, dtype=values.dtype)  # numpy writes it: no tensor to lift
    out.numpy()[...] = ascending[..., ::-1]
    return out


def demand_trends(
    counts: torch.Tensor | list[torch.Tensor], num_candidates: list[int]
) -> list[float]:
    """Delta_t (Eq. 8) of each request from its top-p sizes ``counts [R, 2, ...]`` (short,
    long; or a list of such groups, in order) over its ``num_candidates[r]`` estimation
    candidates; one host sync for all.

    Both views share the candidate set, so r^S - r^L averaged over layers and heads is the mean
    size difference over |C|. The sums of integer sizes are exact, so a request's Delta_t does
    not depend on the others it is computed with.
    """
    groups = [counts] if isinstance(counts, torch.Tensor) else counts
    diffs = []
    for group in groups:
        means = group.float().flatten(2).mean(dim=-1)
        diffs.append(means[:, 0] - means[:, 1])
    flat = (diffs[0] if len(diffs) == 1 else torch.cat(diffs)).tolist()
    return [d / n for d, n in zip(flat, num_candidates, strict=True)]


def entropy_ratio(attn: torch.Tensor) -> torch.Tensor:
    """Entropy-based alternative to Eq. 7 (paper Table 2): exp(H(a)) / |C| in (0, 1].

    exp(H) is the perplexity ("effective number of tokens") of the distribution, so the ratio is
    on the same scale as the top-p working-set ratio.
    """
    a = attn.float().clamp_min(0)
    h = -(a * torch.log(a.clamp_min(1e-30))).sum(dim=-1)
    return (h.exp() / attn.shape[-1]).clamp(max=1.0)


def demand_trend(ratio_short: torch.Tensor, ratio_long: torch.Tensor) -> float:
    """Delta_t (Eq. 8): mean over participating layers and KV heads of r^S minus that of r^L."""
    return float(ratio_short.float().mean() - ratio_long.float().mean())


def ema_update(summary: torch.Tensor, query: torch.Tensor, beta: float) -> torch.Tensor:
    """One EMA step in place (Eq. 6): ``summary = beta * summary + (1 - beta) * query``."""
    return summary.mul_(beta).add_(query.to(summary.dtype), alpha=1.0 - beta)


def update_query_summaries(
    summaries: torch.Tensor, query: torch.Tensor, beta_short: float, beta_long: float, first: bool
) -> None:
    """Update the short/long summaries in place from one decode query (Eq. 6, appendix E.1).

    Args:
        summaries: ``[..., 2, Hq, d]`` (index 0 short, 1 long), pre-RoPE.
        query: ``[..., Hq, d]`` current pre-RoPE (post q-norm) query.
        first: first decode step of this slot: both summaries are set to the query.
    """
    if first:
        summaries.copy_(query.unsqueeze(-3).expand_as(summaries))
        return
    ema_update(summaries.select(-3, 0), query, beta_short)
    ema_update(summaries.select(-3, 1), query, beta_long)


def rms_calibrate(summary: torch.Tensor, query: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """RMS calibration (Eq. 12): rescale each head of ``summary`` to the RMS of ``query``.

    ``summary`` and ``query`` are ``[..., Hq, d]``; the RMS is taken over ``d`` per head.
    """
    rms_q = query.float().pow(2).mean(dim=-1, keepdim=True).sqrt()
    rms_s = summary.float().pow(2).mean(dim=-1, keepdim=True).sqrt()
    return summary.float() * (rms_q / rms_s.clamp_min(eps))


def group_attention(queries: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """Per-KV-head attention distributions from a GQA query group.

    Args:
        queries: ``[L, Hq, d]`` post-RoPE queries (one per query head).
        keys: ``[L, Hkv, N, d]`` post-RoPE candidate keys.
        scale: softmax scale (1/sqrt(d) for Llama and Qwen3).
    Returns:
        ``[L, Hkv, N]``: for each KV head, the mean over its query group of the softmax.
    """
    num_layers, num_q, d = queries.shape
    num_kv = keys.shape[1]
    if num_q % num_kv:
        raise ValueError(f"query heads ({num_q}) must be a multiple of KV heads ({num_kv})")
    q = queries.float().reshape(num_layers, num_kv, num_q // num_kv, d)
    logits = torch.einsum("lhgd,lhnd->lhgn", q, keys.float()) * scale
    return logits.softmax(dim=-1).mean(dim=2)
