"""What ``LLM.generate`` and ``LLM.score`` return, and the engine-wide statistics."""

from __future__ import annotations

import math

import attrs

from growpage.latency import PERCENTILES


@attrs.frozen(kw_only=True)
class RequestOutput:
    """One generated request.

    Attributes:
        trajectory: ``(position, num_pages, action)`` after every capacity boundary.
        events: the request's boundary event counts (``EventCounters.as_dict()``).
        ttft_s / tpot_s: time to first token; mean time per output token after the first.
        e2e_s: time from submission (or arrival) to the last token.
        arrival_s: when the request arrived, in seconds after the first of its call arrived
            (``generate(..., arrival_s=...)``; 0 for a call whose requests all arrive at
            once).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str
    trajectory: list[tuple[int, int, str]]
    events: dict[str, int]
    num_preemptions: int = 0
    num_cached_tokens: int = 0
    ttft_s: float = 0.0
    tpot_s: float = 0.0
    e2e_s: float = 0.0
    arrival_s: float = 0.0


@attrs.frozen(kw_only=True)
class StreamChunk:
    """What one request produced since its previous chunk (``LLM.stream``).

    Attributes:
        index: the request's position among the call's prompts.
        text: new text; the chunks of a request add up to its ``RequestOutput.text``.
        token_ids: new token ids (text may lag them by a few tokens: an incomplete UTF-8
            character, or a possible start of a stop string, waits for what follows).
        output: the finished request, on its last chunk only (else None).
    """

    index: int
    request_id: str
    text: str
    token_ids: list[int]
    output: RequestOutput | None = None

    @property
    def finished(self) -> bool:
        return self.output is not None


@attrs.frozen(kw_only=True)
class ScoreOutput:
    """Teacher-forced negative log-likelihood of a continuation (paper section 5.3).

    ``token_nlls[i]`` is ``-log p(continuation[i] | prompt, continuation[:i])`` under the
    policy's KV (compression decisions made as in decoding, the next token forced), and
    ``token_ranks[i]`` the number of tokens the model scored strictly higher there (0: greedy
    decoding would have produced it).
    """

    request_id: str
    prompt_token_ids: list[int]
    continuation_token_ids: list[int]
    token_nlls: list[float]
    trajectory: list[tuple[int, int, str]]
    events: dict[str, int]
    num_preemptions: int = 0
    token_ranks: list[int] = attrs.Factory(list)

    @property
    def nll(self) -> float:
        return float(sum(self.token_nlls))

    @property
    def mean_nll(self) -> float:
        return self.nll / len(self.token_nlls)

    @property
    def perplexity(self) -> float:
        return math.exp(self.mean_nll)

    def greedy_match(self, start: int = 0, stop: int | None = None) -> bool:
        """Whether greedy decoding would reproduce ``continuation[start:stop]`` exactly."""
        return all(r == 0 for r in self.token_ranks[start:stop])


@attrs.frozen(kw_only=True)
class EngineStats:
    """Engine-wide numbers of one ``generate`` / ``score`` call.

    Attributes:
        tps: output tokens per second over the whole call.
        tpot_s: mean over requests of the time per output token after the first.
        avg_resident: C, the time-averaged number of requests resident (running).
        avg_kv_budget: mean KV capacity (tokens) a decoding request held, over decode steps.
        avg_kv_above_prompt: the same, of capacity beyond the request's prompt (0 where the
            capacity is below it).
        events: the controller's event counts (grow, compress, shrink, fallback, ...).
        boundary_s: wall time spent in capacity control (decisions, scoring, compaction).
        deferred_s: of that, the work run beside a decode step's forward: compressions
            (``async_compaction``) and late boundaries (``async_decisions``); 0 without them.
        deferred_waited_s: of that, what the steps waited for: the part after the forward had
            finished (on the CPU, all of it).
        e2e_s: mean over requests of the time from submission to finish.
        ttft_p50_s ... e2e_p99_s: percentiles (``growpage.latency.PERCENTILES``) over the
            requests of their TTFT, TPOT and end-to-end time in seconds, defined as the means
            are (numpy's linear interpolation; 0 without requests), named as the simulator's
            ``ServingMetrics`` names them (whose TPOT is in ms).
        pool_timeline: ``(seconds since the call started, KV pages in use, running requests)``
            at the end of every step, as the simulator's ``ServingResult.pool_timeline()``
            (``growpage.plots.plot_pool`` draws either).
    """

    policy: str
    page_size: int
    num_pages: int
    num_requests: int
    num_prompt_tokens: int
    num_output_tokens: int
    num_steps: int
    total_s: float
    tps: float
    tpot_s: float
    ttft_s: float
    avg_resident: float
    avg_kv_budget: float
    max_pages_used: int
    num_preemptions: int
    prefix_hit_tokens: int
    events: dict[str, int]
    avg_kv_above_prompt: float = 0.0
    boundary_s: float = 0.0
    deferred_s: float = 0.0
    deferred_waited_s: float = 0.0
    e2e_s: float = 0.0
    ttft_p50_s: float = 0.0
    ttft_p90_s: float = 0.0
    ttft_p99_s: float = 0.0
    tpot_p50_s: float = 0.0
    tpot_p90_s: float = 0.0
    tpot_p99_s: float = 0.0
    e2e_p50_s: float = 0.0
    e2e_p90_s: float = 0.0
    e2e_p99_s: float = 0.0
    pool_timeline: list[tuple[float, int, int]] = attrs.field(factory=list, repr=False)

    def rows(self) -> list[tuple[str, str]]:
        e = self.events
        deferred = (
            [
                (
                    "deferred work",
                    f"{self.deferred_s:.2f} s of it, {self.deferred_waited_s:.2f} s waited for",
                )
            ]
            if self.deferred_s > 0
            else []
        )
        return [
            ("policy", self.policy),
            ("requests", str(self.num_requests)),
            ("prompt / output tokens", f"{self.num_prompt_tokens} / {self.num_output_tokens}"),
            ("total time", f"{self.total_s:.2f} s"),
            ("throughput (TPS)", f"{self.tps:.1f} tok/s"),
            ("TPOT", f"{1000 * self.tpot_s:.1f} ms"),
            ("TTFT", f"{1000 * self.ttft_s:.1f} ms"),
            *self._percentile_rows(),
            ("avg resident requests C", f"{self.avg_resident:.2f}"),
            (
                "avg KV budget",
                f"{self.avg_kv_budget:.0f} tokens ({self.avg_kv_above_prompt:.0f} above the prompt)",
            ),
            (
                "KV pages used (max / total)",
                f"{self.max_pages_used} / {self.num_pages} x {self.page_size} tokens",
            ),
            (
                "grow / compress / shrink",
                f"{e.get('grow', 0)} / {e.get('compress', 0)} / {e.get('shrink', 0)}",
            ),
            (
                "boundary time",
                f"{self.boundary_s:.2f} s ({100 * self.boundary_s / max(self.total_s, 1e-9):.1f}%)",
            ),
            *deferred,
            ("fallbacks", str(e.get("fallback", 0))),
            ("preemptions", str(self.num_preemptions)),
            ("prefix-cache hit tokens", str(self.prefix_hit_tokens)),
        ]

    def _percentile_rows(self) -> list[tuple[str, str]]:
        """Percentiles of TTFT and TPOT (ms), and end-to-end time (s): mean and percentiles."""
        qs = "/".join(f"p{q}" for q in PERCENTILES)

        def row(name: str, scale: float, fmt: str) -> str:
            return " / ".join(
                format(scale * getattr(self, f"{name}_p{q}_s"), fmt) for q in PERCENTILES
            )

        return [
            (f"TTFT {qs}", f"{row('ttft', 1000, '.1f')} ms"),
            (f"TPOT {qs}", f"{row('tpot', 1000, '.1f')} ms"),
            ("end to end (mean)", f"{self.e2e_s:.2f} s"),
            (f"end to end {qs}", f"{row('e2e', 1, '.2f')} s"),
        ]

    def table(self) -> str:
        rows = self.rows()
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
