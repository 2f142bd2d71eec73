"""What a user comparing policies on a workload of their own needs from the serving simulator:
latency percentiles (TTFT, TPOT, end to end) they can trust, Poisson arrivals at a rate of their
choice, and JSON Lines workload files with errors that name the line and the field."""

from __future__ import annotations

import csv
import json

import attrs
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from growpage import GrowPageConfig
from growpage.cli import main
from growpage.errors import ConfigError, WorkloadError
from growpage.sim.costmodel import LinearCostModel, load_cost_model
from growpage.sim.metrics import PERCENTILES
from growpage.sim.reports import latency_table
from growpage.sim.serving import SimConfig, simulate
from growpage.sim.workload_csv import (
    WorkloadRequest,
    load_workload_jsonl,
    parse_workload_csv,
    parse_workload_jsonl,
)
from growpage.sim.workloads import WORKLOADS, resolve_workload

SMALL = ["--page-size", "32", "--recent-window", "4"]
GOLDEN_CONFIG = GrowPageConfig(page_size=4, recent_window=1, min_capacity=2)
GOLDEN_COST = LinearCostModel(base_s=1.0, per_prefill_token_s=0.5)


def run_json(capsys, argv):
    assert main(argv + ["--json"]) == 0
    return json.loads(capsys.readouterr().out)


# ---- latency percentiles ---------------------------------------------------------------------
def test_latencies_of_a_hand_derived_scenario():
    # The golden scenario "a later arrival cuts the decode segment": r0 (prompt 4, 9 output
    # tokens) prefills 0-3 s and finishes at 14 s; r1 (prompt 4, 5 output tokens, arrives at
    # 4.5 s) prefills 5-8 s and finishes at 12 s. TTFT 3 / 3.5 s, E2E 14 / 7.5 s, TPOT (after
    # the first token) 11/8 s and 4/4 s.
    requests = [WorkloadRequest("r0", 0.0, 4, 9), WorkloadRequest("r1", 4.5, 4, 5)]
    result = simulate(
        requests,
        "fullkv",
        GOLDEN_CONFIG,
        SimConfig(num_kv_pages=10, admission_reserve=0.0),
        GOLDEN_COST,
    )
    m = result.metrics
    assert [(r.ttft_s, r.e2e_s, r.tpot_ms) for r in result.requests] == [
        (3.0, 14.0, 1375.0),
        (3.5, 7.5, 1000.0),
    ]
    assert m.e2e_s == pytest.approx((14.0 + 7.5) / 2)
    # Two values: percentile q lies q% of the way from the smaller to the larger.
    assert (m.ttft_p50_s, m.ttft_p90_s, m.ttft_p99_s) == pytest.approx((3.25, 3.45, 3.495))
    assert (m.e2e_p50_s, m.e2e_p90_s, m.e2e_p99_s) == pytest.approx((10.75, 13.35, 13.935))
    assert (m.tpot_p50_ms, m.tpot_p90_ms, m.tpot_p99_ms) == pytest.approx((1187.5, 1337.5, 1371.25))


def test_a_request_that_never_decodes_is_left_out_of_the_mean_budget():
    """One output token comes from the prefill: no decode step, so no budget to average (as no
    TPOT); the mean budget is the other request's, not dragged halfway to 0."""
    requests = [WorkloadRequest("one", 0.0, 4, 1), WorkloadRequest("many", 0.0, 4, 9)]
    result = simulate(
        requests,
        "fullkv",
        GOLDEN_CONFIG,
        SimConfig(num_kv_pages=10, admission_reserve=0.0),
        GOLDEN_COST,
    )
    one, many = result.requests
    assert (one.avg_budget, one.tpot_ms) == (None, None)
    assert many.avg_budget is not None and many.avg_budget >= 4  # at least its page
    assert result.metrics.avg_kv_budget == pytest.approx(many.avg_budget)


