"""``CapacityController``: executes capacity decisions at boundaries
(docs/architecture.md, "Capacity semantics").

The controller owns no policy logic: it detects the boundary, forces growth below
``min_capacity``, asks the policy, and executes GROW / COMPRESS & HOLD / SHRINK on the request's
pages (through ``PagePool``) and KV content (through a ``KVView``). Every exit path leaves the
request and the pool either fully updated or untouched.

A compression can be deferred (``on_boundary(..., defer=True)``, the engine's asynchronous
compaction, paper appendix E.3): its pages are settled at once (copy-on-write pages allocated,
pages it will release still held) and the returned ``BoundaryOutcome.pending`` runs the
selection and the compaction later, or is cancelled.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Generic

import attrs
import torch

from growpage.core.boundary_context import BoundaryBatch, BoundaryContext, missing_sums_hint
from growpage.core.config import GrowPageConfig
from growpage.core.decision import Action, Decision
from growpage.core.events import EventCounters
from growpage.core.kv_view import KVView
from growpage.core.pages import PagePool
from growpage.core.policy import PolicyT
from growpage.core.request import RequestState
from growpage.errors import ConfigError, GrowPageError, PolicyError

if TYPE_CHECKING:
    from growpage.core.compaction_batch import CompactionBatch


@attrs.frozen
class BoundaryOutcome:
    """What happened at one boundary."""

    decision: Decision | None  # the policy's answer; None when growth was forced
    action: Action
    fallback: bool = False  # GROW was refused and COMPRESS ran instead
    pages_before: int = 0
    pages_after: int = 0
    tokens_after: int = 0
    delta: float | None = None  # Delta_t when the policy computed it
    #: A deferred compression (``on_boundary(defer=True)``): run it (or cancel it) before the
    #: request's next token; until then the request is unchanged. None when nothing is pending.
    pending: PendingCompaction | None = None

    @property
    def needs_preemption(self) -> bool:
        return self.action is Action.PREEMPT


@attrs.define(eq=False)
class PendingCompaction:
    """A COMPRESS or SHRINK whose pages are settled but whose selection and compaction have not
    run: ``tokens_after`` slots of ``state`` will be kept, in the pages ``target``.

    The copy-on-write pages it needs are already allocated (held here, in no block table), and
    the pages it will release are still in the request's block table, so nothing else can be
    given them before the compaction has read them. ``run`` selects, compacts and updates the
    request (all or nothing, like a compression that was not deferred); ``cancel`` returns the
    copy-on-write pages and leaves the request at its boundary, as it was.
    """

    controller: CapacityController
    state: RequestState
    view: KVView
    ctx: BoundaryContext
    decision: Decision
    action: Action
    fallback: bool
    delta: float | None
    tokens_after: int
    target: list[int]  # the block table after the action
    released: list[int]  # pages to free once compacted
    fresh: list[int]  # copy-on-write pages allocated for ``target``
    source: list[int]  # the block table now
    done: bool = False

    def run(self, compactions: CompactionBatch | None = None) -> BoundaryOutcome:
        """Select and compact; the request then holds ``tokens_after`` tokens in ``target``.
        With ``compactions`` it is booked there instead (``CompactionBatch.book``): the
        request's pages and state as after it at once, its KV when the batch runs."""
        self._check_open()
        if self.state.block_table != self.source or self.state.num_tokens != self.ctx.num_tokens:
            self.cancel()
            raise ValueError(
                f"request {self.state.request_id!r} changed while its compaction "
                "was pending (run or cancel it before the request moves on)"
            )
        self.done = True
        return self.controller._execute(self, compactions)

    def cancel(self) -> None:
        """Drop the compression: its copy-on-write pages go back to the pool."""
        self._check_open()
        self.done = True
        self.controller.pool.free(self.fresh)

    def _check_open(self) -> None:
        if self.done:
            raise ValueError(
                f"the pending compaction of request {self.state.request_id!r} "
                "already ran or was cancelled"
            )


