"""``SimRequest``: one request as the serving simulator tracks it."""

from __future__ import annotations

from growpage.core.kv_view import KVView
from growpage.core.request import RequestState
from growpage.core.residency import PrefixChain
from growpage.sim.workload_csv import WorkloadRequest


class SimRequest:
    """A request's serving state. Token counters are exact as of decode step ``sync_step``.

    Attributes:
        state: the controller's ``RequestState`` (block table; counts in controller units).
        num_tokens: resident KV tokens; generated: output tokens whose KV is written, one per
            decode step (both at sync_step). The prefill produces the first output token, so a
            request decodes ``decode_tokens`` = ``output_tokens - 1`` steps.
        admit_step: decode step of its last admission (a boundary then has no query summary).
        event_step: decode step of its next event (boundary or finish).
        budget_tokens: sum over its decoded tokens of its capacity (pages * b) when written.
        capacity: ``(time_s, pages)`` whenever its page count changes (0 = not resident).
    """

    __slots__ = (
        "spec",
        "request_id",
        "prompt_tokens",
        "output_tokens",
        "state",
        "view",
        "num_tokens",
        "generated",
        "sync_step",
        "admit_step",
        "event_step",
        "event_tick",
        "admit_seq",
        "is_running",
        "resuming",
        "prefill_target",
        "prefill_left",
        "prefix_chain",
        "num_preemptions",
        "budget_tokens",
        "first_token_s",
        "finish_s",
        "capacity",
    )

    def __init__(self, spec: WorkloadRequest) -> None:
        self.spec = spec
        self.request_id = spec.request_id
        self.prompt_tokens = spec.prompt_tokens
        self.output_tokens = spec.output_tokens
        self.state = RequestState(spec.request_id, num_prompt_tokens=spec.prompt_tokens)
        self.view: KVView | None = None
        self.num_tokens = self.generated = self.sync_step = self.admit_step = 0
        self.event_step = self.event_tick = self.admit_seq = 0
        self.is_running = False
        self.resuming = False  # preempted, waiting for its recompute
        self.prefill_target = 0  # tokens its current prefill computes, cached ones included
        self.prefill_left = 0  # of those, not computed yet (chunked prefill)
        self.prefix_chain = PrefixChain()  # its pages in the prefix cache (this residency)
        self.num_preemptions = 0
        self.budget_tokens = 0
        self.first_token_s: float | None = None
        self.finish_s: float | None = None
        self.capacity: list[tuple[float, int]] = []

    @property
    def num_pages(self) -> int:
        return len(self.state.block_table)

    @property
    def decode_tokens(self) -> int:
        """Decode steps it needs: its prefill produces the first of its output tokens."""
        return self.output_tokens - 1

    @property
    def avg_budget(self) -> float | None:
        """Mean capacity in tokens over its decode steps (as the engine's: not over the token
        each recompute after a preemption writes, which ``generated`` counts too); None before
        its first decode step (a request of one output token has none), as ``tpot_ms``."""
        decoded = self.generated - self.num_preemptions
        return self.budget_tokens / decoded if decoded > 0 else None

    @property
    def ttft_s(self) -> float | None:
        """Seconds from arrival to the end of its first prefill (None before it)."""
        return None if self.first_token_s is None else self.first_token_s - self.spec.arrival_s

    @property
    def e2e_s(self) -> float | None:
        """Seconds from arrival to its last output token (None before it finished)."""
        return None if self.finish_s is None else self.finish_s - self.spec.arrival_s

    @property
    def tpot_ms(self) -> float | None:
        """Milliseconds per output token after the first, from the end of its first prefill
        to its finish (stalls and preemptions included; None before it finished, or for a
        request of one output token), as the engine's ``tpot_s``."""
        if self.finish_s is None or self.first_token_s is None or self.output_tokens < 2:
            return None
        return 1e3 * (self.finish_s - self.first_token_s) / (self.output_tokens - 1)

    def __repr__(self) -> str:
        return (
            f"SimRequest({self.request_id!r}, tokens={self.num_tokens}, "
            f"generated={self.generated}/{self.output_tokens}, pages={self.num_pages})"
        )
