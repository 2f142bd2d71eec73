"""Host work per capacity boundary on the kernel path (``benchmarks/boundary_ops.py``).

On a GPU a boundary of a small model costs launches and host syncs, so their counts are
behaviour: a regression here is a slower engine, whatever this machine's clock says.
"""

from __future__ import annotations

import json

import pytest
import torch
from benchmark_scripts import load_benchmark


@pytest.fixture(scope="module")
def report():
    bench = load_benchmark("boundary_ops")
    return bench.measure(
        bench.parse_args(["--requests", "3", "--max-tokens", "26", "--kv-pages", "9", "--top", "5"])
    )


def test_both_outcomes_are_measured(report):
    rows = report["rows"]
    assert {"compress", "decided grow"} <= set(rows), rows
    assert all(r["boundaries"] > 0 and r["ms"] > 0 for r in rows.values())


def test_a_decided_grow_waits_for_the_device_once(report):
    grow = report["rows"]["decided grow"]
    # Delta_t is read once; the block table is copied once; three launches: the calibrated,
    # rotated summaries and the two demand-attention kernels.
    assert grow["syncs"] == 1 and grow["h2d"] == 1 and grow["launches"] == 3, grow
    assert grow["ops"] <= 16, grow  # the top-p sizes and Delta_t in torch


def test_a_compression_waits_for_the_device_twice(report):
    compress = report["rows"]["compress"]
    # Delta_t, then the selection check; the source and destination tables in one copy.
    assert compress["syncs"] == 2 and compress["h2d"] == 2, compress
    assert compress["launches"] == 6 and compress["ops"] <= 38, compress


@pytest.fixture(scope="module")
def shared(report):
    """Four requests of equal prompt length: their boundaries fall in the same steps. Members
    are padded as on a GPU (on the CPU only equal candidate counts are sorted together), so
    every step's attention is one batch."""
    from growpage.core.boundary_context import BoundaryBatch

    bench = load_benchmark("boundary_ops")
    before = BoundaryBatch.pad
    report = bench.measure(
        bench.parse_args(
            [
                "--requests",
                "4",
                "--max-tokens",
                "40",
                "--kv-pages",
                "14",
                "--prompt-len",
                "30",
                "--pad",
            ]
        )
    )
    assert report["pad"] is True and BoundaryBatch.pad is before  # set for the run only
    return report


def test_boundaries_of_one_step_wait_for_delta_once(report, shared):
    steps = shared["rows"]["shared steps"]["per_step"]
    assert len(steps) >= 2 and all(step["decided"] >= 2 for step in steps), steps
    solo_grow, solo_compress = report["rows"]["decided grow"], report["rows"]["compress"]
    for step in steps:
        # One sync for every Delta_t of the step, then one for the check of all its
        # compressions' selections. The step's queries are one launch and its demand attention
        # two, for all its boundaries; its compressions add their selection attention (2)
        # and their compaction (1), for all of them (core.compaction_batch).
        compressed = step["compress"] > 0
        assert step["syncs"] == 1 + compressed, step
        assert step["launches"] == 3 + 3 * compressed, step
        alone = (
            solo_grow["ops"] * (step["decided"] - step["compress"])
            + solo_compress["ops"] * step["compress"]
        )
        assert step["ops"] < alone, (step, alone)  # one top-p sort for all of them


def test_the_launch_counter_is_removed_afterwards(report):
    from triton.runtime import interpreter

    assert interpreter.InterpretedFunction.run.__qualname__ == "InterpretedFunction.run"


def test_host_only_times_boundaries_with_launches_stubbed():
    from growpage.kernels.variants import KERNELS

    bench = load_benchmark("boundary_ops")
    report = bench.measure(
        bench.parse_args(
            ["--requests", "2", "--max-tokens", "30", "--kv-pages", "6", "--host-only", "--phases"]
        )
    )
    assert report["host_only"] and report["rows"]
    phases = report["phases"]  # the boundary phases of the same run
    assert phases["decided"] == sum(
        row["boundaries"] for kind, row in report["rows"].items() if kind != "forced grow"
    )
    assert phases["calls"]["compact"] == report["rows"].get("compress", {}).get("boundaries", 0)
    assert "| attention |" in phases["markdown"]
    for row in report["rows"].values():
        assert set(row) == {"boundaries", "ms"} and row["boundaries"] > 0 and row["ms"] > 0
    assert all("run" not in kernel.__dict__ for kernel in KERNELS.values())  # stubs removed


