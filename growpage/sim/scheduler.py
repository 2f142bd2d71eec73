"""Continuous-batching scheduler of the serving simulator (nano-vLLM style, page accounting).

Requests wait in FCFS order; a step either prefills (a chunk of the prompts of requests still
prefilling, then of newly admitted ones, within the step's token budget: prefill takes priority,
as in the engine) or decodes one token for every running request. Decode steps run in
*segments*: between two events (a request at a capacity boundary, or finishing) nothing changes
but token counts, so a segment of ``k`` steps is priced at once and nothing is done per token. A request's counters
are brought up to date (``_sync``) only when it has an event.

Preemption is by recompute (``core.residency``): the victim, the most recently admitted running
request whose recompute fits the pool, frees its pages and goes back to the front of the queue;
when re-admitted it pays a prefill of all its tokens (prompt + generated, the last sampled one
included), which rebuilds its full KV and samples its next output token. When no victim fits,
the request that needs a page sits the next step out.
"""

from __future__ import annotations

import enum
import heapq
from collections import deque
from collections.abc import Sequence

import attrs

from growpage.core.capacity import BoundaryOutcome, PendingCompaction
from growpage.core.decision import Action
from growpage.core.events import EventCounters
from growpage.core.kv_view import KVView
from growpage.core.residency import (
    admit,
    can_admit,
    decides_late,
    fits_pool,
    pages_for,
    pick_victim,
)
from growpage.errors import ConfigError
from growpage.sim.prefix import PrefixCache
from growpage.sim.requests import SimRequest
from growpage.sim.sources import ScriptSource, TraceSource


@attrs.frozen
class PrefillStep:
    """One prefill step: the requests it computes a chunk of, in order, each chunk's tokens,
    and the KV tokens those requests computed in earlier steps (what the chunks attend to
    besides themselves)."""

    requests: tuple[SimRequest, ...]
    chunks: tuple[int, ...]
    context_tokens: int = 0

    @property
    def tokens(self) -> int:
        return sum(self.chunks)


class _Unsettled(enum.Enum):
    """``Scheduler._boundary``'s answer for a boundary it did not settle."""

    LATE = "late"  # a preemption for it left it holding no shared page: filed, decided late
    WAITS = "waits"  # no victim's recompute fits the pool: it sits the next step out


