"""Bad input to the simulator, ``growpage calibrate`` and the ``sim`` commands: a pool too large
for memory, a cost model out of scale or free, a sweep point given twice, an ``--out`` under
a file. Each is a ``ConfigError`` naming the problem, raised before anything is allocated or
any output folder is made."""

from __future__ import annotations

import json
import re
import warnings

import numpy as np
import pytest

from growpage.cli import main
from growpage.core.config import GrowPageConfig
from growpage.core.host_memory import MemoryFigure
from growpage.errors import ConfigError
from growpage.sim.costmodel import (
    MAX_STEP_S,
    LinearCostModel,
    PiecewiseCostModel,
    RooflineCostModel,
    check_step_times,
    load_cost_model,
    with_boundary_costs,
)
from growpage.sim.hardware import A100_80GB, QWEN3_8B
from growpage.sim.serving import SimConfig, check_pool_memory, simulate
from growpage.sim.sweep import SweepPoint, check_points, parse_points
from growpage.sim.workloads import resolve_workload

HUGE = {"kind": "linear", "base_s": 1e308, "per_seq_s": 1e308}
FREE = {"kind": "linear", "base_s": 0}
STEPS = "num_seqs,kv_tokens,prefill_tokens,step_s\n"
COST = LinearCostModel(base_s=0.01, per_seq_s=0.001)


def cost_file(tmp_path, fields: dict) -> str:
    path = tmp_path / "cost.json"
    coefficients = dict.fromkeys(("base_s", "per_seq_s", "per_kv_token_s", "per_prefill_token_s"))
    path.write_text(json.dumps({**{k: 0 for k in coefficients}, **fields}))
    return str(path)


def fails_leaving_nothing(capsys, tmp_path, argv: list[str], says: str) -> None:
    """``argv`` exits 2 with ``says`` on stderr, leaving no ``tmp_path/out``."""
    assert main([*argv, "--out", str(tmp_path / "out" / "run")]) == 2
    assert says in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


# ---- a pool too large for memory ------------------------------------------------------
def test_a_pool_whose_bookkeeping_would_not_fit_is_refused_naming_its_setting():
    check_pool_memory(6, (6 * 160, "test"))  # 160 bytes a page: fits exactly
    check_pool_memory(10**12, None)  # memory unknown: nothing checked
    with pytest.raises(ConfigError) as info:
        check_pool_memory(7, (6 * 160, "a test's limit"))
    assert str(info.value) == (
        "SimConfig.num_kv_pages 7: the page pool's bookkeeping would take 1120 bytes (0.00 GiB), "
        "more than the 960 bytes (0.00 GiB) available (a test's limit); give fewer pages"
    )


def test_simulate_refuses_a_pool_larger_than_the_host_before_allocating(monkeypatch):
    requests = resolve_workload("tiny")
    with pytest.raises(ConfigError, match=r"^SimConfig.num_kv_pages 1000000000000: the page pool"):
        simulate(requests, "fullkv", GrowPageConfig(), SimConfig(num_kv_pages=10**12), COST)
    small = MemoryFigure(1000, "a small host")
    monkeypatch.setattr("growpage.sim.serving.available_memory", lambda: small)
    with pytest.raises(ConfigError, match=r"available \(a small host\); give fewer pages"):
        simulate(requests, "fullkv", GrowPageConfig(), SimConfig(), COST)


def test_sim_serve_checks_kv_pages_against_the_memory_available(capsys, tmp_path, monkeypatch):
    argv = ["sim", "serve", "--workload", "tiny", "--kv-pages"]
    fails_leaving_nothing(
        capsys, tmp_path, [*argv, "1000000000000"], "--kv-pages 1000000000000: the page pool's"
    )
    # The engine's figure: a cgroup limit under the physical memory counts.
    fake = MemoryFigure(100 * 160, "cgroup v2 limit: a test's")
    monkeypatch.setattr("growpage.commands.sim.available_memory", lambda: fake)
    fails_leaving_nothing(
        capsys, tmp_path, [*argv, "101"], "more than the 16000 bytes (0.00 GiB) available (cgroup"
    )


