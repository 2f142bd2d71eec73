"""The Ray executor on a local Ray of 2 CPUs, started once for this module and stopped after
it: the same rows as the local executor's, in the same order; killed workers retried; failed
rows; resume across executors; one engine per Ray actor for the engine policy table."""

from __future__ import annotations

import json
import logging
import sys

import pytest

ray = pytest.importorskip("ray")

import executor_points  # noqa: E402
from benchmark_scripts import load_benchmark  # noqa: E402
from executor_points import (  # noqa: E402
    FakeBench,
    builds_by_pid,
    built_once,
    runs_of,
    square_or_die,
    square_or_interrupt,
    square_or_raise,
)

from growpage.cli import main  # noqa: E402
from growpage.executors import LocalExecutor, RowStore  # noqa: E402
from growpage.executors.ray_executor import RayExecutor  # noqa: E402
from growpage.sim.synthetic import SyntheticSpec, write_synthetic_trace_set  # noqa: E402

SWEEP = ["--workload", "tiny", "--page-size", "64", "--kv-pages", "150", "--fidelity-traces", "1"]
CRASH = """
from growpage import CapacityPolicy


class Crash(CapacityPolicy):
    name = "crash"

    def decide(self, ctx):
        raise RuntimeError("kaboom")
"""


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    """A Ray of 2 CPUs for this module; the test modules' functions travel by value (Ray's
    workers cannot import them by name)."""
    bench = load_benchmark("policies_engine")
    for module in (executor_points, bench):
        ray.cloudpickle.register_pickle_by_value(module)
    ray.init(num_cpus=2, address="local", include_dashboard=False, logging_level=logging.WARNING)
    try:
        yield
    finally:
        ray.shutdown()
        for module in (executor_points, bench):
            ray.cloudpickle.unregister_pickle_by_value(module)


def grid(tmp_path, **extra) -> dict:
    for name in ("runs", "builds"):
        (tmp_path / name).mkdir(exist_ok=True)
    return {"runs": str(tmp_path / "runs"), "builds": str(tmp_path / "builds"), **extra}


def oracle(items, shared) -> list[dict]:
    return [{"item": i, "square": i * i, "tag": shared.get("tag")} for i in items]