class CapacityController(Generic[PolicyT]):
    """Runs one policy over any number of requests sharing one ``PagePool``."""

    def __init__(
        self,
        policy: PolicyT,
        pool: PagePool,
        config: GrowPageConfig,
        min_kept: Callable[[RequestState], int] | None = None,
    ) -> None:
        """``min_kept``: the fewest slots a compression of a request may keep, in place of
        ``min_kept_tokens`` of ``config`` (the simulator's script mode counts in pages)."""
        if pool.page_size != config.page_size:
            raise ValueError(
                f"pool page size {pool.page_size} != config page size {config.page_size}"
            )
        self.policy = policy
        self.pool = pool
        self.config = config
        self.events = EventCounters()
        self._min_kept = min_kept

    def needs_decision(self, state: RequestState) -> bool:
        return state.is_at_boundary(self.config.page_size)

    def will_decide(self, state: RequestState, view: KVView) -> bool:
        """Whether the policy decides ``state``'s boundary (at one, not forced to grow)."""
        return self.needs_decision(state) and not self.grows_freely(state) and view.has_query_state

    def min_kept(self, state: RequestState) -> int:
        """Fewest tokens a compression of ``state`` may keep (``min_kept_tokens``)."""
        if self._min_kept is not None:
            return self._min_kept(state)
        return min_kept_tokens(self.config, state.num_prompt_tokens)

    def grows_freely(self, state: RequestState) -> bool:
        """Below the floor: ``state``'s boundary grows without asking the policy (fewer than
        ``min_capacity`` pages, or a compression would keep fewer than ``min_kept``)."""
        pages = state.num_pages
        return pages < self.config.min_capacity or (pages - 1) * self.config.page_size < (
            self.min_kept(state)
        )

    def prepare(self, items: Iterable[tuple[RequestState, KVView]]) -> BoundaryBatch:
        """One ``BoundaryBatch`` of the requests among ``items`` whose boundary the policy will
        decide: give it to ``on_boundary`` for each of them, in any order, in the same step."""
        batch = BoundaryBatch()
        for state, view in items:
            if self.will_decide(state, view):
                batch.add(self.context(state, view))
        return batch

    def context(self, state: RequestState, view: KVView) -> BoundaryContext:
        """A fresh ``BoundaryContext`` of ``state`` at its boundary, over ``view``."""
        return BoundaryContext(
            state.request_id,
            state.num_tokens,
            state.position,
            state.num_pages,
            self.pool.num_free_pages,
            self.config,
            view,
            state.num_prompt_tokens,
            num_recent_queries=_declared_window(self.policy),
        )

    def on_boundary(
        self,
        state: RequestState,
        view: KVView,
        batch: BoundaryBatch | None = None,
        defer: bool = False,
        compactions: CompactionBatch | None = None,
    ) -> BoundaryOutcome:
        """Make room for one more token of ``state``; see ``BoundaryOutcome``.

        ``batch``: from ``prepare`` in this step; when it holds a context for ``state`` that
        context (and its view, of the same request) is used, so its signals are shared.
        ``defer``: a compression is settled but not run: the outcome's ``pending`` runs it
        (``PendingCompaction``); grow, preempt and forced growth happen at once either way.
        ``compactions``: this step's ``CompactionBatch``; a compression is booked in it (the
        pages and the request as after it, now) and its selection and compaction run with
        the step's others (``CompactionBatch.run``), before the request's next token.
        """
        ctx = batch.take(state.request_id) if batch is not None else None
        if ctx is not None:
            if (ctx.num_tokens, ctx.position, ctx.num_pages) != (
                state.num_tokens,
                state.position,
                state.num_pages,
            ):
                raise ValueError(
                    f"request {state.request_id!r} changed since its boundary "
                    "batch was prepared (prepare and decide in the same step)"
                )
            view = ctx.view
        b = self.config.page_size
        if state.num_tokens != state.num_pages * b:
            raise ValueError(
                f"request {state.request_id!r} is not at a capacity boundary "
                f"({state.num_tokens} tokens in {state.num_pages} pages of {b})"
            )
        if view.num_tokens != state.num_tokens:
            raise ValueError(
                f"KV view holds {view.num_tokens} tokens, request state {state.num_tokens}"
            )
        self._count(state, "boundaries")
        if self.grows_freely(state) or not view.has_query_state:
            return self._forced_grow(state)
        if ctx is None:
            ctx = self.context(state, view)
        ctx.num_free_pages = self.pool.num_free_pages  # now, not when the batch was prepared
        decision = _call(self.policy, "decide", ctx)
        if not isinstance(decision, Decision):
            raise PolicyError(
                f"policy {_name(self.policy)} returned {decision!r} from decide(); "
                f"expected a growpage.Decision (request {ctx.request_id!r} at "
                f"position {ctx.position})",
                request_id=ctx.request_id,
            )
        self._count(state, f"decided_{decision.value}")
        delta = ctx.computed_delta()
        if decision is Decision.GROW:
            if self.pool.can_allocate(1, respect_watermark=True):
                return self._grow(state, decision, delta)
            if not getattr(self.policy, "fallback_to_compress", True):
                return self._preempt(state, decision, delta)
            self._count(state, "fallback")
            return self._compress(
                state, view, ctx, decision, Action.COMPRESS, True, delta, defer, compactions
            )
        if decision is Decision.SHRINK and (
            state.num_pages - 1 < self.config.min_capacity
            or (state.num_pages - 2) * self.config.page_size < self.min_kept(state)
        ):
            self._count(state, "shrink_refused")
            return self._compress(
                state, view, ctx, decision, Action.COMPRESS, False, delta, defer, compactions
            )
        action = Action.SHRINK if decision is Decision.SHRINK else Action.COMPRESS
        return self._compress(state, view, ctx, decision, action, False, delta, defer, compactions)

    # ---- actions --------------------------------------------------------------------------
    def _forced_grow(self, state: RequestState) -> BoundaryOutcome:
        if not self.pool.can_allocate(1):
            return self._preempt(state, None, None)
        self._count(state, "forced_grow")
        return self._grow(state, None, None)

    def _grow(
        self, state: RequestState, decision: Decision | None, delta: float | None
    ) -> BoundaryOutcome:
        before = state.num_pages
        state.block_table.extend(self.pool.allocate(1))
        self._count(state, "grow")
        return self._done(state, decision, Action.GROW, False, before, delta)

    def _compress(
        self,
        state: RequestState,
        view: KVView,
        ctx: BoundaryContext,
        decision: Decision,
        action: Action,
        fallback: bool,
        delta: float | None,
        defer: bool = False,
        compactions: CompactionBatch | None = None,
    ) -> BoundaryOutcome:
        """Settle the pages of a compression (copy-on-write pages for shared ones: preempt
        when there are none), then run it (or book it in ``compactions``), or with ``defer``
        hand it back pending."""
        b, before = self.config.page_size, state.num_pages
        drop = 2 if action is Action.SHRINK else 1
        dst, released = _target_pages(
            list(state.block_table), self.pool, shrink=action is Action.SHRINK
        )
        shared_slots = [i for i, page in enumerate(dst) if self.pool.is_shared(page)]
        if not self.pool.can_allocate(len(shared_slots)):
            return self._preempt(state, decision, delta)
        fresh = self.pool.allocate(len(shared_slots))
        for i, page in zip(shared_slots, fresh, strict=True):
            released.append(dst[i])
            dst[i] = page
        pending = PendingCompaction(
            self,
            state,
            view,
            ctx,
            decision,
            action,
            fallback,
            delta,
            (before - drop) * b,
            dst,
            released,
            fresh,
            list(state.block_table),
        )
        if not defer:
            return pending.run(compactions)
        return BoundaryOutcome(
            decision, action, fallback, before, len(dst), pending.tokens_after, delta, pending
        )

    def _execute(
        self, p: PendingCompaction, compactions: CompactionBatch | None = None
    ) -> BoundaryOutcome:
        """Selection and compaction of a settled compression; all or nothing. With
        ``compactions`` booked there instead."""
        if compactions is not None:
            return compactions.book(p)
        try:
            indices = self._checked_selection(p.ctx, p.tokens_after)
            p.view.compact(indices, p.source, p.target)
        except BaseException:
            self.pool.free(p.fresh)
            raise
        return self.book(p)

    def book(self, p: PendingCompaction) -> BoundaryOutcome:
        """The pages and the request as after ``p``'s compaction (done, or to be run by a
        ``CompactionBatch``): pages invalidated and released, block table and token count,
        events and trajectory."""
        state, before = p.state, p.state.num_pages
        for page in p.target:
            self.pool.invalidate(page)  # compaction rewrites content: no longer a prefix page
        self.pool.free(p.released)
        state.block_table[:] = p.target
        state.num_tokens = p.tokens_after
        self._count(state, p.action.value)
        if p.fresh:
            self._count(state, "cow_pages", len(p.fresh))
        return self._done(state, p.decision, p.action, p.fallback, before, p.delta)

    def _preempt(
        self, state: RequestState, decision: Decision | None, delta: float | None
    ) -> BoundaryOutcome:
        self._count(state, "preempt_needed")
        return BoundaryOutcome(
            decision,
            Action.PREEMPT,
            False,
            state.num_pages,
            state.num_pages,
            state.num_tokens,
            delta,
        )

    def _done(
        self,
        state: RequestState,
        decision: Decision | None,
        action: Action,
        fallback: bool,
        before: int,
        delta: float | None,
    ) -> BoundaryOutcome:
        state.trajectory.append((state.position, state.num_pages, action.value))
        return BoundaryOutcome(
            decision, action, fallback, before, state.num_pages, state.num_tokens, delta
        )

    # ---- helpers --------------------------------------------------------------------------
    def checked_selection(self, ctx: BoundaryContext, keep: int) -> torch.Tensor:
        """The policy's selection of ``keep`` slots, checked (``PolicyError`` naming the
        problem) and ascending per layer and KV head."""
        return self._checked_selection(ctx, keep)

    def _checked_selection(self, ctx: BoundaryContext, keep: int) -> torch.Tensor:
        indices = _call(self.policy, "select", ctx, keep)
        problem, ordered = _check_selection(indices, ctx, keep)
        if problem:
            raise PolicyError(
                f"policy {_name(self.policy)} select(): {problem} "
                f"(request {ctx.request_id!r} at position {ctx.position})",
                request_id=ctx.request_id,
            )
        assert ordered is not None  # no problem: the checked selection comes back
        return ordered

    def _count(self, state: RequestState, field: str, n: int = 1) -> None:
        for counters in (self.events, state.events):
            setattr(counters, field, getattr(counters, field) + n)


