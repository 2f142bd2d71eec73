"""Where a served request's capacity decisions come from.

* ``TraceSource`` (*trace* mode, exact): every request gets a ``TraceView`` over its own trace
  (from a trace set, or a synthetic trace drawn for its lengths); the controller runs in tokens.
* ``ScriptSource`` (*script* mode, scales to thousands of requests): see ``sim.scripted``. The
  requests are split by length into ``num_scripts`` groups; each group shares one synthetic
  trace long enough for its longest request, replayed once under the policy (only when the
  policy reads an attention signal at all) on a copy of it made before serving starts: the
  served policy object is never called from inside its own ``decide`` (a script is replayed
  when a policy first reads a signal), and no replay sees its state. A policy that cannot be
  deep-copied (it holds a lock, a file) has every script replayed up front instead.

Both own the shared ``PagePool`` (through their ``CapacityController``) and expose ``scale``:
tokens per controller slot (1 in trace mode, the page size in script mode).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np

from growpage.core.capacity import CapacityController, forced_growth_pages
from growpage.core.config import GrowPageConfig
from growpage.core.kv_view import KVView
from growpage.core.pages import PagePool
from growpage.core.trace_set import TraceSet
from growpage.core.traces import Trace, TraceHeader
from growpage.errors import ConfigError, SimulationError
from growpage.policies.base import CapacityPolicy
from growpage.sim.replay import ReplayOptions, replay_trace
from growpage.sim.scripted import (
    CountingView,
    RecordingPolicy,
    ScriptedPolicy,
    SignalLog,
    kept_pages,
    page_units,
)
from growpage.sim.synthetic import SyntheticSpec, synthetic_trace
from growpage.sim.traceview import TraceView
from growpage.sim.workload_csv import WorkloadRequest

# Synthetic traces behind scripts and per-request traces: small heads (the regime dynamics, not
# the head count, drive Delta_t), regimes of ~1k tokens.
SCRIPT_SPEC = SyntheticSpec(
    num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=32, mean_regime_len=1024.0
)


class TraceSource:
    """Trace mode: a real KV view per request."""

    scale = 1

    def __init__(
        self,
        policy: CapacityPolicy,
        config: GrowPageConfig,
        num_pages: int,
        trace_of: Callable[[WorkloadRequest], Trace],
    ) -> None:
        pool = PagePool(num_pages, config.page_size, watermark=config.watermark)
        self.controller = CapacityController(policy, pool, config)
        self.trace_of = trace_of

    def view_for(self, request: WorkloadRequest, num_cached_tokens: int = 0) -> KVView:
        """A fresh view of ``request`` admitted with ``num_cached_tokens`` from the prefix
        cache (whose queries never ran: ``TraceView.recent_queries`` starts after them)."""
        view = TraceView(
            self.trace_of(request),
            self.controller.config,
            track_accumulated=getattr(self.controller.policy, "needs_accumulated_attention", False),
        )
        view.num_cached_tokens = num_cached_tokens
        view.write_until(request.prompt_tokens)
        return view

    def prepare(self, view: KVView, num_units: int, position: int, decoded: bool) -> None:
        assert isinstance(view, TraceView)  # view_for's
        view.prepare_boundary(position, decoded)


class ScriptSource:
    """Script mode: page-unit controller, signals played back from per-group scripts."""

    def __init__(
        self,
        policy: CapacityPolicy,
        config: GrowPageConfig,
        num_pages: int,
        requests: Sequence[WorkloadRequest],
        num_scripts: int = 8,
        seed: int = 0,
        spec: SyntheticSpec = SCRIPT_SPEC,
    ) -> None:
        self.scale = config.page_size
        self.book = ScriptBook(policy, config, requests, num_scripts, seed, spec)
        pool = PagePool(num_pages, 1, watermark=config.watermark)
        adapter = ScriptedPolicy(policy, config, self.book.lookup)
        self.controller = CapacityController(
            adapter, pool, page_units(config), min_kept=kept_pages(config)
        )

    def view_for(self, request: WorkloadRequest, num_cached_tokens: int = 0) -> KVView:
        return CountingView()

    def prepare(self, view: KVView, num_units: int, position: int, decoded: bool) -> None:
        assert isinstance(view, CountingView)  # view_for's
        view.count = num_units
        view.decoded = decoded


@attrs.define
class _Script:
    prompt_len: int
    gen_len: int
    logs: list[SignalLog] | None = None


class ScriptBook:
    """Signal logs of scripted replays, built on first use (up front for a policy that cannot
    be deep-copied: see the module docstring); ``lookup`` serves ``ScriptedPolicy``."""

    def __init__(
        self,
        policy: CapacityPolicy,
        config: GrowPageConfig,
        requests: Sequence[WorkloadRequest],
        num_scripts: int,
        seed: int,
        spec: SyntheticSpec,
    ) -> None:
        self.policy, self.config, self.seed, self.spec = policy, config, seed, spec
        self.script_of: dict[object, int] = {}
        self.scripts: list[_Script] = []
        self.replayer: CapacityPolicy | None = None
        if not requests:
            return
        # NOTE: a script is built lazily, inside the served policy's decide (its first signal
        # read): replayed on the served object itself, that would call it re-entrantly (a lock
        # it holds deadlocks) and mix the replay's state into its own. A copy replays instead.
        try:
            self.replayer = copy.deepcopy(policy)
        except Exception:  # noqa: BLE001 - whatever deepcopy raises: replay up front instead
            pass
        totals = np.array([r.prompt_tokens + r.output_tokens for r in requests])
        groups = np.array_split(np.argsort(totals, kind="stable"), max(1, num_scripts))
        for g in (g for g in groups if len(g)):
            prompt = int(np.median([requests[i].prompt_tokens for i in g]))
            longest = int(totals[g].max())
            gen = max(longest - prompt, 1) + 2 * config.page_size  # margin: never run out
            gen = max([gen] + [_script_len_for(requests[i], prompt, config) for i in g])
            for i in g:
                self.script_of[requests[i].request_id] = len(self.scripts)
            self.scripts.append(_Script(prompt, gen))
        if self.replayer is None:  # not from inside decide: the served object replays
            for index in range(len(self.scripts)):
                self._logs(index)

    def lookup(self, request_id: object, ordinal: int, key: tuple[Any, ...]) -> Any:
        index = self.script_of.get(request_id)
        if index is None:
            raise SimulationError(f"request {request_id!r} has no script")
        logs = self._logs(index)
        if ordinal >= len(logs):
            raise SimulationError(
                f"request {request_id!r} reached decided boundary {ordinal}, "
                f"its script has {len(logs)}"
            )
        if key not in logs[ordinal]:
            raise SimulationError(
                f"policy {self.policy.name!r} read {key[0]}({', '.join(map(repr, key[1:]))}) at "
                f"decided boundary {ordinal} of request {request_id!r}, but its script run did "
                "not (in script mode which signals a policy reads must not depend on the pool "
                "state, nor on num_pages or capacity, which fallbacks change; use trace mode: "
                "--decisions trace, SimConfig(decisions='trace'))"
            )
        return logs[ordinal][key]

    def _logs(self, index: int) -> list[SignalLog]:
        script = self.scripts[index]
        if script.logs is None:
            spec = attrs.evolve(
                self.spec, prompt_len=script.prompt_len, gen_len=script.gen_len, with_values=False
            )
            trace = synthetic_trace(spec, self.seed + index, request_id=f"script-{index}")
            recorder = RecordingPolicy(self.policy if self.replayer is None else self.replayer)
            replay_trace(trace, recorder, self.config, ReplayOptions(fidelity_queries=0))
            script.logs = recorder.logs.get(trace.request_id, [])
        return script.logs

    @property
    def num_built(self) -> int:
        return sum(s.logs is not None for s in self.scripts)


def _script_len_for(request: WorkloadRequest, prompt: int, config: GrowPageConfig) -> int:
    """Generated tokens a script with a ``prompt``-token prompt needs to hold a decided
    boundary for each of ``request``'s, with one page to spare.

    NOTE: boundaries come every page once the prompt's last page is full; the first ones,
    below the floor (``forced_growth_pages``), are forced growths and decide nothing. A request with a
    shorter prompt than the script's can thus have more output, and one with more prompt
    pages fewer forced growths, than the script has boundaries for."""
    b = config.page_size

    def first_free_and_forced(prompt_tokens: int) -> tuple[int, int]:
        pages = -(-prompt_tokens // b)
        return pages * b - prompt_tokens, max(0, forced_growth_pages(config, prompt_tokens) - pages)

    free, forced = first_free_and_forced(request.prompt_tokens)
    script_free, script_forced = first_free_and_forced(prompt)
    boundaries = max(0, -(-(request.output_tokens - free) // b))
    return script_free + (boundaries + script_forced - forced + 1) * b


def synthetic_trace_of(
    spec: SyntheticSpec = SCRIPT_SPEC, seed: int = 0
) -> Callable[[WorkloadRequest], Trace]:
    """Trace mode without recorded traces: a synthetic trace drawn for each request's lengths."""
    index: dict[str, int] = {}

    def trace_of(request: WorkloadRequest) -> Trace:
        i = index.setdefault(request.request_id, len(index))
        s = attrs.evolve(spec, prompt_len=request.prompt_tokens, gen_len=request.output_tokens)
        return synthetic_trace(s, seed + i, request_id=request.request_id)

    return trace_of


