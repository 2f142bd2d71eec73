"""The KV pool over time (``ServingResult.pool_timeline``, ``pool.png`` of ``sim serve``): pages
in use and resident requests at every change, consistent with the run's metrics."""

from __future__ import annotations

from types import SimpleNamespace

import attrs
import pytest

from growpage import GrowPageConfig, plots
from growpage.cli import main
from growpage.sim.costmodel import LinearCostModel, load_cost_model
from growpage.sim.serving import ServingResult, SimConfig, simulate
from growpage.sim.workload_csv import WorkloadRequest
from growpage.sim.workloads import WORKLOADS

# Pages of 4 tokens; a prefill step of 4 tokens takes 3 s, a decode step 1 s.
GOLDEN_CONFIG = GrowPageConfig(page_size=4, recent_window=1, min_capacity=2)
GOLDEN_COST = LinearCostModel(base_s=1.0, per_prefill_token_s=0.5)


def test_timeline_of_a_hand_derived_scenario():
    # Pages of 4 tokens, a prefill step of 4 tokens takes 3 s, a decode step 1 s (the golden
    # scenario of test_serving_review). r0 (prompt 4, 9 output tokens: 8 decode steps) is
    # admitted at 0 with one page, takes its 2nd page at 3 s (its first decode step) and its 3rd
    # at 10 s, and finishes at 14 s; r1 (prompt 4, 5 output tokens, arrives 4.5 s) is admitted at
    # 5 s, takes its 2nd page at 8 s and finishes at 12 s.
    requests = [WorkloadRequest("r0", 0.0, 4, 9), WorkloadRequest("r1", 4.5, 4, 5)]
    result = simulate(
        requests,
        "fullkv",
        GOLDEN_CONFIG,
        SimConfig(num_kv_pages=10, admission_reserve=0.0),
        GOLDEN_COST,
    )
    assert result.pool_timeline() == [
        (0.0, 1, 1),
        (3.0, 2, 1),
        (5.0, 3, 2),
        (8.0, 4, 2),
        (10.0, 5, 2),
        (12.0, 3, 1),
        (14.0, 0, 0),
    ]


def test_a_requests_changes_at_one_time_apply_in_its_own_order():
    a = SimpleNamespace(capacity=[(0.0, 1), (2.0, 3), (2.0, 2), (5.0, 0)])
    b = SimpleNamespace(capacity=[(1.0, 1), (2.0, 2), (2.0, 3), (4.0, 0)])
    result = ServingResult(metrics=None, requests=[a, b], events=None, pool=None)
    assert result.pool_timeline() == [
        (0.0, 1, 1),
        (1.0, 2, 2),
        (2.0, 5, 2),
        (4.0, 2, 1),
        (5.0, 0, 0),
    ]


def _integral(timeline, column):
    return sum(
        (nxt[0] - row[0]) * row[column]
        for row, nxt in zip(timeline[:-1], timeline[1:], strict=True)
    )


@pytest.mark.parametrize("policy", ["growpage", "fullkv", "fixed", "shrink"])
def test_timeline_agrees_with_the_metrics_on_a_loaded_pool(policy):
    spec = attrs.evolve(WORKLOADS["small"], arrival="poisson", rate_per_s=4.0)
    requests = spec.requests(3)[:40]
    sim = SimConfig(num_kv_pages=120, max_num_seqs=24)
    result = simulate(requests, policy, GrowPageConfig(), sim, load_cost_model("a100-qwen3-8b"))
    m, timeline = result.metrics, result.pool_timeline()
    times = [t for t, _, _ in timeline]
    assert times == sorted(set(times)) and times[0] == 0.0
    first_arrival = min(r.arrival_s for r in requests)  # the run's clock starts at 0
    assert first_arrival > 0 and timeline[1][0] >= first_arrival
    assert timeline[-1][1:] == (0, 0)
    assert timeline[-1][0] - first_arrival == pytest.approx(m.total_s, rel=1e-12)
    assert all(
        0 <= used <= sim.num_kv_pages and 0 <= n <= sim.max_num_seqs for _, used, n in timeline
    )
    assert max(used for _, used, _ in timeline) == m.peak_pages
    # C is the run's time-average of resident requests, integrated by the simulator itself.
    assert _integral(timeline, 2) / m.total_s == pytest.approx(m.avg_resident, rel=1e-9)
    if policy == "fullkv":
        assert m.num_preemptions > 0  # the pool binds: pages go and come back mid-run


