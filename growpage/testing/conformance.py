"""``check_policy``: the conformance kit a policy author runs on their own policy."""

from __future__ import annotations

import contextlib
import copy
import random
from collections.abc import Callable, Hashable, Iterator
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Flaky

from growpage.core.capacity import selection_problem
from growpage.core.context import BoundaryContext, changed_signals, missing_sums_hint
from growpage.core.decision import Decision
from growpage.errors import GrowPageError
from growpage.testing.strategies import BoundaryCase, boundary_cases, check_knob

if TYPE_CHECKING:
    from growpage.testing.serving import ServingCase

RULES = {
    "valid-decision": "decide() returns a growpage.Decision",
    "exact-selection": "select() returns an integer tensor [L, Hkv, keep] of unique slot "
                       "indices within the resident tokens, the protected recent window included",
    "deterministic": "the same context gives the same decision and selection",
    "order-independent": "a boundary gets the same decision and selection when another "
                         "request's decide() and select() come between its own (asynchronous "
                         "compaction runs a step's selections after all of its decisions)",
    "no-mutation": "decide() and select() leave the context and its KV view unchanged",
    "no-crash": "decide() and select() work on any valid small context (CPU tensors)",
    "serves": "served by the simulator on a small workload under a tight page pool "
              "(check_serving), every request finishes with all its tokens, every page comes "
              "back, and a fresh copy of the policy serves it with the same events",
}


class PolicyConformanceError(GrowPageError, AssertionError):
    """A policy broke a conformance rule; ``rule`` is its key in ``RULES``."""

    def __init__(self, rule: str, detail: str, case: BoundaryCase | ServingCase | None = None
                 ) -> None:
        self.rule, self.detail, self.case = rule, detail, case
        msg = f"[{rule}] {RULES[rule]}: {detail}"
        if case is not None:
            msg += f"\n  example: {case}"
        super().__init__(msg)


def _snapshot(ctx: Any) -> dict:   # the kit's contexts: a DenseKVView behind
    view = ctx.view
    state = {k: v for k, v in vars(ctx).items() if not k.startswith("_") and k != "view"}
    tensors = {"keys": view.keys(), "positions": view.positions(),
               "summaries": view.summaries, "current": view.current_query}
    acc = view.accumulated_attention()
    if acc is not None:
        tensors["acc"] = acc
    return {"state": copy.deepcopy(state), "tensors": {k: t.clone() for k, t in tensors.items()}}


# What a snapshot's tensors are, in the words a policy reaches them with.
_VIEW_TENSORS = {"keys": "ctx.view.keys()", "positions": "ctx.view.positions()",
                 "summaries": "the query summaries (ctx.view.query_state().short / .long)",
                 "current": "the current query (ctx.view.query_state().current)",
                 "acc": "ctx.view.accumulated_attention()"}


def _changes(a: dict, b: dict) -> list[str]:
    """What differs between two snapshots of a context, named as a policy reaches it."""
    changed = [f"ctx.{k}" for k in a["state"].keys() | b["state"].keys()
               if a["state"].get(k) != b["state"].get(k)]
    for k in a["tensors"].keys() | b["tensors"].keys():
        x, y = a["tensors"].get(k), b["tensors"].get(k)
        if x is None or y is None or not torch.equal(x, y):
            changed.append(_VIEW_TENSORS.get(k, k))
    return sorted(changed)


def _run(policy: object, case: BoundaryCase) -> tuple[Decision, list[torch.Tensor]]:
    ctx = case.context()
    before = _snapshot(ctx)
    decision = _call(policy, "decide", ctx, case)
    if not isinstance(decision, Decision):
        raise PolicyConformanceError("valid-decision", f"got {decision!r}", case)
    selections = []
    for keep in _keeps(case):
        indices = _call(policy, "select", ctx, case, keep)
        problem = selection_problem(indices, ctx, keep)
        if problem:
            raise PolicyConformanceError("exact-selection", f"keep={keep}: {problem}", case)
        selections.append(indices.clone())
    changed = _changes(before, _snapshot(ctx))
    if changed:
        raise PolicyConformanceError("no-mutation", "the context or its view changed: "
                                     f"{', '.join(changed)}", case)
    changed = changed_signals(ctx, case.context())
    if changed:
        raise PolicyConformanceError("no-mutation", "a tensor the context returned was "
                                     f"modified in place: {', '.join(changed)} changed", case)
    return decision, selections


def _call(policy: object, method: str, ctx: BoundaryContext, case: BoundaryCase,
          *args: object) -> Any:
    """``policy.method(ctx, *args)``; what it raises is a ``no-crash`` error naming the call."""
    try:
        return getattr(policy, method)(ctx, *args)
    except Exception as exc:
        call = f"{method}(ctx{', keep=' + str(args[0]) if args else ''})"
        raise PolicyConformanceError("no-crash", f"{call} raised {type(exc).__name__}: "
                                     f"{exc}{missing_sums_hint(ctx)}", case) from exc


