"""Built-in policies (paper section 3 and appendix H.1) and two classic selections."""

from __future__ import annotations

import random

import attrs
import torch

from growpage.core.boundary_context import BoundaryContext
from growpage.core.decision import Decision
from growpage.core.observation import snapkv_scores
from growpage.core.selection import top_slots, topk_slots, with_protected
from growpage.policies.base import CapacityPolicy
from growpage.policies.registry import register_policy
from growpage.validators import Check, in_range, integer, optional, positive_int

_ODD = Check(
    "a positive odd integer (a max pool centred on each slot)",
    lambda v: positive_int.accepts(v) and v % 2 == 1,
)
_TAU = optional(in_range(-1, 1))


# NOTE: the built-in policies are dict-based attrs classes (slots=False). An author's subclass
# may set its own attributes in __init__; a slotted base's generated __getstate__ would drop
# them from every copy and pickle (the conformance kit's fresh copies, a sweep's workers).


def _grow_if(condition: bool) -> Decision:
    return Decision.GROW if condition else Decision.COMPRESS


@register_policy
@attrs.define(slots=False)
class GrowPagePolicy(CapacityPolicy):
    """GrowPage (section 3.2): grow when Delta_t > tau, else Compress & Hold.

    ``tau`` and ``p`` default (None) to the controller's ``GrowPageConfig``.
    """

    name = "growpage"
    tau: float | None = attrs.field(default=None, validator=_TAU)
    p: float | None = attrs.field(default=None, validator=optional(in_range(1e-9, 1)))

    def decide(self, ctx: BoundaryContext) -> Decision:
        tau = ctx.config.tau if self.tau is None else self.tau
        return _grow_if(ctx.delta(self.p) > tau)


@register_policy
@attrs.define(slots=False)
class InversePolicy(GrowPagePolicy):
    """GrowPage-Inverse (appendix H.1): grow when Delta_t <= tau, compress otherwise."""

    name = "inverse"

    def decide(self, ctx: BoundaryContext) -> Decision:
        tau = ctx.config.tau if self.tau is None else self.tau
        return _grow_if(ctx.delta(self.p) <= tau)


@register_policy
@attrs.define(slots=False)
class EntropyPolicy(CapacityPolicy):
    """Delta_t from attention entropy instead of the top-p working set (Table 2 ablation)."""

    name = "entropy"
    tau: float | None = attrs.field(default=None, validator=_TAU)

    def decide(self, ctx: BoundaryContext) -> Decision:
        tau = ctx.config.tau if self.tau is None else self.tau
        return _grow_if(ctx.entropy_delta() > tau)


@register_policy
@attrs.define(slots=False)
class ShrinkPolicy(CapacityPolicy):
    """GrowPage-Shrink (Eq. 13): shrink below ``shrink_below``, compress up to ``tau``, else grow.

    Never shrinks under ``min_capacity_tokens`` of capacity after the shrink.
    """

    name = "shrink"
    shrink_below: float = attrs.field(default=-0.005, validator=in_range(-1, 1))
    tau: float | None = attrs.field(default=None, validator=_TAU)
    min_capacity_tokens: int = attrs.field(default=1024, validator=positive_int)

    def decide(self, ctx: BoundaryContext) -> Decision:
        tau = ctx.config.tau if self.tau is None else self.tau
        delta = ctx.delta()
        if delta > tau:
            return Decision.GROW
        if (
            delta < self.shrink_below
            and (ctx.num_pages - 1) * ctx.page_size >= self.min_capacity_tokens
        ):
            return Decision.SHRINK
        return Decision.COMPRESS


@register_policy
@attrs.define(slots=False)
class FixedBudgetPolicy(CapacityPolicy):
    """Zipage-style fixed budget: grow up to ``budget_tokens`` of capacity, then always compress."""

    name = "fixed"
    budget_tokens: int = attrs.field(default=4096, validator=positive_int)

    def decide(self, ctx: BoundaryContext) -> Decision:
        return _grow_if(ctx.capacity + ctx.page_size <= self.budget_tokens)


