"""Query summaries of a whole trace, computed once (paper Eq. 6, appendix E.1).

The short/long EMAs of a request depend only on its pre-RoPE queries, so a replay does not need
to update them token by token: ``ema_snapshots`` computes the summaries at a list of positions in
a few vectorized passes. With ``s_{p0} = q_{p0}`` (the first decode query initializes both) and
``s_t = beta * s_{t-1} + (1 - beta) * q_t``, the summary at snapshot ``g_n`` is::

    s_{g_n} = beta^(g_n - g_{n-1}) * s_{g_{n-1}} + sum_{g_{n-1} < j <= g_n} (1 - beta) beta^(g_n - j) q_j

The inner sums are one weighted ``index_add`` over the tokens; only the short scan over the
snapshots is sequential. With ``zero_start`` (``GrowPageConfig.summary_start == "average"``)
the EMA starts at zero instead, so the first query weighs ``(1 - beta) beta^age`` like any
other (the engine's ``QueryStatePool`` with ``zero_start``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

BLOCK_TOKENS = 2048  # tokens weighted at once (bounds the temporary memory)


def ema_snapshots(
    queries: torch.Tensor,
    first: int,
    positions: Sequence[int],
    betas: Sequence[float],
    zero_start: bool = False,
) -> torch.Tensor:
    """EMA summaries of ``queries`` at ``positions``.

    Args:
        queries: ``[L, T, Hq, d]`` pre-RoPE queries of one trace.
        first: first decode position p0 (its query initializes every EMA).
        positions: strictly increasing positions in ``[first, T)``.
        betas: EMA decays, e.g. ``(beta_short, beta_long)``.
        zero_start: start every EMA at zero (the first query is blended in, not copied).
    Returns:
        ``[n, L, len(betas), Hq, d]`` fp32: the summaries after the update at each position,
        the layout ``DenseKVView.set_queries`` takes per position.
    """
    num_layers, num_tokens, num_q, d = queries.shape
    grid = torch.as_tensor(list(positions), dtype=torch.long)
    n = grid.numel()
    if n == 0:
        return queries.new_zeros(0, num_layers, len(betas), num_q, d, dtype=torch.float32)
    if grid[0] < first or grid[-1] >= num_tokens or (n > 1 and (grid.diff() <= 0).any()):
        raise ValueError(f"positions must increase strictly within [{first}, {num_tokens})")
    out = torch.empty(n, num_layers, len(betas), num_q, d)
    for i, beta in enumerate(betas):
        out[:, :, i] = _snapshots_one(queries, first, grid, float(beta), zero_start)
    return out


def _snapshots_one(
    queries: torch.Tensor, first: int, grid: torch.Tensor, beta: float, zero_start: bool
) -> torch.Tensor:
    """``[n, L, Hq, d]`` summaries of one decay at the ``grid`` positions."""
    num_layers, _, num_q, d = queries.shape
    n, last = grid.numel(), int(grid[-1])
    sums = torch.zeros(num_layers, n, num_q, d)
    for start in range(first, last + 1, BLOCK_TOKENS):
        stop = min(start + BLOCK_TOKENS, last + 1)
        pos = torch.arange(start, stop)
        chunk = torch.searchsorted(grid, pos)  # snapshot each token feeds
        age = (grid[chunk] - pos).double()
        weight = (1.0 - beta) * torch.pow(beta, age)
        if not zero_start:
            weight[pos == first] = beta ** float(grid[0] - first)  # the initializing query
        block = queries[:, start:stop].float() * weight.float().view(1, -1, 1, 1)
        sums.index_add_(1, chunk, block)
    decay = torch.pow(beta, grid.diff().double()).float()  # [n - 1]
    for k in range(1, n):
        sums[:, k].add_(sums[:, k - 1], alpha=float(decay[k - 1]))
    return sums.transpose(0, 1)
