"""``growpage sim replay|serve|sweep`` end to end on tiny inputs."""

from __future__ import annotations

import json

import attrs
import pytest

from growpage.cli import main
from growpage.errors import ConfigError
from growpage.sim.sweep import SweepPoint, parse_points
from growpage.sim.synthetic import SyntheticSpec, write_synthetic_trace_set

SMALL = ["--page-size", "32", "--recent-window", "4"]


def set_and_workload(tmp_path, rows: str):
    """A trace set ``tmp_path/set`` (synthetic-0, -1: the KV of 90 and 60 generated tokens after
    a 20-token prompt, so requests of 91 and 61 output tokens: the last output token is never
    fed back) and a CSV workload of ``rows`` (with a trace column) beside it."""
    spec = SyntheticSpec(
        num_layers=1, num_q_heads=2, num_kv_heads=1, head_dim=16, prompt_len=20, gen_len=1
    )
    write_synthetic_trace_set(tmp_path / "set", spec, output_lens=[90, 60], seed=2)
    csv = tmp_path / "w.csv"
    csv.write_text("arrival_s,prompt_tokens,output_tokens,trace\n" + rows)
    return csv


def run_json(capsys, argv):
    assert main(argv + ["--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_replay_synthetic_json_and_files(capsys, tmp_path):
    out = run_json(
        capsys,
        [
            "sim",
            "replay",
            "--synthetic",
            "2",
            "--gen-len",
            "300",
            *SMALL,
            "--policy",
            "fixed",
            "--param",
            "budget_tokens=128",
            "--signals",
            "--out",
            str(tmp_path),
        ],
    )
    assert out["summary"]["policy"] == "ALL" and out["summary"]["traces"] == 2
    assert out["params"] == {"budget_tokens": 128}
    assert all(t["max_pages"] * 32 <= 128 for t in out["traces"])
    assert "spearman" in out["signals"]
    for name in ("replay.json", "replay.csv", "capacity.png", "signals.png"):
        assert (tmp_path / name).stat().st_size > 0


def test_replay_a_trace_set_prints_a_table(capsys, tmp_path):
    spec = SyntheticSpec(
        num_layers=1, num_q_heads=2, num_kv_heads=1, head_dim=16, prompt_len=20, gen_len=1
    )
    write_synthetic_trace_set(tmp_path / "set", spec, output_lens=[100, 150], seed=1)
    assert main(["sim", "replay", "--traces", str(tmp_path / "set"), *SMALL]) == 0
    table = capsys.readouterr().out
    assert "synthetic-0" in table and "synthetic-1" in table and "ALL" in table


def test_serve_named_workload_and_csv_in_trace_mode(capsys, tmp_path):
    out = run_json(
        capsys,
        ["sim", "serve", "--workload", "tiny", *SMALL, "--kv-pages", "80", "--out", str(tmp_path)],
    )
    m = out["metrics"]
    assert m["num_requests"] == 12 and m["tps"] > 0 and m["peak_pages"] <= 80
    assert out["policy"] == "growpage" and out["params"] == {}
    assert (tmp_path / "requests.csv").read_text().count("\n") == 13
    csv = set_and_workload(tmp_path, "0,5,5,synthetic-1\n0.1,5,5,\n")
    out = run_json(
        capsys,
        [
            "sim",
            "serve",
            "--workload",
            str(csv),
            *SMALL,
            "--kv-pages",
            "20",
            "--decisions",
            "trace",
            "--traces",
            str(tmp_path / "set"),
            "--cost",
            "a100-r1-llama-8b",
        ],
    )
    # Lengths come from the traces: synthetic-1 (61) and, in turn, the set's entry 1 (61).
    assert out["metrics"]["output_tokens"] == 122


def test_bad_workload_is_reported_not_raised(capsys, tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("arrival_s,prompt_tokens\n0,1\n")
    assert main(["sim", "serve", "--workload", str(bad)]) == 2
    assert "header" in capsys.readouterr().err


def test_parse_sweep_points():
    assert parse_points(["growpage", "fixed@budget_tokens=1,2;x=a"]) == [
        SweepPoint("growpage"),
        SweepPoint("fixed", (("budget_tokens", 1), ("x", "a"))),
        SweepPoint("fixed", (("budget_tokens", 2), ("x", "a"))),
    ]
    assert SweepPoint("fixed", (("budget_tokens", 1),)).label == "fixed budget_tokens=1"
    with pytest.raises(Exception, match="bad sweep spec"):
        parse_points(["fixed@budget_tokens"])
    with pytest.raises(ConfigError, match="key 'budget_tokens' given twice"):
        parse_points(["fixed@budget_tokens=1024;budget_tokens=2048"])


@pytest.mark.parametrize(
    "text, value",
    [
        ("None", None),
        ("null", None),
        ("True", True),
        ("true", True),
        ("1e-3", 1e-3),
        ("-0.01", -0.01),
        ('"x"', "x"),
        ("abc", "abc"),
        (" 2 ", 2),
    ],
)
def test_param_and_sweep_values_are_read_alike(text, value):
    from growpage.commands.sim import parse_params

    assert parse_params([f"tau={text}"]) == {"tau": value}
    assert parse_points([f"growpage@tau={text},0.5"]) == [
        SweepPoint("growpage", (("tau", value),)),
        SweepPoint("growpage", (("tau", 0.5),)),
    ]


def test_sweep_runs_points_and_writes_a_pareto_plot(capsys, tmp_path):
    out = run_json(
        capsys,
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
            "fixed@budget_tokens=64,128",
            "--jobs",
            "1",
            "--fidelity-traces",
            "1",
            "--out",
            str(tmp_path),
        ],
    )
    labels = [p["label"] for p in out["points"]]
    assert labels == ["fullkv", "fixed budget_tokens=64", "fixed budget_tokens=128"]
    assert out["points"][0]["mass_mean"] == 1.0 > out["points"][1]["mass_mean"]
    assert (tmp_path / "pareto.png").stat().st_size > 0
    assert attrs.has(SweepPoint)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["sim", "replay", "--synthetic", "0"], "--synthetic must be an integer >= 1, got 0"),
        (["sim", "replay", "--synthetic", "-2"], "--synthetic must be an integer >= 1, got -2"),
        (
            ["sim", "sweep", "--workload", "tiny", "--points", "fullkv", "--jobs", "0"],
            "--jobs must be an integer >= 1, got 0",
        ),
        (
            ["sim", "sweep", "--workload", "tiny", "--points", "fullkv", "--fidelity-traces", "-1"],
            "--fidelity-traces must be an integer >= 0, got -1",
        ),
    ],
)
def test_bad_counts_are_reported(capsys, argv, message):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_replay_of_an_empty_trace_set_is_an_error_and_writes_nothing(capsys, tmp_path):
    from growpage.core.trace_set import TraceSet

    TraceSet(tmp_path / "set", create=True)
    assert (
        main(
            [
                "sim",
                "replay",
                "--traces",
                str(tmp_path / "set"),
                *SMALL,
                "--out",
                str(tmp_path / "out"),
            ]
        )
        == 2
    )
    assert "the trace set is empty" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "command",
    [
        ["sim", "replay", "--synthetic", "1", "--gen-len", "64"],
        ["sim", "serve", "--workload", "tiny"],
        [
            "sim",
            "sweep",
            "--workload",
            "tiny",
            "--points",
            "fullkv",
            "--jobs",
            "1",
            "--fidelity-traces",
            "0",
        ],
    ],
)
def test_an_unusable_out_dir_fails_before_the_work(capsys, tmp_path, monkeypatch, command):
    import growpage.commands.sim as commands

    def no_work(*args, **kwargs):
        raise AssertionError("the work started before --out was checked")

    monkeypatch.setattr(commands, "tqdm", no_work)
    monkeypatch.setattr("growpage.executors.grids.replay_trace", no_work)
    monkeypatch.setattr("growpage.sim.sweep.run_sweep", no_work)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert main(command + [*SMALL, "--out", str(blocker / "out")]) == 2
    assert "--out" in capsys.readouterr().err


