"""The serving simulator charges capacity control when the cost model prices it."""

from __future__ import annotations

import json
import subprocess
import sys

import attrs
import pytest

from growpage import GrowPageConfig
from growpage.errors import ConfigError
from growpage.policies import resolve_policy
from growpage.sim.costmodel import (
    CostModel,
    LinearCostModel,
    RooflineCostModel,
    load_cost_model,
    with_boundary_costs,
)
from growpage.sim.serving import SimConfig, simulate
from growpage.sim.workload_csv import WorkloadRequest
from growpage.sim.workloads import resolve_workload

COST = LinearCostModel(base_s=0.01, per_seq_s=0.001, per_kv_token_s=1e-5, per_prefill_token_s=1e-4)
CONFIG = GrowPageConfig(page_size=64, recent_window=16)
SIM = SimConfig(num_kv_pages=30, num_scripts=3, record_events=True)


def decided_and_compactions(result) -> tuple[int, int]:
    kinds = [kind for _, kind, _, _ in result.events]
    m = result.metrics
    # Every boundary the policy decided is logged as grow / compress / shrink (a fallback is
    # logged twice: "fallback", then "compress"); forced grows are logged as grow too.
    decided = kinds.count("grow") - m.forced_grows + kinds.count("compress") + kinds.count("shrink")
    return decided, m.compresses + m.shrinks


def test_priced_boundaries_add_exactly_their_cost_when_all_arrive_at_once():
    requests = [attrs.evolve(r, arrival_s=0.0) for r in resolve_workload("tiny", seed=1)]
    free = simulate(requests, "growpage", CONFIG, SIM, COST)
    priced = simulate(
        requests,
        "growpage",
        CONFIG,
        SIM,
        with_boundary_costs(COST, boundary_s=0.002, compaction_s=0.005),
    )
    # Same decisions in the same order: only the clock moves.
    assert [e[1:] for e in priced.events] == [e[1:] for e in free.events]
    decided, compactions = decided_and_compactions(free)
    assert decided > 0 and compactions > 0 and free.metrics.fallbacks > 0
    charge = 0.002 * decided + 0.005 * compactions
    assert free.metrics.boundary_s == 0.0
    assert priced.metrics.boundary_s == pytest.approx(charge, rel=1e-9)
    assert priced.metrics.total_s == pytest.approx(free.metrics.total_s + charge, rel=1e-9)
    assert priced.metrics.tps < free.metrics.tps


def test_fullkv_pays_for_its_decisions_only():
    requests = [attrs.evolve(r, arrival_s=0.0) for r in resolve_workload("tiny", seed=2)]
    sim = SimConfig(num_kv_pages=400)
    free = simulate(requests, "fullkv", CONFIG, sim, COST)
    priced = simulate(
        requests,
        "fullkv",
        CONFIG,
        sim,
        with_boundary_costs(COST, boundary_s=0.001, compaction_s=1.0),
    )
    decided = free.metrics.grows - free.metrics.forced_grows
    assert free.metrics.compresses == 0 and decided > 0
    assert priced.metrics.boundary_s == pytest.approx(0.001 * decided)


def test_prices_are_validated_and_kept_in_the_linear_model_file(tmp_path):
    with pytest.raises(ValueError, match="boundary_s must be a finite number >= 0"):
        LinearCostModel(boundary_s=-1.0)
    roofline = with_boundary_costs(load_cost_model("a100-qwen3-8b"), compaction_s=0.003)
    assert isinstance(roofline, RooflineCostModel)
    assert (roofline.boundary_s, roofline.compaction_s) == (0.0, 0.003)
    assert roofline.boundary_time(4, 2) == pytest.approx(0.006)
    path = with_boundary_costs(COST, 0.001, 0.002).save(tmp_path / "c.json")
    assert LinearCostModel.load(path).boundary_time(3, 1) == pytest.approx(0.005)
    old = {
        k: v
        for k, v in json.loads(path.read_text()).items()
        if k not in ("boundary_s", "compaction_s")
    }  # a file from before the prices
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert LinearCostModel.load(tmp_path / "old.json").boundary_time(3, 1) == 0.0


def test_other_cost_models_cannot_take_prices():
    class Flat(CostModel):
        def step_time(self, num_seqs, kv_tokens, prefill_tokens=0):
            return 0.01

    assert Flat().boundary_time(5, 5) == 0.0
    with pytest.raises(ConfigError, match="has no boundary_s/compaction_s"):
        with_boundary_costs(Flat(), boundary_s=0.1)


