"""``benchmarks/paper_scale.py``: the synthetic-demand calibration search (on exact functions
and on a small serving configuration) and the report's ratios."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from benchmark_scripts import load_benchmark

from growpage.core.config import GrowPageConfig
from growpage.sim.costmodel import load_cost_model
from growpage.sim.serving import SimConfig
from growpage.sim.workloads import LengthDist, RequestClass, WorkloadSpec

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("paper_scale")


def test_search_finds_a_decreasing_functions_target(bench):
    calls = []

    def budget_at(x):
        calls.append(x)
        return 8000.0 / math.sqrt(x)

    found = bench.search(budget_at, 250.0, 16.0, 65536.0, 256.0, tolerance=0.025, max_evals=8)
    assert found.within and abs(found.budget - 250.0) <= 0.025 * 250.0
    assert found.value == pytest.approx(1024.0, rel=0.06)
    assert [h[0] for h in found.history] == calls and len(calls) <= 8
    assert all(16.0 <= x <= 65536.0 for x in calls)


def test_search_handles_increasing_functions_and_stops_at_the_start(bench):
    found = bench.search(
        lambda x: 10.0 * x, 500.0, 1.0, 1000.0, 20.0, decreasing=False, max_evals=10
    )
    assert found.within and found.value == pytest.approx(50.0, rel=0.025)
    at_start = bench.search(lambda x: 100.0, 101.0, 1.0, 10.0, 5.0, tolerance=0.05)
    assert at_start.within and len(at_start.history) == 1


def test_search_reports_an_unreachable_target(bench):
    found = bench.search(lambda x: 1000.0 / x, 5000.0, 1.0, 100.0, 10.0, max_evals=6)
    assert not found.within
    assert found.value == 1.0 and found.budget == 1000.0  # the closest end of the range
    assert len(found.history) == 2  # start, then the end: no bracket


def test_calibration_search_on_a_small_serving_configuration(bench):
    # 32 requests of ~1k tokens, 16 scripts, a pool with room for all: GrowPage's budget falls
    # from ~340 tokens (regimes of 128 tokens) to ~230 (regimes of 512); 280 lies between.
    workload = WorkloadSpec(
        name="small-search",
        classes=[
            RequestClass("r", 32, LengthDist(64, 0.0, 16, 256), LengthDist(1024, 0.3, 256, 2048))
        ],
    )
    setup = bench.Setup(
        requests=workload.requests(0),
        config=GrowPageConfig(page_size=64),
        sim=SimConfig(num_kv_pages=2000, max_num_seqs=32, num_scripts=16),
        cost=load_cost_model("a100-qwen3-8b"),
    )
    found, chosen, row = bench.calibrate_demand(
        setup, "mean_regime_len", 128.0, 2048.0, 280.0, tolerance=0.10, max_evals=6, progress=False
    )
    assert found.within, found
    assert abs(row["token_budget"] - 280.0) <= 0.10 * 280.0
    assert chosen["mean_regime_len"] == pytest.approx(found.value)
    assert row["token_budget"] == found.budget
    assert row["num_requests"] == 32 and 0 < row["avg_resident"] <= 32
    assert all(128.0 <= x <= 2048.0 for x, _ in found.history)


def test_ratios_against_the_paper(bench):
    rows = {
        "growpage": {"avg_resident": 120.0, "tps": 2400.0},
        "fixed-4096": {"avg_resident": 100.0, "tps": 2000.0},
        "fixed-8192": {"avg_resident": 60.0, "tps": 1200.0},
    }
    r = bench.ratios(rows)
    assert r["fixed-4096"]["avg_resident"]["sim"] == pytest.approx(1.2)
    assert r["fixed-4096"]["tps"]["paper"] == pytest.approx(2213 / 1690)
    assert r["fixed-8192"]["tps"]["sim"] == pytest.approx(2.0)
    assert r["fixed-8192"]["tps"]["paper"] == pytest.approx(1.9)
    assert r["fixed-8192"]["avg_resident"]["paper"] == pytest.approx(1.8)