# ---- cost models out of scale or free -------------------------------------------------


@pytest.mark.parametrize(
    "build",
    [
        lambda: LinearCostModel(base_s=1e308),
        lambda: LinearCostModel(per_seq_s=1e308, base_s=1e308),  # inf
        lambda: LinearCostModel(per_kv_token_s=1.0, per_prefill_token_s=MAX_STEP_S),
        lambda: LinearCostModel(base_s=0.01, compaction_s=MAX_STEP_S / 100),  # 256 per step
        lambda: PiecewiseCostModel(batch_sizes=(1, 2), batch_s=(1e308, 1e308)),
        lambda: RooflineCostModel(hardware=A100_80GB, model=QWEN3_8B, overhead_s=1e300),
        lambda: with_boundary_costs(COST, boundary_s=1e300),
    ],
)
def test_a_cost_model_pricing_a_real_step_beyond_any_machine_is_refused(build):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no numpy overflow warning on the way
        with pytest.raises(ConfigError, match=r"prices a step of 256 sequences .* out of scale"):
            build()


def test_the_step_bound_is_a_bound_and_free_models_are_parts_not_servers():
    assert LinearCostModel(base_s=MAX_STEP_S).base_s == MAX_STEP_S  # at the bound: taken
    # Slow but real prices are taken: half a second per KV token (tests/sim use such models).
    check_step_times(LinearCostModel(per_kv_token_s=0.5, per_prefill_token_s=1.0))
    free = LinearCostModel(per_prefill_token_s=1e-4)  # built: a part, boundary prices alone
    with pytest.raises(ConfigError, match="prices a decode step at 0 s"):
        check_step_times(free)


@pytest.mark.parametrize(
    "fields, says",
    [
        (HUGE, r"prices a step of 256 .* at inf s, more than the 1e\+09 s"),
        (FREE, "prices a decode step at 0 s"),
    ],
    ids=["huge", "free"],
)
def test_a_cost_model_file_is_checked_when_loaded_before_the_output_folder(
    capsys, tmp_path, fields, says
):
    path = cost_file(tmp_path, fields)
    with pytest.raises(ConfigError, match=f"^{re.escape(path)}: cost model 'linear' {says}"):
        load_cost_model(path)
    for command in (["serve"], ["sweep", "--points", "fullkv", "--fidelity-traces", "0"]):
        fails_leaving_nothing(
            capsys,
            tmp_path,
            ["sim", *command, "--workload", "tiny", "--cost", path],
            f"{path}: cost model 'linear' prices",
        )


def test_a_boundary_price_out_of_scale_names_its_flag(capsys, tmp_path):
    fails_leaving_nothing(
        capsys,
        tmp_path,
        ["sim", "serve", "--workload", "tiny", "--boundary-ms", "1e300"],
        "--boundary-ms: cost model 'roofline' prices a step of 256 sequences",
    )


@pytest.mark.parametrize("kind", ["linear", "piecewise"])
def test_calibrate_writes_no_model_that_would_be_refused(capsys, tmp_path, kind):
    huge = tmp_path / "huge.csv"
    huge.write_text(STEPS + "1,100,0,1e308\n2,200,0,1e308\n4,400,0,1e308\n4,800,0,1e308\n")
    prefill_only = tmp_path / "prefill.csv"  # every step explained by its prefill tokens alone
    prefill_only.write_text(STEPS + "1,0,10,0.01\n2,0,20,0.02\n4,0,40,0.04\n4,0,80,0.08\n")
    for rows, says in ((huge, "out of scale"), (prefill_only, "prices a decode step at 0 s")):
        argv = ["calibrate", "--measurements", str(rows), "--kind", kind]
        fails_leaving_nothing(
            capsys, tmp_path, argv, f"{rows}, the measurements fit no usable model: cost model"
        )
        assert says in main_err(capsys, [*argv, "--out", str(tmp_path / "m.json")])
        assert not (tmp_path / "m.json").exists()