def test_calibrate_reports_an_unusable_out_path(capsys, tmp_path):
    rows = tmp_path / "m.csv"
    rows.write_text(
        "num_seqs,kv_tokens,prefill_tokens,step_s\n1,100,0,0.01\n2,200,0,0.02\n"
        "4,400,0,0.03\n8,800,100,0.05\n1,50,500,0.04\n"
    )
    assert main(["calibrate", "--measurements", str(rows), "--out", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err
    assert main(["calibrate", "--measurements", str(rows), "--out", str(rows / "x.json")]) == 2
    assert "--out" in capsys.readouterr().err
    assert (
        main(["calibrate", "--measurements", str(rows), "--out", str(tmp_path / "new" / "cm.json")])
        == 0
    )
    assert json.loads((tmp_path / "new" / "cm.json").read_text())["kind"] == "linear"


def test_sweep_in_trace_mode_serves_the_trace_set(capsys, tmp_path):
    spec = SyntheticSpec(
        num_layers=1, num_q_heads=2, num_kv_heads=1, head_dim=16, prompt_len=20, gen_len=1
    )
    write_synthetic_trace_set(tmp_path / "set", spec, output_lens=[90, 60], seed=2)
    csv = tmp_path / "w.csv"
    csv.write_text("arrival_s,prompt_tokens,output_tokens,trace\n0,5,5,synthetic-1\n0,5,5,\n")
    out = run_json(
        capsys,
        [
            "sim",
            "sweep",
            "--workload",
            str(csv),
            *SMALL,
            "--kv-pages",
            "20",
            "--points",
            "fullkv",
            "--jobs",
            "1",
            "--fidelity-traces",
            "0",
            "--decisions",
            "trace",
            "--traces",
            str(tmp_path / "set"),
        ],
    )
    # As in serve: synthetic-1 (61 output tokens), then the set's entry 1 (61), not the
    # CSV's 5 + 5.
    assert out["points"][0]["output_tokens"] == 122
    assert (
        main(
            [
                "sim",
                "sweep",
                "--workload",
                str(csv),
                *SMALL,
                "--points",
                "fullkv",
                "--decisions",
                "trace",
                "--traces",
                str(tmp_path / "nothing"),
            ]
        )
        == 2
    )
    assert "not a trace set" in capsys.readouterr().err
    # Fidelity replays the set's traces too (it replayed synthetic ones): as `sim replay`.
    replayed = run_json(
        capsys,
        [
            "sim",
            "replay",
            "--traces",
            str(tmp_path / "set"),
            *SMALL,
            "--policy",
            "fixed",
            "--param",
            "budget_tokens=64",
            "--fidelity-queries",
            "4",
        ],
    )["summary"]
    swept = run_json(
        capsys,
        [
            "sim",
            "sweep",
            "--workload",
            str(csv),
            *SMALL,
            "--kv-pages",
            "20",
            "--points",
            "fixed@budget_tokens=64",
            "--jobs",
            "1",
            "--fidelity-traces",
            "4",
            "--decisions",
            "trace",
            "--traces",
            str(tmp_path / "set"),
        ],
    )["points"][0]  # the set holds 2
    assert swept["mass_mean"] == pytest.approx(replayed["mass_mean"])
    assert swept["replay_avg_budget"] == pytest.approx(replayed["avg_budget"])
    assert swept["fidelity_source"] == f"traces {tmp_path / 'set'} (first 2)"


@pytest.mark.parametrize("command", ["serve", "sweep"])
def test_traces_without_trace_mode_is_an_error(capsys, tmp_path, command):
    spec = SyntheticSpec(
        num_layers=1, num_q_heads=2, num_kv_heads=1, head_dim=16, prompt_len=20, gen_len=1
    )
    write_synthetic_trace_set(tmp_path / "set", spec, output_lens=[90], seed=2)
    assert (
        main(["sim", command, "--workload", "tiny", *SMALL, "--traces", str(tmp_path / "set")]) == 2
    )
    assert "--decisions trace" in capsys.readouterr().err


def test_sweep_without_fidelity_plots_the_budget(capsys, tmp_path, monkeypatch):
    import growpage.plots as plots

    calls = []
    monkeypatch.setattr(
        plots,
        "plot_pareto",
        lambda rows, path, x, y, *a: calls.append([(r[x], r[y]) for r in rows]),
    )
    run_json(
        capsys,
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
            "fixed@budget_tokens=64",
            "--jobs",
            "1",
            "--fidelity-traces",
            "0",
            "--out",
            str(tmp_path),
        ],
    )
    assert len(calls) == 1 and len(calls[0]) == 2
    assert all(x > 0 and y is not None and y > 0 for x, y in calls[0])  # no empty plot


@pytest.mark.parametrize("value", ["0", "-2", "two"])
def test_threads_must_be_a_positive_integer(value, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["sim", "replay", "--synthetic", "1", "--threads", value])
    assert exit_info.value.code == 2
    assert "--threads: expected an integer >= 1" in capsys.readouterr().err


CRASH_POLICY = """
import attrs
from growpage.policies.base import CapacityPolicy


@attrs.define
class Crash(CapacityPolicy):
    name = "crash"

    def decide(self, ctx):
        raise RuntimeError("kaboom")


@attrs.define
class AsksTheContextWrong(CapacityPolicy):
    name = "asks-wrong"

    def decide(self, ctx):
        return ctx.attention("longterm")
"""


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_a_failing_sweep_point_is_named_and_the_others_are_kept(capsys, tmp_path, jobs):
    (tmp_path / "pols.py").write_text(CRASH_POLICY)
    crash = f"{tmp_path / 'pols.py'}:Crash"
    argv = [
        "sim",
        "sweep",
        "--workload",
        "tiny",
        *SMALL,
        "--kv-pages",
        "120",
        "--points",
        crash,
        "fullkv",
        "--jobs",
        jobs,
        "--fidelity-traces",
        "0",
        "--out",
        str(tmp_path / "out"),
    ]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert "fullkv" in captured.out and "Traceback" not in captured.err
    bar, _, error = captured.err.rpartition("growpage: error: ")
    assert bar.endswith("\n") and "2/2" in bar and "1 failed" in bar  # closed before the error
    assert error.startswith("1 of 2 sweep points failed (1 finished")
    assert (
        f"  {crash}: PolicyError: policy crash decide() raised RuntimeError: kaboom (request '"
        in error
        and "pols.py:11, in decide)" in error
    )
    saved = json.loads((tmp_path / "out" / "sweep.json").read_text())
    assert [p["label"] for p in saved["points"]] == ["fullkv"]
    assert saved["points"][0]["tps"] > 0
    assert [p["label"] for p in saved["failed"]] == [crash]
    assert (tmp_path / "out" / "pareto.png").stat().st_size > 0
    assert main(argv[:-2] + ["--json"]) == 2
    out = json.loads(capsys.readouterr().out)
    assert [p["label"] for p in out["points"]] == ["fullkv"]
    assert "RuntimeError: kaboom" in out["failed"][0]["error"]


def test_a_failing_sweep_point_names_the_policys_line_when_growpage_refused_its_call(
    capsys, tmp_path
):
    """The context method raises (inside growpage), but the line to fix is the policy's, as
    ``sim serve`` and ``sim replay`` report it."""
    (tmp_path / "pols.py").write_text(CRASH_POLICY)
    argv = [
        "sim",
        "sweep",
        "--workload",
        "tiny",
        *SMALL,
        "--kv-pages",
        "120",
        "--points",
        f"{tmp_path / 'pols.py'}:AsksTheContextWrong",
        "--jobs",
        "1",
        "--fidelity-traces",
        "0",
    ]
    assert main(argv) == 2
    error = capsys.readouterr().err.rpartition("growpage: error: ")[2]
    assert "got 'longterm'" in error
    assert error.rstrip().endswith(f"({tmp_path / 'pols.py'}:19, in decide)"), error


def test_serve_records_the_policy_params(capsys, tmp_path):
    out = run_json(
        capsys,
        [
            "sim",
            "serve",
            "--workload",
            "tiny",
            *SMALL,
            "--kv-pages",
            "80",
            "--policy",
            "fixed",
            "--param",
            "budget_tokens=128",
            "--out",
            str(tmp_path),
        ],
    )
    assert out["policy"] == "fixed" and out["params"] == {"budget_tokens": 128}
    saved = json.loads((tmp_path / "metrics.json").read_text())
    assert saved["policy"] == "fixed" and saved["params"] == {"budget_tokens": 128}


def test_sweep_points_run_with_the_threads_asked_for(capsys, monkeypatch):
    import torch

    calls = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    run_json(
        capsys,
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
            "--threads",
            "3",
        ],
    )
    assert calls and set(calls) == {3}


