"""Scripted decisions: the policy runs live, its attention signals are played back.

A paper-scale workload (thousands of requests, up to 32k tokens each) cannot afford a real KV
view per request. In *script* mode the serving simulator still asks the real policy at every
boundary, through the real ``CapacityController``, but:

* the request's plain facts (pages, capacity, position, free pages in the shared pool) are live;
* the attention signals the policy reads (``ctx.delta()``, ``ctx.entropy_delta()``, ...) are
  played back from a *script*: the same policy replayed once on a synthetic trace with a private
  pool (``sim.replay``), where a ``RecordingContext`` logged every signal call per boundary.

So state-driven policies (``fixed``, ``fullkv``, ``random``) are exact, and signal-driven ones
(``growpage``, ``inverse``, ``shrink``, ``entropy``) see the Delta_t sequence of a real replay of
a request with the same regime dynamics. What is not modelled: a fallback changes the KV content
a real request would have, the script's signals do not follow it.

NOTE: in script mode the controller counts in *pages*: it runs with ``page_size = 1`` over a
pool of the same pages, so a compression keeps ``P - 1`` one-slot "tokens" (no KV content is
simulated, and the selection checks stay tiny). ``ScriptedContext`` converts back: the policy
sees tokens and the real ``GrowPageConfig``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, cast

import torch

from growpage.core.boundary_context import BoundaryContext
from growpage.core.capacity import min_kept_tokens
from growpage.core.config import GrowPageConfig
from growpage.core.decision import Decision
from growpage.core.kv_view import KVView, QueryState
from growpage.core.request import RequestState
from growpage.core.rope import RopeConfig
from growpage.errors import SimulationError
from growpage.policies.base import CapacityPolicy

SIGNALS = (
    "attention",
    "working_set_ratio",
    "delta",
    "entropy_delta",
    "scores",
    "accumulated_attention",
    "recent_queries",
    "window_attention",
    "positions",
)

SignalLog = dict[tuple[Any, ...], Any]  # (method, *args) -> value, for one boundary


def signal_key(method: str, *args: Any) -> tuple[Any, ...]:
    """Log key of a signal call; trailing None arguments (defaults) are dropped."""
    while args and args[-1] is None:
        args = args[:-1]
    return (method, *args)


def page_units(config: GrowPageConfig) -> GrowPageConfig:
    """The controller config of script mode: one slot per page (see the module NOTE). The
    prompt and the floor are counted by ``kept_pages``, not by this config."""
    return config.replace(
        page_size=1, recent_window=0, k_loc=0, protect_prompt=False, floor_tokens=None
    )


def kept_pages(config: GrowPageConfig) -> Callable[[RequestState], int]:
    """The script-mode controller's ``min_kept``: pages a compression must keep for
    ``config``'s prompt and floor rules (a request's ``num_prompt_tokens`` is in tokens).
    (P - 1) pages keep enough tokens iff P - 1 >= ceil(tokens / b): the same boundaries grow
    freely as with tokens."""

    def pages(state: RequestState) -> int:
        return -(-min_kept_tokens(config, state.num_prompt_tokens) // config.page_size)

    return pages


class CountingView(KVView):
    """KV view with no content: only the resident count (script mode, page units)."""

    num_layers = num_q_heads = num_kv_heads = 1
    head_dim = 2
    rope = RopeConfig(head_dim=2)
    softmax_scale = 1.0

    def __init__(self, num_tokens: int = 0) -> None:
        self.count = num_tokens
        self.decoded = True  # set per boundary (ScriptSource.prepare)

    @property
    def num_tokens(self) -> int:
        return self.count

    @property
    def has_query_state(self) -> bool:
        return self.decoded

    def _no_content(self) -> torch.Tensor:
        raise SimulationError(
            "a script-mode request has no KV content (keys, positions, "
            "queries): a policy that reads ctx.view in decide() needs trace "
            "mode (SimConfig(decisions='trace'), --decisions trace)"
        )

    def keys(self) -> torch.Tensor:
        return self._no_content()

    def positions(self) -> torch.Tensor:
        return self._no_content()

    def query_state(self) -> QueryState:
        self._no_content()
        raise AssertionError

    def compact(self, keep: torch.Tensor, src_pages: list[int], dst_pages: list[int]) -> None:
        self.count = keep.shape[-1]


class RecordingContext:
    """Forwards everything to a real ``BoundaryContext`` and logs the signal calls."""

    def __init__(self, ctx: BoundaryContext, log: SignalLog) -> None:
        self._ctx, self._log = ctx, log

    def __getattr__(self, name: str) -> Any:
        target = getattr(self._ctx, name)
        if name not in SIGNALS:
            return target

        def record(*args: Any, **kwargs: Any) -> Any:
            value = target(*args, **kwargs)
            bound = inspect.signature(target).bind(*args, **kwargs)
            logged = value.clone() if isinstance(value, torch.Tensor) else value
            self._log[signal_key(name, *bound.args)] = logged
            return value

        return record


class RecordingPolicy(CapacityPolicy):
    """Wraps a policy; ``logs[request_id]`` gets one ``SignalLog`` per decided boundary."""

    def __init__(self, inner: CapacityPolicy) -> None:
        # NOTE: a wrapper takes the class-level settings of the policy it wraps, per instance
        # (they are ClassVars for policy authors, so that mypy refuses an attrs field of them).
        self.inner = inner
        self.name = inner.name  # type: ignore[misc]  # see NOTE
        self.fallback_to_compress = inner.fallback_to_compress  # type: ignore[misc]  # see NOTE
        self.needs_accumulated_attention = inner.needs_accumulated_attention  # type: ignore[misc]  # see NOTE
        self.logs: dict[object, list[SignalLog]] = {}
        self._read: set[tuple[Any, ...]] = set()  # every signal key read at any boundary

    @property
    def needs_recent_queries(self) -> int:
        return self.inner.needs_recent_queries

    def decide(self, ctx: BoundaryContext) -> Decision:
        log: SignalLog = {}
        self.logs.setdefault(ctx.request_id, []).append(log)
        # A proxy: forwards every attribute to ctx (and logs the signal calls).
        decision = self.inner.decide(cast(BoundaryContext, RecordingContext(ctx, log)))
        # A policy that stops reading a signal past some live fact (``CappedGrowPage`` of
        # docs/policy-guide.md: no delta() at its page cap) may read it at that boundary in
        # serving, where fallbacks keep the request smaller: log what it read before, too.
        self._read.update(log)
        for key in self._read - log.keys():
            try:
                value = getattr(ctx, key[0])(*key[1:])
            except Exception:  # not available here: a read in serving is then an error
                continue
            log[key] = value.clone() if isinstance(value, torch.Tensor) else value
        return decision

    def select(self, ctx: BoundaryContext, keep: int) -> torch.Tensor:
        return self.inner.select(ctx, keep)


class ScriptedContext(BoundaryContext):
    """A context with live facts (in tokens) and played-back signals."""

    def __init__(
        self, ctx: BoundaryContext, config: GrowPageConfig, signal: Callable[[tuple[Any, ...]], Any]
    ) -> None:
        b = config.page_size
        super().__init__(
            ctx.request_id,
            ctx.num_pages * b,
            ctx.position,
            ctx.num_pages,
            ctx.num_free_pages,
            config,
            ctx.view,
            ctx.num_prompt_tokens,
        )
        self._signal = signal

    def attention(self, view: str) -> torch.Tensor:
        return self._signal(signal_key("attention", view))

    def working_set_ratio(self, view: str, p: float | None = None) -> torch.Tensor:
        return self._signal(signal_key("working_set_ratio", view, p))

    def delta(self, p: float | None = None) -> float:
        return self._signal(signal_key("delta", p))

    def entropy_delta(self) -> float:
        return self._signal(signal_key("entropy_delta"))

    def scores(self) -> torch.Tensor:
        return self._signal(signal_key("scores"))

    def accumulated_attention(self) -> torch.Tensor | None:
        return self._signal(signal_key("accumulated_attention"))

    def recent_queries(self, window: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self._signal(signal_key("recent_queries", window))

    def window_attention(self, window: int) -> torch.Tensor | None:
        return self._signal(signal_key("window_attention", window))

    def positions(self) -> torch.Tensor:
        return self._signal(signal_key("positions"))


class ScriptedPolicy(CapacityPolicy):
    """Adapter run by the script-mode controller (page units): no decision logic of its own.

    ``decide`` hands the wrapped policy a ``ScriptedContext``; ``lookup(request_id, ordinal,
    key)`` returns the recorded signal ``key`` of the request's ``ordinal``-th decided boundary.
    ``select`` keeps the last ``keep`` slots (there is no content to choose from).
    """

    def __init__(
        self,
        inner: CapacityPolicy,
        config: GrowPageConfig,
        lookup: Callable[[object, int, tuple[Any, ...]], Any],
    ) -> None:
        self.inner, self.config, self.lookup = inner, config, lookup
        self.name = inner.name  # type: ignore[misc]  # as in RecordingPolicy
        self.fallback_to_compress = inner.fallback_to_compress  # type: ignore[misc]  # as in RecordingPolicy
        self.ordinals: dict[object, int] = {}
        self._last: dict[object, tuple[int, int]] = {}  # request -> (position, ordinal)
        self._keep: dict[tuple[int, int], torch.Tensor] = {}

    def decide(self, ctx: BoundaryContext) -> Decision:
        rid = ctx.request_id
        last = self._last.get(rid)
        if last is not None and last[0] == ctx.position:
            # The same boundary decided again (its action had to preempt another request
            # first): the same script boundary, as the engine's policy sees the same request.
            ordinal = last[1]
        else:
            ordinal = self.ordinals.get(rid, 0)
            self.ordinals[rid] = ordinal + 1
            self._last[rid] = (ctx.position, ordinal)
        scripted = ScriptedContext(ctx, self.config, lambda key: self.lookup(rid, ordinal, key))
        return self.inner.decide(scripted)

    def select(self, ctx: BoundaryContext, keep: int) -> torch.Tensor:
        key = (ctx.num_tokens, keep)
        if key not in self._keep:
            self._keep[key] = torch.arange(ctx.num_tokens - keep, ctx.num_tokens).view(1, 1, keep)
        return self._keep[key]