def cli_json(capsys, argv: list[str]) -> tuple[int, dict]:
    code = main([*argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_a_sweep_on_ray_gives_the_rows_of_local_processes(capsys, tmp_path):
    (tmp_path / "pols.py").write_text(CRASH)
    points = ["fullkv", f"{tmp_path / 'pols.py'}:Crash", "fixed@budget_tokens=128,256"]
    argv = ["sim", "sweep", *SWEEP, "--points", *points]
    code, local = cli_json(capsys, [*argv, "--jobs", "2"])
    assert code == 2 and [p["label"] for p in local["points"]] == [
        "fullkv",
        "fixed budget_tokens=128",
        "fixed budget_tokens=256",
    ]
    assert main([*argv, "--executor", "ray"]) == 2  # on the table, as a person reads it
    captured = capsys.readouterr()
    assert "fixed budget_tokens=256" in captured.out and "1 failed" in captured.err
    assert "Crash: PolicyError: policy crash decide() raised RuntimeError: kaboom" in captured.err
    assert cli_json(capsys, [*argv, "--executor", "ray"]) == (2, local)


def test_a_trace_set_replayed_on_ray_gives_the_rows_of_local_processes(capsys, tmp_path):
    spec = SyntheticSpec(num_layers=1, num_q_heads=2, num_kv_heads=1, head_dim=16, prompt_len=20)
    write_synthetic_trace_set(tmp_path / "set", spec, output_lens=[90, 60, 130, 75], seed=3)
    argv = ["sim", "replay", "--traces", str(tmp_path / "set"), "--page-size", "16", "--signals"]
    code, local = cli_json(capsys, [*argv, "--jobs", "2"])
    assert code == 0 and len(local["traces"]) == 4
    assert cli_json(capsys, [*argv, "--executor", "ray"]) == (0, local)


def test_a_grid_cut_short_locally_is_resumed_on_ray(tmp_path, capsys):
    stop = tmp_path / "stop"
    stop.touch()
    shared = grid(tmp_path, stop_at=2, stop_file=str(stop))
    store = tmp_path / "finished"
    with pytest.raises(KeyboardInterrupt), LocalExecutor(1, store=RowStore(store)) as ex:
        ex.run(square_or_interrupt, range(5), shared)
    stop.unlink()
    with RayExecutor(store=RowStore(store, resume=True), progress=False) as ex:
        rows = ex.run(square_or_interrupt, range(5), shared)
    assert rows == oracle(range(5), shared)
    assert [runs_of(shared, i) for i in range(5)] == [1] * 5


def test_a_killed_ray_worker_has_its_points_run_again(tmp_path):
    shared = grid(tmp_path, killers=[1, 4], always=[])
    with RayExecutor(progress=False) as ex:
        rows = ex.run(square_or_die, range(6), shared)
    assert rows == oracle(range(6), shared)
    assert [runs_of(shared, i) for i in range(6)] == [1, 2, 1, 1, 2, 1]


def test_on_ray_a_raising_point_is_a_failed_row_and_a_deadly_one_fails_after_its_retries(
    tmp_path, capsys
):
    shared = grid(tmp_path, bad=[1], killers=[], always=[2])
    with RayExecutor(max_retries=1) as ex:
        raised = ex.run(square_or_raise, range(3), shared, desc="raise")
        died = ex.run(square_or_die, range(3, 6), {**shared, "always": [4]}, desc="die")
    assert raised[0] == oracle([0], shared)[0] and raised[2] == oracle([2], shared)[0]
    assert raised[1]["error"].startswith("ValueError: point 1 is bad (")
    assert died[0] == oracle([3], shared)[0] and died[2] == oracle([5], shared)[0]
    assert died[1]["point"] == 1 and died[1]["error"].startswith("WorkerDied: ")
    assert runs_of(shared, 4) == 2  # the first run and one retry
    err = capsys.readouterr().err
    assert "raise: 100%" in err and "die: 100%" in err and err.count("1 failed") >= 2


def test_actors_build_one_state_each_keep_it_across_grids_and_restart_when_killed(tmp_path):
    shared = grid(tmp_path, sleep_s={i: 0.05 for i in range(10)}, killers=[11], always=[])
    with RayExecutor(actors=True, progress=False) as ex:
        first = ex.run(built_once, range(6), shared)
        second = ex.run(built_once, range(6, 10), shared)
        pids = set(ex.worker_pids())
        after_kill = ex.run(square_or_die, range(10, 13), shared)
    rows = first + second
    assert [r["square"] for r in rows] == [i * i for i in range(10)]
    builds = builds_by_pid(shared)
    assert set(builds) == {r["pid"] for r in rows} == pids and set(builds.values()) == {1}
    assert len(pids) == 2  # as many actors as the cluster's CPUs
    assert after_kill == oracle(range(10, 13), shared)
    assert [runs_of(shared, i) for i in range(10, 13)] == [1, 2, 1]  # point 11 ran again


def test_the_engine_table_on_ray_actors_gives_the_rows_of_one_process(tmp_path, monkeypatch):
    bench = load_benchmark("policies_engine")
    monkeypatch.setattr(bench, "Bench", FakeBench)
    reports = {}
    for name, flags in (("local", []), ("ray", ["--executor", "ray"])):
        args = bench.parse_args(
            ["--preset", "smoke", "--out", str(tmp_path / name), "--timing-passes", "2", *flags]
        )
        args.builds = str(tmp_path / name / "builds")
        (tmp_path / name / "builds").mkdir(parents=True)
        reports[name] = bench.run(args)
        builds = builds_by_pid({"builds": args.builds})
        assert set(builds.values()) == {1} and len(builds) <= 2, builds
    local, remote = reports["local"]["rows"], reports["ray"]["rows"]
    assert json.dumps(remote, sort_keys=True) == json.dumps(local, sort_keys=True)
    growpage = next(r for r in local if r["policy"] == "growpage")
    expected = [label for n in bench.ALL_POLICIES for label, _, _ in bench.plan(args, n, growpage)]
    assert [r["label"] for r in local] == expected
    assert all(len(r["tps_passes"]) == 2 for r in local)
    assert sys.modules[FakeBench.__module__] is executor_points
