"""``benchmarks/sim_vs_engine.py`` on a tiny random model: record a workload with the engine,
fit the cost model on the engine's forward passes, serve the same requests in the simulator
(trace mode) and compare; both worlds count the same requests and tokens, with sane numbers."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
from benchmark_scripts import load_benchmark

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "engine"))
from llm_helpers import prompt, tiny_model  # noqa: E402

from growpage.sim.calibrate import fit_piecewise  # noqa: E402
from growpage.sim.sweep import parse_points  # noqa: E402

NUM_REQUESTS, MAX_TOKENS = 4, 24


def _script():
    return load_benchmark("sim_vs_engine")


@pytest.fixture(scope="module")
def bench():
    return _script()


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def scenario(bench):
    # 4 requests of 11-17 + 24 tokens need 36-40 pages of 4 tokens at once; the pool has 14,
    # so fullkv must preempt, and growpage compresses.
    return bench.Scenario(
        num_requests=NUM_REQUESTS,
        max_tokens=MAX_TOKENS,
        page_size=4,
        kv_pages=14,
        max_num_seqs=8,
        record_kv_pages=256,
        chat=False,
    )


@pytest.fixture(scope="module")
def prompts():
    return [prompt(11 + 2 * i, 40 + i) for i in range(NUM_REQUESTS)]


@pytest.fixture(scope="module")
def recorded(bench, model, scenario, prompts, tmp_path_factory):
    traces, outs = bench.record_traces(
        model, None, scenario, prompts, tmp_path_factory.mktemp("traces") / "set", progress=False
    )
    return bench.workload_from_traces(traces, [len(o.token_ids) for o in outs])


@pytest.fixture(scope="module")
def cost(bench, model, scenario, prompts):
    shapes = bench.calibration_shapes(scenario, sum(len(p) for p in prompts))
    table = bench.measure(model, shapes, repeats=0, progress=False)
    assert table.shape == (len(shapes[0]) * len(shapes[1]) + len(shapes[2]), 4)
    assert (table[:, 3] > 0).all()
    assert sorted(set(table[table[:, 2] == 0, 0])) == list(range(1, NUM_REQUESTS + 1))
    return fit_piecewise(table)


def test_recorded_workload_is_the_submitted_one(recorded, prompts):
    requests, traces = recorded
    assert [r.prompt_tokens for r in requests] == [len(p) for p in prompts]
    assert [r.output_tokens for r in requests] == [MAX_TOKENS] * NUM_REQUESTS
    for r in requests:
        trace = traces[r.request_id]
        assert r.arrival_s == 0.0
        # Every layer, queries and keys of prompt + fed-back tokens (the last one is not a row).
        assert trace.header.layer_ids == (0, 1) and trace.values is None
        assert trace.num_tokens == r.prompt_tokens + MAX_TOKENS - 1


@pytest.mark.parametrize("spec", ["fullkv", "growpage"])
def test_engine_and_simulator_count_the_same_work(
    bench, model, scenario, prompts, recorded, cost, spec
):
    requests, traces = recorded
    (point,) = parse_points([spec])
    stats, config = bench.run_engine(model, None, scenario, point, prompts, progress=False)
    result = bench.run_sim(requests, traces, point, config, scenario, cost)
    row = bench.compare(point.label, bench.engine_row(stats), bench.sim_row(result))
    engine, sim = row["engine"], row["sim"]
    assert engine["num_requests"] == sim["num_requests"] == NUM_REQUESTS
    assert engine["output_tokens"] == sim["output_tokens"] == NUM_REQUESTS * MAX_TOKENS
    for side in (engine, sim):
        for key in ("tps", "avg_resident", "total_s", "avg_kv_budget"):
            assert math.isfinite(side[key]) and side[key] > 0, (key, side)
        assert side["avg_resident"] <= NUM_REQUESTS
        assert side["tps"] == pytest.approx(side["output_tokens"] / side["total_s"], rel=1e-6)
        # No request ever holds more than the pool.
        assert side["avg_kv_budget"] <= scenario.kv_pages * scenario.page_size
        # Latencies, named alike on both sides: a first token before the last, within the run.
        assert 0 < side["ttft_p50_s"] <= side["ttft_p99_s"] <= side["e2e_p99_s"]
        assert side["e2e_p50_s"] <= side["e2e_p99_s"] <= side["total_s"] * (1 + 1e-9)
        assert 0 < side["tpot_p50_ms"] <= side["tpot_p99_ms"]
    if spec == "fullkv":  # never compresses; the pool is too small to keep everyone resident
        assert engine["compresses"] == sim["compresses"] == 0
        assert engine["preemptions"] > 0 and sim["preemptions"] > 0
    else:  # closed loop on the recorded KV: the policy compresses in both
        assert engine["compresses"] > 0 and sim["compresses"] > 0
        assert engine["preemptions"] == sim["preemptions"] == 0
    assert set(row["rel_error"]) == {k for k, _, _ in bench.METRICS}
    assert row["within_target"] == all(
        abs(row["rel_error"][k]) <= bench.TARGET for k in bench.GATED
    )


def test_relative_error_and_report(bench):
    assert bench.relative_error(110.0, 100.0) == pytest.approx(0.10)
    assert bench.relative_error(0.0, 0.0) == 0.0
    engine = {k: 10 for k, _, _ in bench.METRICS}
    sim = {**engine, "tps": 12}
    row = bench.compare("p", engine, sim)
    assert row["rel_error"]["tps"] == pytest.approx(0.2) and not row["within_target"]
    meta = {
        "command": "x",
        "machine": "m",
        "torch": "t",
        "threads": 1,
        "date": "d",
        "wall_s": 1.0,
        "num_requests": 1,
        "prompt_tokens": 1,
        "max_tokens": 1,
        "kv_pages": 1,
        "page_size": 1,
        "max_num_seqs": 1,
        "recorded_layers": "all",
        "calibration_rows": 4,
        "calibration_rms_s": 0.001,
        "cost_model": {
            "batch_sizes": [0, 1, 2],
            "batch_s": [0.05, 0.01, 0.0125],
            "per_kv_token_s": 1e-7,
            "per_prefill_token_s": 1e-4,
        },
        "linear_calibration_rms_s": 0.002,
        "linear_cost_model": {
            "base_s": 0.01,
            "per_seq_s": 0.001,
            "per_kv_token_s": 1e-7,
            "per_prefill_token_s": 1e-4,
        },
    }
    text = bench.markdown([row], meta)
    assert "| p | TPS (tok/s) | 10.0 | 12.0 | +20.0% **!** |" in text
    assert "(0: 50.0, 1: 10.0, 2: 12.5; 0 = prefill)" in text
    assert "linear model" not in text  # no linear rows given
    linear = bench.compare("p", engine, {**engine, "total_s": 9})
    text = bench.markdown([row], meta, [linear])
    assert "rms 2.00 ms: base 10.00 ms + 1.000 ms/seq" in text
    assert "| p | +0.0% | +0.0% | -10.0% |" in text
    assert bench.relative_error(3, 0) is None  # the engine never compressed
    row = bench.compare("p", {**engine, "compresses": 0}, {**engine, "compresses": 3})
    assert "| p | compress | 0 | 3 | n/a (+3) |" in bench.markdown([row], meta)


def test_poisson_arrivals_reach_both_sides(bench, model, scenario, prompts, recorded, cost):
    import attrs

    arriving = attrs.evolve(scenario, arrival_rate=20.0)  # 4 requests over ~0.2 s
    times = arriving.arrivals()
    assert times[0] == 0.0 and times == sorted(times) and times[-1] > 0
    assert scenario.arrivals() is None
    requests, traces = recorded
    timed = [attrs.evolve(r, arrival_s=t) for r, t in zip(requests, times, strict=True)]
    (point,) = parse_points(["growpage"])
    stats, config = bench.run_engine(model, None, arriving, point, prompts, progress=False)
    result = bench.run_sim(timed, traces, point, config, arriving, cost)
    row = bench.compare(point.label, bench.engine_row(stats), bench.sim_row(result))
    engine, sim = row["engine"], row["sim"]
    assert engine["output_tokens"] == sim["output_tokens"] == NUM_REQUESTS * MAX_TOKENS
    for side in (engine, sim):  # the last request arrives times[-1] after the first
        assert side["total_s"] > times[-1]
    assert [r.spec.arrival_s for r in result.requests] == times
    meta = {
        "command": "x",
        "machine": "m",
        "torch": "t",
        "threads": 1,
        "date": "d",
        "wall_s": 1.0,
        "num_requests": 1,
        "prompt_tokens": 1,
        "max_tokens": 1,
        "kv_pages": 1,
        "page_size": 1,
        "max_num_seqs": 1,
        "recorded_layers": "all",
        "calibration_rows": 4,
        "calibration_rms_s": 0.001,
        "arrival_rate": 20.0,
        "cost_model": {
            "batch_sizes": [0, 1],
            "batch_s": [0.05, 0.01],
            "per_kv_token_s": 1e-7,
            "per_prefill_token_s": 1e-4,
        },
    }
    assert "Poisson arrivals at 20 requests/s (seed 0, the first at t = 0)" in bench.markdown(
        [row], meta
    )
