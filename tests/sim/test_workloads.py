"""Workload specs and CSV files: the paper's mixed workload, validation, fuzzing."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from growpage.errors import WorkloadError
from growpage.sim.workload_csv import (
    MAX_ARRIVAL_S,
    WorkloadRequest,
    load_workload_csv,
    parse_workload_csv,
    parse_workload_jsonl,
)
from growpage.sim.workloads import (
    WORKLOADS,
    LengthDist,
    RequestClass,
    WorkloadSpec,
    resolve_workload,
)

FUZZ = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def test_mixed_workload_is_table_6():
    requests = resolve_workload("mixed", seed=0)
    kinds = [r.kind for r in requests]
    assert len(requests) == 3559
    assert (kinds.count("amc23"), kinds.count("aime24"), kinds.count("gsm8k")) == (1280, 960, 1319)
    assert max(r.output_tokens for r in requests) <= 32768
    assert all(r.arrival_s == 0.0 for r in requests)
    means = {
        k: np.mean([r.output_tokens for r in requests if r.kind == k])
        for k in ("gsm8k", "amc23", "aime24")
    }
    assert 1900 < means["gsm8k"] < 2500 and 7000 < means["amc23"] < 9000
    assert 13000 < means["aime24"] < 16000
    assert resolve_workload("mixed", seed=0) == requests  # seeded
    assert resolve_workload("mixed", seed=1) != requests


def test_poisson_arrivals_are_increasing():
    import attrs

    spec = attrs.evolve(WORKLOADS["tiny"], arrival="poisson", rate_per_s=2.0)
    arrivals = [r.arrival_s for r in spec.requests(seed=3)]
    assert arrivals == sorted(arrivals) and arrivals[0] > 0


def test_length_dist_clips_and_validates():
    rng = np.random.default_rng(0)
    x = LengthDist(1000, 1.5, 10, 2000).sample(rng, 5000)
    assert x.min() >= 10 and x.max() <= 2000 and x.dtype == np.int64
    assert (LengthDist(7).sample(rng, 3) == 7).all()
    with pytest.raises(WorkloadError):
        LengthDist(100, low=50, high=10)
    with pytest.raises(WorkloadError, match="sigma"):
        LengthDist(100, sigma=float("nan"))


def test_csv_round_trip(tmp_path):
    path = tmp_path / "w.csv"
    path.write_text("arrival_s,prompt_tokens,output_tokens,trace\n1.5,120,2048,req-0\n0,96,800,\n")
    requests = load_workload_csv(path)
    assert [(r.arrival_s, r.prompt_tokens, r.output_tokens, r.trace) for r in requests] == [
        (0.0, 96, 800, None),
        (1.5, 120, 2048, "req-0"),
    ]
    assert resolve_workload(str(path)) == requests


def test_a_shared_prefix_reads_from_csv_and_json_lines(tmp_path):
    csv_path, jsonl_path = tmp_path / "w.csv", tmp_path / "w.jsonl"
    csv_path.write_text(
        "arrival_s,prompt_tokens,output_tokens,prefix,prefix_tokens\n0,120,20,sys,64\n0.5,96,8,,\n"
    )
    jsonl_path.write_text(
        '{"arrival_s": 0, "prompt_tokens": 120, "output_tokens": 20, '
        '"prefix": "sys", "prefix_tokens": 64}\n'
        '{"arrival_s": 0.5, "prompt_tokens": 96, "output_tokens": 8}\n'
    )
    for requests in (load_workload_csv(csv_path), resolve_workload(str(jsonl_path))):
        assert [(r.prefix, r.prefix_tokens) for r in requests] == [("sys", 64), (None, 0)]


@pytest.mark.parametrize(
    "row, match",
    [
        ("0,10,5,sys,", "line 2: prefix and prefix_tokens are given together"),
        ("0,10,5,,4", "line 2: prefix and prefix_tokens are given together"),
        ("0,10,5,sys,11", r"line 2: prefix_tokens must be an integer in \[0, prompt_tokens = 10\]"),
        ("0,10,5,sys,0", "line 2: prefix_tokens must lie in"),
        ("0,10,5,sys,x", "line 2: prefix_tokens must be an integer"),
    ],
)
def test_a_bad_shared_prefix_names_the_line(row, match):
    with pytest.raises(WorkloadError, match=match):
        parse_workload_csv("arrival_s,prompt_tokens,output_tokens,prefix,prefix_tokens\n" + row)


@pytest.mark.parametrize(
    "obj, match",
    [
        ('"prefix": "sys"', "given together"),
        ('"prefix_tokens": 4', "given together"),
        ('"prefix": 3, "prefix_tokens": 4', "prefix must be a string"),
        ('"prefix": "sys", "prefix_tokens": 4.0', "prefix_tokens must be an integer"),
        ('"prefix": "sys", "prefix_tokens": 11', r"prompt_tokens = 10\]"),
    ],
)
def test_a_bad_shared_prefix_in_json_lines_names_the_line(obj, match):
    with pytest.raises(WorkloadError, match="line 1: .*" + match):
        parse_workload_jsonl(
            '{"arrival_s": 0, "prompt_tokens": 10, "output_tokens": 5, ' + obj + "}"
        )


@pytest.mark.parametrize(
    "text, match",
    [
        ("", "empty"),
        ("arrival_s,prompt_tokens\n0,1\n", "header"),
        ("arrival_s,prompt_tokens,output_tokens,extra\n0,1,1,1\n", "header"),
        ("arrival_s,prompt_tokens,output_tokens,output_tokens\n0,1,1,1\n", "header"),
        ("arrival_s,prompt_tokens,output_tokens\n", "no requests"),
        ("arrival_s,prompt_tokens,output_tokens\n0,12.5,3\n", "line 2: prompt_tokens"),
        ("arrival_s,prompt_tokens,output_tokens\n0,1,3\n0,0,3\n", "line 3: prompt_tokens"),
        ("arrival_s,prompt_tokens,output_tokens\n-1,1,3\n", "arrival_s"),
        ("arrival_s,prompt_tokens,output_tokens\nnan,1,3\n", "arrival_s"),
        ("arrival_s,prompt_tokens,output_tokens\ninf,1,3\n", "arrival_s"),
        ("arrival_s,prompt_tokens,output_tokens\n0,1\n", "2 fields"),
        ("arrival_s,prompt_tokens,output_tokens\n0,1,99999999999\n", "output_tokens"),
    ],
)
def test_bad_csv_gets_a_workload_error(tmp_path, text, match):
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(WorkloadError, match=match):
        load_workload_csv(path)


def test_missing_or_binary_file(tmp_path):
    with pytest.raises(WorkloadError, match="no such"):
        load_workload_csv(tmp_path / "nope.csv")
    binary = tmp_path / "b.csv"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(WorkloadError):
        load_workload_csv(binary)
    with pytest.raises(WorkloadError, match="unknown workload") as info:
        resolve_workload("nonsense")
    # every column a workload file may have, as load_workload_csv reads them
    assert "(arrival_s, prompt_tokens, output_tokens[, trace, prefix, prefix_tokens])" in str(
        info.value
    )


@FUZZ
@given(st.binary(max_size=300))
def test_random_bytes_only_ever_raise_workload_error(tmp_path, data):
    path = tmp_path / "fuzz.csv"
    path.write_bytes(data)
    try:
        load_workload_csv(path)
    except WorkloadError:
        pass


cell = st.one_of(
    st.text(max_size=8),
    st.integers(-5, 10**8).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
)


@FUZZ
@given(
    header=st.permutations(["arrival_s", "prompt_tokens", "output_tokens", "trace"]),
    rows=st.lists(st.lists(cell, min_size=2, max_size=5), max_size=5),
)
def test_mutated_csv_rows_only_ever_raise_workload_error(header, rows):
    text = ",".join(header) + "\n" + "\n".join(",".join(r) for r in rows)
    try:
        requests = parse_workload_csv(text)
    except WorkloadError:
        return
    assert all(r.prompt_tokens >= 1 and r.output_tokens >= 1 and r.arrival_s >= 0 for r in requests)


def test_errors_name_the_file_line_despite_blank_lines(tmp_path):
    path = tmp_path / "gaps.csv"
    path.write_text("\narrival_s,prompt_tokens,output_tokens\n\n0,10,10\n\n\n0,x,10\n")
    with pytest.raises(WorkloadError, match=r"gaps.csv, line 7: prompt_tokens"):
        load_workload_csv(path)
    path.write_text("arrival_s,prompt_tokens,output_tokens\n\n0,10,10\n\n0.5,20,20\n")
    assert [r.request_id for r in load_workload_csv(path)] == ["req-0", "req-1"]


@pytest.mark.parametrize(
    "fields, says",
    [
        (dict(arrival_s=float("nan")), "arrival_s"),
        (dict(arrival_s=float("inf")), "arrival_s"),
        (dict(arrival_s=-1.0), "arrival_s"),
        (dict(prompt_tokens=0), "prompt_tokens"),
        (dict(prompt_tokens=64.5), "prompt_tokens"),
        (dict(output_tokens=0), "output_tokens"),
        (dict(output_tokens=True), "output_tokens"),
        (dict(request_id=""), "request_id"),
        (dict(trace=3), "trace"),
        (dict(prefix="sys"), "prefix and prefix_tokens go together"),
        (dict(prefix_tokens=8), "prefix and prefix_tokens go together"),
        (dict(prefix="sys", prefix_tokens=65), "prefix_tokens must be an integer in"),
        (dict(prefix="sys", prefix_tokens=True), "prefix_tokens must be an integer in"),
        (dict(prefix="", prefix_tokens=8), "prefix must be a non-empty string"),
        (dict(prefix=7, prefix_tokens=8), "prefix must be a string"),
    ],
    ids=lambda v: str(v) if isinstance(v, str) else None,
)
def test_a_workload_request_built_in_python_is_checked_as_a_csv_row_is(fields, says):
    good = dict(request_id="r", arrival_s=0.0, prompt_tokens=64, output_tokens=32)
    WorkloadRequest(**good)
    with pytest.raises(WorkloadError, match=says):
        WorkloadRequest(**{**good, **fields})


def test_simulate_wants_distinct_request_ids():
    from growpage import GrowPageConfig
    from growpage.sim.costmodel import load_cost_model
    from growpage.sim.serving import SimConfig, simulate

    twins = [WorkloadRequest("r", 0.0, 64, 700), WorkloadRequest("r", 0.0, 64, 700)]
    for mode in ("script", "trace"):
        with pytest.raises(WorkloadError, match="two requests have the id 'r'"):
            simulate(
                twins,
                "growpage",
                GrowPageConfig(page_size=64),
                SimConfig(num_kv_pages=64, decisions=mode),
                load_cost_model("a100-qwen3-8b"),
            )


@pytest.mark.parametrize(
    "spec, says",
    [
        (dict(arrival="poisson", rate_per_s=0), "rate_per_s"),
        (dict(rate_per_s=-1.0), "rate_per_s"),
        (dict(rate_per_s=float("nan")), "rate_per_s"),
        (dict(classes=[]), "classes"),
        (dict(classes=["gsm8k"]), "classes"),
        (dict(arrival="bursty"), "arrival"),
    ],
    ids=lambda v: str(v) if isinstance(v, str) else None,
)
def test_a_workload_spec_is_checked(spec, says):
    one = RequestClass("a", 2, LengthDist(10), LengthDist(10))
    with pytest.raises(WorkloadError, match=says):
        WorkloadSpec(**{"name": "w", "classes": [one], **spec})


@pytest.mark.parametrize(
    "args, says",
    [
        (("a", -3), "count"),
        (("", 2), "name"),
        (("a", 2.5), "count"),
    ],
)
def test_a_request_class_is_checked(args, says):
    with pytest.raises(WorkloadError, match=says):
        RequestClass(*args, LengthDist(10), LengthDist(10))
    with pytest.raises(WorkloadError, match="prompt"):
        RequestClass("a", 2, 10, LengthDist(10))


@pytest.mark.parametrize(
    "text, says",
    [
        (
            '{"arrival_s": 1' + "0" * 400 + ', "prompt_tokens": 5, "output_tokens": 5}',
            "line 1: arrival_s",
        ),
        (
            '{"arrival_s": 0, "prompt_tokens": 5, "output_tokens": 5, "trace": "a\u2028b"}\n'
            '{"arrival_s": -1, "prompt_tokens": 5, "output_tokens": 5}',
            "line 2: arrival_s",
        ),
    ],
)
def test_json_lines_edge_cases_are_workload_errors_on_the_right_line(text, says):
    """An integer too large for a float is refused, not an OverflowError; a line separator
    inside a string does not end a line, so the line numbers stay the file's."""
    with pytest.raises(WorkloadError, match=says):
        parse_workload_jsonl(text, "w.jsonl")
    with pytest.raises(WorkloadError, match="arrival_s"):
        WorkloadRequest("r", 10**400, 5, 5)