@pytest.mark.parametrize(
    "command",
    [
        ["sim", "replay", "--traces"],
        ["sim", "serve", "--workload", "tiny", "--decisions", "trace", "--traces"],
    ],
)
def test_a_missing_trace_set_directory_is_named_as_such(capsys, tmp_path, command):
    (tmp_path / "file").write_text("x")
    assert main(command + [str(tmp_path / "nosuchdir")]) == 2
    assert f"{tmp_path / 'nosuchdir'}: no such directory" in capsys.readouterr().err
    assert main(command + [str(tmp_path / "file")]) == 2
    assert f"{tmp_path / 'file'}: not a directory" in capsys.readouterr().err
    assert main(command + [str(tmp_path)]) == 2
    assert "index.json: no trace-set index" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags",
    [
        ["--gen-len", "100"],
        ["--schedule", "bogus"],
        ["--seed", "3"],
        ["--gen-len", "100", "--schedule", "switch"],
    ],
)
def test_replay_of_a_trace_set_rejects_synthetic_only_flags(capsys, tmp_path, flags):
    spec = SyntheticSpec(
        num_layers=1, num_q_heads=2, num_kv_heads=1, head_dim=16, prompt_len=20, gen_len=1
    )
    write_synthetic_trace_set(tmp_path / "set", spec, output_lens=[100], seed=1)
    assert main(["sim", "replay", "--traces", str(tmp_path / "set"), *SMALL, *flags]) == 2
    err = capsys.readouterr().err
    assert "for --synthetic traces only, not with --traces" in err
    assert all(flag in err for flag in flags if flag.startswith("--"))


