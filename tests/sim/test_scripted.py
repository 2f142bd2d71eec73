"""Script mode: signals recorded in a replay are played back to the live policy."""

from __future__ import annotations

import threading

import attrs
import pytest

from growpage import BoundaryContext, CapacityPolicy, Decision, GrowPageConfig
from growpage.policies import resolve_policy
from growpage.sim.costmodel import LinearCostModel
from growpage.sim.replay import ReplayOptions, replay_trace
from growpage.sim.scripted import RecordingPolicy, SimulationError, signal_key
from growpage.sim.serving import SimConfig, simulate
from growpage.sim.sources import SCRIPT_SPEC, ScriptBook
from growpage.sim.synthetic import synthetic_trace
from growpage.sim.workload_csv import WorkloadRequest

CONFIG = GrowPageConfig(page_size=32, recent_window=4)
COST = LinearCostModel(base_s=1.0, per_prefill_token_s=0.5)


@attrs.define
class PositionalP(CapacityPolicy):
    """Reads delta with a keyword argument and the entropy signal."""

    name = "positional-p"

    def decide(self, ctx: BoundaryContext) -> Decision:
        delta, entropy = ctx.delta(p=0.9), ctx.entropy_delta()
        return Decision.GROW if delta > 0 and entropy > -1 else Decision.COMPRESS


def test_recording_logs_every_signal_the_policy_read():
    trace = synthetic_trace(attrs.evolve(SCRIPT_SPEC, gen_len=300), seed=1, request_id="t")
    recorder = RecordingPolicy(PositionalP())
    replay_trace(trace, recorder, CONFIG, ReplayOptions(fidelity_queries=0))
    logs = recorder.logs["t"]
    assert logs and all(set(log) == {("delta", 0.9), ("entropy_delta",)} for log in logs)
    assert signal_key("delta", None) == ("delta",) and signal_key("delta", 0.9) == ("delta", 0.9)


def test_played_back_decisions_equal_the_replayed_ones():
    """One request alone, an ample pool: script mode decides exactly as its script's replay."""
    request = WorkloadRequest("only", 0.0, 40, 700)
    book = ScriptBook(resolve_policy("growpage"), CONFIG, [request], 1, 7, SCRIPT_SPEC)
    script = book.scripts[0]
    trace = synthetic_trace(
        attrs.evolve(
            SCRIPT_SPEC, prompt_len=script.prompt_len, gen_len=script.gen_len, with_values=False
        ),
        7,
        request_id="script-0",
    )
    replayed = [
        r.decision
        for r in replay_trace(trace, "growpage", CONFIG, ReplayOptions(fidelity_queries=0)).records
        if r.decision
    ]
    result = simulate(
        [request],
        "growpage",
        CONFIG,
        SimConfig(num_kv_pages=100, num_scripts=1, seed=7, record_events=True),
        COST,
    )
    served = [e[1] for e in result.events if e[1] in ("grow", "compress")]
    assert served == replayed[: len(served)] and len(served) >= 20


def test_a_signal_the_script_did_not_record_is_a_simulation_error():
    class Moody(CapacityPolicy):
        name = "moody"

        def decide(self, ctx):  # reads a signal only when the pool is nearly full
            if ctx.num_free_pages < 3 and ctx.delta() > 1:
                return Decision.GROW
            return Decision.GROW if ctx.num_pages < 3 else Decision.COMPRESS

    with pytest.raises(SimulationError, match="did not"):
        simulate(
            [WorkloadRequest("a", 0.0, 40, 400), WorkloadRequest("b", 0.0, 40, 400)],
            Moody(),
            CONFIG,
            SimConfig(num_kv_pages=8, admission_reserve=0.0),
            COST,
        )


def test_a_policy_reading_kv_content_in_script_mode_is_pointed_to_trace_mode():
    class KeyReader(CapacityPolicy):
        name = "key-reader"

        def decide(self, ctx):
            return Decision.GROW if float(ctx.view.keys().norm()) > 1 else Decision.COMPRESS

    requests = [WorkloadRequest("a", 0.0, 40, 200)]
    with pytest.raises(SimulationError, match=r"needs trace mode .*--decisions trace"):
        simulate(requests, KeyReader(), CONFIG, SimConfig(num_kv_pages=40), COST)
    done = simulate(
        requests, KeyReader(), CONFIG, SimConfig(num_kv_pages=40, decisions="trace"), COST
    )
    assert done.metrics.num_requests == 1 and done.metrics.output_tokens == 200


def test_a_policy_reading_accumulated_attention_in_decide_runs_in_script_mode():
    """The script's replay tracks the sums for such a policy, so their played-back value is
    there (it was None: the recording wrapper hid the policy's flag)."""

    class SumsDecide(CapacityPolicy):
        name = "sums-decide"
        needs_accumulated_attention = True

        def decide(self, ctx):
            acc = ctx.accumulated_attention()
            return Decision.GROW if float(acc[..., -1].mean()) > 1.0 else Decision.COMPRESS

    recorder = RecordingPolicy(SumsDecide())
    assert recorder.needs_accumulated_attention
    done = simulate(
        [WorkloadRequest("a", 0.0, 40, 300), WorkloadRequest("b", 0.0, 40, 300)],
        SumsDecide(),
        CONFIG,
        SimConfig(num_kv_pages=60),
        COST,
    )
    assert done.metrics.output_tokens == 600
    assert done.metrics.grows + done.metrics.compresses > 5