class Scheduler:
    """Owns the waiting queue, the running batch and (through the source) the page pool."""

    def __init__(
        self,
        source: TraceSource | ScriptSource,
        page_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        admission_reserve: int = 0,
        record_events: bool = False,
        chunked_prefill: bool = True,
        prefix_caching: bool = True,
        defer_compactions: bool = False,
    ) -> None:
        self.source = source
        self.controller = source.controller
        self.pool = source.controller.pool
        self.page_size = page_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.admission_reserve = admission_reserve  # pages left free for running requests
        self.chunked_prefill = chunked_prefill
        self.prefix = PrefixCache(self.pool, source.scale, prefix_caching)
        self.defer_compactions = defer_compactions  # settle now, run after the others
        self._pending: dict[str, PendingCompaction] = {}
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.finished: list[SimRequest] = []
        self.step = 0  # decode steps done
        self.num_preemptions = 0
        self.events: list[tuple] | None = [] if record_events else None
        self._heap: list[tuple[int, int, SimRequest]] = []
        self._tick = 0
        self._kv_offset = 0  # sum over running of (num_tokens - sync_step)
        self.prefilling: list[SimRequest] = []  # running, their prefill not done, in order
        # Of the last resolve_boundaries: the decisions and compactions run at once, before
        # the late boundaries and deferred compactions (which run beside the next step).
        self.synchronous_work = (0, 0)

    # ---- bookkeeping ------------------------------------------------------------------------
    def log(self, now: float, kind: str, request: SimRequest) -> None:
        """``(time_s, kind, request_id, pages held)``; finish/preempt log the pages released."""
        if self.events is not None:
            self.events.append((round(now, 6), kind, request.request_id, request.num_pages))

    def _sync(self, r: SimRequest) -> None:
        d = self.step - r.sync_step
        if d:
            r.num_tokens += d
            r.generated += d
            r.budget_tokens += d * r.num_pages * self.page_size
            r.sync_step = self.step

    def _set_tokens(self, r: SimRequest, num_tokens: int) -> None:
        self._kv_offset += num_tokens - r.num_tokens
        r.num_tokens = num_tokens

    def _schedule_event(self, r: SimRequest) -> None:
        free = r.num_pages * self.page_size - r.num_tokens
        r.event_step = self.step + min(free, r.decode_tokens - r.generated)
        self._tick += 1
        r.event_tick = self._tick
        heapq.heappush(self._heap, (r.event_step, self._tick, r))

    def _pop_due(self) -> list[SimRequest]:
        """Running requests whose event is now, in admission order."""
        due = []
        while self._heap and self._heap[0][0] <= self.step:
            _, tick, r = heapq.heappop(self._heap)
            if r.is_running and r.event_tick == tick:
                due.append(r)
        return sorted(due, key=lambda r: r.admit_seq)

    def kv_tokens(self) -> int:
        """Resident KV tokens of the running batch now."""
        return self._kv_offset + len(self.running) * self.step

    def longest_context(self, excluding: Sequence[SimRequest] = ()) -> int:
        """Resident KV tokens now of the longest running request but ``excluding`` (0 when
        none)."""
        skip = {id(r) for r in excluding}
        # A request's tokens now: those at its sync step plus one per step since.
        behind = [r.num_tokens - r.sync_step for r in self.running if id(r) not in skip]
        return max(behind) + self.step if behind else 0

    def next_event_step(self) -> int:
        while self._heap and not (
            self._heap[0][2].is_running and self._heap[0][2].event_tick == self._heap[0][1]
        ):
            heapq.heappop(self._heap)
        return self._heap[0][0] if self._heap else self.step

    # ---- admission and prefill --------------------------------------------------------------
    def _prefill_need(self, r: SimRequest) -> int:
        """Tokens its (next) prefill computes: the prompt, or after a preemption every token it
        has, the last sampled one included (a recompute, see ``_start``)."""
        return r.prompt_tokens + (r.generated + 1 if r.resuming else 0)

    def admit(self, now: float) -> PrefillStep | None:
        """The next prefill step, None when there is none (a decode step comes next).

        As the engine's scheduler: the running requests still prefilling take their next chunk
        first, then waiting requests are admitted FCFS while seats, pages and the step's token
        budget (``max_num_batched_tokens``) last. An admitted request gets the pages of its
        whole prefill at once: with prefix caching the cached pages of its leading tokens,
        which its prefill does not compute, and new ones for the rest. With chunked prefill
        (the default) each takes what is left of the budget, and a longer prompt goes on in
        the next steps; without, a request's whole prefill is one chunk and it waits when the
        budget cannot hold it (a longer one than the budget runs alone).
        """
        budget = self.max_num_batched_tokens
        chunks: list[tuple[SimRequest, int]] = []
        for r in self.prefilling:
            if budget <= 0:
                break
            n = min(r.prefill_left, budget)
            chunks.append((r, n))
            budget -= n
        while self.waiting and len(self.running) < self.max_num_seqs and budget > 0:
            r = self.waiting[0]
            cached, todo, fits = self._admission(r)
            if not self.chunked_prefill and chunks and todo > budget:
                break
            if not fits:
                if not self.running:
                    pages = pages_for(self._prefill_need(r), self.page_size)
                    raise ConfigError(
                        f"request {r.request_id!r} needs {pages} KV pages; the pool "
                        f"has {self.pool.num_pages}"
                    )
                break
            self.waiting.popleft()
            self._start(r, cached, now)
            n = min(todo, budget) if self.chunked_prefill else todo
            chunks.append((r, n))
            budget -= n
        if not chunks:
            return None
        # What the chunks attend to besides themselves: their requests' KV computed before
        # (earlier chunks, cached pages).
        context = sum(r.prefill_target - r.prefill_left for r, _ in chunks)
        for r, n in chunks:
            r.prefill_left -= n
            self.prefix.register(r, r.prefill_target - r.prefill_left)
        self.prefilling = [r for r in self.prefilling if r.prefill_left]
        return PrefillStep(tuple(r for r, _ in chunks), tuple(n for _, n in chunks), context)

    def _admission(self, r: SimRequest) -> tuple[list[int], int, bool]:
        """For waiting ``r`` now: the cached pages it would take, the tokens its prefill would
        compute, and whether its pages fit (``residency.can_admit``, leaving
        ``admission_reserve`` free too)."""
        need = self._prefill_need(r)
        cached = self.prefix.cached_pages(r, need)
        fits = can_admit(
            self.pool, cached, need, self.page_size, len(self.running), self.admission_reserve
        )
        return cached, need - len(cached) * self.page_size, fits

    def can_admit(self) -> bool:
        """Whether the head of the queue would be admitted now (nothing changes)."""
        return (
            bool(self.waiting)
            and len(self.running) < self.max_num_seqs
            and self._admission(self.waiting[0])[2]
        )

    def _start(self, r: SimRequest, cached: list[int], now: float) -> None:
        if r.view is None or r.resuming:
            # A recompute starts from a fresh view: what its compressions dropped is back.
            r.view = self.source.view_for(r.spec, len(cached) * self.page_size)
        r.prefill_target = self._prefill_need(r)
        r.state.block_table = admit(self.pool, cached, r.prefill_target, self.page_size)
        self.prefix.took(r, cached)
        r.prefill_left = r.prefill_target - len(cached) * self.page_size
        self.prefix.register(r, len(cached) * self.page_size)
        self.prefilling.append(r)
        if r.resuming:
            # As the engine's recompute: the prefill computes every token the request has, the
            # last one (sampled, never fed back yet) included, and samples the next. Its KV is
            # full again (the compressions are forgotten), and it has one more output token.
            r.num_tokens = r.prompt_tokens + r.generated + 1
            r.generated += 1
        else:
            r.num_tokens = r.prompt_tokens
        # Its KV counts in full from now: no decode step runs while a request prefills (a
        # prefill step comes first as long as one does), so it is whole when next read.
        r.sync_step = r.admit_step = self.step
        self._kv_offset += r.num_tokens - r.sync_step
        r.is_running = True
        r.admit_seq = self._tick = self._tick + 1
        self.running.append(r)
        r.capacity.append((now, r.num_pages))
        self.log(now, "resume" if r.resuming else "admit", r)
        r.resuming = False
        self._schedule_event(r)

    # ---- decode -----------------------------------------------------------------------------
    def resolve_boundaries(
        self, now: float, late_decisions: bool = False
    ) -> tuple[list[SimRequest], list[SimRequest]]:
        """Run the controller for every running request at a capacity boundary now; returns,
        of those still running, the ones whose KV was compacted (Compress & Hold, Shrink, a
        refused GROW) and, with ``late_decisions`` (the engine's ``async_decisions``), the
        ones whose boundary was decided late.

        As the engine's scheduler: the requests are taken in admission order. With late
        decisions a request whose boundary can be decided beside the next step
        (``residency.decides_late``) is only filed; with ``defer_compactions`` (the engine's
        ``async_compaction``) a compression is settled (its copy-on-write pages taken) but not
        run. Both kinds then run after all the others, in the order they were filed, as the
        engine's ``DeferredBoundaries.run`` does beside the step: a page two requests share is
        copied by both, and stays cached. ``synchronous_work`` is then the decisions and compactions
        that ran at once, before those (the engine's, while scheduling the step).
        """
        events = self.controller.events
        decided, compactions = _work(events)
        compacted, late = [], []
        waits: list[SimRequest] = []  # no victim fits: they sit the next step out
        deferred: list[tuple[SimRequest, bool]] = []  # (request, a late boundary?) in order
        for r in self._pop_due():
            if not r.is_running:
                continue
            self._sync(r)
            if late_decisions and self._decides_late(r):
                late.append(r)
                deferred.append((r, True))
                continue
            outcome = self._boundary(
                r, now, defer=self.defer_compactions, late_decisions=late_decisions
            )
            if outcome is _Unsettled.WAITS:
                waits.append(r)
                continue
            if outcome is _Unsettled.LATE:
                # Its boundary had to preempt another request first, which left it holding no
                # shared page: the engine's make_room, asked again, files it as a late one.
                late.append(r)
                deferred.append((r, True))
                continue
            if outcome is not None and outcome.action in (Action.COMPRESS, Action.SHRINK):
                compacted.append(r)
                if outcome.pending is not None:
                    deferred.append((r, False))
        now_decided, now_compactions = _work(events)
        self.synchronous_work = (now_decided - decided, now_compactions - compactions)
        for r, is_late in deferred:
            if not r.is_running:  # preempted for a later one (its compaction was cancelled)
                continue
            if not is_late:
                self._run_pending(r, now)
                continue
            outcome = self._boundary(r, now)  # never filed again: late_decisions is off
            if isinstance(outcome, BoundaryOutcome) and outcome.action in (
                Action.COMPRESS,
                Action.SHRINK,
            ):
                compacted.append(r)
        waits = [r for r in waits if r.is_running]
        if waits and len(waits) == len(self.running):
            raise ConfigError(
                f"the pool ({self.pool.num_pages} pages) cannot make progress: every running "
                "request needs a KV page and no preemption victim's recompute fits it"
            )
        self.sit_out(waits)
        return [r for r in compacted if r.is_running], [r for r in late if r.is_running]

    def _can_recompute(self, r: SimRequest) -> bool:
        """Whether the recompute of running ``r`` (every token it has now, see ``_start``)
        fits the pool."""
        num_tokens = r.prompt_tokens + r.generated + self.step - r.sync_step + 1
        return fits_pool(num_tokens, self.page_size, self.pool.num_pages)

    def _prepare(self, r: SimRequest) -> KVView:
        """Bring ``r``'s controller state and view to its boundary now; returns the view."""
        state, view = r.state, r.view
        state.num_tokens = r.num_tokens // self.source.scale
        state.position = r.prompt_tokens + r.generated
        assert view is not None  # given when the request was admitted
        # No decode step since its admission: no query summary yet (a prompt that fills its
        # last page, or the first step after a recompute), so the controller grows.
        self.source.prepare(
            view, state.num_tokens, state.position, decoded=self.step > r.admit_step
        )
        return view

    def _decides_late(self, r: SimRequest) -> bool:
        """``residency.decides_late`` for ``r`` at its boundary now."""
        return decides_late(self.controller, r.state, self._prepare(r))

    def sit_out(self, requests: list[SimRequest]) -> None:
        """``requests`` skip the next decode step (asynchronous compaction: their compaction
        runs beside it): they gain no token in it, and their next event comes a step later."""
        for r in requests:
            r.sync_step += 1  # the next step does not count for it
            self._kv_offset -= 1
            r.event_step += 1
            self._tick += 1
            r.event_tick = self._tick  # the entry pushed before is stale now
            heapq.heappush(self._heap, (r.event_step, self._tick, r))

    def _boundary(
        self, r: SimRequest, now: float, defer: bool = False, late_decisions: bool = False
    ) -> BoundaryOutcome | _Unsettled | None:
        """One boundary of ``r``: its outcome, None when ``r`` itself was preempted. With
        ``defer`` a compression is only settled (its outcome's ``pending``; ``_run_pending``
        runs it). With ``late_decisions``, ``_Unsettled.LATE`` when a preemption for it left
        it deciding late: as the engine's ``make_room`` asked again, it is only filed."""
        state = r.state
        while True:
            view = self._prepare(r)
            fallbacks = state.events.fallback
            outcome = self.controller.on_boundary(state, view, defer=defer)
            if state.events.fallback > fallbacks:
                # Logged also when the compression it fell back to had to preempt (no page to
                # copy a shared page to), as the engine counts it.
                self.log(now, "fallback", r)
            if outcome.action is not Action.PREEMPT:
                break
            victim = pick_victim(self.running, self._can_recompute)
            if len(self.running) == 1:
                raise ConfigError(self._alone_error(r))
            if victim is None:
                return _Unsettled.WAITS
            self.preempt(victim, now)
            if victim is r:
                return None
            if late_decisions and self._decides_late(r):
                return _Unsettled.LATE
        if outcome.pending is not None:
            self._pending[r.request_id] = outcome.pending
        else:
            self._settled(r, outcome, now)
        return outcome

    def _settled(self, r: SimRequest, outcome: BoundaryOutcome, now: float) -> None:
        self.log(now, outcome.action.value, r)
        self._set_tokens(r, r.state.num_tokens * self.source.scale)
        if outcome.pages_after != outcome.pages_before:
            r.capacity.append((now, r.num_pages))
        self._schedule_event(r)

    def _run_pending(self, r: SimRequest, now: float) -> None:
        """Run the compression settled for ``r`` (``_boundary(defer=True)``)."""
        self._settled(r, self._pending.pop(r.request_id).run(), now)

    def _alone_error(self, r: SimRequest) -> str:
        """Why ``r`` cannot go on even alone, and, for a policy that never compresses, the
        pool it needs."""
        total = r.prompt_tokens + r.output_tokens  # its KV ends one token short of this
        text = (
            f"request {r.request_id!r} ({r.prompt_tokens} prompt + {r.output_tokens} output "
            f"tokens) cannot get a page even alone, holding {r.num_pages} pages after "
            f"{r.generated + 1} output tokens: the pool ({self.pool.num_pages} pages of "
            f"{self.page_size} tokens, watermark {self.pool.watermark}) is too small"
        )
        if not self.controller.policy.fallback_to_compress:
            need = pages_for(total - 1, self.page_size) + self.pool.watermark
            text += (
                f"; policy {self.controller.policy.name!r} never compresses, so it needs "
                f"{need} pages (--kv-pages {need})"
            )
        return text

    def preempt(self, r: SimRequest, now: float) -> None:
        """Recompute preemption: free the pages, back to the front of the queue."""
        self._sync(r)
        self.log(now, "preempt", r)
        r.resuming = True
        self._release(r)
        r.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(r)
        r.capacity.append((now, 0))

    def _release(self, r: SimRequest) -> None:
        pending = self._pending.pop(r.request_id, None)
        if pending is not None:  # its settled compaction will not run: its pages go back
            pending.cancel()
        self.pool.free(reversed(r.state.block_table))  # tail first: cached heads stay longest
        r.state.block_table = []
        r.is_running = False
        self.running.remove(r)
        if r.prefill_left:
            self.prefilling.remove(r)
            r.prefill_left = 0
        self._kv_offset -= r.num_tokens - r.sync_step

    def finish_prefilled(self, step: PrefillStep, now: float) -> None:
        """The prefill ``step`` has run: each request whose prefill it completed produced an
        output token, its first or after a recompute its next (see ``_start``); those that
        needed no more finish. Those still prefilling go on in the next prefill step."""
        for r in step.requests:
            if r.prefill_left:
                continue
            if r.first_token_s is None:
                r.first_token_s = now
            if r.generated >= r.decode_tokens:
                self._finish(r, now)

    def _finish(self, r: SimRequest, now: float) -> None:
        self.log(now, "finish", r)
        self._release(r)
        r.finish_s = now
        r.capacity.append((now, 0))
        self.finished.append(r)

    def advance(self, num_steps: int, now: float) -> None:
        """``num_steps`` decode steps have run; finish the requests that are done."""
        self.step += num_steps
        for r in self._pop_due():
            self._sync(r)
            if r.generated >= r.decode_tokens:
                self._finish(r, now)
            else:  # at a boundary: resolved before the next decode step
                self._tick += 1
                r.event_tick = self._tick
                heapq.heappush(self._heap, (r.event_step, self._tick, r))


def _work(events: EventCounters) -> tuple[int, int]:
    """The decisions a policy made and the compactions run, so far."""
    return (
        events.decided_grow + events.decided_compress + events.decided_shrink,
        events.compress + events.shrink,
    )