def test_pool_plot_draws_each_timeline(tmp_path, monkeypatch):
    drawn = []
    save = plots._save

    def keep(fig, path):
        drawn.extend(
            (
                ax.get_ylabel(),
                [(line.get_label(), tuple(line.get_ydata())) for line in ax.get_lines()],
            )
            for ax in fig.axes
        )
        return save(fig, path)

    monkeypatch.setattr(plots, "_save", keep)
    timelines = {
        "growpage": [(0.0, 1, 1), (3.0, 2, 1), (5.0, 3, 2), (14.0, 0, 0)],
        "fullkv": [(0.0, 2, 1), (9.0, 0, 0)],
    }
    path = plots.plot_pool(timelines, tmp_path / "pool.png", num_pages=10, max_num_seqs=4)
    assert path.stat().st_size > 0
    (pages_label, pages_lines), (req_label, req_lines) = drawn
    assert pages_label == "KV pages in use" and req_label == "resident requests"
    assert pages_lines == [("growpage", (1, 2, 3, 0)), ("fullkv", (2, 0)), ("pool (10)", (10, 10))]
    assert req_lines == [
        ("growpage", (1, 1, 2, 0)),
        ("fullkv", (1, 0)),
        ("max_num_seqs (4)", (4, 4)),
    ]


def test_sim_serve_writes_the_pool_plot(tmp_path, capsys):
    out = tmp_path / "serve"
    assert (
        main(
            [
                "sim",
                "serve",
                "--workload",
                "tiny",
                "--page-size",
                "32",
                "--recent-window",
                "4",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert (out / "pool.png").stat().st_size > 0
    assert "pool.png" in capsys.readouterr().out


@pytest.mark.parametrize("decisions", ["script", "trace"])
def test_a_page_shared_through_the_prefix_cache_counts_once_in_the_timeline(decisions):
    """Three requests beginning with the same 3 pages (a system prompt) hold them together: the
    pool holds each once, so the timeline (and ``pool.png``) never counts more pages than the
    pool's, and its peak is ``peak_pages``."""
    requests = [
        WorkloadRequest(f"r{i}", 10.0 * i, 16, 40, prefix="sys", prefix_tokens=12) for i in range(3)
    ]
    sim = SimConfig(num_kv_pages=36, admission_reserve=0.0, decisions=decisions)
    result = simulate(requests, "fullkv", GOLDEN_CONFIG, sim, GOLDEN_COST)
    m, timeline = result.metrics, result.pool_timeline()
    assert m.prefix_hit_tokens == 24  # r1 and r2 each took the 3 cached pages
    assert all(0 <= used <= sim.num_kv_pages for _, used, _ in timeline)
    assert max(used for _, used, _ in timeline) == m.peak_pages
    assert timeline[-1][1:] == (0, 0)
    assert _integral(timeline, 2) / m.total_s == pytest.approx(m.avg_resident, rel=1e-9)


def test_the_pool_is_empty_while_the_engine_waits_for_an_arrival():
    """r0 (prompt 4, 5 output tokens) finishes at 7 s; r1 arrives at 20 s: in between nothing
    is resident and no page is in use."""
    requests = [WorkloadRequest("r0", 0.0, 4, 5), WorkloadRequest("r1", 20.0, 4, 5)]
    result = simulate(
        requests,
        "fullkv",
        GOLDEN_CONFIG,
        SimConfig(num_kv_pages=10, admission_reserve=0.0),
        GOLDEN_COST,
    )
    assert result.pool_timeline() == [
        (0.0, 1, 1),
        (3.0, 2, 1),
        (7.0, 0, 0),
        (20.0, 1, 1),
        (23.0, 2, 1),
        (27.0, 0, 0),
    ]
    assert _integral(result.pool_timeline(), 2) / result.metrics.total_s == pytest.approx(
        result.metrics.avg_resident
    )