@pytest.mark.parametrize(
    "command", [["serve"], ["sweep", "--points", "fullkv", "--jobs", "1", "--fidelity-traces", "0"]]
)
def test_the_workload_trace_column_is_noted_on_stderr(capsys, tmp_path, command):
    csv = set_and_workload(tmp_path, "0,5,5,synthetic-1\n0,20,61,\n0,5,5,\n")
    argv = ["sim", *command, "--workload", str(csv), *SMALL, "--kv-pages", "40", "--json"]
    for mode in ([], ["--decisions", "trace"]):  # script mode, trace mode without a set
        assert main(argv + mode) == 0
        err = capsys.readouterr().err
        assert err.count("the trace column is ignored") == 1 and "lengths" not in err
    assert main(argv + ["--decisions", "trace", "--traces", str(tmp_path / "set")]) == 0
    err = capsys.readouterr().err
    # synthetic-1 (20 + 61), then the set's entries in turn: synthetic-1 again (20 + 61, as
    # the CSV says) and synthetic-0 (20 + 91).
    assert (
        err.count(
            "growpage: note: 2 of 3 requests take their prompt and output lengths from "
            f"their traces in {tmp_path / 'set'}"
        )
        == 1
    )
    assert "ignored" not in err
    assert main(["sim", *command, "--workload", "tiny", *SMALL, "--json"]) == 0
    assert capsys.readouterr().err == ""


