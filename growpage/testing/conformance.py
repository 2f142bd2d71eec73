"""``check_policy``: the conformance kit a policy author runs on their own policy.

The rules are in ``growpage.testing.rules``; this module checks those of one boundary (valid
decision, exact selection, determinism, no mutation, no crash) and runs them over random
boundaries; ``growpage.testing.history`` checks the ones that compare calls across boundaries.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Flaky

from growpage.core.boundary_context import changed_signals
from growpage.core.capacity import selection_problem
from growpage.core.decision import Decision
from growpage.testing.history import HISTORY, check_history, check_order
from growpage.testing.rules import (
    RULES,
    PolicyConformanceError,
    PolicyConformanceWarning,
    call_policy,
    copy_policy,
    global_rngs_seeded,
    keeps_of,
)
from growpage.testing.strategies import BoundaryCase, boundary_cases, check_knob

__all__ = [
    "RULES",
    "PolicyConformanceError",
    "PolicyConformanceWarning",
    "check_case",
    "check_policy",
    "global_rngs_seeded",
    "raise_smallest_failure",
    "refuse_a_class",
]


#: ``check_case``'s ``pristine`` for a policy that cannot be copied (already warned about).
NO_COPY = object()


def _snapshot(ctx: Any) -> dict:  # the kit's contexts: a DenseKVView behind
    view = ctx.view
    state = {k: v for k, v in vars(ctx).items() if not k.startswith("_") and k != "view"}
    tensors = {
        "keys": view.keys(),
        "positions": view.positions(),
        "summaries": view.summaries,
        "current": view.current_query,
    }
    acc = view.accumulated_attention()
    if acc is not None:
        tensors["acc"] = acc
    return {"state": copy.deepcopy(state), "tensors": {k: t.clone() for k, t in tensors.items()}}


# What a snapshot's tensors are, in the words a policy reaches them with.
_VIEW_TENSORS = {
    "keys": "ctx.view.keys()",
    "positions": "ctx.view.positions()",
    "summaries": "the query summaries (ctx.view.query_state().short / .long)",
    "current": "the current query (ctx.view.query_state().current)",
    "acc": "ctx.view.accumulated_attention()",
}


def _changes(a: dict, b: dict) -> list[str]:
    """What differs between two snapshots of a context, named as a policy reaches it."""
    changed = [
        f"ctx.{k}"
        for k in a["state"].keys() | b["state"].keys()
        if a["state"].get(k) != b["state"].get(k)
    ]
    for k in a["tensors"].keys() | b["tensors"].keys():
        x, y = a["tensors"].get(k), b["tensors"].get(k)
        if x is None or y is None or not torch.equal(x, y):
            changed.append(_VIEW_TENSORS.get(k, k))
    return sorted(changed)


def _run(policy: object, case: BoundaryCase) -> tuple[Decision, list[torch.Tensor]]:
    ctx = case.context()
    before = _snapshot(ctx)
    decision = call_policy(policy, "decide", ctx, case)
    if not isinstance(decision, Decision):
        raise PolicyConformanceError("valid-decision", f"got {decision!r}", case)
    selections = []
    for keep in keeps_of(case):
        indices = call_policy(policy, "select", ctx, case, keep)
        problem = selection_problem(indices, ctx, keep)
        if problem:
            raise PolicyConformanceError("exact-selection", f"keep={keep}: {problem}", case)
        selections.append(indices.clone())
    changed = _changes(before, _snapshot(ctx))
    if changed:
        raise PolicyConformanceError(
            "no-mutation", f"the context or its view changed: {', '.join(changed)}", case
        )
    changed = changed_signals(ctx, case.context())
    if changed:
        raise PolicyConformanceError(
            "no-mutation",
            f"a tensor the context returned was modified in place: {', '.join(changed)} changed",
            case,
        )
    return decision, selections


def check_case(policy: object, case: BoundaryCase, pristine: object | None = None) -> None:
    """Check every rule on one boundary; raise ``PolicyConformanceError`` on the first broken.

    ``pristine``: a copy of the policy as it was built, before any call (``check_policy``
    passes one); None copies ``policy`` as it is now; ``NO_COPY``: the policy cannot be
    copied (the history check is left out)."""
    if pristine is None:
        pristine = copy_policy(policy, HISTORY)
    elif pristine is NO_COPY:
        pristine = None
    try:  # the two runs see different global RNG states: the context alone must decide
        with global_rngs_seeded(case.seed):
            decision, selections = _run(policy, case)
        with global_rngs_seeded(case.seed + 1):
            again, selections2 = _run(policy, case)
    except PolicyConformanceError:
        raise
    except Exception as exc:  # noqa: BLE001 - any crash is a broken rule
        raise PolicyConformanceError("no-crash", f"{type(exc).__name__}: {exc}", case) from exc
    if again is not decision:
        raise PolicyConformanceError(
            "deterministic", f"decided {decision} then {again} on the same context", case
        )
    for keep, a, b in zip(keeps_of(case), selections, selections2, strict=True):
        if not torch.equal(a.sort(dim=-1).values, b.sort(dim=-1).values):
            raise PolicyConformanceError(
                "deterministic",
                f"select(ctx, keep={keep}) chose different slots on the same context",
                case,
            )
    check_order(policy, case)
    if pristine is not None:
        check_history(pristine, case)


def check_policy(policy: object, max_examples: int = 40, **strategy_kwargs: Any) -> None:
    """Run the conformance rules (``RULES``) on ``max_examples`` random small boundaries.

    Raises ``PolicyConformanceError`` naming the rule, with the shrunk (smallest) failing
    example. ``strategy_kwargs`` go to ``growpage.testing.boundary_cases``
    (``protected_prompt=True`` checks the policy with the prompt kept out of compression, as
    ``growpage eval accuracy --protect-prompt`` runs it); a policy with
    ``needs_accumulated_attention`` gets the accumulated sums in every example, and one with
    ``needs_recent_queries`` the recent queries, as the simulator and the engine give them. ``TypeError`` when ``policy`` is not a policy
    object (a class, a name: see ``resolve_policy``).
    """
    refuse_a_class(policy, "check_policy")
    check_knob("check_policy", "max_examples", max_examples, 1)
    missing = [m for m in ("decide", "select") if not callable(getattr(policy, m, None))]
    if missing:
        raise TypeError(
            f"check_policy takes a policy object, got {policy!r} (no "
            f"{' or '.join(missing)}() method)"
        )
    if getattr(policy, "needs_accumulated_attention", False):
        strategy_kwargs.setdefault("accumulated", True)
    if getattr(policy, "needs_recent_queries", 0):
        strategy_kwargs.setdefault("recent_queries", True)
    failure: list[PolicyConformanceError] = []
    # Before any call: each example's history check copies it.
    pristine = copy_policy(policy, HISTORY)
    pristine = NO_COPY if pristine is None else pristine

    @kit_settings(max_examples)
    @given(boundary_cases(**strategy_kwargs))
    def run(case: BoundaryCase) -> None:
        try:
            check_case(policy, case, pristine)
        except PolicyConformanceError as exc:
            failure[:] = [exc]
            raise

    raise_smallest_failure(run, failure, "a boundary")


def refuse_a_class(policy: object, caller: str) -> None:
    """``TypeError`` when ``policy`` is a class rather than a policy object."""
    if isinstance(policy, type):
        raise TypeError(
            f"{caller} takes a policy object, got the class {policy.__name__}: "
            f"call {caller}({policy.__name__}())"
        )


def kit_settings(max_examples: int) -> settings:
    """The kit's hypothesis settings: the same examples on every run (derandomized, no example
    database), no deadline or health checks (a policy may be slow), and the smallest failure
    alone."""
    return settings(
        max_examples=max_examples,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
        print_blob=False,
        report_multiple_bugs=False,
    )


def raise_smallest_failure(
    run: Callable[[], None], failure: list[PolicyConformanceError], what: str
) -> None:
    """Run the hypothesis test ``run``, whose examples leave their ``PolicyConformanceError``
    in ``failure``; raise the last one (the smallest example's). A failure that does not repeat
    on the same example (``what``) is a ``deterministic`` error: hidden state."""
    try:
        run()
    except PolicyConformanceError:
        # Keep the policy's own exception (a no-crash failure's traceback into the policy's
        # code); ``from None`` would reset the cause the kit set, and hide the line.
        smallest = failure[-1]
        raise smallest from smallest.__cause__
    except Flaky as exc:  # failed once, then passed on the same example: hidden state
        first = failure[-1] if failure else None
        detail = f"[{first.rule}] {first.detail}" if first else str(exc).splitlines()[0]
        raise PolicyConformanceError(
            "deterministic",
            f"{what} failed ({detail}) and passed when run again: the policy "
            "depends on state outside the context (a call counter, a global RNG...)",
            first.case if first else None,
        ) from None