def test_serve_cli_charges_the_given_prices():
    def serve(*extra: str) -> dict:
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "growpage.cli",
                "sim",
                "serve",
                "--workload",
                "tiny",
                "--page-size",
                "64",
                "--kv-pages",
                "30",
                "--json",
                *extra,
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        return json.loads(out)["metrics"]

    free, priced = serve(), serve("--boundary-ms", "2", "--compaction-ms", "5")
    assert free["boundary_s"] == 0.0 and priced["boundary_s"] > 0
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "growpage.cli",
            "sim",
            "serve",
            "--workload",
            "tiny",
            "--boundary-ms",
            "-1",
        ],
        capture_output=True,
        text=True,
    )
    assert bad.returncode != 0 and "--boundary-ms must be a finite number >= 0" in bad.stderr


@pytest.mark.parametrize("decisions", ["script", "trace"])
def test_a_synchronous_boundary_is_paid_before_the_step_beside_late_ones(decisions):
    """async_decisions: a request holding a page shared through the prefix cache keeps its
    boundary synchronous, so its price is paid before the step (as in the engine, where it
    runs while scheduling), even when other requests' late boundaries run beside that step.

    Pages of 4 tokens, decode steps of 1 s, every decided boundary compresses (fixed at 2
    pages). At 4 s all three requests compress: s1 still shares the prefix's page with s2, so
    its decision and compaction (0.1 s each) come first; z's and s2's, late, hide behind the
    step s1 decodes alone. Every later boundary is late and hidden too: the run lasts 0.2 s
    longer than when capacity control is free, and pays for all 9 decisions and 9
    compactions in ``boundary_s``."""
    config = GrowPageConfig(page_size=4, recent_window=1, min_capacity=2)
    requests = [
        WorkloadRequest("s1", 0.0, 6, 12, prefix="p", prefix_tokens=4),
        WorkloadRequest("z", 0.0, 6, 12),
        WorkloadRequest("s2", 0.5, 6, 12, prefix="p", prefix_tokens=4),
    ]
    sim = SimConfig(
        num_kv_pages=40, admission_reserve=0.0, async_decisions=True, decisions=decisions
    )

    def run(price: float):
        cost = LinearCostModel(base_s=1.0, boundary_s=price, compaction_s=price)
        return simulate(
            requests, resolve_policy("fixed", budget_tokens=8), config, sim, cost
        ).metrics

    free, paid = run(0.0), run(0.1)
    assert (free.total_s, free.compresses, free.prefix_hit_tokens) == (16.0, 9, 4)
    assert paid.total_s == pytest.approx(16.2)
    assert paid.boundary_s == pytest.approx(0.1 * (9 + 9))


def test_a_steps_compactions_pay_the_step_price_once():
    """As the engine runs them, a step's compactions are one pass: ``compaction_step_s`` once
    per step that compacts, however many compact in it."""
    requests = [attrs.evolve(r, arrival_s=0.0) for r in resolve_workload("tiny", seed=1)]
    free = simulate(requests, "growpage", CONFIG, SIM, COST)
    priced = simulate(
        requests, "growpage", CONFIG, SIM, with_boundary_costs(COST, compaction_step_s=0.01)
    )
    assert [e[1:] for e in priced.events] == [e[1:] for e in free.events]
    steps = {t for t, kind, _, _ in free.events if kind in ("compress", "shrink")}
    compactions = decided_and_compactions(free)[1]
    assert 0 < len(steps) < compactions  # some steps compact several requests
    assert priced.metrics.boundary_s == pytest.approx(0.01 * len(steps), rel=1e-9)


def test_step_prices_add_to_the_per_request_ones_and_are_kept_in_the_file(tmp_path):
    cost = with_boundary_costs(COST, 0.001, 0.002, boundary_step_s=0.01, compaction_step_s=0.02)
    assert cost.boundary_time(0, 0) == 0.0
    assert cost.boundary_time(3, 0) == pytest.approx(0.01 + 0.003)
    assert cost.boundary_time(3, 1) == pytest.approx(0.01 + 0.003 + 0.02 + 0.002)
    assert LinearCostModel.load(cost.save(tmp_path / "c.json")) == cost
    with pytest.raises(ValueError, match="compaction_step_s must be a finite number >= 0"):
        LinearCostModel(compaction_step_s=-1.0)
    roofline = with_boundary_costs(load_cost_model("a100-qwen3-8b"), boundary_step_s=0.004)
    assert roofline.boundary_time(2, 0) == pytest.approx(0.004)
