"""The boundary signals of several requests in one pass (the torch path), each bitwise what its
``BoundaryContext`` computes alone.

``BoundaryContext`` computes, per request: the summaries calibrated (Eq. 12) and rotated to the
current position, the logits of both over the resident keys, and the group softmax over the
estimation or the selection candidates. Here the summaries of all requests go through one
pass (elementwise maths and per-row reductions over the head dimension: the same result per
row), and so does the gather of their keys. Each request's logits are its own einsum over keys
laid out as its view lays them out (a batch of the products, or another layout, may take
another kernel). The softmaxes and the group means go per group of requests with the same
number of resident slots: a row padded to another length would be summed in another order,
and the decisions must not move by a rounding. Each context then holds its own slices, so what
it answers (and what the policy reads) is what it would have computed::

    contexts  A(N=96) B(N=128) C(N=96)   ->  queries [3, 2, L, Hq, d], keys: one gather
              (sorted: A C B)                softmaxes: rows {A, C} and {B}

A step's pass computes the selection scores (Eq. 9) of its requests too, so that those which
compress need no second pass.

Views with fast signals (the engine's kernels, ``KVView.has_fast_signals``) are left alone:
their ``BoundaryBatch`` asks them for all members at once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from growpage.core import demand
from growpage.core.rope import rope_at_each
from growpage.core.selection import importance

if TYPE_CHECKING:
    from growpage.core.boundary_context import BoundaryContext


def fill_estimation(contexts: list[BoundaryContext]) -> None:
    """Cache the estimation attention (``attention()``) and the selection scores of the
    torch-path ``contexts`` lacking them, in one pass."""
    todo = [
        c
        for c in contexts
        if not c.view.has_fast_signals and "_estimation_attention" not in vars(c)
    ]
    if todo:
        _fill(todo, None, estimation=True)


def selection_scores(
    contexts: list[BoundaryContext], tables: list[list[int]]
) -> list[torch.Tensor]:
    """Importance (Eq. 9) of each of ``contexts``' selection candidates, ``ctx.scores()``'s
    values; those the step's pass did not compute (a policy that decided without them), in one
    more. ``tables``: each request's block table at its boundary (its state may have been
    booked since)."""
    todo = [
        (c, table)
        for c, table in zip(contexts, tables, strict=True)
        if "_importance" not in vars(c) and "_selection_attention" not in vars(c)
    ]
    fast = [(c, t) for c, t in todo if c.view.has_fast_signals]
    if len(fast) > 1:
        _fill_fast([c for c, _ in fast], [t for _, t in fast])
    if len(fast) < len(todo):
        slow = [(c, t) for c, t in todo if not c.view.has_fast_signals]
        _fill([c for c, _ in slow], [t for _, t in slow], estimation=False)
    return [vars(c)["_importance"] if "_importance" in vars(c) else c.scores() for c in contexts]


def _fill_fast(contexts: list[BoundaryContext], tables: list[list[int]]) -> None:
    """The selection attention and scores of fast-signal ``contexts`` from one call of their
    views' ``batch_boundary_signals`` (through ``tables``)."""
    counts = [c.num_selection_candidates for c in contexts]
    cached = all("_queries" in vars(c) for c in contexts)
    signals = type(contexts[0].view).batch_boundary_signals(
        [c.view for c in contexts],
        [c.position for c in contexts],
        counts,
        tables,
        torch.stack([c._queries for c in contexts]) if cached else None,
    )
    if signals is None:
        return  # each computes its own (``scores()``)
    padded = signals[1]
    scores = importance(padded[:, 0], padded[:, 1])
    for i, (c, n) in enumerate(zip(contexts, counts, strict=True)):
        c.__dict__["_selection_attention"] = padded[i, ..., :n]
        c.__dict__["_importance"] = scores[i, ..., :n]


def _fill(
    contexts: list[BoundaryContext], tables: list[list[int]] | None, estimation: bool
) -> None:
    """Queries and keys of ``contexts`` in one pass each, each request's logits as it computes
    them alone, then per group of equal slot counts the selection scores and
    (``estimation``) the estimation attention."""
    order = sorted(range(len(contexts)), key=lambda i: contexts[i].num_tokens)
    contexts = [contexts[i] for i in order]
    tables = None if tables is None else [tables[i] for i in order]
    view = contexts[0].view
    counts = [c.num_tokens for c in contexts]
    _queries(contexts)
    keys = type(view).batch_keys([c.view for c in contexts], tables, counts)
    for c, k in zip(contexts, keys, strict=True):
        if "_logits" not in vars(c):
            c.__dict__["_logits"] = _logits(c, k)
    start = 0
    while start < len(contexts):
        end = start + counts.count(counts[start])
        group = contexts[start:end]
        logits = torch.stack([c._logits for c in group]) if len(group) > 1 else None
        _cache(group, logits if logits is not None else group[0]._logits[None], estimation)
        start = end


def _queries(contexts: list[BoundaryContext]) -> None:
    """``_queries`` of the contexts lacking them (calibrated and rotated summaries), in one
    pass."""
    missing = [c for c in contexts if "_queries" not in vars(c)]
    if not missing:
        return
    views = [c.view for c in missing]
    summaries, current = type(views[0]).batch_query_states(views)
    calibrated = demand.rms_calibrate(summaries, current.unsqueeze(1))
    rotated = rope_at_each(views[0].rope, calibrated, [c.position for c in missing])
    for i, c in enumerate(missing):
        c.__dict__["_queries"] = rotated[i]


def _logits(ctx: BoundaryContext, keys: torch.Tensor) -> torch.Tensor:
    """``BoundaryContext._logits`` of ``ctx`` over ``keys [L, Hkv, N, d]`` (laid out as its
    view's ``keys()``): the same einsum on the same operands. (One einsum per request: a
    batch of the matrix products may take another kernel, by layout or thread count.)"""
    view = ctx.view
    views, num_layers, _, d = ctx._queries.shape
    q = ctx._queries.reshape(views, num_layers, view.num_kv_heads, -1, d)
    return torch.einsum("vlhgd,lhnd->vlhgn", q, keys.float()) * view.softmax_scale


def _cache(group: list[BoundaryContext], logits: torch.Tensor, estimation: bool) -> None:
    """Each context's slices of its group's logits and signals (``_group_softmax``'s maths)."""
    first = group[0]
    selection = logits[..., : first.num_selection_candidates].softmax(dim=-1).mean(dim=4)
    scores = importance(selection[:, 0], selection[:, 1])
    attn = None
    if estimation:
        attn = logits[..., : first.num_estimation_candidates].softmax(dim=-1).mean(dim=4)
    for i, c in enumerate(group):
        c.__dict__["_logits"] = logits[i]
        c.__dict__["_selection_attention"] = selection[i]
        c.__dict__["_importance"] = scores[i]
        if attn is not None:
            c.__dict__["_estimation_attention"] = attn[i]