def main_err(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    return capsys.readouterr().err


def test_a_calibrated_model_at_realistic_prices_is_written_and_served(tmp_path, capsys):
    rows = tmp_path / "m.csv"
    rows.write_text(STEPS + "1,100,0,0.01\n2,200,0,0.02\n4,900,8,0.03\n8,800,0,0.05\n")
    out = tmp_path / "new" / "cm.json"
    assert main(["calibrate", "--measurements", str(rows), "--out", str(out)]) == 0
    capsys.readouterr()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        assert main(["sim", "serve", "--workload", "tiny", "--cost", str(out), "--json"]) == 0
    metrics = json.loads(capsys.readouterr().out)["metrics"]
    assert metrics["tps"] > 0 and np.isfinite(metrics["tpot_ms"])


# ---- --out under a file ----------------------------------------------------------------
def test_out_under_a_file_says_that_the_file_is_not_a_folder(capsys, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    rows = tmp_path / "m.csv"
    rows.write_text(STEPS + "1,100,0,0.01\n2,200,0,0.02\n4,900,8,0.03\n8,800,0,0.05\n")
    for target in (blocker / "x.json", blocker / "deeper" / "x.json"):
        err = main_err(capsys, ["calibrate", "--measurements", str(rows), "--out", str(target)])
        assert f"--out {target}: {blocker} is not a folder" in err
    err = main_err(capsys, ["sim", "serve", "--workload", "tiny", "--out", str(blocker / "d")])
    assert f"--out {blocker / 'd'}: {blocker} is not a folder" in err
    err = main_err(capsys, ["sim", "serve", "--workload", "tiny", "--out", str(blocker)])
    assert f"--out {blocker}: {blocker} is not a folder" in err


def test_calibrate_with_bad_measurements_leaves_no_folder(capsys, tmp_path):
    rows = tmp_path / "m.csv"
    rows.write_text(STEPS + "1,100,0,-1\n")
    argv = ["calibrate", "--measurements", str(rows)]
    fails_leaving_nothing(capsys, tmp_path, argv, "measurement fields must be finite and >= 0")


# ---- a sweep point given twice ---------------------------------------------------------
@pytest.mark.parametrize(
    "specs, says",
    [
        (["growpage", "growpage"], "the point 'growpage' is given twice; give each point once"),
        (["fixed@budget_tokens=1024,2048,1024"], "the point 'fixed budget_tokens=1024' is"),
        (
            ["growpage@tau=0", "growpage@tau=0.0"],
            "the point 'growpage tau=0.0' is given twice (as 'growpage tau=0')",
        ),
    ],
)
def test_a_sweep_point_given_twice_is_refused_naming_it(capsys, tmp_path, specs, says):
    with pytest.raises(ConfigError, match="^sweep: " + re.escape(says)):
        check_points(parse_points(specs))
    argv = ["sim", "sweep", "--workload", "tiny", "--fidelity-traces", "0", "--points", *specs]
    fails_leaving_nothing(capsys, tmp_path, argv, f"--points: {says}")


def test_a_sweep_refuses_a_bad_point_before_its_output_folder(capsys, tmp_path):
    argv = ["sim", "sweep", "--workload", "tiny", "--fidelity-traces", "0", "--points"]
    fails_leaving_nothing(capsys, tmp_path, [*argv, "fullkv", "nosuch"], "unknown policy 'nosuch'")
    check_points([SweepPoint("fullkv"), SweepPoint("fixed", (("budget_tokens", 512),))])


def test_serve_refuses_a_request_the_pool_cannot_hold_before_its_output_folder(capsys, tmp_path):
    argv = ["sim", "serve", "--workload", "tiny", "--kv-pages", "1"]
    fails_leaving_nothing(capsys, tmp_path, argv, "cannot finish even alone")
