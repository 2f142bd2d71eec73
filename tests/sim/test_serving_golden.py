"""Serving simulator: exact event traces of tiny scenarios (golden lists, derived by hand).

A request of ``N`` output tokens decodes ``N - 1`` steps: its prefill produces the first token.

Every scenario uses page size 4, min_capacity 2, and a linear cost model with round numbers:
a decode step takes 1 s, a prefill step 1 s + 0.5 s per prompt token. Log entries are
``(time_s, event, request_id, pages held)``; ``finish`` / ``preempt`` show the pages released.
"""

from __future__ import annotations

import attrs
import pytest

from growpage import CapacityPolicy, Decision, GrowPageConfig
from growpage.errors import ConfigError
from growpage.policies import FixedBudgetPolicy
from growpage.sim.costmodel import LinearCostModel
from growpage.sim.serving import SimConfig, simulate
from growpage.sim.workload_csv import WorkloadRequest

CONFIG = GrowPageConfig(page_size=4, recent_window=1, min_capacity=2)
COST = LinearCostModel(base_s=1.0, per_prefill_token_s=0.5)


def req(rid: str, prompt: int, output: int, arrival: float = 0.0) -> WorkloadRequest:
    return WorkloadRequest(rid, arrival, prompt, output)


def run(requests, policy, pages, **sim):
    cfg = SimConfig(num_kv_pages=pages, admission_reserve=0.0, record_events=True, **sim)
    return simulate(requests, policy, CONFIG, cfg, COST)


@attrs.define
class GrowThenShrink(CapacityPolicy):
    """Grow below 3 pages, shrink at 3 (reads no attention signal)."""

    name = "grow-then-shrink"

    def decide(self, ctx):
        return Decision.GROW if ctx.num_pages < 3 else Decision.SHRINK


# Always asks for a page and falls back to compression when refused (fullkv would preempt).
ALWAYS_GROW = FixedBudgetPolicy(budget_tokens=10**6)


def test_grow_is_refused_when_the_pool_is_empty_and_falls_back_to_compress():
    # Scenario: two requests share 5 pages under an always-grow policy. Both prompts fill one page: forced
    # growth at t=5; at t=9 r0 takes the last page, r1's GROW is refused (fallback); at t=13
    # both fall back; at t=14 both finish.
    result = run([req("r0", 4, 10), req("r1", 4, 10)], ALWAYS_GROW, pages=5)
    assert result.events == [
        (0, "arrive", "r0", 0),
        (0, "arrive", "r1", 0),
        (0, "admit", "r0", 1),
        (0, "admit", "r1", 1),
        (5.0, "grow", "r0", 2),
        (5.0, "grow", "r1", 2),
        (9.0, "grow", "r0", 3),
        (9.0, "fallback", "r1", 2),
        (9.0, "compress", "r1", 2),
        (13.0, "fallback", "r0", 3),
        (13.0, "compress", "r0", 3),
        (13.0, "fallback", "r1", 2),
        (13.0, "compress", "r1", 2),
        (14.0, "finish", "r0", 3),
        (14.0, "finish", "r1", 2),
    ]
    m = result.metrics
    assert (m.grows, m.forced_grows, m.compresses, m.fallbacks, m.num_preemptions) == (
        3,
        2,
        3,
        3,
        0,
    )
    assert m.total_s == 14.0 and m.tps == 20 / 14.0