@register_policy
@attrs.define(slots=False)
class FullKVPolicy(CapacityPolicy):
    """Full KV: always grow; when no page is free the request is preempted, never compressed
    (plain PagedAttention, as vLLM)."""

    name = "fullkv"
    fallback_to_compress = False

    def decide(self, ctx: BoundaryContext) -> Decision:
        return Decision.GROW


@register_policy
@attrs.define(slots=False)
class RandomPolicy(CapacityPolicy):
    """GrowPage-Random (appendix H.1): grow with probability ``grow_prob``.

    The draw depends only on (seed, request id, position), so it is reproducible and the same
    in the simulator and the engine whatever the order requests reach their boundaries.
    """

    name = "random"
    grow_prob: float = attrs.field(default=0.3, validator=in_range(0, 1))
    seed: int = attrs.field(default=0, validator=integer)

    def decide(self, ctx: BoundaryContext) -> Decision:
        rng = random.Random(f"{self.seed}:{ctx.request_id}:{ctx.position}")
        return _grow_if(rng.random() < self.grow_prob)


@register_policy
@attrs.define(slots=False)
class StreamingLLMPolicy(FixedBudgetPolicy):
    """Fixed budget with StreamingLLM selection: keep ``num_sinks`` first slots plus the most
    recent ones (attention sinks + sliding window)."""

    name = "streamingllm"
    num_sinks: int = attrs.field(default=4, validator=positive_int)

    def select(self, ctx: BoundaryContext, keep: int) -> torch.Tensor:
        # A protected prompt is the sinks (and more): the first slots are kept either way.
        sinks = max(min(self.num_sinks, keep - ctx.recent_window), ctx.num_protected_prefix)
        slots = torch.cat(
            [torch.arange(sinks), torch.arange(ctx.num_tokens - keep + sinks, ctx.num_tokens)]
        )
        return slots.to(ctx.device).expand(*ctx.shape, keep).clone()


@register_policy
@attrs.define(slots=False)
class H2OPolicy(FixedBudgetPolicy):
    """Fixed budget with H2O selection: heavy hitters by accumulated attention + recent window.

    ``needs_accumulated_attention`` makes both worlds record the sums: the simulator's trace
    views replay every query, the engine adds each step's attention per cache slot (and runs
    without prefix caching). A view that records none (a custom one) falls back on the
    summaries' importance (``ctx.scores()``).
    """

    name = "h2o"
    needs_accumulated_attention = True

    def select(self, ctx: BoundaryContext, keep: int) -> torch.Tensor:
        acc = ctx.accumulated_attention()
        if acc is not None:
            scores = acc[..., : ctx.num_selection_candidates]
        else:
            scores = ctx.scores()
        prefix = ctx.num_protected_prefix
        chosen = topk_slots(scores[..., prefix:], keep - ctx.recent_window - prefix) + prefix
        return with_protected(chosen, ctx.num_tokens, ctx.recent_window, prefix=prefix)


@register_policy
@attrs.define(slots=False)
class SnapKVPolicy(FixedBudgetPolicy):
    """Fixed budget with SnapKV selection at decoding time: per layer and KV head, the slots
    the last ``window`` queries attend to most (summed over the window and the query group,
    max-pooled over ``kernel_size`` neighbouring slots) + recent window.

    ``needs_recent_queries`` (= ``window``) makes both worlds keep the queries: the engine a
    ring of each running request's last ``window`` queries, the simulator its trace's rows.
    A view that keeps none (a custom one) falls back on the summaries' importance
    (``ctx.scores()``), pooled alike.
    """

    name = "snapkv"
    window: int = attrs.field(default=16, validator=positive_int)
    kernel_size: int = attrs.field(default=7, validator=_ODD)

    @property
    def needs_recent_queries(self) -> int:
        return self.window

    def select(self, ctx: BoundaryContext, keep: int) -> torch.Tensor:
        attn = ctx.window_attention(self.window)
        if attn is None:
            attn = ctx.scores()
        scores = snapkv_scores(attn, ctx.num_selection_candidates, self.kernel_size)
        prefix = ctx.num_protected_prefix
        # ties to earlier slots, ascending
        chosen = top_slots(scores[..., prefix:], keep - ctx.recent_window - prefix) + prefix
        return with_protected(
            chosen, ctx.num_tokens, ctx.recent_window, chosen_sorted=True, prefix=prefix
        )