@pytest.mark.parametrize(
    "which, says",
    [
        ("cost", r"cost must be a CostModel, got tuple .*load_cost_model\('a100-qwen3-8b'\)"),
        ("config", "config must be a GrowPageConfig, got dict"),
        ("sim", "sim must be a SimConfig, got int"),
    ],
)
def test_simulate_names_a_setting_of_the_wrong_type(which, says):
    from growpage.sim.hardware import PRESETS

    args = {"config": GOLDEN_CONFIG, "sim": SimConfig(num_kv_pages=10), "cost": GOLDEN_COST}
    args[which] = {"cost": PRESETS["a100-qwen3-8b"], "config": {"page_size": 4}, "sim": 10}[which]
    with pytest.raises(ConfigError, match=says):
        simulate([WorkloadRequest("r0", 0.0, 4, 9)], "fullkv", **args)


@pytest.mark.parametrize("policy", ["growpage", "fullkv", "fixed", "shrink"])
def test_latency_metrics_hold_their_invariants_on_a_loaded_pool(policy):
    spec = attrs.evolve(WORKLOADS["small"], arrival="poisson", rate_per_s=4.0)
    requests = spec.requests(3)[:40]
    cost = load_cost_model("a100-qwen3-8b")
    result = simulate(requests, policy, GrowPageConfig(), SimConfig(num_kv_pages=120), cost)
    m, done = result.metrics, result.requests
    assert len(done) == len(requests)
    assert all(r.generated == r.decode_tokens == r.output_tokens - 1 for r in done)
    ttft = np.array([r.ttft_s for r in done])
    e2e = np.array([r.e2e_s for r in done])
    tpot = np.array([r.tpot_ms for r in done])
    assert (ttft >= 0).all() and (ttft <= e2e).all() and (tpot > 0).all()
    for name, values, unit in (("ttft", ttft, "s"), ("e2e", e2e, "s"), ("tpot", tpot, "ms")):
        got = [getattr(m, f"{name}_p{q}_{unit}") for q in PERCENTILES]
        assert got == pytest.approx(np.percentile(values, PERCENTILES).tolist())
        assert got == sorted(got)
        assert getattr(m, f"{name}_{unit}") == pytest.approx(values.mean())
    # Each request's TTFT is at most its E2E, so every percentile of TTFT is at most E2E's.
    assert all(getattr(m, f"ttft_p{q}_s") <= getattr(m, f"e2e_p{q}_s") for q in PERCENTILES)
    assert m.e2e_p99_s <= m.total_s + 1e-9


