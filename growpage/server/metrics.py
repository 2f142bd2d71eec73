"""``/metrics``: the engine's state and counters, and request latencies, for Prometheus.

Gauges and counters come from an ``EngineSnapshot`` the engine thread publishes after every
step (a scrape never touches the engine); histograms are observed by the engine thread as
requests finish and steps end. Each server has its own ``CollectorRegistry``, so several can
live in one process (tests).

============================================  =======  ==============================================
metric                                        type     what
============================================  =======  ==============================================
growpage_requests_running                     gauge    requests resident in the engine
growpage_requests_waiting                     gauge    requests queued for admission
growpage_kv_pages_used / _free / _total       gauge    KV pool pages (a cached prefix page is free)
growpage_grows_total                          counter  pages grown (forced growths included)
growpage_forced_grows_total                   counter  growths below min_capacity (no policy call)
growpage_compressions_total                   counter  compress & hold actions
growpage_shrinks_total                        counter  shrink actions
growpage_fallbacks_total                      counter  GROW refused by the pool, compressed instead
growpage_preemptions_total                    counter  requests preempted (recompute)
growpage_prefix_cache_hit_tokens_total        counter  prompt tokens taken from the prefix cache
growpage_boundary_seconds_total               counter  wall time in capacity control
growpage_prompt_tokens_total                  counter  prompt tokens of accepted requests
growpage_generation_tokens_total              counter  tokens generated
growpage_requests_finished_total{reason}      counter  stop, length, abort (client or shutdown), error
growpage_requests_rejected_total{reason}      counter  invalid (400), queue_full, shutting_down
growpage_time_to_first_token_seconds          hist.    arrival at the server to the first token
growpage_time_per_output_token_seconds        hist.    (finish - first token) / (tokens - 1)
growpage_e2e_request_latency_seconds          hist.    arrival to finish
growpage_step_seconds                         hist.    engine step wall time
growpage_step_boundary_seconds                hist.    capacity-control time of the steps that had any
============================================  =======  ==============================================
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import attrs
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from growpage.engine.loop.sequence import Sequence

CONTENT_TYPE = CONTENT_TYPE_LATEST  # the text exposition format
LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100, 250)
TOKEN_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
FINISH_REASONS = ("stop", "length", "abort", "error")
REJECT_REASONS = ("invalid", "queue_full", "shutting_down")
# (metric name, help, EngineSnapshot.events key)
_EVENT_COUNTERS = (
    ("growpage_grows", "KV pages grown (forced growths included)", "grow"),
    ("growpage_forced_grows", "growths below min_capacity, without a policy call", "forced_grow"),
    ("growpage_compressions", "compress & hold actions", "compress"),
    ("growpage_shrinks", "shrink actions (a page released)", "shrink"),
    ("growpage_fallbacks", "GROW refused by the pool, compressed instead", "fallback"),
)


@attrs.frozen(kw_only=True)
class EngineSnapshot:
    """The engine's numbers after a step (running totals since the server started)."""

    num_running: int = 0
    num_waiting: int = 0
    num_pages_used: int = 0
    num_pages_free: int = 0
    events: dict[str, int] = attrs.field(factory=dict)
    num_preemptions: int = 0
    prefix_hit_tokens: int = 0
    boundary_s: float = 0.0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    finished: dict[str, int] = attrs.field(factory=dict)  # by FINISH_REASONS
    rejected: dict[str, int] = attrs.field(factory=dict)  # by REJECT_REASONS


class _SnapshotCollector(Collector):
    """Gauges and counters read from the latest snapshot."""

    def __init__(self, snapshot: Callable[[], EngineSnapshot]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        s = self._snapshot()
        for name, doc, value in (
            ("growpage_requests_running", "requests resident in the engine", s.num_running),
            ("growpage_requests_waiting", "requests queued for admission", s.num_waiting),
            ("growpage_kv_pages_used", "KV pool pages in use", s.num_pages_used),
            (
                "growpage_kv_pages_free",
                "KV pool pages free (cached prefixes count)",
                s.num_pages_free,
            ),
            ("growpage_kv_pages_total", "KV pool pages", s.num_pages_used + s.num_pages_free),
        ):
            yield GaugeMetricFamily(name, doc, value=value)
        for name, doc, key in _EVENT_COUNTERS:
            yield CounterMetricFamily(name, doc, value=s.events.get(key, 0))
        totals: tuple[tuple[str, str, float], ...] = (
            ("growpage_preemptions", "requests preempted (recompute)", s.num_preemptions),
            (
                "growpage_prefix_cache_hit_tokens",
                "prompt tokens taken from the prefix cache",
                s.prefix_hit_tokens,
            ),
            ("growpage_boundary_seconds", "wall seconds in capacity control", s.boundary_s),
            ("growpage_prompt_tokens", "prompt tokens of accepted requests", s.num_prompt_tokens),
            ("growpage_generation_tokens", "tokens generated", s.num_generation_tokens),
        )
        for name, doc, total in totals:
            yield CounterMetricFamily(name, doc, value=total)
        for name, doc, label, values, reasons in (
            ("growpage_requests_finished", "requests ended", "reason", s.finished, FINISH_REASONS),
            (
                "growpage_requests_rejected",
                "requests refused before they ran",
                "reason",
                s.rejected,
                REJECT_REASONS,
            ),
        ):
            family = CounterMetricFamily(name, doc, labels=[label])
            for reason in reasons:
                family.add_metric([reason], values.get(reason, 0))
            yield family


class ServerMetrics:
    """The server's Prometheus registry; ``render()`` is the ``/metrics`` body."""

    def __init__(self, snapshot: Callable[[], EngineSnapshot]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_SnapshotCollector(snapshot))

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, buckets=buckets, registry=self.registry)

        self.ttft = histogram(
            "growpage_time_to_first_token_seconds",
            "arrival at the server to the first token",
            LATENCY_BUCKETS_S,
        )
        self.tpot = histogram(
            "growpage_time_per_output_token_seconds",
            "time per output token after the first",
            TOKEN_BUCKETS_S,
        )
        self.e2e = histogram(
            "growpage_e2e_request_latency_seconds", "arrival to the last token", LATENCY_BUCKETS_S
        )
        self.step = histogram("growpage_step_seconds", "engine step wall time", TOKEN_BUCKETS_S)
        self.step_boundary = histogram(
            "growpage_step_boundary_seconds",
            "capacity-control seconds of a step that had any",
            TOKEN_BUCKETS_S,
        )

    def observe_finished(self, seq: Sequence) -> None:
        """A request's latencies, as ``EngineStats`` defines them (seconds)."""
        if seq.first_token_s is None or seq.finish_s is None:
            return
        self.ttft.observe(seq.first_token_s - seq.arrival_s)
        self.e2e.observe(seq.finish_s - seq.arrival_s)
        if seq.num_output_tokens > 1:
            self.tpot.observe((seq.finish_s - seq.first_token_s) / (seq.num_output_tokens - 1))

    def observe_step(self, seconds: float, boundary_s: float) -> None:
        self.step.observe(seconds)
        if boundary_s > 0:
            self.step_boundary.observe(boundary_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)