def test_serving_tables_print_seconds_with_three_significant_digits():
    from growpage.sim.reports import SERVING_COLUMNS, format_table

    rows = [
        {"total_s": t, "boundary_s": b}
        for t, b in [(0.04123, 0.0), (43.18, 0.0061), (10800.4, 2.5)]
    ]
    columns = [c for c in SERVING_COLUMNS if c[0] in ("total_s", "boundary_s")]
    lines = format_table(rows, columns).splitlines()
    assert [line.split() for line in lines[2:]] == [
        ["0.0412", "0"],
        ["43.2", "0.00610"],
        ["10800", "2.50"],
    ]


def test_a_policy_module_in_the_current_directory_is_suggested_as_a_file(
    capsys, tmp_path, monkeypatch
):
    import os
    import sys

    (tmp_path / "cwd_pols.py").write_text(CRASH_POLICY)
    monkeypatch.chdir(tmp_path)  # as the console script runs: the cwd is not on sys.path
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", os.getcwd())])
    argv = ["sim", "replay", "--synthetic", "1", "--gen-len", "64", *SMALL]
    assert main(argv + ["--policy", "cwd_pols:Crash"]) == 2
    assert (
        "No module named 'cwd_pols'; to load the file cwd_pols.py, give 'cwd_pols.py:Crash'"
        in capsys.readouterr().err
    )
    assert main(argv + ["--policy", "no_such_pols:Crash"]) == 2
    assert "a policy in a file is given as 'path/file.py:Crash'" in capsys.readouterr().err