@contextlib.contextmanager
def global_rngs_seeded(seed: int) -> Iterator[None]:
    """Seed Python's, numpy's and torch's process-wide RNGs; restore them afterwards.

    NOTE: hypothesis reseeds them identically for every example, so without this a policy
    drawing from them makes the same draws on both runs of ``check_case`` and looks
    deterministic. Torch's CPU generator only (the kit's tensors are on the CPU):
    ``torch.manual_seed`` would also seed the accelerators' generators, which ``fork_rng``
    does not restore, and costs a stack capture per call where CUDA is not initialized."""
    py_state, np_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.default_generator.manual_seed(seed)
        try:
            yield
        finally:
            random.setstate(py_state)
            np.random.set_state(np_state)


def check_case(policy: object, case: BoundaryCase, pristine: object | None = None) -> None:
    """Check every rule on one boundary; raise ``PolicyConformanceError`` on the first broken.

    ``pristine``: a copy of the policy as it was built, before any call (``check_policy``
    passes one); None copies ``policy`` as it is now."""
    pristine = _copy(policy) if pristine is None else pristine
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
        raise PolicyConformanceError("deterministic", f"decided {decision} then {again} on the "
                                     "same context", case)
    for keep, a, b in zip(_keeps(case), selections, selections2, strict=True):
        if not torch.equal(a.sort(dim=-1).values, b.sort(dim=-1).values):
            raise PolicyConformanceError("deterministic", f"select(ctx, keep={keep}) chose "
                                         "different slots on the same context", case)
    _check_order(policy, case)
    if pristine is not None:
        _check_history(pristine, case)


def _copy(policy: object) -> object | None:
    """A deep copy of ``policy``, or None when it cannot be copied (no history check then)."""
    try:
        return copy.deepcopy(policy)
    except Exception:  # noqa: BLE001 - a policy holding a lock, a file...: not a broken rule
        return None


def _check_history(pristine: object, case: BoundaryCase) -> None:
    """``case``'s boundary on a fresh copy of the policy, then on another fresh copy that first
    saw an earlier boundary of the same request and a boundary of another request: the answers
    must be the same (``deterministic``: a function of the context, not of what came before).
    Catches state keyed by request id alone (a per-request memo or counter) and state shared
    by all requests (a running threshold); a cache keyed by ``(request_id, position)`` passes.
    As in ``_check_order``, the other boundaries failing on their own is left to their example.
    """
    others: list[tuple[str, BoundaryCase, Hashable | None]] = [
        ("another request's boundary", attrs.evolve(case, seed=case.seed + 104729,
                                                    num_pages=case.num_pages + 1), None)]
    earlier = _earlier_boundary(case)
    if earlier is not None:
        others.insert(0, ("an earlier boundary of the same request", earlier,
                          case.context().request_id))
    seed = case.seed + 3
    alone = _answers(_copy(pristine), case.context(), case, seed)
    after = _answers_after(pristine, others, case, seed)
    if after is None or _same_answers(alone, after):
        return
    if len(others) > 1:   # name the boundary that is enough to change the answer, if one is
        for shown in (others[:1], others[1:]):
            answers = _answers_after(pristine, shown, case, seed)
            if answers is not None and not _same_answers(alone, answers):
                others, after = shown, answers
                break
    saw = " and ".join(f"{label} (position {other.position})" for label, other, _ in others)
    if after[0] is not alone[0]:
        what = f"decided {alone[0]} on a fresh copy of the policy, {after[0]}"
    else:
        keep = next(k for k, a, b in zip(_keeps(case), alone[1], after[1], strict=True)
                    if not _same_selection(a, b))
        what = f"select(ctx, keep={keep}) chose other slots than on a fresh copy of the policy"
    raise PolicyConformanceError(
        "deterministic", f"{what} on a fresh copy that first saw {saw}: the answer depends "
        "on what the policy saw before, not on the context alone; keep state only as a cache "
        "keyed by (ctx.request_id, ctx.position)", case)


def _earlier_boundary(case: BoundaryCase) -> BoundaryCase | None:
    """A boundary of the same request at an earlier position (other content), or None at the
    first boundary a request can have (``min_capacity`` pages, nothing evicted)."""
    if case.num_pages > 2:
        return attrs.evolve(case, seed=case.seed + 15485863, num_pages=case.num_pages - 1)
    if case.gap >= case.page_size:
        return attrs.evolve(case, seed=case.seed + 15485863, gap=case.gap - case.page_size)
    return None


def _answers(policy: object, ctx: BoundaryContext, case: BoundaryCase, seed: int
             ) -> tuple[Any, list[Any]]:
    """``decide`` and every ``select`` of ``case``'s boundary, each call with seeded RNGs."""
    decision = _seeded(policy, "decide", ctx, case, seed)
    return decision, [_seeded(policy, "select", ctx, case, seed + 1 + i, keep)
                      for i, keep in enumerate(_keeps(case))]