def min_kept_tokens(config: GrowPageConfig, num_prompt_tokens: int) -> int:
    """Fewest tokens a compression of a request with a ``num_prompt_tokens`` prompt may
    keep: the prompt plus ``floor_tokens`` when a floor is set, and with ``protect_prompt`` the
    prompt plus the recent window (both kept by every compression); 0 when neither is set."""
    c = config
    least = 0 if c.floor_tokens is None else num_prompt_tokens + c.floor_tokens
    if c.protect_prompt:
        least = max(least, num_prompt_tokens + c.recent_window)
    return least


def forced_growth_pages(config: GrowPageConfig, num_prompt_tokens: int) -> int:
    """Pages a request grows to without asking its policy (``grows_freely``): at least
    ``min_capacity``, and enough that a compression keeps ``min_kept_tokens``."""
    least = min_kept_tokens(config, num_prompt_tokens)
    return max(config.min_capacity, -(-least // config.page_size) + 1 if least else 0)


def selection_problem(indices: object, ctx: BoundaryContext, keep: int) -> str | None:
    """Why ``indices`` is not a valid selection of ``keep`` slots, or None when it is."""
    return _check_selection(indices, ctx, keep)[0]


def _check_selection(
    indices: object, ctx: BoundaryContext, keep: int
) -> tuple[str | None, torch.Tensor | None]:
    """``(problem, indices sorted ascending)``; one host sync when the selection is valid and
    ascending, as the contract asks (an unordered one is sorted here, at a second sync)."""
    num_layers, num_kv = ctx.shape
    expected = (num_layers, num_kv, keep)
    if not isinstance(indices, torch.Tensor):
        return (
            f"returned {type(indices).__name__}, expected a torch.Tensor of shape {expected}"
        ), None
    if indices.dtype.is_floating_point or indices.dtype.is_complex or indices.dtype == torch.bool:
        return (f"returned dtype {indices.dtype}, expected an integer tensor (torch.long)"), None
    if torch.iinfo(indices.dtype).bits < 32:
        # NOTE: refused even when the slots fit: small contexts (the kit's) would pass and a
        # real one (thousands of slots) would not, or would wrap around.
        return (
            f"returned dtype {indices.dtype}, too narrow for slot indices (at most "
            f"{torch.iinfo(indices.dtype).max}); return torch.long or torch.int32"
        ), None
    if tuple(indices.shape) != expected:
        return f"wrong shape {tuple(indices.shape)}, expected {expected} (exact kept count)", None
    slots = indices.to(torch.long)
    n, recent, prefix = ctx.num_tokens, ctx.recent_window, ctx.num_protected_prefix
    if keep < recent:
        return f"protected recent window (last {recent} slots) not fully kept", None
    if keep < prefix + recent:
        return (
            f"cannot keep {keep} slots with the protected prompt ({prefix} slots) and the "
            f"recent window ({recent})"
        ), None
    if not keep:
        return None, slots
    if not bool(_invalid(slots, n, recent, prefix).any()):
        return None, slots
    ordered = slots.sort(dim=-1).values
    if not bool(_invalid(ordered, n, recent, prefix).any()):
        return None, ordered
    outside = (ordered < 0) | (ordered >= n)
    if bool(outside.any()):
        layer, head, i = _first(outside)
        return (
            f"slot index out of range [0, {n}): {int(ordered[layer, head, i])} in layer "
            f"{layer}, KV head {head}"
        ), None
    repeated = ordered[..., 1:] == ordered[..., :-1]
    if bool(repeated.any()):
        layer, head, i = _first(repeated)
        return (
            f"duplicate slot indices within a layer/KV head: slot "
            f"{int(ordered[layer, head, i])} twice in layer {layer}, KV head {head}"
        ), None
    if prefix:
        lacking = ordered[..., prefix - 1] != prefix - 1
        if bool(lacking.any()):
            layer, head = _first(lacking)
            row = ordered[layer, head, :prefix]  # ascending from 0: slot i is missing at i
            missing = int((row != torch.arange(prefix, device=row.device)).nonzero()[0])
            return (
                f"protected prompt (first {prefix} slots, GrowPageConfig.protect_prompt) not "
                f"fully kept: slot {missing} missing in layer {layer}, KV head {head}"
            ), None
    # Sorted, unique and in range, a row lacks the window iff its last `recent` slots are not
    # the window (and recent > 0, else nothing is wrong and this is not reached).
    window = torch.arange(n - recent, n, device=ordered.device)
    layer, head, _ = _first(ordered[..., -recent:] != window)
    missing = int(window[~torch.isin(window, ordered[layer, head])][0])
    return (
        f"protected recent window (last {recent} slots) not fully kept: slot {missing} "
        f"missing in layer {layer}, KV head {head}"
    ), None


def _first(flags: torch.Tensor) -> tuple[int, ...]:
    """Index of the first true entry of ``flags`` (error path only: one host sync)."""
    return tuple(int(i) for i in flags.nonzero()[0])


def _invalid(slots: torch.Tensor, n: int, recent: int, prefix: int = 0) -> torch.Tensor:
    """Per layer and KV head: not strictly ascending, out of ``[0, n)``, without the last
    ``recent`` slots or without the first ``prefix``. Strictly ascending and within
    ``[0, n)``, the window is there iff the R-th last entry is ``n - R`` and the prefix iff
    entry ``prefix - 1`` is ``prefix - 1``, so every rule is one flag (one sync for all)."""
    bad = (slots[..., 0] < 0) | (slots[..., -1] >= n)
    bad |= (slots[..., 1:] <= slots[..., :-1]).any(dim=-1)
    if recent:
        bad |= slots[..., -recent] != n - recent
    if prefix:
        bad |= slots[..., prefix - 1] != prefix - 1
    return bad


def invalid_rows(
    keep: torch.Tensor,
    num_kept: list[int],
    num_tokens: list[int],
    recent: int,
    prefixes: list[int],
) -> list[bool]:
    """``_invalid`` of several selections at once, one host sync for all: row r of ``keep
    [R, L, Hkv, K_max]`` holds ``num_kept[r]`` slots (the rest padding) of a request with
    ``num_tokens[r]`` slots and ``prefixes[r]`` protected leading ones; True where some layer
    or KV head of the row breaks a rule (``_check_selection`` then says which).

    The same rules as ``_invalid``: strictly ascending within ``[0, n)``, so the first entry is
    at least 0 and the last below n; then the window is there iff entry ``K - R`` is ``n - R``
    and the prefix iff entry ``p - 1`` is ``p - 1``. Those four entries of each row are read in
    one gather and held to their bounds."""
    num, device = keep.shape[0], keep.device
    rows = []
    for k, n, p in zip(num_kept, num_tokens, prefixes, strict=True):
        window = (k - recent, n - recent, n - recent) if recent else (0, 0, n - 1)
        prefix = (p - 1, p - 1, p - 1) if p else (0, 0, n - 1)
        # (column, lowest, highest) of: first, last, window start, prefix end; then K.
        rows.append([0, 0, n - 1, k - 1, 0, n - 1, *window, *prefix, k])
    meta = torch.tensor(rows, device=device).view(num, 13, 1, 1)
    bounds = meta[:, :12].view(num, 4, 3, 1, 1).unbind(2)  # column, lowest, highest
    columns = bounds[0].view(num, 1, 1, 4).expand(-1, *keep.shape[1:3], -1)
    entries = keep.gather(-1, columns.clamp(min=0))
    lowest, highest = bounds[1].view(num, 1, 1, 4), bounds[2].view(num, 1, 1, 4)
    bad = ((entries < lowest) | (entries > highest)).any(dim=-1)
    pairs = torch.arange(1, keep.shape[-1], device=device) < meta[:, 12].view(num, 1, 1, 1)
    bad |= (pairs & (keep[..., 1:] <= keep[..., :-1])).any(dim=-1)
    return bad.flatten(1).any(dim=1).tolist()


def _target_pages(pages: list[int], pool: PagePool, shrink: bool) -> tuple[list[int], list[int]]:
    """Block table after the action and the pages it releases (before copy-on-write)."""
    dst = list(pages)
    if not shrink:
        return dst, []
    # Release a shared page when there is one: dropping a reference costs no copy.
    shared = [i for i, page in enumerate(dst) if pool.is_shared(page)]
    victim = shared[-1] if shared else len(dst) - 1
    return dst, [dst.pop(victim)]


def _declared_window(policy: object) -> int | None:
    """The policy's ``needs_recent_queries`` (0 without one); None when it is no count (the
    engine refuses it when it is built; the context then asks the view)."""
    window = getattr(policy, "needs_recent_queries", 0)
    return window if type(window) is int and window >= 0 else None


def _name(policy: object) -> str:
    return getattr(policy, "name", type(policy).__name__)


def _call(policy: object, method: str, ctx: BoundaryContext, *args: object) -> Any:
    """``policy.method(ctx, *args)``; an exception it raises (other than the library's own
    errors, which name their problem) becomes a ``PolicyError`` naming the policy, the method
    and the boundary, chained to the original (its traceback is kept)."""
    try:
        return getattr(policy, method)(ctx, *args)
    except GrowPageError as exc:
        if not isinstance(exc, ConfigError):
            raise
        # A bad argument to a context method (``attention("longterm")``, ``delta(p=1.5)``) is
        # the policy's bug: name the policy and the boundary as for any other exception.
        raise PolicyError(
            f"policy {_name(policy)} {method}() raised ConfigError: {exc} "
            f"(request {ctx.request_id!r} at position {ctx.position})",
            request_id=ctx.request_id,
        ) from exc
    except Exception as exc:
        raise PolicyError(
            f"policy {_name(policy)} {method}() raised {type(exc).__name__}: "
            f"{exc} (request {ctx.request_id!r} at position {ctx.position})"
            f"{missing_sums_hint(ctx)}",
            request_id=ctx.request_id,
        ) from exc