def test_output_piped_into_a_reader_that_stops_early_ends_quietly():
    """`growpage sim replay ... | head -1`: the broken pipe is no traceback."""
    import subprocess
    import sys

    code = (
        "import sys; from growpage import cli; sys.exit(cli.main(['sim', 'replay', "
        "'--synthetic', '2', '--gen-len', '256', '--page-size', '64']))"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    proc.stdout.close()  # the reader is gone before anything was written
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 1, err
    assert "Traceback" not in err and "Exception ignored" not in err and "error" not in err


def test_a_broken_trace_in_a_set_is_found_before_any_replay(tmp_path, capsys, monkeypatch):
    from growpage.core.trace_set import TraceSet
    from growpage.sim.synthetic import SyntheticSpec, synthetic_trace

    ts = TraceSet(tmp_path / "set", create=True)
    spec = SyntheticSpec(gen_len=128)
    entries = [ts.write(synthetic_trace(spec, i, f"t{i}")) for i in range(2)]
    (tmp_path / "set" / entries[1].file).write_text("broken")
    monkeypatch.setattr(
        "growpage.executors.grids.replay_trace", lambda *a, **k: pytest.fail("replayed")
    )
    assert main(["sim", "replay", "--traces", str(tmp_path / "set")]) == 2
    assert entries[1].file in capsys.readouterr().err


def test_serve_with_async_compaction(capsys):
    base = [
        "sim",
        "serve",
        "--workload",
        "tiny",
        *SMALL,
        "--kv-pages",
        "80",
        "--policy",
        "fixed",
        "--param",
        "budget_tokens=128",
    ]
    sync = run_json(capsys, base)
    asyn = run_json(capsys, [*base, "--async-compaction"])
    assert not sync["sim"]["async_compaction"] and asyn["sim"]["async_compaction"]
    assert asyn["metrics"]["output_tokens"] == sync["metrics"]["output_tokens"]
    assert asyn["metrics"]["compresses"] == sync["metrics"]["compresses"] > 0
    assert asyn["metrics"]["decode_steps"] > sync["metrics"]["decode_steps"]
    late = run_json(capsys, [*base, "--async-decisions"])
    assert late["sim"]["async_decisions"] and not asyn["sim"]["async_decisions"]
    assert late["metrics"]["output_tokens"] == sync["metrics"]["output_tokens"]
    assert late["metrics"]["decode_steps"] > sync["metrics"]["decode_steps"]


def test_small_pages_get_the_engines_recent_window(capsys):
    """--page-size 16 alone works, as growpage generate --page-size 16 does (window 4)."""
    out = run_json(
        capsys, ["sim", "replay", "--synthetic", "1", "--gen-len", "128", "--page-size", "16"]
    )
    assert out["config"]["recent_window"] == 4
    out = run_json(capsys, ["sim", "replay", "--synthetic", "1", "--gen-len", "128"])
    assert out["config"]["recent_window"] == 16
    out = run_json(
        capsys,
        [
            "sim",
            "replay",
            "--synthetic",
            "1",
            "--gen-len",
            "128",
            "--page-size",
            "16",
            "--recent-window",
            "2",
        ],
    )
    assert out["config"]["recent_window"] == 2


def test_serve_shares_a_prefix_unless_told_not_to(capsys, tmp_path):
    """Eight requests naming one 256-token system prompt (pages of 32): seven take its 8 cached
    pages; ``--no-prefix-caching`` computes every token, and ``--no-chunked-prefill`` is
    recorded. The text report says how many tokens came from the cache."""
    path = tmp_path / "w.csv"
    path.write_text(
        "arrival_s,prompt_tokens,output_tokens,prefix,prefix_tokens\n"
        + "".join(f"{i * 0.01},300,40,sys,256\n" for i in range(8))
    )
    base = [
        "sim",
        "serve",
        "--workload",
        str(path),
        *SMALL,
        "--kv-pages",
        "200",
        "--policy",
        "fullkv",
        "--max-num-batched-tokens",
        "512",
    ]
    cached = run_json(capsys, base)
    assert cached["metrics"]["prefix_hit_tokens"] == 7 * 256
    assert cached["sim"]["prefix_caching"] and cached["sim"]["chunked_prefill"]
    assert cached["cost_model"]["kind"] == "RooflineCostModel"
    computed = run_json(capsys, [*base, "--no-prefix-caching", "--no-chunked-prefill"])
    assert computed["metrics"]["prefix_hit_tokens"] == 0
    assert not computed["sim"]["prefix_caching"] and not computed["sim"]["chunked_prefill"]
    assert computed["metrics"]["ttft_s"] > cached["metrics"]["ttft_s"]
    assert main(base) == 0
    assert f"{7 * 256} prompt tokens from the prefix cache" in capsys.readouterr().out


def test_a_policy_error_names_the_policy_files_line(capsys, tmp_path):
    """``growpage sim replay`` with a policy that raises says where, as ``sim sweep`` does."""
    (tmp_path / "bad_policy.py").write_text(
        "from growpage import CapacityPolicy, Decision\n\n\n"
        "class Bad(CapacityPolicy):\n"
        "    name = 'bad'\n\n"
        "    def decide(self, ctx):\n"
        "        return {}[ctx.position]\n"
    )
    code = main(
        [
            "sim",
            "replay",
            "--synthetic",
            "1",
            "--gen-len",
            "200",
            *SMALL,
            "--policy",
            f"{tmp_path / 'bad_policy.py'}:Bad",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2
    assert f"({tmp_path / 'bad_policy.py'}:8, in decide)" in err, err


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["sim", "replay", "--traces", ""], "--traces"),
        (
            ["sim", "serve", "--workload", "tiny", "--decisions", "trace", "--traces", " "],
            "--traces",
        ),
        (["sim", "replay", "--synthetic", "1", "--out", ""], "--out"),
        (["sim", "serve", "--workload", ""], "--workload"),
        (["calibrate", "--measurements", ""], "--measurements"),
        (["record", "--prompts", "p.txt", "--out", ""], "--out"),
        (["generate", "--prompt", "hi", "--out", ""], "--out"),
    ],
)
def test_an_empty_path_is_a_usage_error(capsys, argv, flag):
    # --traces "" used to read the current directory (a traceback in replay, synthetic traces
    # in serve), --out "" to write into it or nothing at all.
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert (
        f"argument {flag}: expected a name or path, got an empty string" in capsys.readouterr().err
    )


