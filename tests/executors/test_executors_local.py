"""The local executor and what every executor shares: rows in order, failed rows, retries of
points whose worker was killed, the row store behind --resume, Ctrl-C, the executor flags.

The oracle of a grid is its function called point by point in this process."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from executor_points import (
    builds_by_pid,
    built_once,
    runs_of,
    square,
    square_or_die,
    square_or_interrupt,
    square_or_raise,
)

from growpage.cli import main
from growpage.executors import LocalExecutor, RowStore, fingerprint
from growpage.executors.options import FINISHED_DIR

SMALL = ["--page-size", "16", "--recent-window", "4"]


def grid(tmp_path: Path, **extra) -> dict:
    (tmp_path / "runs").mkdir(exist_ok=True)
    (tmp_path / "builds").mkdir(exist_ok=True)
    return {"runs": str(tmp_path / "runs"), "builds": str(tmp_path / "builds"), **extra}


def oracle(items, shared) -> list[dict]:
    return [{"item": i, "square": i * i, "tag": shared.get("tag")} for i in items]


@pytest.mark.parametrize("jobs", [1, 2])
def test_rows_come_back_in_order_whichever_point_finishes_first(tmp_path, jobs):
    shared = grid(tmp_path, sleep_s={0: 0.4})  # point 0 finishes last with two workers
    with LocalExecutor(jobs, store=RowStore(tmp_path / "rows"), progress=False) as ex:
        rows = ex.run(square, range(6), shared)
    assert rows == oracle(range(6), shared)
    assert [runs_of(shared, i) for i in range(6)] == [1] * 6
    assert ex.point_s[0] >= 0.4 and all(0 <= s < 0.4 for s in ex.point_s[1:])  # as they ran
    saved = [json.loads(p.read_text()) for p in (tmp_path / "rows").iterdir()]
    assert sorted(s["point_s"] for s in saved) == sorted(ex.point_s)


@pytest.mark.parametrize("jobs", [1, 2])
def test_a_point_that_raises_is_a_failed_row_and_the_grid_goes_on(tmp_path, capsys, jobs):
    shared = grid(tmp_path, bad=[2])
    names = [{"label": f"p{i}"} for i in range(5)]
    with LocalExecutor(jobs) as ex:
        rows = ex.run(square_or_raise, range(5), shared, names, desc="test")
    assert rows[:2] + rows[3:] == [r for r in oracle(range(5), shared) if r["item"] != 2]
    assert rows[2]["label"] == "p2" and set(rows[2]) == {"label", "error"}
    error = rows[2]["error"]
    assert error.startswith("ValueError: point 2 is bad (") and "executor_points.py:" in error
    assert error.endswith(", in square_or_raise)")
    bar = capsys.readouterr().err
    assert "5/5" in bar and "1 failed" in bar


def test_a_killed_worker_has_its_points_run_again_and_no_row_is_lost_or_doubled(tmp_path):
    shared = grid(tmp_path, killers=[1, 4], always=[], sleep_s={i: 0.1 for i in range(8)})
    with LocalExecutor(2, progress=False) as ex:
        rows = ex.run(square_or_die, range(8), shared)
    assert rows == oracle(range(8), shared)
    assert runs_of(shared, 1) == runs_of(shared, 4) == 2  # killed once, then finished
    # A point running beside a killed one is run again too (the pool breaks with it).
    assert all(1 <= runs_of(shared, i) <= 2 for i in range(8))


def test_a_point_that_kills_every_worker_fails_alone_after_its_retries(tmp_path):
    shared = grid(tmp_path, killers=[], always=[3], sleep_s={i: 0.1 for i in range(6)})
    with LocalExecutor(2, max_retries=1, progress=False) as ex:
        rows = ex.run(square_or_die, range(6), shared, [{"label": i} for i in range(6)])
    expected = oracle(range(6), shared)
    assert rows[:3] + rows[4:] == expected[:3] + expected[4:]  # its neighbours all finished
    assert rows[3]["label"] == 3 and rows[3]["error"].startswith("WorkerDied: ")
    assert "died 2 times" in rows[3]["error"]  # alone: the first run, then one retry
    assert runs_of(shared, 3) in (2, 3)  # and once beside another point, if it was


def test_resume_runs_only_the_points_without_a_stored_row(tmp_path, capsys):
    stop = tmp_path / "stop"
    stop.touch()
    shared = grid(tmp_path, stop_at=3, stop_file=str(stop))
    store_dir = tmp_path / "out" / FINISHED_DIR
    with pytest.raises(KeyboardInterrupt), LocalExecutor(1, store=RowStore(store_dir)) as ex:
        ex.run(square_or_interrupt, range(6), shared)
    assert f"3 of 6 points finished; their rows are in {store_dir}/" in capsys.readouterr().err
    assert len(list(store_dir.glob("*.json"))) == 3  # written as each point finished
    assert not list(store_dir.glob(".*"))  # no temporary file left
    stop.unlink()
    with LocalExecutor(2, store=RowStore(store_dir, resume=True), progress=False) as ex:
        rows = ex.run(square_or_interrupt, range(6), shared)
    assert rows == oracle(range(6), shared)
    assert [runs_of(shared, i) for i in range(6)] == [1] * 6  # none ran twice


def test_stored_rows_of_other_settings_are_not_taken(tmp_path):
    shared = grid(tmp_path, tag="a")
    store_dir = tmp_path / "rows"
    with LocalExecutor(1, store=RowStore(store_dir), progress=False) as ex:
        ex.run(square, range(3), shared)
    other = {**shared, "tag": "b"}
    with LocalExecutor(1, store=RowStore(store_dir, resume=True), progress=False) as ex:
        assert ex.run(square, range(3), other) == oracle(range(3), other)
    assert [runs_of(shared, i) for i in range(3)] == [2, 2, 2]
    with LocalExecutor(1, store=RowStore(store_dir, resume=True), progress=False) as ex:
        assert ex.run(square, range(4), shared) == oracle(range(4), shared)
    assert [runs_of(shared, i) for i in range(4)] == [2, 2, 2, 1]  # a's rows were kept


def test_a_fresh_run_clears_the_stored_rows_and_only_them(tmp_path):
    store_dir = tmp_path / "rows"
    RowStore(store_dir).put("a" * 40, {"x": 1})
    (store_dir / "notes.json").write_text("{}")
    assert RowStore(store_dir, resume=True).get("a" * 40) == {"x": 1}
    assert RowStore(store_dir).get("a" * 40) is None
    assert sorted(p.name for p in store_dir.iterdir()) == ["notes.json"]


def test_stored_rows_come_back_as_they_were_written(tmp_path):
    row = {"nan": math.nan, "inf": -math.inf, "pair": (1, 2.5), "nested": {"k": [None, True]}}
    RowStore(tmp_path).put("b" * 40, row)
    back = RowStore(tmp_path, resume=True).get("b" * 40)
    assert back is not None and math.isnan(back["nan"]) and back["inf"] == -math.inf
    assert back["pair"] == [1, 2.5] and back["nested"] == {"k": [None, True]}
    (tmp_path / ("c" * 40 + ".json")).write_text('{"key": "c"')  # cut short by hand
    with pytest.raises(Exception, match="not a finished row") as info:
        RowStore(tmp_path, resume=True)
    assert "c" * 40 in str(info.value)


def test_fingerprints_ignore_order_and_keep_values_apart():
    assert fingerprint({"b": 1, "a": {2, 3}}) == fingerprint({"a": {3, 2}, "b": 1})
    assert fingerprint({"x", "y", "z"}) == fingerprint({"z", "y", "x"})
    distinct = [0.0, -0.0, 1, 1.0, True, "1", None, (1,), [1.0], math.inf]
    assert len({fingerprint(v) for v in distinct}) == len(distinct)
    assert fingerprint(math.nan) == fingerprint(float("nan"))


def test_tensors_are_fingerprinted_by_their_whole_content():
    import torch

    a = torch.zeros(4000)
    b = a.clone()
    b[2000] = 1.0  # torch's repr elides the middle: the reprs are the same
    assert repr(a) == repr(b) and fingerprint(a) != fingerprint(b)
    assert fingerprint(a) == fingerprint(a.clone())
    assert fingerprint(a.to(torch.bfloat16)) != fingerprint(a.to(torch.float16))


def test_the_local_executor_builds_a_workers_state_once(tmp_path):
    shared = grid(tmp_path, sleep_s={i: 0.05 for i in range(8)})
    with LocalExecutor(2, progress=False) as ex:
        first = ex.run(built_once, range(8), shared)
        second = ex.run(built_once, range(8, 12), shared)  # the workers live on
    rows = first + second
    assert [r["square"] for r in rows] == [i * i for i in range(12)]
    builds = builds_by_pid(shared)
    assert set(builds) == {r["pid"] for r in rows} and set(builds.values()) == {1}
    assert len(builds) <= 2


# ---- the command line ------------------------------------------------------------------------
def test_ray_missing_is_named_with_the_extra_to_install(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    kept = tmp_path / FINISHED_DIR / ("d" * 40 + ".json")
    RowStore(kept.parent).put("d" * 40, {"label": "from an earlier run"})
    argv = ["sim", "sweep", "--workload", "tiny", "--points", "fullkv", "--executor", "ray"]
    assert main([*argv, "--out", str(tmp_path)]) == 2
    assert "--executor ray needs Ray, an optional extra: pip install 'growpage[ray]'" in (
        capsys.readouterr().err
    )
    assert kept.exists()  # the refused run cleared nothing


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--address", "auto"], "--address: for --executor ray only"),
        (["--resume"], "--resume needs --out DIR"),
        (["--executor", "ray", "--address", "auto", "--jobs", "2"], "--jobs sizes a Ray"),
        (["--jobs", "0"], "--jobs must be an integer >= 1, got 0"),
        (["--executor", "ray", "--address", "127.0.0.1:1"], "no Ray cluster answers there"),
    ],
)
@pytest.mark.parametrize(
    "command", [["sweep", "--workload", "tiny"], ["replay", "--synthetic", "1"]]
)
def test_executor_flags_are_checked_before_the_work(capsys, monkeypatch, flags, message, command):
    monkeypatch.setattr("growpage.sim.sweep.try_point", lambda *a: pytest.fail("ran"))
    monkeypatch.setattr("growpage.executors.grids.replay_trace", lambda *a: pytest.fail("ran"))
    assert main(["sim", *command, *SMALL, *flags]) == 2
    assert message in capsys.readouterr().err


def run_json(capsys, argv: list[str]) -> dict:
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_replay_in_worker_processes_gives_the_same_results(capsys):
    argv = ["sim", "replay", "--synthetic", "3", "--gen-len", "96", *SMALL, "--signals"]
    alone = run_json(capsys, argv)
    assert run_json(capsys, [*argv, "--jobs", "2"]) == alone
    assert [t["request_id"] for t in alone["traces"]] == [
        "synthetic-0",
        "synthetic-1",
        "synthetic-2",
    ]


def test_traces_handed_over_as_points_replay_as_their_set_does(tmp_path):
    from growpage.core.config import GrowPageConfig
    from growpage.executors.grids import ReplayJob, replay_point
    from growpage.sim.replay import ReplayOptions
    from growpage.sim.synthetic import SyntheticSpec, write_synthetic_trace_set

    spec = SyntheticSpec(num_layers=1, num_q_heads=2, num_kv_heads=1, head_dim=16, prompt_len=20)
    traces = write_synthetic_trace_set(tmp_path / "set", spec, output_lens=[70, 90], seed=5)
    job = ReplayJob(
        policy="growpage",
        config=GrowPageConfig(page_size=16, recent_window=4),
        options=ReplayOptions(fidelity_queries=2),
        traces=str(tmp_path / "set"),
    )
    with LocalExecutor(2, progress=False) as ex:
        by_entry = ex.run(replay_point, traces.index, job)
        by_value = ex.run(replay_point, list(traces), job)
    assert by_value == by_entry and [r["request_id"] for r in by_entry] == [
        "synthetic-0",
        "synthetic-1",
    ]


ONE_BAD_TRACE = """
from growpage import CapacityPolicy, Decision


