"""The rules that compare a boundary's answers across calls of one policy object:
``order-independent`` (another request's calls interleaved with its own) and the history half
of ``deterministic`` (fresh copies of the policy, one of which saw other boundaries first)."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import attrs
import torch

from growpage.core.boundary_context import BoundaryContext
from growpage.testing.rules import PolicyConformanceError, copy_policy, keeps_of, seeded_call
from growpage.testing.strategies import BoundaryCase

#: What the kit does instead of the history check for a policy that cannot be copied.
HISTORY = "'deterministic' was not checked on fresh copies of it"


def check_history(pristine: object, case: BoundaryCase) -> None:
    """``case``'s boundary on a fresh copy of the policy, then on another fresh copy that first
    saw an earlier boundary of the same request and a boundary of another request: the answers
    must be the same (``deterministic``: a function of the context, not of what came before).
    Catches state keyed by request id alone (a per-request memo or counter) and state shared
    by all requests (a running threshold); a cache keyed by ``(request_id, position)`` passes.
    As in ``check_order``, the other boundaries failing on their own is left to their example.
    """
    others: list[tuple[str, BoundaryCase, Hashable | None]] = [
        (
            "another request's boundary",
            attrs.evolve(case, seed=case.seed + 104729, num_pages=case.num_pages + 1),
            None,
        )
    ]
    earlier = _earlier_boundary(case)
    if earlier is not None:
        others.insert(
            0, ("an earlier boundary of the same request", earlier, case.context().request_id)
        )
    seed = case.seed + 3
    alone = _answers(copy_policy(pristine, HISTORY), case.context(), case, seed)
    after = _answers_after(pristine, others, case, seed)
    if after is None or _same_answers(alone, after):
        return
    if len(others) > 1:  # name the boundary that is enough to change the answer, if one is
        for shown in (others[:1], others[1:]):
            answers = _answers_after(pristine, shown, case, seed)
            if answers is not None and not _same_answers(alone, answers):
                others, after = shown, answers
                break
    saw = " and ".join(f"{label} (position {other.position})" for label, other, _ in others)
    if after[0] is not alone[0]:
        what = f"decided {alone[0]} on a fresh copy of the policy, {after[0]}"
    else:
        keep = next(
            k
            for k, a, b in zip(keeps_of(case), alone[1], after[1], strict=True)
            if not _same_selection(a, b)
        )
        what = f"select(ctx, keep={keep}) chose other slots than on a fresh copy of the policy"
    raise PolicyConformanceError(
        "deterministic",
        f"{what} on a fresh copy that first saw {saw}: the answer depends "
        "on what the policy saw before, not on the context alone; keep state only as a cache "
        "keyed by (ctx.request_id, ctx.position)",
        case,
    )


def _earlier_boundary(case: BoundaryCase) -> BoundaryCase | None:
    """A boundary of the same request at an earlier position (other content), or None at the
    first boundary a request can have (``min_capacity`` pages, nothing evicted)."""
    if case.num_pages > 2:
        return attrs.evolve(case, seed=case.seed + 15485863, num_pages=case.num_pages - 1)
    if case.gap >= case.page_size:
        return attrs.evolve(case, seed=case.seed + 15485863, gap=case.gap - case.page_size)
    return None


def _answers(
    policy: object, ctx: BoundaryContext, case: BoundaryCase, seed: int
) -> tuple[Any, list[Any]]:
    """``decide`` and every ``select`` of ``case``'s boundary, each call with seeded RNGs."""
    decision = seeded_call(policy, "decide", ctx, case, seed)
    return decision, [
        seeded_call(policy, "select", ctx, case, seed + 1 + i, keep)
        for i, keep in enumerate(keeps_of(case))
    ]


def _answers_after(
    pristine: object, others: list[tuple[str, BoundaryCase, Any]], case: BoundaryCase, seed: int
) -> tuple[Any, list[Any]] | None:
    """``_answers`` on a fresh copy of the policy that first answered ``others`` (a request id
    given with one makes it a boundary of that request); None when one of them fails."""
    policy = copy_policy(pristine, HISTORY)
    try:
        for i, (_, other, request_id) in enumerate(others):
            ctx = other.context()
            if request_id is not None:
                ctx.request_id = request_id
            _answers(policy, ctx, other, seed + 100 * (i + 1))
    except PolicyConformanceError:
        return None
    return _answers(policy, case.context(), case, seed)


def _same_answers(a: tuple[Any, list[Any]], b: tuple[Any, list[Any]]) -> bool:
    return a[0] is b[0] and all(_same_selection(x, y) for x, y in zip(a[1], b[1], strict=True))


def _same_selection(a: Any, b: Any) -> bool:
    return (
        isinstance(a, torch.Tensor)
        and isinstance(b, torch.Tensor)
        and a.shape == b.shape
        and torch.equal(a.sort(dim=-1).values, b.sort(dim=-1).values)
    )


def check_order(policy: object, case: BoundaryCase) -> None:
    """``case``'s boundary alone, then again with another request's boundary (same layers and
    heads, one page more, other content) interleaved: decide it, decide the other, select the
    other, then select it. Its answers must be the same (``order-independent``). Each of its
    calls gets the same global RNG state both times, so only what the policy carries from call
    to call can tell them apart (a policy drawing from the global RNGs fails ``deterministic``
    instead); the other boundary failing on its own is left to the example that draws it."""
    # Another request of another length: a policy that carries something from decide() to
    # select() (num_tokens, positions, a plan) gives itself away only if the two differ.
    other = attrs.evolve(case, seed=case.seed + 7919, num_pages=case.num_pages + 1)
    keeps, seed = keeps_of(case), case.seed + 2
    ctx = case.context()
    decision = seeded_call(policy, "decide", ctx, case, seed)
    selections = [
        seeded_call(policy, "select", ctx, case, seed + 1 + i, keep) for i, keep in enumerate(keeps)
    ]
    ctx, ctx_other = case.context(), other.context()
    first = seeded_call(policy, "decide", ctx, case, seed)
    try:
        seeded_call(policy, "decide", ctx_other, other, seed + 100)
        for keep in keeps_of(other):
            seeded_call(policy, "select", ctx_other, other, seed + 101, keep)
    except PolicyConformanceError:
        return
    picks = [
        seeded_call(policy, "select", ctx, case, seed + 1 + i, keep) for i, keep in enumerate(keeps)
    ]
    if first is not decision:
        raise PolicyConformanceError(
            "order-independent",
            f"decided {decision} alone, {first} with another request's boundary around it",
            case,
        )
    for keep, alone, mixed in zip(keeps, selections, picks, strict=True):
        if not (
            isinstance(mixed, torch.Tensor)
            and mixed.shape == alone.shape
            and torch.equal(alone.sort(dim=-1).values, mixed.sort(dim=-1).values)
        ):
            raise PolicyConformanceError(
                "order-independent",
                f"select(ctx, keep={keep}) chose other slots when another "
                "request's decide() and select() came after its decide()",
                case,
            )
