"""Serving simulation (simpy): continuous batching over one shared ``PagePool``.

Two processes share a ``Scheduler``: ``arrivals`` puts requests in the waiting queue at their
arrival times; ``engine`` loops schedule -> run -> update: a prefill step when waiting requests
can be admitted (they take priority, as in nano-vLLM), otherwise the capacity boundaries that are
due go through the ``CapacityController`` and the running batch decodes up to its next event
(one ``env.timeout`` per segment of identical steps, priced by the cost model). Simulated time
is in seconds.

Step semantics, as in the engine (and vLLM): a prefill step computes the admitted requests'
prompts (plus, for a request back from preemption, its generated tokens: recompute), in chunks
of at most ``max_num_batched_tokens`` tokens a step, and the step that completes a request's
prompt produces its first output token (after a recompute, its next); each decode step writes
the KV slot of a running request's last token and produces its next one. A request of ``N`` output tokens thus decodes ``N - 1`` steps,
and its KV ends at ``prompt + N - 1`` tokens (the last token is never fed back).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator, Sequence

import attrs
import numpy as np
import simpy

from growpage.core.capacity import forced_growth_pages
from growpage.core.config import GrowPageConfig
from growpage.core.events import EventCounters
from growpage.core.host_memory import available_memory
from growpage.core.pages import PagePool, bookkeeping_bytes
from growpage.core.residency import defers_beside_step
from growpage.core.traces import Trace
from growpage.errors import ConfigError, WorkloadError
from growpage.policies.base import CapacityPolicy
from growpage.policies.registry import resolve_policy
from growpage.sim.costmodel import CostModel, check_step_times
from growpage.sim.metrics import ServingMetrics, compute_metrics
from growpage.sim.requests import SimRequest
from growpage.sim.scheduler import Scheduler
from growpage.sim.sources import SCRIPT_SPEC, ScriptSource, TraceSource, synthetic_trace_of
from growpage.sim.synthetic import SyntheticSpec
from growpage.sim.workload_csv import WorkloadRequest
from growpage.validators import flag, in_range, one_of, positive_int

DECISION_MODES = ("script", "trace")


@attrs.frozen(kw_only=True)
class SimConfig:
    """Settings of the serving simulator (the policy's settings are a ``GrowPageConfig``).

    Attributes:
        num_kv_pages: pages in the shared KV pool (1500 ~ Qwen3-8B on an A100 80 GB, b = 256).
        max_num_seqs: most running requests (continuous-batching seats).
        max_num_batched_tokens: most tokens one prefill step computes.
        chunked_prefill: as the engine: a prompt longer than what is left of a prefill step's
            token budget computes that much and goes on in the next prefill steps (a request
            decodes once its whole prompt is computed). False: a prompt is one chunk, waiting
            for a step with room for it (one longer than the budget runs alone), as nano-vLLM.
        prefix_caching: as the engine's ``enable_prefix_caching``: full prompt pages stay
            cached after their request leaves, and a request whose leading pages are cached
            (a shared ``WorkloadRequest.prefix``, or its own after a preemption) takes them
            instead of computing them (``sim.prefix``).
        admission_reserve: share of the pool a new request must leave free when admitted
            (room for the running requests to grow; 0 = nano-vLLM's greedy admission,
            vLLM keeps 1%).
        decisions: "script" (scales to paper-size workloads) or "trace" (a real KV view per
            request); see ``sim.sources``.
        num_scripts: script mode: synthetic traces shared by the requests (grouped by length).
        seed: seeds the scripts' and per-request synthetic traces.
        record_events: keep the ``(time_s, event, request_id, pages)`` log.
        async_compaction: as the engine's ``async_compaction``: a request whose KV was
            compacted sits the next decode step out while its compaction runs beside it
            (unless nothing else would decode); the step waits for the compaction's price
            (``CostModel.compaction_s``) only where that is longer than the step.
        async_decisions: as the engine's ``async_decisions`` (beyond the paper): a request
            whose boundary its policy decided sits the next decode step out while its whole
            boundary (decision and action) runs beside it (unless nothing else would decode,
            or the policy never falls back to compressing); the step waits for the boundary's
            price only where that is longer than the step. The synchronous boundaries (a
            policy's that never compresses, a request's holding a shared page) are paid before
            the step.
    """

    num_kv_pages: int = attrs.field(default=1500, validator=positive_int)
    max_num_seqs: int = attrs.field(default=256, validator=positive_int)
    max_num_batched_tokens: int = attrs.field(default=16384, validator=positive_int)
    chunked_prefill: bool = attrs.field(default=True, validator=flag)
    prefix_caching: bool = attrs.field(default=True, validator=flag)
    decisions: str = attrs.field(default="script", validator=one_of(DECISION_MODES))
    admission_reserve: float = attrs.field(default=0.05, validator=in_range(0, 1, hi_open=True))
    num_scripts: int = attrs.field(default=8, validator=positive_int)
    seed: int = 0
    record_events: bool = False
    async_compaction: bool = attrs.field(default=False, validator=flag)
    async_decisions: bool = attrs.field(default=False, validator=flag)


@attrs.define
class ServingResult:
    """A finished run: metrics, the requests, the optional event log, and the pool over time
    (``timeline``: see ``pool_timeline``)."""

    metrics: ServingMetrics
    requests: list[SimRequest]
    events: list[tuple] | None
    pool: PagePool
    timeline: list[tuple[float, int, int]] | None = None

    def capacity_trajectories(self) -> dict[str, list[tuple[float, int]]]:
        """Per request: ``(time_s, pages)`` at every change of its page count."""
        return {r.request_id: list(r.capacity) for r in self.requests}

    def pool_timeline(self) -> list[tuple[float, int, int]]:
        """``(time_s, pages in use, resident requests)`` from time 0 and at every time either
        changes (the last point: all gone). Pages in use are the pool's: a page shared through
        the prefix cache counts once, however many requests hold it.

        A result built without a recorded ``timeline`` sums the requests' capacity
        trajectories instead, which counts a shared page once per holder."""
        if self.timeline is not None:
            return list(self.timeline)
        # A request's changes at one time apply in its own order: (time, request, index).
        changes = sorted(
            (t, i, k, pages)
            for i, r in enumerate(self.requests)
            for k, (t, pages) in enumerate(r.capacity)
        )
        held = [0] * len(self.requests)
        used = resident = 0
        timeline = [(0.0, 0, 0)]
        for t, i, _, pages in changes:
            used += pages - held[i]
            resident += (pages > 0) - (held[i] > 0)
            held[i] = pages
            t = float(t)
            if timeline[-1][0] == t:
                timeline[-1] = (t, used, resident)
            else:
                timeline.append((t, used, resident))
        return timeline


@attrs.define
class _Run:
    """Mutable state shared by the two processes."""

    scheduler: Scheduler
    cost: CostModel
    num_requests: int
    next_arrival_s: float = float("inf")
    idle: simpy.Event | None = None
    resident_s: float = 0.0
    prefill_steps: int = 0
    decode_steps: int = 0
    peak_pages: int = 0
    boundary_s: float = 0.0
    async_compaction: bool = False
    async_decisions: bool = False
    on_progress: Callable[[int], object] | None = None  # called with the finished count
    # (time_s, pages in use, resident requests) at every change: ServingResult.pool_timeline.
    # NOTE: the pool's count, not the sum of the requests' block tables, which counts a page
    # shared through the prefix cache once per holder (and could exceed the pool).
    timeline: list[tuple[float, int, int]] = attrs.Factory(lambda: [(0.0, 0, 0)])

    def spend(self, env: simpy.Environment, seconds: float) -> simpy.Timeout:
        self.resident_s += len(self.scheduler.running) * seconds
        if seconds > 0:  # a state held for no time (a free prefill) is not in pool_timeline()
            self.peak_pages = max(self.peak_pages, self.scheduler.pool.num_used_pages)
            self.mark(env.now)
        return env.timeout(seconds)

    def mark(self, now: float) -> None:
        """Enter the pool's state from ``now`` on in ``timeline`` (when it changed)."""
        point = (float(now), self.scheduler.pool.num_used_pages, len(self.scheduler.running))
        if self.timeline[-1][0] == point[0]:
            self.timeline[-1] = point
        elif self.timeline[-1][1:] != point[1:]:
            self.timeline.append(point)


def arrivals(
    env: simpy.Environment, run: _Run, requests: Sequence[SimRequest]
) -> Generator[simpy.Event, None, None]:
    """Move each request to the waiting queue at its arrival time (requests sorted by it)."""
    for i, r in enumerate(requests):
        if r.spec.arrival_s > env.now:
            run.next_arrival_s = r.spec.arrival_s
            yield env.timeout(r.spec.arrival_s - env.now)
        run.scheduler.waiting.append(r)
        run.scheduler.log(env.now, "arrive", r)
        nxt = requests[i + 1].spec.arrival_s if i + 1 < len(requests) else float("inf")
        run.next_arrival_s = nxt
        if run.idle is not None and not run.idle.triggered:
            run.idle.succeed()
    run.next_arrival_s = float("inf")


def engine(env: simpy.Environment, run: _Run) -> Generator[simpy.Event, None, None]:
    """The engine loop: prefill when possible, else decode up to the next event."""
    sched, cost = run.scheduler, run.cost
    while len(sched.finished) < run.num_requests:
        prefill = sched.admit(env.now)
        if prefill is not None:
            yield run.spend(env, cost.prefill_time(prefill.tokens, prefill.context_tokens))
            run.prefill_steps += 1
            done = len(sched.finished)
            sched.finish_prefilled(prefill, env.now)
            _report_progress(run, done)
            continue
        if not sched.running:
            run.mark(env.now)  # the pool is empty until the next arrival
            run.idle = env.event()
            yield run.idle
            continue
        decisions_s, compactions_s, compacted, late = _resolve_boundaries(run, env.now)
        # Compacted at once (decided while scheduling): with async_compaction they too sit out.
        compacted = [r for r in compacted if r not in late]
        sitting = late + compacted if run.async_compaction else late
        if defers_beside_step(len(sitting), len(sched.running) - len(sitting)):
            # Their deferred work (async_decisions: whole boundaries; async_compaction:
            # compactions) runs beside the next step, which they sit out. The boundary work
            # that ran while scheduling is paid first (``_synchronous_s``: a policy's that never
            # compresses, a request's holding a shared page, every decision without
            # async_decisions); the step waits only for deferred work longer than itself.
            run.boundary_s += decisions_s + compactions_s
            before_s = _synchronous_s(run)
            if before_s > 0:
                yield run.spend(env, before_s)
            num_steps, seconds = (
                1,
                max(_sit_out_step(run, sitting), decisions_s + compactions_s - before_s),
            )
        else:
            seconds = decisions_s + compactions_s
            if seconds > 0:  # capacity control as the cost model prices it (0: free)
                run.boundary_s += seconds
                yield run.spend(env, seconds)
            if not sched.running:
                continue
            num_steps, seconds = _segment(run, env.now)
        yield run.spend(env, seconds)
        run.decode_steps += num_steps
        done = len(sched.finished)
        sched.advance(num_steps, env.now)
        _report_progress(run, done)


def _report_progress(run: _Run, finished_before: int) -> None:
    """``on_progress(num_finished)`` when requests finished since ``finished_before``."""
    finished = len(run.scheduler.finished)
    if run.on_progress is not None and finished != finished_before:
        run.on_progress(finished)


def _resolve_boundaries(
    run: _Run, now: float
) -> tuple[float, float, list[SimRequest], list[SimRequest]]:
    """Resolve the boundaries due now: the seconds the cost model charges for their decisions
    and for their compactions, the running requests whose KV was compacted, and, with
    ``async_decisions``, those whose boundary was decided late (``Scheduler.resolve_boundaries``)."""
    events = run.scheduler.controller.events
    decided, compactions = _decided(events), events.compress + events.shrink
    compacted, late = run.scheduler.resolve_boundaries(now, run.async_decisions)
    decided = _decided(events) - decided
    compactions = events.compress + events.shrink - compactions
    decisions_s = run.cost.boundary_time(decided, 0)
    return (
        decisions_s,
        run.cost.boundary_time(decided, compactions) - decisions_s,
        compacted,
        late,
    )


def _synchronous_s(run: _Run) -> float:
    """Seconds the cost model charges for the boundary work the last ``_resolve_boundaries``
    ran at once, before the step (``Scheduler.synchronous_work``): with ``async_compaction``
    its compactions were deferred, so that is its decisions alone."""
    decided, compactions = run.scheduler.synchronous_work
    return run.cost.boundary_time(decided, compactions)


def _sit_out_step(run: _Run, compacted: list[SimRequest]) -> float:
    """Seconds of one decode step of the running requests but ``compacted``, which sit it
    out (``Scheduler.sit_out``)."""
    sched = run.scheduler
    batch = len(sched.running) - len(compacted)
    kv = (
        batch * (sched.longest_context(compacted) + 1)
        if run.cost.padded_kv
        else sched.kv_tokens() - sum(r.num_tokens for r in compacted) + batch
    )
    sched.sit_out(compacted)
    return run.cost.decode_time(batch, kv, 1)


def _decided(events: EventCounters) -> int:
    return events.decided_grow + events.decided_compress + events.decided_shrink


def _segment(run: _Run, now: float) -> tuple[int, float]:
    """Decode steps until the next event (or the next arrival) and their total seconds."""
    sched = run.scheduler
    batch = len(sched.running)
    num_steps = sched.next_event_step() - sched.step
    assert num_steps >= 1, "an event is due but was not resolved"
    if sched.can_admit():
        # A boundary freed pages (a shrink, a preemption) or a request arrived while the
        # boundaries were paid for: as in the engine, it is admitted after the next step.
        num_steps = 1
    # Every running request gains a token per step, so the longest does too: padded KV grows
    # by ``batch`` per step, as the sum does.
    kv = batch * (sched.longest_context() + 1) if run.cost.padded_kv else sched.kv_tokens() + batch
    seconds = run.cost.decode_time(batch, kv, num_steps)
    if run.next_arrival_s < now + seconds:  # stop after the step the arrival falls in
        ends = np.cumsum(run.cost.decode_times(batch, kv, num_steps))
        num_steps = int(np.searchsorted(ends, run.next_arrival_s - now)) + 1
        return num_steps, float(ends[num_steps - 1])
    return num_steps, seconds


def _check_requests(requests: Sequence[WorkloadRequest]) -> None:
    """``WorkloadRequest``s (each checked when built) with distinct ids."""
    seen: set[str] = set()
    for r in requests:
        if not isinstance(r, WorkloadRequest):
            raise WorkloadError(f"simulate() takes WorkloadRequests, got {r!r}")
        if r.request_id in seen:
            raise WorkloadError(
                f"two requests have the id {r.request_id!r}: ids must be "
                "distinct (they name the requests in the results)"
            )
        seen.add(r.request_id)


def _check_fits(
    requests: Sequence[WorkloadRequest],
    policy: CapacityPolicy,
    config: GrowPageConfig,
    sim: SimConfig,
) -> None:
    """A ``ConfigError`` before the run (not when it gets there) for a request that cannot
    finish even alone in the pool, as the engine refuses it when it is added.

    A compressing policy needs its prompt and the first decode step's token, and the forced
    growth up to ``min_capacity``; one that never compresses (``fullkv``) needs its whole KV,
    ``prompt + output - 1`` tokens, leaving the watermark free for its growth beyond
    ``min_capacity``."""
    b, pages, reserve = config.page_size, sim.num_kv_pages, config.watermark
    compresses = bool(getattr(policy, "fallback_to_compress", True))
    for r in requests:
        total = math.ceil((r.prompt_tokens + r.output_tokens - 1) / b)  # its KV at the end
        forced = min(forced_growth_pages(config, r.prompt_tokens), total)
        if compresses:
            # As the engine's Scheduler.add (KVCacheManager.can_ever_fit): the prompt and one
            # more token, whatever the output length.
            need = max(math.ceil((r.prompt_tokens + 1) / b), forced)
            if need <= pages:
                continue
            why = f"its prompt and first decode step need {need} pages of {b} tokens"
        else:
            need = total
            if need <= max(pages - reserve, forced) and math.ceil(r.prompt_tokens / b) <= pages:
                continue
            why = (
                f"policy {policy.name!r} never compresses, so it needs {need} pages of {b} "
                f"tokens"
                + (f" and the watermark's {reserve}" if reserve else "")
                + f" (--kv-pages {need + reserve})"
            )
        raise ConfigError(
            f"request {r.request_id!r} ({r.prompt_tokens} prompt + "
            f"{r.output_tokens} output tokens) cannot finish even alone: {why}; "
            f"the pool has {pages}"
        )


def _check_types(config: object, sim: object, cost: object) -> None:
    """``simulate``'s settings are the objects it reads, or a ``ConfigError`` says which is not
    (a preset name or a ``PRESETS`` entry is not a cost model: ``load_cost_model`` makes one)."""
    for name, value, kind, hint in (
        ("config", config, GrowPageConfig, ""),
        ("sim", sim, SimConfig, ""),
        (
            "cost",
            cost,
            CostModel,
            "; build one with LinearCostModel(...), RooflineCostModel(hardware, model) or "
            "load_cost_model('a100-qwen3-8b') (a preset's name or a calibrated model's JSON)",
        ),
    ):
        if not isinstance(value, kind):
            raise ConfigError(
                f"simulate(): {name} must be a {kind.__name__}, got "
                f"{type(value).__name__} {value!r:.80}{hint}"
            )


def check_pool_memory(
    num_pages: int, available: tuple[int, str] | None, name: str = "SimConfig.num_kv_pages"
) -> None:
    """A ``ConfigError`` naming ``name`` when the bookkeeping of a pool of ``num_pages`` pages
    (``core.pages.bookkeeping_bytes``) is more than ``available``: bytes, and the limit that
    says so (None: unknown, nothing checked). ``available``: ``core.host_memory``'s figure,
    the memory a new allocation may take (the host's and its cgroup's), as the engine checks
    its KV cache."""
    num_bytes = bookkeeping_bytes(num_pages)
    if available is not None and num_bytes > available[0]:
        raise ConfigError(
            f"{name} {num_pages}: the page pool's bookkeeping would take {_size(num_bytes)}, "
            f"more than the {_size(available[0])} available ({available[1]}); give fewer pages"
        )


def _size(num_bytes: int) -> str:
    return f"{num_bytes} bytes ({num_bytes / 2**30:.2f} GiB)"


def check_simulation(
    requests: Sequence[WorkloadRequest],
    policy: str | CapacityPolicy,
    config: GrowPageConfig,
    sim: SimConfig,
    cost: CostModel,
) -> CapacityPolicy:
    """What ``simulate`` checks before it allocates anything, a ``ConfigError`` (or
    ``WorkloadError``) saying what is wrong; the policy resolved. A command calls it before
    it creates its output folder."""
    _check_requests(requests)
    _check_types(config, sim, cost)
    policy = resolve_policy(policy)
    _check_fits(requests, policy, config, sim)
    check_step_times(cost)
    check_pool_memory(sim.num_kv_pages, available_memory())
    return policy


def simulate(
    requests: Sequence[WorkloadRequest],
    policy: str | CapacityPolicy,
    config: GrowPageConfig,
    sim: SimConfig,
    cost: CostModel,
    trace_of: Callable[[WorkloadRequest], Trace] | None = None,
    on_progress: Callable[[int], object] | None = None,
    demand: SyntheticSpec = SCRIPT_SPEC,
) -> ServingResult:
    """Serve ``requests`` under ``policy``; see the module docstring.

    ``trace_of`` gives each request's trace in trace mode (default: a synthetic trace drawn for
    the request's lengths); script mode ignores it. ``demand`` is the synthetic demand behind
    the scripts of script mode and trace mode's default traces: its regime parameters (the
    lengths are set per script or request; ``benchmarks/paper_scale.py`` tunes it).
    ``on_progress(num_finished)`` is called whenever requests finish.
    """
    policy = check_simulation(requests, policy, config, sim, cost)
    if sim.decisions == "trace":
        source: TraceSource | ScriptSource = TraceSource(
            policy, config, sim.num_kv_pages, trace_of or synthetic_trace_of(demand, sim.seed)
        )
    else:
        source = ScriptSource(
            policy, config, sim.num_kv_pages, requests, sim.num_scripts, sim.seed, demand
        )
    reserve = int(sim.admission_reserve * sim.num_kv_pages)
    # As the engine (LLM()): a policy that reads H2O accumulated attention keeps per-slot sums,
    # which shared pages cannot hold, so it runs without prefix caching.
    prefix_caching = sim.prefix_caching and not getattr(
        policy, "needs_accumulated_attention", False
    )
    sched = Scheduler(
        source,
        config.page_size,
        sim.max_num_seqs,
        sim.max_num_batched_tokens,
        reserve,
        sim.record_events,
        sim.chunked_prefill,
        prefix_caching,
        sim.async_compaction,
    )
    sim_requests = [SimRequest(r) for r in sorted(requests, key=lambda r: r.arrival_s)]
    env = simpy.Environment()
    run = _Run(
        sched,
        cost,
        len(sim_requests),
        async_compaction=sim.async_compaction,
        async_decisions=sim.async_decisions,
        on_progress=on_progress,
    )
    env.process(arrivals(env, run, sim_requests))
    env.process(engine(env, run))
    env.run()
    run.mark(env.now)  # all gone
    first = min((r.arrival_s for r in requests), default=0.0)
    metrics = compute_metrics(
        policy.name,
        sim_requests,
        source.controller.events,
        env.now - first,
        run.resident_s,
        sched.num_preemptions,
        run.decode_steps,
        run.prefill_steps,
        run.peak_pages,
        sched.pool.num_pages,
        run.boundary_s,
        sched.prefix.hit_tokens,
    )
    return ServingResult(metrics, sim_requests, sched.events, sched.pool, run.timeline)