def test_a_line_separator_inside_a_json_string_is_not_a_line_break():
    text = '{"arrival_s": 0, "prompt_tokens": 5, "output_tokens": 5, "trace": "a\u2028b"}\n'
    assert [r.trace for r in parse_workload_jsonl(text)] == ["a\u2028b"]


def test_a_negative_seed_is_a_workload_error():
    with pytest.raises(WorkloadError, match="seed must be an int >= 0, got -1"):
        resolve_workload("tiny", seed=-1)


@pytest.mark.parametrize("arrival", ["1.7e12", "1733100000000", "1.7e18"])
def test_an_arrival_beyond_the_clocks_resolution_is_refused_with_its_line(tmp_path, arrival):
    """Simulated time is float seconds from 0: at 1.7e18 s (an epoch in nanoseconds) a decode
    step of 10 ms does not move the clock, and every latency came out 0 s without a word;
    at 1.7e12 s (milliseconds) they were off by a few tenths of a percent. The formats refuse
    an arrival past 2^32 s (136 years; the clock keeps a microsecond there), naming the line."""
    header = "arrival_s,prompt_tokens,output_tokens\n"
    csv_path = tmp_path / "w.csv"
    csv_path.write_text(header + "0,4,9\n" + f"{arrival},4,9\n")
    with pytest.raises(
        WorkloadError,
        match=rf"w.csv, line 3: arrival_s must be at most "
        rf"4294967296 .*, got {arrival}",
    ):
        load_workload_csv(csv_path)
    with pytest.raises(WorkloadError, match=r"w.jsonl, line 1: arrival_s must be at most"):
        parse_workload_jsonl(
            f'{{"arrival_s": {arrival}, "prompt_tokens": 4, "output_tokens": 9}}', "w.jsonl"
        )
    with pytest.raises(WorkloadError, match=r"'r': arrival_s must be at most"):
        WorkloadRequest("r", float(arrival), 4, 9)