@attrs.define
class CappedGrowPage(CapacityPolicy):
    """docs/policy-guide.md's example: GrowPage's trend signal, never beyond max_pages."""

    name = "capped-growpage"
    max_pages: int = 3

    def decide(self, ctx: BoundaryContext) -> Decision:
        if ctx.num_pages >= self.max_pages:
            return Decision.COMPRESS
        return Decision.GROW if ctx.delta() > 0 else Decision.COMPRESS


def test_a_policy_that_stops_reading_a_signal_at_its_cap_serves_in_script_mode():
    """Its script run reaches the cap and stops reading delta(); in serving, fallbacks keep the
    request below the cap, where it reads delta() again at that boundary: the script logs
    every signal read before at each boundary, so this is no SimulationError."""
    requests = [WorkloadRequest(f"r{i}", 0.0, 40, 600) for i in range(6)]
    result = simulate(
        requests, CappedGrowPage(), CONFIG, SimConfig(num_kv_pages=14, admission_reserve=0.0), COST
    )
    m = result.metrics
    assert m.fallbacks > 0 and m.output_tokens == 6 * 600


def test_a_boundary_decided_again_after_a_preemption_reads_the_same_script_boundary():
    """When a boundary's action must preempt another request first, the controller asks the
    policy again at the same position: that is the same script boundary, not the next one
    (the engine's policy sees the same request again)."""
    from types import SimpleNamespace

    from growpage.sim.scripted import ScriptedPolicy

    read = []

    class ReadsDelta(CapacityPolicy):
        name = "reads-delta"

        def decide(self, ctx):
            ctx.delta()
            return Decision.GROW

    policy = ScriptedPolicy(
        ReadsDelta(), CONFIG, lambda rid, ordinal, key: read.append((rid, ordinal)) or 0.0
    )
    for rid, position in (("a", 64), ("a", 64), ("b", 64), ("a", 96), ("a", 96), ("a", 128)):
        policy.decide(
            SimpleNamespace(
                request_id=rid,
                position=position,
                num_pages=2,
                num_free_pages=3,
                view=None,
                num_prompt_tokens=0,
            )
        )
    assert read == [("a", 0), ("a", 0), ("b", 0), ("a", 1), ("a", 1), ("a", 2)]


class NotReentrant(CapacityPolicy):
    """Notes the context it is deciding on, reads delta(), then checks the note: a policy
    called again from inside its own decide() finds another request's context there."""

    name = "not-reentrant"

    def __init__(self) -> None:
        self.deciding: object = None
        self.calls = 0

    def decide(self, ctx: BoundaryContext) -> Decision:
        assert self.deciding is None, "decide() was called from inside decide()"
        self.deciding, self.calls = ctx.request_id, self.calls + 1
        try:
            return Decision.GROW if ctx.delta() > 0 else Decision.COMPRESS
        finally:
            self.deciding = None


class HoldsALock(CapacityPolicy):
    """Guards its decisions with a lock (not re-entrant): ``copy.deepcopy`` cannot copy it."""

    name = "holds-a-lock"

    def __init__(self) -> None:
        self.lock = threading.Lock()

    def decide(self, ctx: BoundaryContext) -> Decision:
        with self.lock:
            return Decision.GROW if ctx.delta() > 0 else Decision.COMPRESS


REQUESTS = [WorkloadRequest(f"r{i}", 0.1 * i, 40, 400 + 200 * i) for i in range(4)]


def test_scripts_replay_on_a_copy_so_the_served_policy_is_never_re_entered():
    """Until 2026-12 a script was replayed on the served policy object, from inside its own
    decide() (the first signal it read): NotReentrant's assert fired, and the replay's calls
    were counted as the served policy's own."""
    policy = NotReentrant()
    m = simulate(REQUESTS, policy, CONFIG, SimConfig(num_kv_pages=40, num_scripts=2), COST).metrics
    assert m.output_tokens == sum(r.output_tokens for r in REQUESTS)
    assert m.fallbacks > 0 and m.forced_grows == 0  # a fallback: a GROW refused, compressed
    assert policy.calls == m.grows + m.compresses > 10  # the served boundaries only


def test_a_policy_that_cannot_be_copied_has_its_scripts_replayed_up_front():
    """Replayed on the served object, but before serving starts, not from inside decide()
    (where its lock, held, deadlocked the run until 2026-12)."""
    book = ScriptBook(HoldsALock(), CONFIG, REQUESTS, 2, 0, SCRIPT_SPEC)
    assert book.replayer is None and book.num_built == 2
    result = simulate(
        REQUESTS, HoldsALock(), CONFIG, SimConfig(num_kv_pages=40, num_scripts=2), COST
    )
    assert result.metrics.output_tokens == sum(r.output_tokens for r in REQUESTS)
    assert result.metrics.grows + result.metrics.compresses > 10
    lazy = ScriptBook(resolve_policy("growpage"), CONFIG, REQUESTS, 2, 0, SCRIPT_SPEC)
    assert lazy.replayer is not None and lazy.num_built == 0  # a copyable one: on first use