def test_forced_growth_without_a_page_preempts_the_most_recent_request():
    # Scenario: 3 pages. At t=5 r0 grows to 2 pages; r1 cannot reach min_capacity and is
    # preempted (it is the most recently admitted) while r0 decodes on. Its recompute computes its 4 prompt tokens and its first output token, 5
    # tokens in 2 pages, which it cannot get while r0 holds 2 and then 3 (r0 grows at t=9). It
    # is re-admitted when r0 finishes at t=11: a prefill of 5 tokens (3.5 s) that also samples
    # its second output token, so 5 decode steps are left: 3 to fill its 2 pages, a growth at
    # t=17.5, 2 more.
    result = run([req("r0", 4, 7), req("r1", 4, 7)], ALWAYS_GROW, pages=3)
    assert result.events == [
        (0, "arrive", "r0", 0),
        (0, "arrive", "r1", 0),
        (0, "admit", "r0", 1),
        (0, "admit", "r1", 1),
        (5.0, "grow", "r0", 2),
        (5.0, "preempt", "r1", 1),
        (9.0, "grow", "r0", 3),
        (11.0, "finish", "r0", 3),
        (11.0, "resume", "r1", 2),
        (17.5, "grow", "r1", 3),
        (19.5, "finish", "r1", 3),
    ]
    assert result.metrics.num_preemptions == 1
    assert (result.metrics.prefill_steps, result.metrics.decode_steps) == (2, 6 + 5)
    r1 = result.requests[1]
    assert (
        r1.num_preemptions == 1
        and r1.generated == 6
        and r1.capacity == [(0, 1), (5.0, 0), (11.0, 2), (17.5, 3), (19.5, 0)]
    )
    # Its budget over its 5 decode steps (the engine's definition): 3 at 2 pages, 2 at 3.
    assert r1.avg_budget == (3 * 8 + 2 * 12) / 5


def test_fullkv_preempts_instead_of_compressing():
    # Same scenario as the fallback one, under fullkv: at t=9 r1's GROW is refused, and since
    # fullkv never compresses, r1 (the most recently admitted) is preempted and recomputed.
    result = run([req("r0", 4, 10), req("r1", 4, 10)], "fullkv", pages=5)
    kinds = [e[1] for e in result.events]
    assert "compress" not in kinds and "fallback" not in kinds
    assert result.events[7] == (9.0, "preempt", "r1", 2)
    assert [e[2] for e in result.events if e[1] == "finish"] == ["r0", "r1"]
    assert result.metrics.num_preemptions >= 1 and result.metrics.compresses == 0


def test_shrink_releases_a_page_and_the_request_grows_again():
    result = run([req("r0", 4, 17)], GrowThenShrink(), pages=10)
    assert result.events == [
        (0, "arrive", "r0", 0),
        (0, "admit", "r0", 1),
        (3.0, "grow", "r0", 2),
        (7.0, "grow", "r0", 3),
        (11.0, "shrink", "r0", 2),
        (15.0, "grow", "r0", 3),
        (19.0, "finish", "r0", 3),
    ]
    assert result.requests[0].capacity == [
        (0, 1),
        (3.0, 2),
        (7.0, 3),
        (11.0, 2),
        (15.0, 3),
        (19.0, 0),
    ]
    # Decoded tokens: 4 at 2 pages, 4 at 3, 4 at 2, 4 at 3 -> average 2.5 pages of 4 tokens.
    assert result.metrics.avg_kv_budget == 10.0


def test_a_later_arrival_cuts_the_decode_segment_and_is_admitted_next():
    # r1 arrives at 4.5 s while r0 decodes: the segment stops after the step that ends at 5 s.
    result = run([req("r0", 4, 9), req("r1", 4, 5, arrival=4.5)], "fullkv", pages=10)
    assert result.events == [
        (0, "arrive", "r0", 0),
        (0, "admit", "r0", 1),
        (3.0, "grow", "r0", 2),
        (4.5, "arrive", "r1", 0),
        (5.0, "admit", "r1", 1),
        (8.0, "grow", "r1", 2),
        (10.0, "grow", "r0", 3),
        (12.0, "finish", "r1", 2),
        (14.0, "finish", "r0", 3),
    ]
    m = result.metrics
    assert m.total_s == 14.0 and m.prefill_steps == 2 and m.decode_steps == 8
    # TTFT: r0 3 s (prefill end), r1 8 - 4.5 = 3.5 s.
    assert m.ttft_s == (3.0 + 3.5) / 2


