"""``benchmarks/sensitivity.py`` (paper appendix D): the τ and k_loc sweeps on tiny synthetic
traces and a tiny served workload, their Δt interval counts, and the command's files."""

from __future__ import annotations

import json

import pytest
import torch
from benchmark_scripts import load_benchmark

from growpage.core.trace_set import TraceSet
from growpage.errors import TraceError
from growpage.sim.synthetic import SyntheticSpec, synthetic_trace
from growpage.sim.workloads import resolve_workload

# Short regimes on small heads: exact Δt ties (0) and compressions where the quota binds.
SPEC = SyntheticSpec(
    num_layers=1,
    num_q_heads=2,
    num_kv_heads=1,
    head_dim=16,
    prompt_len=32,
    gen_len=480,
    mean_regime_len=128.0,
)
PAGE = 32


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread_for_the_module():
    """The module-scoped sweeps run before the per-test one-thread fixture of conftest."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("sensitivity")


@pytest.fixture(scope="module")
def replay_setup(bench):
    traces = [synthetic_trace(SPEC, seed, f"t{seed}") for seed in range(2)]
    return bench.ReplaySetup(traces=traces, page_size=PAGE, fidelity_queries=4)


def test_delta_intervals_put_a_tie_with_tau_on_the_compress_side(bench):
    edges = [-0.001, 0.0, 0.001]
    assert bench.interval_labels(edges) == ["≤ -0.001", "(-0.001, 0]", "(0, 0.001]", "> 0.001"]
    counts = bench.count_deltas([-0.5, -0.001, 0.0, 0.0, 0.0005, 0.001, 0.002], edges)
    assert counts == {"delta_counts": [2, 2, 2, 1], "delta_zero": 2, "decided": 7}


@pytest.mark.parametrize(
    "at_256, page, k_loc, share",
    [(16, 64, 4, "1/16"), (64, 64, 16, "1/4"), (128, 256, 128, "1/2"), (0, 32, 0, "0")],
)
def test_paper_quota_scales_with_the_page(bench, at_256, page, k_loc, share):
    assert bench.scaled_kloc(at_256, page) == k_loc
    assert bench.page_share(k_loc, page) == share


def test_tau_rows_and_decisions_follow_delta(bench, replay_setup):
    """One row per τ; a decided boundary grows iff Δt > τ, so the grow share is the count of
    Δt above τ; and two τ replays of a trace agree until the first Δt between them, which
    grows under the smaller τ (the grow share itself need not be monotone after that)."""
    taus = [-1.0, -0.003, 0.0, 0.003, 1.0]
    runs = {t: bench.replay_row(replay_setup, bench.tau_point(t), None, taus) for t in taus}
    for i, (tau, (row, results)) in enumerate(runs.items()):
        assert row["tau"] == tau and row["k_loc"] == PAGE // 4 and row["traces"] == 2
        assert {"avg_budget", "mass_mean", "mass_min", "output_error", "grow_ratio"} <= set(row)
        assert sum(row["delta_counts"]) == row["decided"] > 0
        grown = sum(row["delta_counts"][i + 1 :])  # the intervals above τ
        assert row["grow_ratio"] * row["decided"] == pytest.approx(grown)
        for res in results:
            for r in res.records:
                if r.decision is not None:
                    assert (r.decision == "grow") == (r.delta > tau)
    assert runs[-1.0][0]["grow_ratio"] == 1.0 and runs[1.0][0]["grow_ratio"] == 0.0
    assert runs[-0.003][0]["grow_ratio"] > runs[0.0][0]["grow_ratio"]  # ties at Δt = 0 grow
    for low, high in zip(taus[:-1], taus[1:], strict=True):
        for a, b in zip(runs[low][1], runs[high][1], strict=True):
            da = [(r.position, r.decision, r.delta) for r in a.records if r.decision]
            db = [(r.position, r.decision, r.delta) for r in b.records if r.decision]
            split = next((j for j, (x, y) in enumerate(zip(da, db, strict=True)) if x != y), None)
            if split is not None:
                assert da[split][0] == db[split][0] and da[split][2] == db[split][2]
                assert da[split][1] == "grow" and db[split][1] == "compress"
                assert low < da[split][2] <= high


def test_kloc_changes_which_tokens_a_fixed_budget_keeps_not_how_many(bench, replay_setup):
    point = bench.kloc_points(128)[1]
    rows = [bench.replay_row(replay_setup, point, k, [0.0])[0] for k in (0, PAGE // 2)]
    assert [r["k_loc"] for r in rows] == [0, PAGE // 2]
    assert [r["k_loc_share"] for r in rows] == ["0", "1/2"]
    for key in ("avg_budget", "grow", "compress", "boundaries"):
        assert rows[0][key] == rows[1][key]
    assert rows[0]["quota_changed_slots"] == 0 and rows[0]["quota_changed_heads"] == 0
    assert rows[1]["quota_changed_slots"] > 0 and rows[1]["quota_changed_heads"] > 0
    assert rows[0]["mass_mean"] != rows[1]["mass_mean"]


@pytest.fixture(scope="module")
def swept(bench, replay_setup):
    serve = bench.ServeSetup(
        requests=resolve_workload("tiny")[:6],
        workload="tiny",
        num_kv_pages=30,
        fidelity_traces=1,
        fidelity_gen_len=512,
    )
    plan = bench.SweepPlan(taus=(-0.001, 0.0, 0.001), kloc_at_256=(32, 64, 128), kloc_budget=128)
    calls = []
    with pytest.MonkeyPatch.context() as mp:  # count the points actually run
        for name in ("replay_row", "serve_row"):
            inner = getattr(bench, name)
            mp.setattr(bench, name, lambda *a, _f=inner, _n=name: calls.append(_n) or _f(*a))
        result = bench.run_sweeps(plan, replay_setup, serve, progress=False)
    return result, plan, serve, calls


def test_sweeps_give_one_row_per_value_and_share_the_default_point(bench, replay_setup, swept):
    result, plan, serve, calls = swept
    assert result["intervals"] == bench.interval_labels([-0.001, 0.0, 0.001])
    assert [r["tau"] for r in result["tau"]["replay"]] == [-0.001, 0.0, 0.001]
    assert [r["tau"] for r in result["tau"]["serve"]] == [-0.001, 0.0, 0.001]
    replayed = result["kloc"]["replay"]
    assert [(r["policy"], r["k_loc"]) for r in replayed] == [
        ("growpage", 4),
        ("growpage", 8),
        ("growpage", 16),
        ("fixed-128", 4),
        ("fixed-128", 8),
        ("fixed-128", 16),
    ]
    assert [r["k_loc"] for r in result["kloc"]["serve"]] == [32, 64, 128]
    default = replayed[1]  # k_loc = b/4 at τ = 0: the τ sweep's middle point, run once
    assert {k: v for k, v in default.items() if k != "policy"} == {
        k: v for k, v in result["tau"]["replay"][1].items() if k != "policy"
    }
    assert result["kloc"]["serve"][1] == result["tau"]["serve"][1]
    # 3 τ + 2 further growpage + 3 fixed replays; 3 τ + 2 further k_loc served: each once
    assert calls.count("replay_row") == 8 and calls.count("serve_row") == 5
    assert bench.count_points(plan, replay_setup, serve) == 13
    for row in result["tau"]["serve"]:
        assert row["tps"] > 0 and 0 < row["avg_resident"] <= 6
        assert sum(row["delta_counts"]) == row["decided"] > 0
        grown = sum(
            c
            for c, edge in zip(row["delta_counts"][1:], [-0.001, 0.0, 0.001], strict=True)
            if edge >= row["tau"]
        )
        assert row["grow_ratio"] * row["decided"] == pytest.approx(grown)
        assert 0 <= row["fidelity_mass_mean"] <= 1 + 1e-6


def test_command_writes_report_json_and_plots(bench, tmp_path, capsys):
    traces = TraceSet(tmp_path / "traces", create=True)
    for seed in range(2):
        traces.write(synthetic_trace(SPEC, seed, f"t{seed}"))
    out = tmp_path / "out"
    assert (
        bench.main(
            [
                "--traces",
                str(tmp_path / "traces"),
                "--page-size",
                str(PAGE),
                "--taus=-0.001,0,0.001",
                "--kloc",
                "64,128",
                "--kloc-budget",
                "128",
                "--fidelity-queries",
                "2",
                "--workload",
                "tiny",
                "--kv-pages",
                "40",
                "--fidelity-traces",
                "0",
                "--no-serve-kloc",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert {p.name for p in out.iterdir()} == {
        "report.md",
        "sensitivity.json",
        "tau.png",
        "kloc.png",
    }
    payload = json.loads((out / "sensitivity.json").read_text())
    assert payload["settings"]["num_traces"] == 2 and payload["settings"]["workload"] == "tiny"
    assert len(payload["result"]["tau"]["serve"]) == 3 and "serve" not in payload["result"]["kloc"]
    report = (out / "report.md").read_text()
    printed = capsys.readouterr().out
    for title in ("D.1 τ, real traces", "D.1 τ, served", "D.2 k_loc, real traces"):
        assert f"## {title}" in report and f"## {title}" in printed
    assert "| -0.001 |" in printed and "| fixed-128 | 16 | 1/2 |" in printed


@pytest.mark.parametrize(
    "args",
    [
        ["--taus", "0,0"],
        ["--taus", "2"],
        ["--taus", "x"],
        ["--kloc", "6"],
        ["--kloc", "512"],
        ["--page-size", "2"],
        ["--kloc-budget", "0"],
    ],
)
def test_bad_options_stop_before_any_work(bench, args, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(args)
    assert "error:" in capsys.readouterr().err


def test_a_missing_trace_set_fails_before_the_output_folder_exists(bench, tmp_path):
    with pytest.raises(TraceError, match="no such directory"):
        bench.main(
            ["--traces", str(tmp_path / "none"), "--no-serve", "--out", str(tmp_path / "out")]
        )
    assert not (tmp_path / "out").exists()