@pytest.mark.parametrize("value", ["0", "-3"])
def test_record_refuses_a_max_tokens_below_one_before_loading_the_model(tmp_path, capsys, value):
    with pytest.raises(SystemExit) as exit_info:
        main(
            ["record", "--prompts", "p.txt", "--out", str(tmp_path / "set"), "--max-tokens", value]
        )
    assert exit_info.value.code == 2
    assert "--max-tokens: expected an integer >= 1" in capsys.readouterr().err
    assert not (tmp_path / "set").exists()


def test_replay_capacity_plot_draws_each_trace_to_its_last_token(capsys, tmp_path, monkeypatch):
    import growpage.plots as plots

    drawn = {}
    real = plots.plot_capacity
    monkeypatch.setattr(
        plots,
        "plot_capacity",
        lambda trajectories, *a, **k: drawn.update(trajectories) or real(trajectories, *a, **k),
    )
    # Page size 256: a 214-token trace of a 64-token prompt never reaches a boundary; its line
    # used to be a single point (an empty plot).
    out = run_json(
        capsys,
        [
            "sim",
            "replay",
            "--synthetic",
            "2",
            "--gen-len",
            "150",
            "--page-size",
            "256",
            "--out",
            str(tmp_path),
        ],
    )
    assert all(t["boundaries"] == 0 for t in out["traces"])
    assert len(drawn) == 2
    for trace in out["traces"]:
        line = drawn[trace["request_id"]]
        assert len(line) == 2 and line[-1][0] == trace["num_tokens"]
        assert line[0][1] == line[-1][1]