def test_serve_prints_the_latency_table_and_writes_per_request_latencies(capsys, tmp_path):
    assert (
        main(
            [
                "sim",
                "serve",
                "--workload",
                "tiny",
                *SMALL,
                "--kv-pages",
                "400",
                "--policy",
                "fixed",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    for label in ("TTFT (s)", "TPOT (ms)", "E2E (s)"):
        assert label in text
    metrics = json.loads((tmp_path / "metrics.json").read_text())["metrics"]
    assert metrics["e2e_p99_s"] >= metrics["e2e_p50_s"] > 0
    with (tmp_path / "requests.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == metrics["num_requests"]
    for row in rows:
        arrival, first, finish = (float(row[k]) for k in ("arrival_s", "first_token_s", "finish_s"))
        assert float(row["e2e_s"]) == pytest.approx(finish - arrival)
        assert float(row["ttft_s"]) == pytest.approx(first - arrival)
        assert float(row["tpot_ms"]) == pytest.approx(
            1e3 * (finish - first) / (int(row["output_tokens"]) - 1)
        )


def test_latency_table_rows_hold_the_mean_and_the_percentiles():
    m = {"ttft_s": 0.5, "tpot_ms": 12.0, "e2e_s": 40.0}
    for key, unit in (("ttft", "s"), ("tpot", "ms"), ("e2e", "s")):
        m |= {f"{key}_p50_{unit}": 1.0, f"{key}_p90_{unit}": 2.0, f"{key}_p99_{unit}": 3.25}
    lines = latency_table(m).splitlines()
    assert lines[0].split() == ["latency", "mean", "p50", "p90", "p99"]
    assert lines[3].split() == ["TPOT", "(ms)", "12.0", "1.00", "2.00", "3.25"]


def test_the_sweep_table_compares_tail_latencies(capsys, tmp_path):
    assert (
        main(
            [
                "sim",
                "sweep",
                "--workload",
                "tiny",
                *SMALL,
                "--kv-pages",
                "120",
                "--points",
                "fullkv",
                "--jobs",
                "1",
                "--fidelity-traces",
                "0",
                "--arrival-rate",
                "2",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    assert "E2E p99 s" in capsys.readouterr().out
    saved = json.loads((tmp_path / "sweep.json").read_text())
    assert saved["arrival_rate_per_s"] == [2.0]
    assert saved["points"][0]["e2e_p99_s"] > 0


def test_a_sweep_over_arrival_rates_runs_every_point_at_each(capsys, tmp_path):
    argv = [
        "sim",
        "sweep",
        "--workload",
        "tiny",
        *SMALL,
        "--kv-pages",
        "120",
        "--points",
        "fullkv",
        "fixed@budget_tokens=64",
        "--jobs",
        "1",
        "--fidelity-traces",
        "0",
    ]
    out = run_json(capsys, argv + ["--arrival-rate", "0.5", "4", "--out", str(tmp_path)])
    points = out["points"]
    assert [(p["label"], p["arrival_rate_per_s"]) for p in points] == [
        ("fullkv @0.5/s", 0.5),
        ("fixed budget_tokens=64 @0.5/s", 0.5),
        ("fullkv @4/s", 4.0),
        ("fixed budget_tokens=64 @4/s", 4.0),
    ]
    # Each rate's rows are those of a sweep at that rate alone.
    alone = run_json(capsys, argv + ["--arrival-rate", "4"])["points"]
    assert [{**p, "label": "", "group": ""} for p in points[2:]] == [
        {**p, "label": "", "group": ""} for p in alone
    ]
    with (tmp_path / "sweep.csv").open() as f:
        assert [row["arrival_rate_per_s"] for row in csv.DictReader(f)] == [
            "0.5",
            "0.5",
            "4.0",
            "4.0",
        ]
    assert main(argv + ["--arrival-rate", "1", "1"]) == 2
    assert "a rate is given twice" in capsys.readouterr().err


# ---- arrival rate ----------------------------------------------------------------------------
def test_an_arrival_rate_keeps_the_requests_and_scales_their_arrivals():
    slow, fast = resolve_workload("tiny", 5, rate_per_s=1.0), resolve_workload("tiny", 5, 4.0)
    offline = resolve_workload("tiny", 5)
    lengths = [
        [(r.request_id, r.prompt_tokens, r.output_tokens) for r in rs]
        for rs in (slow, fast, offline)
    ]
    assert lengths[0] == lengths[1] == lengths[2]
    assert all(r.arrival_s == 0 for r in offline)
    arrivals = np.array([r.arrival_s for r in slow])
    assert (np.diff(arrivals) >= 0).all() and arrivals[-1] > 0
    assert [r.arrival_s for r in fast] == pytest.approx((arrivals / 4).tolist())


def test_serve_takes_an_arrival_rate_and_records_it(capsys):
    argv = ["sim", "serve", "--workload", "tiny", *SMALL, "--kv-pages", "400", "--policy", "fixed"]
    offline = run_json(capsys, argv)
    paced = run_json(capsys, argv + ["--arrival-rate", "0.5"])
    assert offline["arrival_rate_per_s"] is None and paced["arrival_rate_per_s"] == 0.5
    assert paced["metrics"]["output_tokens"] == offline["metrics"]["output_tokens"]
    # Spread over ~24 s instead of all at t = 0: less queueing, a longer run.
    assert paced["metrics"]["ttft_s"] < offline["metrics"]["ttft_s"]
    assert paced["metrics"]["total_s"] != offline["metrics"]["total_s"]


@pytest.mark.parametrize("rate", ["0", "-1", "inf", "nan"])
def test_a_bad_arrival_rate_is_refused(capsys, rate):
    assert main(["sim", "serve", "--workload", "tiny", "--arrival-rate", rate]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"growpage: error: --arrival-rate (requests per second) must be a finite number > 0, "
        f"got {float(rate)}"
    ]


def test_an_arrival_rate_with_a_workload_file_is_refused(capsys, tmp_path):
    path = tmp_path / "w.csv"
    path.write_text("arrival_s,prompt_tokens,output_tokens\n0,10,20\n")
    assert main(["sim", "serve", "--workload", str(path), "--arrival-rate", "2"]) == 2
    assert "gives its own arrival times" in capsys.readouterr().err


# ---- JSON Lines workloads --------------------------------------------------------------------
def test_jsonl_reads_as_the_same_csv_does(tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_text(
        '{"arrival_s": 1.5, "prompt_tokens": 120, "output_tokens": 2048, '
        '"trace": "req-0"}\n\n'
        '{"arrival_s": 0, "prompt_tokens": 96, "output_tokens": 800, '
        '"trace": null}\n'
    )
    from_csv = parse_workload_csv(
        "arrival_s,prompt_tokens,output_tokens,trace\n1.5,120,2048,req-0\n0,96,800,\n"
    )
    fields = [
        [(r.request_id, r.arrival_s, r.prompt_tokens, r.output_tokens, r.trace) for r in rs]
        for rs in (load_workload_jsonl(path), from_csv)
    ]
    assert fields[0] == fields[1]
    assert resolve_workload(str(path)) == load_workload_jsonl(path)


@pytest.mark.parametrize(
    "text, says",
    [
        ("", "empty workload"),
        ("\n  \n", "empty workload"),
        ('{"arrival_s": 0, "prompt_tokens": 10}\n', "line 1: missing output_tokens"),
        ('{"arrival_s": 0, "prompt_tokens": 10, "output_tokens": 5, "id": 3}', "unknown key 'id'"),
        ('\n{"arrival_s": -1, "prompt_tokens": 10, "output_tokens": 5}', "line 2: arrival_s"),
        (
            '{"arrival_s": NaN, "prompt_tokens": 10, "output_tokens": 5}',
            "arrival_s must be a finite",
        ),
        ('{"arrival_s": "0", "prompt_tokens": 10, "output_tokens": 5}', "arrival_s must be"),
        (
            '{"arrival_s": 0, "prompt_tokens": 1.5, "output_tokens": 5}',
            "prompt_tokens must be an int",
        ),
        (
            '{"arrival_s": 0, "prompt_tokens": true, "output_tokens": 5}',
            "prompt_tokens must be an int",
        ),
        (
            '{"arrival_s": 0, "prompt_tokens": 10, "output_tokens": 2000000}',
            r"output_tokens must lie",
        ),
        ('{"arrival_s": 0, "prompt_tokens": 10, "output_tokens": 5, "trace": 7}', "trace must be"),
        ("[1, 2]", "line 1: expected a JSON object"),
        ('{"arrival_s": 0,', "line 1: not valid JSON"),
    ],
)
def test_a_bad_jsonl_workload_gets_a_workload_error(text, says):
    with pytest.raises(WorkloadError, match=says) as info:
        parse_workload_jsonl(text, "w.jsonl")
    assert str(info.value).startswith("w.jsonl") and "\n" not in str(info.value)


@pytest.mark.parametrize(
    "text, says",
    [
        (
            '{"arrival_s": 5, "prompt_tokens": 10, "output_tokens": 5, "arrival_s": 0}',
            "line 1: key 'arrival_s' given twice",
        ),
        (
            '\n{"arrival_s": 0, "prompt_tokens": 10, "output_tokens": 5, "prompt_tokens": 10,\n',
            "line 2: not valid JSON",
        ),
        (
            '{"arrival_s": 0, "prompt_tokens": 10, "output_tokens": 5}\n'
            '{"prefix": "a", "prefix_tokens": 4, "arrival_s": 0, "prompt_tokens": 10, '
            '"output_tokens": 5, "prefix": "b", "prefix_tokens": 4}',
            "line 2: keys 'prefix', 'prefix_tokens' given twice",
        ),
    ],
)
def test_a_jsonl_key_given_twice_is_refused(text, says):
    """A CSV column given twice is an error; so is a JSON Lines key, whose last value json
    would otherwise take silently (a request arriving at 0 s instead of 5 s)."""
    with pytest.raises(WorkloadError, match=says) as info:
        parse_workload_jsonl(text, "w.jsonl")
    assert str(info.value).startswith("w.jsonl") and "\n" not in str(info.value)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.one_of(
            st.text(max_size=30),
            st.dictionaries(
                st.sampled_from(["arrival_s", "prompt_tokens", "output_tokens", "trace", "x"]),
                st.one_of(
                    st.none(),
                    st.booleans(),
                    st.integers(-3, 3 << 20),
                    st.floats(allow_nan=True, allow_infinity=True),
                    st.text(max_size=4),
                ),
            ).map(json.dumps),
        ),
        max_size=5,
    )
)
def test_mutated_jsonl_only_ever_raises_workload_error(lines):
    try:
        requests = parse_workload_jsonl("\n".join(lines))
    except WorkloadError:
        return
    assert requests and all(
        r.prompt_tokens >= 1 and r.output_tokens >= 1 and r.arrival_s >= 0 for r in requests
    )


def test_serve_runs_a_jsonl_workload(capsys, tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_text(
        '{"arrival_s": 0, "prompt_tokens": 40, "output_tokens": 90}\n'
        '{"arrival_s": 0.25, "prompt_tokens": 30, "output_tokens": 60}\n'
    )
    out = run_json(
        capsys,
        ["sim", "serve", "--workload", str(path), *SMALL, "--kv-pages", "50", "--policy", "fixed"],
    )
    assert out["metrics"]["num_requests"] == 2 and out["metrics"]["output_tokens"] == 150


# ---- very long requests ----------------------------------------------------------------------
def test_a_workload_with_very_long_requests_is_warned_about_before_the_run(capsys, tmp_path):
    path = tmp_path / "long.csv"
    path.write_text("arrival_s,prompt_tokens,output_tokens\n0,100,70000\n0,100,500\n")
    assert (
        main(
            [
                "sim",
                "serve",
                "--workload",
                str(path),
                "--kv-pages",
                "400",
                "--policy",
                "fixed",
                "--json",
            ]
        )
        == 0
    )
    out, err = capsys.readouterr()
    assert json.loads(out)["metrics"]["output_tokens"] == 70500
    assert err.count("growpage: warning:") == 1
    assert "the longest request has 70100 tokens" in err


def test_a_workload_of_ordinary_lengths_gets_no_warning(capsys):
    assert (
        main(
            [
                "sim",
                "serve",
                "--workload",
                "tiny",
                *SMALL,
                "--kv-pages",
                "400",
                "--policy",
                "fixed",
                "--json",
            ]
        )
        == 0
    )
    assert "warning" not in capsys.readouterr().err


# ---- script mode: every request has a scripted signal for every decision ---------------------
def test_a_request_with_a_short_prompt_does_not_outrun_its_script():
    # One script for the three: median prompt 100, longest total 400, so a script of
    # 400 - 100 tokens (+ margin) is shorter than r2's 340 decode steps; its last decisions
    # had no scripted signal (SimulationError "reached decided boundary N, its script has N").
    requests = [
        WorkloadRequest("r0", 0.0, 100, 301),
        WorkloadRequest("r1", 0.0, 100, 301),
        WorkloadRequest("r2", 0.0, 60, 341),
    ]
    config = GrowPageConfig(page_size=4, recent_window=1)
    result = simulate(
        requests,
        "growpage",
        config,
        SimConfig(num_kv_pages=400, num_scripts=1),
        load_cost_model("a100-qwen3-8b"),
    )
    assert [r.generated for r in result.requests] == [300, 300, 340]


@settings(max_examples=25, deadline=None)
@given(
    lengths=st.lists(st.tuples(st.integers(1, 120), st.integers(1, 300)), min_size=1, max_size=6),
    page_size=st.sampled_from([4, 5, 8, 16]),
    num_scripts=st.integers(1, 3),
    min_capacity=st.integers(2, 5),
    policy=st.sampled_from(["growpage", "shrink"]),
)
def test_signal_reading_policies_never_run_out_of_script(
    lengths, page_size, num_scripts, min_capacity, policy
):
    requests = [WorkloadRequest(f"r{i}", 0.0, p, o) for i, (p, o) in enumerate(lengths)]
    config = GrowPageConfig(page_size=page_size, recent_window=1, min_capacity=min_capacity)
    result = simulate(
        requests,
        policy,
        config,
        SimConfig(num_kv_pages=2000, num_scripts=num_scripts),
        load_cost_model("a100-qwen3-8b"),
    )
    assert [r.generated for r in result.requests] == [
        r.output_tokens - 1 for r in sorted(requests, key=lambda r: r.arrival_s)
    ]


# ---- a pool too small for one request --------------------------------------------------------
@pytest.mark.parametrize("decisions", ["script", "trace"])
def test_a_pool_too_small_for_fullkv_names_the_pages_it_needs(decisions):
    # 10 prompt + 31 output tokens: the KV ends at 40 tokens (the last output token is never
    # fed back), 10 pages of 4, which fullkv (never compresses) must hold at once.
    requests = [WorkloadRequest("r", 0.0, 10, 31)]
    config = GrowPageConfig(page_size=4, recent_window=1)
    with pytest.raises(ConfigError) as info:
        simulate(
            requests,
            "fullkv",
            config,
            SimConfig(num_kv_pages=9, admission_reserve=0.0, decisions=decisions),
            GOLDEN_COST,
        )
    message = str(info.value)
    assert message == (
        "request 'r' (10 prompt + 31 output tokens) cannot finish even alone: "
        "policy 'fullkv' never compresses, so it needs 10 pages of 4 tokens "
        "(--kv-pages 10); the pool has 9"
    )
    result = simulate(
        requests,
        "fullkv",
        config,
        SimConfig(num_kv_pages=10, admission_reserve=0.0, decisions=decisions),
        GOLDEN_COST,
    )
    assert result.metrics.peak_pages == 10 and result.requests[0].generated == 30


# ---- CSV header errors -----------------------------------------------------------------------
@pytest.mark.parametrize(
    "header, says",
    [
        ("arrival_s,prompt_tokens", "(missing 'output_tokens')"),
        ("arrival,prompt_tokens,output_tokens", "(missing 'arrival_s'; unknown column 'arrival')"),
        ("arrival_s,prompt_tokens,output_tokens,prompt_tokens", "(repeated 'prompt_tokens')"),
        (
            "0,96,800",
            "(missing 'arrival_s', 'prompt_tokens', 'output_tokens'; unknown column '0', "
            "'96', '800'; the first line must be the header)",
        ),
    ],
)
def test_a_bad_csv_header_names_what_is_wrong(header, says):
    with pytest.raises(WorkloadError) as info:
        parse_workload_csv(header + "\n0,96,800\n", "w.csv")
    assert str(info.value) == (
        f"w.csv: bad header {says}: it must hold arrival_s, "
        "prompt_tokens, output_tokens and optionally trace, prefix, prefix_tokens, each once"
    )


# ---- a policy that never compresses is fullkv when memory is plentiful -----------------------
@pytest.mark.parametrize("decisions", ["script", "trace"])
def test_a_budget_never_reached_serves_exactly_as_fullkv(decisions):
    from growpage.policies.registry import resolve_policy

    spec = attrs.evolve(WORKLOADS["tiny"], arrival="poisson", rate_per_s=2.0)
    requests, cost = spec.requests(1), load_cost_model("a100-qwen3-8b")
    config = GrowPageConfig(page_size=64, recent_window=16)
    sim = SimConfig(num_kv_pages=2000, decisions=decisions, record_events=True)
    full = simulate(requests, "fullkv", config, sim, cost)
    fixed = simulate(requests, resolve_policy("fixed", budget_tokens=1 << 20), config, sim, cost)
    assert full.events == fixed.events and full.metrics.compresses == 0
    assert attrs.evolve(full.metrics, policy="x") == attrs.evolve(fixed.metrics, policy="x")