def test_max_num_seqs_and_admission_reserve_hold_requests_back():
    # One seat: r1 waits for r0 to finish. With a reserve of 3 of 4 pages r1 (1 page) cannot
    # be admitted while r0 runs either (a request alone is admitted without the reserve).
    seats = run([req("r0", 4, 3), req("r1", 4, 3)], "fullkv", pages=4, max_num_seqs=1)
    assert [e[:3] for e in seats.events if e[1] in ("admit", "finish")] == [
        (0, "admit", "r0"),
        (5.0, "finish", "r0"),
        (5.0, "admit", "r1"),
        (10.0, "finish", "r1"),
    ]
    cfg = SimConfig(num_kv_pages=4, admission_reserve=0.75, record_events=True)
    reserve = simulate([req("r0", 4, 3), req("r1", 4, 3)], "fullkv", CONFIG, cfg, COST)
    assert [e[:3] for e in reserve.events if e[1] in ("admit", "finish")] == [
        (0, "admit", "r0"),
        (5.0, "finish", "r0"),
        (5.0, "admit", "r1"),
        (10.0, "finish", "r1"),
    ]


def test_a_request_of_one_output_token_finishes_at_its_prefill():
    # r0 and r1 prefill together (8 tokens: 1 + 0.5 * 8 = 5 s), which gives each its first
    # token: r0 (1 output token) finishes then, with no decode step and no TPOT; r1 (3 output
    # tokens, its prompt filling its page) grows for its first decode step and finishes 2 steps
    # later, at 7 s.
    result = run([req("r0", 4, 1), req("r1", 4, 3)], "fullkv", pages=4)
    assert result.events == [
        (0, "arrive", "r0", 0),
        (0, "arrive", "r1", 0),
        (0, "admit", "r0", 1),
        (0, "admit", "r1", 1),
        (5.0, "finish", "r0", 1),
        (5.0, "grow", "r1", 2),
        (7.0, "finish", "r1", 2),
    ]
    r0, r1 = result.requests
    assert (r0.ttft_s, r0.e2e_s, r0.tpot_ms, r0.generated) == (5.0, 5.0, None, 0)
    assert (r1.ttft_s, r1.e2e_s, r1.tpot_ms, r1.generated) == (5.0, 7.0, 1000.0, 2)
    m = result.metrics
    assert (m.prefill_steps, m.decode_steps, m.output_tokens) == (1, 2, 4)
    assert result.pool.num_free_pages == 4


def test_progress_counts_a_request_finished_by_its_prefill():
    # r0 (1 output token) finishes with the prefill at 5 s, r1 at 7 s: two reports, in order.
    seen: list[int] = []
    cfg = SimConfig(num_kv_pages=4, admission_reserve=0.0)
    simulate(
        [req("r0", 4, 1), req("r1", 4, 3)], "fullkv", CONFIG, cfg, COST, on_progress=seen.append
    )
    assert seen == [1, 2]


@pytest.mark.parametrize("decisions", ["script", "trace"])
def test_the_first_decode_step_of_a_full_prompt_grows_without_asking_the_policy(decisions):
    # r0's 8-token prompt fills its 2 pages, fixed-8's budget: its first decode step needs a
    # third page before any query summary exists, so the controller grows (as the engine
    # does) where the policy would have compressed; the next boundary, 4 steps later, is the
    # policy's: a compression at 3 pages.
    result = run(
        [req("r0", 8, 6)], FixedBudgetPolicy(budget_tokens=8), pages=10, decisions=decisions
    )
    assert [e[1:] for e in result.events] == [
        ("arrive", "r0", 0),
        ("admit", "r0", 2),
        ("grow", "r0", 3),
        ("compress", "r0", 3),
        ("finish", "r0", 3),
    ]
    m = result.metrics
    assert (m.grows, m.forced_grows, m.compresses) == (1, 1, 1)


def test_a_prompt_filling_the_pool_cannot_decode_even_under_a_compressing_policy():
    # 12 prompt tokens fill the 3 pages; the first decode step needs a fourth before any query
    # summary exists. Refused up front, as the engine does (prompt + 1 tokens must fit, even
    # for one output token).
    for output in (2, 1):
        with pytest.raises(
            ConfigError,
            match=rf"^request 'r0' \(12 prompt \+ {output} output "
            r"tokens\) cannot finish even alone: its prompt "
            r"and first decode step need 4 pages of 4 tokens; "
            r"the pool has 3$",
        ):
            run([req("r0", 12, output)], FixedBudgetPolicy(budget_tokens=8), pages=3)
    assert (
        run([req("r0", 12, 1)], FixedBudgetPolicy(budget_tokens=8), pages=4).requests[0].finish_s
        == 1 + 0.5 * 12
    )  # one output token: its prefill alone