def _answers_after(pristine: object, others: list[tuple[str, BoundaryCase, Any]],
                   case: BoundaryCase, seed: int) -> tuple[Any, list[Any]] | None:
    """``_answers`` on a fresh copy of the policy that first answered ``others`` (a request id
    given with one makes it a boundary of that request); None when one of them fails."""
    policy = _copy(pristine)
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
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
            and torch.equal(a.sort(dim=-1).values, b.sort(dim=-1).values))


def _seeded(policy: object, method: str, ctx: BoundaryContext, case: BoundaryCase, seed: int,
            *args: object) -> Any:
    """``_call`` with the global RNGs seeded for this one call."""
    with global_rngs_seeded(seed):
        return _call(policy, method, ctx, case, *args)


def _check_order(policy: object, case: BoundaryCase) -> None:
    """``case``'s boundary alone, then again with another request's boundary (same layers and
    heads, one page more, other content) interleaved: decide it, decide the other, select the
    other, then select it. Its answers must be the same (``order-independent``). Each of its
    calls gets the same global RNG state both times, so only what the policy carries from call
    to call can tell them apart (a policy drawing from the global RNGs fails ``deterministic``
    instead); the other boundary failing on its own is left to the example that draws it."""
    # Another request of another length: a policy that carries something from decide() to
    # select() (num_tokens, positions, a plan) gives itself away only if the two differ.
    other = attrs.evolve(case, seed=case.seed + 7919, num_pages=case.num_pages + 1)
    keeps, seed = _keeps(case), case.seed + 2
    ctx = case.context()
    decision = _seeded(policy, "decide", ctx, case, seed)
    selections = [_seeded(policy, "select", ctx, case, seed + 1 + i, keep)
                  for i, keep in enumerate(keeps)]
    ctx, ctx_other = case.context(), other.context()
    first = _seeded(policy, "decide", ctx, case, seed)
    try:
        _seeded(policy, "decide", ctx_other, other, seed + 100)
        for keep in _keeps(other):
            _seeded(policy, "select", ctx_other, other, seed + 101, keep)
    except PolicyConformanceError:
        return
    picks = [_seeded(policy, "select", ctx, case, seed + 1 + i, keep)
             for i, keep in enumerate(keeps)]
    if first is not decision:
        raise PolicyConformanceError("order-independent", f"decided {decision} alone, {first} "
                                     "with another request's boundary around it", case)
    for keep, alone, mixed in zip(keeps, selections, picks, strict=True):
        if not (isinstance(mixed, torch.Tensor) and mixed.shape == alone.shape
                and torch.equal(alone.sort(dim=-1).values, mixed.sort(dim=-1).values)):
            raise PolicyConformanceError(
                "order-independent", f"select(ctx, keep={keep}) chose other slots when another "
                "request's decide() and select() came after its decide()", case)


def _keeps(case: BoundaryCase) -> list[int]:
    """The ``keep`` counts ``select`` is asked for: a compression's, and a shrink's."""
    keeps = [(case.num_pages - 1) * case.page_size]
    if case.num_pages >= 3:
        keeps.append((case.num_pages - 2) * case.page_size)
    return keeps


def check_policy(policy: object, max_examples: int = 40, **strategy_kwargs: Any) -> None:
    """Run the conformance rules (``RULES``) on ``max_examples`` random small boundaries.

    Raises ``PolicyConformanceError`` naming the rule, with the shrunk (smallest) failing
    example. ``strategy_kwargs`` go to ``growpage.testing.boundary_cases``; a policy with
    ``needs_accumulated_attention`` gets the accumulated sums in every example, as the
    simulator and the engine give them to it. ``TypeError`` when ``policy`` is not a policy
    object (a class, a name: see ``resolve_policy``).
    """
    refuse_a_class(policy, "check_policy")
    check_knob("check_policy", "max_examples", max_examples, 1)
    missing = [m for m in ("decide", "select") if not callable(getattr(policy, m, None))]
    if missing:
        raise TypeError(f"check_policy takes a policy object, got {policy!r} (no "
                        f"{' or '.join(missing)}() method)")
    if getattr(policy, "needs_accumulated_attention", False):
        strategy_kwargs.setdefault("accumulated", True)
    failure: list[PolicyConformanceError] = []
    pristine = _copy(policy)   # before any call: each example's history check copies it

    @settings(max_examples=max_examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck), print_blob=False,
              report_multiple_bugs=False)
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
        raise TypeError(f"{caller} takes a policy object, got the class {policy.__name__}: "
                        f"call {caller}({policy.__name__}())")


def raise_smallest_failure(run: Callable[[], None], failure: list[PolicyConformanceError],
                           what: str) -> None:
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
            "deterministic", f"{what} failed ({detail}) and passed when run again: the policy "
            "depends on state outside the context (a call counter, a global RNG...)",
            first.case if first else None) from None
