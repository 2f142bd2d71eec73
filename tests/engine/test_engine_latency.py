"""Engine latency statistics: per-request TTFT, TPOT and end-to-end time, and their means and
percentiles in ``EngineStats``, named as the simulator's metrics are; the pool timeline."""

from __future__ import annotations

import numpy as np
import pytest
from llm_helpers import prompt, tiny_llm, tiny_models

from growpage.engine.sampling_params import SamplingParams
from growpage.latency import PERCENTILES
from growpage.sim.metrics import ServingMetrics


@pytest.fixture(scope="module")
def model():
    return tiny_models()[0]


def test_percentiles_are_those_of_the_requests(model):
    llm = tiny_llm(model, policy="growpage", max_num_seqs=3)  # later requests wait
    prompts = [prompt(5 + 3 * i, i) for i in range(7)]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (1, 4, 9, 16, 2, 12, 7)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    stats = llm.last_stats
    ttft = [o.ttft_s for o in outs]
    e2e = [o.e2e_s for o in outs]
    tpot = [o.tpot_s for o in outs if len(o.token_ids) > 1]  # one token: no TPOT
    assert len(tpot) == 6
    for o in outs:
        assert 0 < o.ttft_s <= o.e2e_s
        n = len(o.token_ids)
        if n > 1:
            assert o.e2e_s == pytest.approx(o.ttft_s + (n - 1) * o.tpot_s)
        else:
            assert o.e2e_s == o.ttft_s  # its only token ends it
    assert stats.e2e_s == pytest.approx(np.mean(e2e))
    assert stats.ttft_s == pytest.approx(np.mean(ttft))
    for name, values in (("ttft", ttft), ("tpot", tpot), ("e2e", e2e)):
        got = [getattr(stats, f"{name}_p{q}_s") for q in PERCENTILES]
        assert got == pytest.approx(np.percentile(values, PERCENTILES).tolist())
        assert got == sorted(got)
    timeline = stats.pool_timeline
    assert len(timeline) == stats.num_steps
    times = [t for t, _, _ in timeline]
    assert times == sorted(times) and 0 < times[-1] <= stats.total_s
    assert max(pages for _, pages, _ in timeline) == stats.max_pages_used
    assert max(n for _, _, n in timeline) == 3 and timeline[-1][2] == 0  # 3 seats; all done
    assert "pool_timeline" not in repr(stats)
    # Waiting for a seat shows in the tail: the last admitted wait for the first to finish.
    assert stats.ttft_p99_s > stats.ttft_p50_s
    table = stats.table()
    p = "/".join(f"p{q}" for q in PERCENTILES)
    for label in (f"TTFT {p}", f"TPOT {p}", "end to end (mean)", f"end to end {p}"):
        assert label in table
    assert f"{1000 * stats.ttft_p99_s:.1f} ms" in table and f"{stats.e2e_p99_s:.2f} s" in table


def test_names_match_the_simulators():
    import attrs

    from growpage.engine.outputs import EngineStats

    engine = {f.name for f in attrs.fields(EngineStats)}
    sim = {f.name.replace("_ms", "_s") for f in attrs.fields(ServingMetrics)}
    latency = {f"{n}_p{q}_s" for n in ("ttft", "tpot", "e2e") for q in PERCENTILES}
    assert latency | {"e2e_s", "ttft_s", "tpot_s"} <= engine & sim


def test_a_summary_without_finished_requests_has_zero_latencies():
    from growpage.core.events import EventCounters
    from growpage.engine.loop.stats import StatsCollector

    stats = StatsCollector(EventCounters()).summary("growpage", page_size=16, num_pages=8)
    assert stats.num_requests == 0
    assert stats.e2e_s == stats.ttft_p50_s == stats.tpot_p90_s == stats.e2e_p99_s == 0.0
    assert "0.0 / 0.0 / 0.0 ms" in stats.table()
