"""Pieces of benchmarks/policies_engine.py: the policy plan, matching and the targets."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from benchmark_scripts import load_benchmark

bench = load_benchmark("policies_engine")


def row(policy: str, label: str | None = None, **kw) -> dict:
    base = dict(
        policy=policy,
        label=label or policy,
        tps=100.0,
        nll=1.0,
        avg_budget=300.0,
        decided_grow=3,
        decided_compress=1,
    )
    return {**base, **kw}


def test_order_always_has_the_baseline_and_what_matching_needs():
    assert bench.policy_order(None) == bench.ALL_POLICIES
    assert bench.policy_order(["inverse"]) == ["fullkv", "inverse"]
    assert bench.policy_order(["random"]) == ["fullkv", "growpage", "random"]
    with pytest.raises(SystemExit, match="unknown policies"):
        bench.policy_order(["nope"])


def test_fixed_and_random_are_matched_to_growpage():
    args = argparse.Namespace(page_size=64, min_capacity=4, seed=5)
    g = row("growpage", avg_budget=290.0, decided_grow=3, decided_compress=1)
    assert bench.plan(args, "fixed", g) == [
        ("fixed-320", "fixed", {"budget_tokens": 320}),
        ("fixed-640", "fixed", {"budget_tokens": 640}),
    ]
    ((label, name, kwargs),) = bench.plan(args, "random", g)
    assert name == "random" and kwargs == {"grow_prob": 0.75, "seed": 5} and "0.75" in label
    small = row("growpage", avg_budget=10.0)  # never below the minimum capacity
    assert bench.plan(args, "fixed", small)[0][2] == {"budget_tokens": 256}
    assert bench.plan(args, "shrink", None) == [("shrink", "shrink", {"min_capacity_tokens": 256})]


def test_targets_are_ratios_of_the_same_run():
    rows = [
        row("fullkv", tps=100.0, nll=1.0),
        row("growpage", tps=160.0, nll=1.01),
        row("fixed", "fixed-256", tps=150.0, nll=1.2),
        row("random", tps=120.0, nll=1.1),
        row("inverse", tps=170.0, nll=1.005),
    ]
    t = bench.targets(rows)
    assert t["growpage_tps_vs_fullkv"] == pytest.approx(1.6)
    assert t["growpage_nll_increase_pct"] == pytest.approx(1.0)
    assert t["tps_and_quality_met"] and t["growpage_beats_matched_fixed"]
    assert t["matched_fixed"] == "fixed-256" and t["random_worse_nll"]
    assert not t["inverse_worse_nll"]
    rows[1]["nll"] = 1.05
    assert not bench.targets(rows)["tps_and_quality_met"]


def test_bad_arguments_are_refused(capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--pool-fraction", "1.5"])
    assert "--pool-fraction" in capsys.readouterr().err
    args = bench.parse_args(["--preset", "full", "--max-tokens", "64"])
    assert args.num_requests == 48 and args.max_tokens == 64 and args.page_size == 64


def test_each_preset_and_device_has_its_own_default_folder():
    def folder(*argv: str) -> tuple[str, ...]:
        return Path(bench.parse_args(list(argv)).out).parts[-3:]

    assert folder("--preset", "full", "--device", "cuda") == (
        "results",
        "policies_engine",
        "full-cuda",
    )
    assert folder() == ("results", "policies_engine", "cpu-cpu")
    assert folder("--device", "cuda:1") == ("results", "policies_engine", "cpu-cuda1")
    assert bench.parse_args(["--out", "elsewhere"]).out == "elsewhere"


def test_coincident_trajectories_are_drawn_apart(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    figures, close = [], plt.close
    monkeypatch.setattr(plt, "close", figures.append)  # keep the figure to look at its lines
    same = [(64, 2, "grow"), (128, 3, "grow"), (192, 3, "compress")]
    rows = [
        row(policy, label, trajectories=[traj], prompt_lens=[60])
        for policy, label, traj in (
            ("fullkv", None, same[:2] + [(192, 4, "grow")]),
            ("growpage", None, same),
            ("fixed", "fixed-128", same),
            ("fixed", "fixed-256", same),
        )
    ]
    bench.plot_trajectories(rows, 64, tmp_path / "t.png")
    [fig] = figures
    lines = fig.axes[0].get_lines()
    assert [line.get_label() for line in lines] == ["fullkv", "growpage", "fixed-128", "fixed-256"]
    assert len({(line.get_linestyle(), line.get_marker()) for line in lines}) == 4
    close(fig)


class _FakeBench:
    """``time_again`` from a table of passes; records the order the rows ran in."""

    def __init__(self, tps_by_label: dict[str, list[float]], events: dict | None = None):
        self.tps, self.events, self.order = tps_by_label, events or {}, []

    def time_again(self, r: dict, conts) -> dict:
        self.order.append(r["label"])
        tps = self.tps[r["label"]][sum(x == r["label"] for x in self.order)]
        counts = {k: r[k] for k in ("grow", "compress", "shrink", "fallback", "preemptions")}
        counts.update(self.events)
        return {"tps": tps, "tpot_ms": 1000 / tps, "total_s": 10_000 / tps, **counts}


def timed_row(label: str, tps: float) -> dict:
    return row(
        label,
        tps=tps,
        tpot_ms=1000 / tps,
        total_s=10_000 / tps,
        grow=3,
        compress=1,
        shrink=0,
        fallback=0,
        preemptions=0,
        kwargs={},
    )


def test_timing_passes_rotate_the_order_and_take_the_median():
    rows = [timed_row("a", 100.0), timed_row("b", 200.0), timed_row("c", 300.0)]
    fake = _FakeBench({"a": [0, 130.0, 90.0], "b": [0, 180.0, 260.0], "c": [0, 310.0, 100.0]})
    bench.timing_passes(fake, rows, conts=None, passes=3)
    assert fake.order == ["b", "c", "a", "c", "a", "b"]  # each pass starts one row later
    assert [r["tps"] for r in rows] == [100.0, 200.0, 300.0]  # medians of the three passes
    assert rows[0]["tps_passes"] == [100.0, 130.0, 90.0]
    assert rows[2]["total_s"] == pytest.approx(10_000 / 300.0)
    one = [timed_row("a", 100.0)]
    bench.timing_passes(_FakeBench({}), one, conts=None, passes=1)  # one pass: nothing more
    assert one[0]["tps"] == 100.0 and one[0]["tps_passes"] == [100.0]


def test_a_pass_with_other_decisions_is_an_error():
    rows = [timed_row("a", 100.0)]
    with pytest.raises(RuntimeError, match="pass 2 gave compress 2, the first 1"):
        bench.timing_passes(_FakeBench({"a": [0, 100.0]}, {"compress": 2}), rows, None, 2)


def test_the_table_says_how_tps_was_timed():
    rows = [timed_row("fullkv", 100.0)]
    for r in rows:
        r.update(avg_resident=2.0, avg_budget=300.0, boundary_s=0.1)
    report = {
        "args": {
            "num_requests": 1,
            "max_tokens": 4,
            "page_size": 8,
            "min_capacity": 4,
            "seed": 0,
            "timing_passes": 3,
        },
        "kv_pages": 8,
        "full_pages": 16,
        "machine": "m",
        "rows": rows,
        "targets": {},
        "fullkv_generate": {"tps": 1.0, "avg_resident": 1.0, "preemptions": 0},
        "wall_s": 1.0,
    }
    assert "the median of 3 passes per row" in bench.to_markdown(report)
    report["args"]["timing_passes"] = 1
    assert "--timing-passes 3" in bench.to_markdown(report)