def test_an_arrival_at_the_bound_serves_as_at_time_0():
    """Up to the bound (an epoch in seconds, say) the latencies are those of the same requests
    arriving from 0 s, to a microsecond."""
    from growpage import GrowPageConfig
    from growpage.sim.costmodel import LinearCostModel
    from growpage.sim.serving import SimConfig, simulate

    assert WorkloadRequest("r", float(MAX_ARRIVAL_S), 4, 9).arrival_s == 2.0**32
    config = GrowPageConfig(page_size=4, recent_window=1, min_capacity=2)
    cost = LinearCostModel(base_s=0.01, per_prefill_token_s=0.0005)
    runs = []
    for start in (0.0, float(MAX_ARRIVAL_S) - 0.5):
        requests = [WorkloadRequest("a", start, 4, 9), WorkloadRequest("b", start + 0.5, 4, 9)]
        runs.append(
            simulate(
                requests, "fullkv", config, SimConfig(num_kv_pages=10, admission_reserve=0.0), cost
            ).metrics
        )
    early, late = runs
    for name in ("total_s", "ttft_s", "e2e_s", "e2e_p99_s"):
        assert getattr(late, name) == pytest.approx(getattr(early, name), abs=1e-6)
    assert late.tpot_ms == pytest.approx(early.tpot_ms, abs=1e-3)
