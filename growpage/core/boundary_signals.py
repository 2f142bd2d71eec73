"""The boundary signals of several requests in one pass (the torch path), each bitwise what its
``BoundaryContext`` computes alone.

``BoundaryContext`` computes, per request: the summaries calibrated (Eq. 12) and rotated to the
current position, the logits of both over the resident keys, and the group softmax over the
estimation or the selection candidates. Here the summaries of all requests go through one
pass (elementwise maths and per-row reductions over the head dimension: the same result per
row), and so does the gather of their keys. The logits, the softmaxes and the group means go
per group of requests with the same number of resident slots: one batched matrix product
(``summary_logits``, which ``BoundaryContext`` computes its own logits with) over the group's
(request, layer, KV head) matrices. Nothing is padded: a BLAS may take another kernel for
another width (on the CPU, below a few dozen columns it does, and the dot products are then
summed in another order), and a softmax row padded to another length is summed in another
order; the decisions must not move by a rounding. Each context then holds its own slices, so
what it answers (and what the policy reads) is what it would have computed::

    contexts  A(N=96) B(N=128) C(N=96)   ->  queries [3, 2, L, Hq, d], keys: one gather
              (sorted: A C B)                products and softmaxes: {A, C} and {B}

A step's pass computes the selection scores (Eq. 9) of its requests too, so that those which
compress need no second pass.

Views with fast signals (the engine's kernels, ``KVView.has_fast_signals``) are left alone:
their ``BoundaryBatch`` asks them for all members at once.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch

from growpage.core import demand
from growpage.core.rope import rope_at_each
from growpage.core.selection import importance
from growpage.core.threads import one_thread

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
    """Queries and keys of ``contexts`` in one pass each, then per group of equal slot counts
    their logits (as each computes them alone), selection scores and (``estimation``)
    estimation attention."""
    order = sorted(range(len(contexts)), key=lambda i: contexts[i].num_tokens)
    contexts = [contexts[i] for i in order]
    tables = None if tables is None else [tables[i] for i in order]
    view = contexts[0].view
    counts = [c.num_tokens for c in contexts]
    _queries(contexts)
    fresh = ["_logits" not in vars(c) for c in contexts]
    todo = [c for c, f in zip(contexts, fresh, strict=True) if f]  # in the same order
    if todo:
        keys = type(view).batch_keys(
            [c.view for c in todo],
            None if tables is None else [t for t, f in zip(tables, fresh, strict=True) if f],
            [c.num_tokens for c in todo],
        )
        queries = torch.stack([c._queries for c in todo])
    start = first = 0  # first: the group's first row of ``keys``
    while start < len(contexts):
        n = counts[start]
        end = start + counts.count(n)
        group = contexts[start:end]
        new = sum(fresh[start:end])
        if new:  # one product for the group: nothing padded
            logits = summary_logits(
                queries[first : first + new],
                keys[first : first + new, :, :, :n],
                view.softmax_scale,
            )
            first += new
            if new < len(group):
                rows = iter(logits)
                logits = torch.stack(
                    [
                        next(rows) if f else c._logits
                        for c, f in zip(group, fresh[start:end], strict=True)
                    ]
                )
        else:
            logits = torch.stack([c._logits for c in group])
        _cache(group, logits, estimation)
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


def summary_logits(queries: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """Scaled logits ``[R, 2, L, Hkv, G, N]`` of the calibrated, rotated summaries ``queries
    [R, 2, L, Hq, d]`` over ``keys [R, L, Hkv, N, d]`` (any float dtype), in one ``bmm`` of
    ``R * L * Hkv`` matrices, each the same product whatever R (``BoundaryContext._logits``
    is this with R = 1)."""
    num, views, num_layers, num_q, d = queries.shape
    num_kv, most = keys.shape[2], keys.shape[3]
    group = num_q // num_kv
    # Matrix (r, l, h): the 2 * G summary rows of that KV head against its keys.
    q = queries.reshape(num, views, num_layers, num_kv, group, d).permute(0, 2, 3, 1, 4, 5)
    q = q.reshape(num * num_layers * num_kv, views * group, d)
    k = keys.float().reshape(num * num_layers * num_kv, most, d).transpose(1, 2)
    # A lone matrix on one CPU thread: in a product of several each is one thread's, and a
    # BLAS may split a lone one across threads and sum it in another order.
    with one_thread(q.device) if len(q) == 1 else contextlib.nullcontext():
        out = torch.bmm(q, k).view(num, num_layers, num_kv, views, group, most)
    return out.permute(0, 3, 1, 2, 4, 5) * scale


def _cache(group: list[BoundaryContext], logits: torch.Tensor, estimation: bool) -> None:
    """Each context's slices of its group's signals (``_group_softmax``'s maths), ``logits``
    the group's stacked."""
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