def traces_for(
    requests: Sequence[WorkloadRequest],
    directory: str,
    on_headers: Callable[[list[TraceHeader]], None] | None = None,
    *,
    deep: bool = False,
    progress: bool = False,
) -> tuple[list[WorkloadRequest], Callable[[WorkloadRequest], Trace]]:
    """Trace mode over a trace set: each request takes its ``trace`` (or the set's entries in
    turn) and the lengths of that trace. A trace holds the KV of every token but the last
    output token (never fed back), so ``G`` generated positions make ``G + 1`` output tokens.
    ``on_headers`` gets the set's headers, read once to check the files; ``deep`` and
    ``progress`` are ``TraceSet.check``'s (also validate every trace's tensors first)."""
    traces = TraceSet(directory)
    if not len(traces):
        raise ConfigError(f"{directory}: the trace set is empty")
    # A broken file is found now, not when its request is admitted.
    headers = traces.check(deep=deep, progress=progress)
    if on_headers is not None:
        on_headers(headers)
    by_id = {e.request_id: e for e in traces.index}
    chosen, out = {}, []
    for i, r in enumerate(requests):
        entry = by_id.get(r.trace) if r.trace else traces.index[i % len(traces)]
        if entry is None:
            raise ConfigError(f"request {r.request_id}: trace {r.trace!r} is not in {directory}")
        if r.prefix is not None and r.prefix_tokens > entry.prompt_len:
            raise ConfigError(
                f"request {r.request_id}: its shared prefix {r.prefix!r} of "
                f"{r.prefix_tokens} tokens is longer than the prompt of its trace "
                f"{entry.request_id!r} in {directory} ({entry.prompt_len} "
                "tokens), which the request takes in trace mode"
            )
        chosen[r.request_id] = entry
        out.append(
            attrs.evolve(
                r,
                prompt_tokens=entry.prompt_len,
                output_tokens=entry.num_tokens - entry.prompt_len + 1,
            )
        )
    return out, lambda request: traces.read(chosen[request.request_id])