def test_a_shared_prefix_longer_than_its_traces_prompt_names_both(capsys, tmp_path):
    spec = SyntheticSpec(
        num_layers=1, num_q_heads=2, num_kv_heads=1, head_dim=16, prompt_len=20, gen_len=1
    )
    write_synthetic_trace_set(tmp_path / "set", spec, output_lens=[30], seed=2)
    csv = tmp_path / "w.csv"
    csv.write_text("arrival_s,prompt_tokens,output_tokens,prefix,prefix_tokens\n0,100,10,sys,90\n")
    assert (
        main(
            [
                "sim",
                "serve",
                "--workload",
                str(csv),
                *SMALL,
                "--kv-pages",
                "20",
                "--decisions",
                "trace",
                "--traces",
                str(tmp_path / "set"),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert (
        "request req-0: its shared prefix 'sys' of 90 tokens is longer than the prompt of "
        f"its trace 'synthetic-0' in {tmp_path / 'set'} (20 tokens)"
    ) in err


def test_traces_of_some_layers_only_get_a_note(capsys, tmp_path):
    from growpage.core.trace_set import TraceSet
    from growpage.core.traces import Trace
    from growpage.sim.synthetic import synthetic_trace

    whole = synthetic_trace(
        SyntheticSpec(
            num_layers=3, num_q_heads=2, num_kv_heads=1, head_dim=16, prompt_len=20, gen_len=40
        ),
        1,
        "r0",
    )
    header = attrs.evolve(whole.header, layer_ids=[0, 2])
    part = Trace(
        header=header,
        queries=whole.queries[[0, 2]],
        keys=whole.keys[[0, 2]],
        values=None if whole.values is None else whole.values[[0, 2]],
    )
    TraceSet(tmp_path / "set", create=True).write(part)
    assert main(["sim", "replay", "--traces", str(tmp_path / "set"), *SMALL, "--json"]) == 0
    err = capsys.readouterr().err
    assert "traces hold 2 of 3 model layers; Delta_t, scores and fidelity are computed" in err
    TraceSet(tmp_path / "whole", create=True).write(whole)
    assert main(["sim", "replay", "--traces", str(tmp_path / "whole"), *SMALL, "--json"]) == 0
    assert "model layers" not in capsys.readouterr().err