class FailsOnOne(CapacityPolicy):
    name = "fails-on-one"

    def decide(self, ctx):
        if ctx.request_id == "synthetic-1":
            raise RuntimeError("not this one")
        return Decision.GROW
"""


def test_a_trace_that_fails_is_named_and_the_others_are_written(capsys, tmp_path):
    (tmp_path / "pol.py").write_text(ONE_BAD_TRACE)
    out = tmp_path / "out"
    argv = ["sim", "replay", "--synthetic", "3", "--gen-len", "96", *SMALL, "--jobs", "2"]
    argv += ["--policy", f"{tmp_path / 'pol.py'}:FailsOnOne", "--out", str(out)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "growpage: error: 1 of 3 traces failed (2 replayed: their results are printed" in err
    assert "  synthetic-1: PolicyError: " in err and "RuntimeError: not this one" in err
    assert f"({tmp_path / 'pol.py'}:10, in decide)" in err
    saved = json.loads((out / "replay.json").read_text())
    assert [t["request_id"] for t in saved["traces"]] == ["synthetic-0", "synthetic-2"]
    assert [f["request_id"] for f in saved["failed"]] == ["synthetic-1"]


def _finished(out: Path) -> int:
    return len(list((out / FINISHED_DIR).glob("*.json")))


def test_ctrl_c_leaves_the_finished_points_and_resume_runs_the_rest(tmp_path):
    """A real SIGINT to ``growpage sim sweep --jobs 2``; the resumed sweep's results are those
    of a sweep that was never interrupted."""
    growpage = Path(sys.executable).parent / "growpage"
    budgets = ",".join(str(64 * k) for k in range(2, 10))  # 8 points of ~0.5 s
    argv = ["sim", "sweep", "--workload", "tiny", "--page-size", "64", "--kv-pages", "150"]
    argv += ["--points", f"fixed@budget_tokens={budgets}", "--fidelity-traces", "1"]
    out = tmp_path / "out"
    command = [str(growpage), *argv, "--jobs", "2", "--out", str(out)]
    # The sweep gets Ctrl-C's default action even where this test runs with SIGINT ignored (a
    # shell's background job), which a child would inherit and then never see the signal.
    run = subprocess.Popen(
        command,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 120
    while _finished(out) < 2 and run.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    run.send_signal(signal.SIGINT)
    _, err = run.communicate(timeout=60)
    kept = _finished(out)
    assert run.returncode == 130, err
    assert 2 <= kept < 8 and "points finished; their rows are in" in err
    assert not (out / "sweep.json").exists()
    resumed = subprocess.run([*command, "--resume"], capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    assert f"{kept}/8" in resumed.stderr  # the bar starts at the kept points
    assert main([*argv, "--jobs", "1", "--out", str(tmp_path / "whole")]) == 0  # the oracle
    saved = json.loads((out / "sweep.json").read_text())
    assert saved == json.loads((tmp_path / "whole" / "sweep.json").read_text())
    assert len(saved["points"]) == 8


def test_the_engine_table_gives_the_same_rows_on_one_or_two_workers(tmp_path, monkeypatch):
    from benchmark_scripts import load_benchmark
    from executor_points import FakeBench

    bench = load_benchmark("policies_engine")
    monkeypatch.setattr(bench, "Bench", FakeBench)  # forked workers inherit it
    reports = {}
    for jobs in ("1", "2"):
        out = tmp_path / jobs
        args = bench.parse_args(["--preset", "smoke", "--out", str(out), "--jobs", jobs])
        args.builds = str(out / "builds")
        (out / "builds").mkdir(parents=True)
        reports[jobs] = bench.run(args)
        builds = builds_by_pid({"builds": args.builds})
        assert set(builds.values()) == {1} and len(builds) <= int(jobs), builds
        if jobs == "1":
            assert list(builds) == [os.getpid()]  # in this process, as before executors
    assert reports["1"]["rows"] == reports["2"]["rows"]
    growpage = next(r for r in reports["1"]["rows"] if r["policy"] == "growpage")
    expected = [label for n in bench.ALL_POLICIES for label, _, _ in bench.plan(args, n, growpage)]
    assert [r["label"] for r in reports["1"]["rows"]] == expected
    assert reports["2"]["kv_pages"] == 24 and reports["2"]["fullkv_generate"]["tps"] == 50.0