def test_boundary_share_estimates_the_gpu_check_run_host_side():
    bench = load_benchmark("boundary_share")
    args = bench.parse_args(
        [
            "--requests",
            "3",
            "--max-tokens",
            "60",
            "--page-size",
            "8",
            "--layers",
            "2",
            "--policies",
            "fullkv",
            "growpage",
            "--async-compaction",
            "--async-decisions",
        ]
    )
    # With launches stubbed the kernels' outputs stay unwritten, so the decisions follow
    # whatever memory torch hands out (they changed with the tests run before this one). Here
    # that memory is NaN, so every decision is the same on every run (Delta_t = 0: compress).
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        report = bench.run(args)
    finally:
        torch.use_deterministic_algorithms(deterministic)
    grow, full = report["rows"]["growpage"], report["rows"]["fullkv"]
    assert grow["decided"] > 0 and grow["events"]["compress"] > 0, grow["events"]
    assert 0 < grow["boundary_pct"] < 100 and grow["boundary_s"] <= grow["total_s"]
    assert grow["phases"]["calls"]["compact"] == grow["events"]["compress"]
    assert full["events"]["compress"] == 0 and full["phases"]["calls"]["compact"] == 0
    # Compressions deferred to beside the forward: what is left is the decisions' share.
    deferred = report["rows"]["growpage+async"]
    assert set(report["rows"]) == {
        "fullkv",
        "growpage",
        "growpage+async",
        "growpage+async-decisions",
    }
    assert deferred["deferred_compactions"] == deferred["events"]["compress"] > 0
    assert 0 < deferred["decision_pct"] < deferred["boundary_pct"]
    assert grow["decision_pct"] == grow["boundary_pct"] and grow["deferred_s"] == 0
    assert grow["deferred_decisions"] == deferred["deferred_decisions"] == 0
    # Whole boundaries beside the forward: every decided one is late (growpage falls back to
    # compressing, no prefix cache), and its work is counted as deferred. How much that takes
    # off the critical path is timing, which the benchmark prints (two runs' shares compared
    # here flipped on a loaded machine).
    late = report["rows"]["growpage+async-decisions"]
    assert late["deferred_decisions"] == late["decided"] > 0
    assert late["deferred_compactions"] == 0  # a late compression runs with its decision
    assert late["deferred_s"] > 0 and 0 <= late["decision_pct"] < late["boundary_pct"]
    # 40% of what fullkv needs for all requests, but room for the longest one.
    assert bench.gpu_check_pool([100] * 10, 412, 64) == 36  # 10 x 9 pages -> 36
    assert bench.gpu_check_pool([100], 60, 8) == 22  # 161 tokens: 21 pages, 8 < 161 // 8 + 2


def test_boundary_share_without_decided_boundaries_says_n_a(capsys, tmp_path):
    bench = load_benchmark("boundary_share")
    out = tmp_path / "share.json"
    argv = [
        "--requests",
        "10",
        "--max-tokens",
        "2",
        "--page-size",
        "32",
        "--layers",
        "1",
        "--policies",
        "growpage",
        "--prompt-len",
        "20",
        "--json",
        str(out),
        "--threads",
        str(torch.get_num_threads()),
    ]  # a page never fills: nothing decided
    assert bench.main(argv) == 0
    row = json.loads(out.read_text())["rows"]["growpage"]
    assert row["decided"] == 0 and row["ms_per_decided"] is None
    assert "| 0 | n/a |" in capsys.readouterr().out


def test_gpu_check_engine_row_without_decided_boundaries_says_n_a(capsys):
    bench = load_benchmark("gpu_check")
    row = {
        "dtype": "float32",
        "tokens_per_s": 10.0,
        "ms_per_step": 12.5,
        "boundary_pct": 0.5,
        "ms_per_decided_boundary": None,
        "boundary_critical_pct": 0.5,
        "compiles_during_run": {},
    }
    bench._print_row("growpage", row)
    out = capsys.readouterr().out
    assert "(n/a ms per decided)" in out and "12.50 ms per step (float32)" in out
