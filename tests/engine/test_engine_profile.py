"""``growpage calibrate`` on the engine: measured rows fit a cost model that predicts them."""

import numpy as np
import pytest
from engine_helpers import random_state_dict, tiny_config

from growpage.engine.loading.loader import build_model
from growpage.engine.modeling.backends import make_attention_backend
from growpage.engine.profiling.profile import measure_step_times
from growpage.sim.calibrate import fit_linear


def test_measure_step_times_rows_and_fit():
    cfg = tiny_config("llama")
    model = build_model(
        cfg, random_state_dict(cfg, seed=0), backend=make_attention_backend("torch", "cpu")
    )
    rows = measure_step_times(
        model, batch_sizes=(1, 4), contexts=(16, 96), prefills=(8, 40), repeats=1, progress=False
    )
    assert [(r["num_seqs"], r["kv_tokens"], r["prefill_tokens"]) for r in rows] == [
        (1, 16, 0),
        (1, 96, 0),
        (4, 64, 0),
        (4, 384, 0),
        (0, 0, 8),
        (0, 0, 40),
    ]
    assert all(r["step_s"] > 0 for r in rows)
    table = np.array(
        [[r["num_seqs"], r["kv_tokens"], r["prefill_tokens"], r["step_s"]] for r in rows]
    )
    model_fit = fit_linear(table)
    assert model_fit.base_s >= 0 and model_fit.per_kv_token_s >= 0


def test_measure_boundary_costs_prices_decisions_and_compactions():
    from growpage.engine.profiling.profile import measure_boundary_costs
    from growpage.sim.costmodel import with_boundary_costs

    cfg = tiny_config("llama")
    model = build_model(cfg, random_state_dict(cfg, seed=0))
    costs = measure_boundary_costs(
        model, num_requests=3, max_tokens=48, page_size=4, progress=False
    )
    assert costs["decided"] > 0 and costs["compactions"] > 0, costs
    assert 0 < costs["steps"] <= costs["decided"]
    assert costs["boundary_s"] + costs["boundary_step_s"] > 0
    assert costs["compaction_s"] + costs["compaction_step_s"] > 0
    priced = with_boundary_costs(
        fit_linear(
            np.array([[1, 16, 0, 0.01], [4, 64, 0, 0.02], [1, 0, 8, 0.03], [2, 32, 0, 0.015]])
        ),
        costs["boundary_s"],
        costs["compaction_s"],
        costs["boundary_step_s"],
        costs["compaction_step_s"],
    )
    assert priced.boundary_time(2, 1) == pytest.approx(
        costs["boundary_step_s"]
        + 2 * costs["boundary_s"]
        + costs["compaction_step_s"]
        + costs["compaction_s"]
    )


def test_a_batched_prefill_is_timed_as_that_many_prompts(monkeypatch):
    import pytest

    from growpage.engine.profiling import profile

    cfg = tiny_config("llama")
    model = build_model(
        cfg, random_state_dict(cfg, seed=0), backend=make_attention_backend("torch", "cpu")
    )
    seen = []
    build = profile.prefill_context

    def recording(seq_lens, **kwargs):
        seen.append(list(seq_lens))
        return build(seq_lens, **kwargs)

    monkeypatch.setattr(profile, "prefill_context", recording)
    rows = measure_step_times(
        model, batch_sizes=(1,), contexts=(16,), prefills=(10, (3, 10)), repeats=0, progress=False
    )
    assert seen == [[10], [4, 3, 3]]  # one sequence; three prompts of 10 tokens in all
    assert [(r["num_seqs"], r["prefill_tokens"]) for r in rows[1:]] == [(0, 10), (0, 10)]
    with pytest.raises(ValueError, match="num_seqs <= tokens"):
        profile._prefill_row(model, (5, 3), 0)


def test_prefill_rows_are_priced_as_the_simulator_prices_a_prefill_step():
    """A cost model that fits the rows exactly predicts the simulator's prefill steps: a
    prefill row holds what ``CostModel.prefill_time`` charges for (its tokens, no sequence)."""
    from growpage.sim.costmodel import LinearCostModel

    cfg = tiny_config("llama")
    model = build_model(
        cfg, random_state_dict(cfg, seed=0), backend=make_attention_backend("torch", "cpu")
    )
    rows = measure_step_times(
        model, batch_sizes=(1,), contexts=(16,), prefills=(12, (3, 30)), repeats=0, progress=False
    )
    cost = LinearCostModel(
        base_s=0.01, per_seq_s=0.002, per_kv_token_s=1e-5, per_prefill_token_s=1e-3
    )
    for r in rows[1:]:
        assert cost.prefill_time(r["prefill_tokens"]) == cost.step_time(
            r["num_seqs"], r["kv_tokens"], r["prefill_tokens"]
        )


def test_step_prices_are_fitted_per_step_and_per_request():
    from growpage.engine.profiling.profile import fit_step_prices

    counts = [1, 2, 3, 4, 0, 2]
    seconds = [0.003 + 0.001 * n if n else 0.5 for n in counts]  # a step without any: ignored
    step, each = fit_step_prices(counts, seconds)
    assert step == pytest.approx(0.003) and each == pytest.approx(0.001)
    assert fit_step_prices([2, 2, 2], [0.004, 0.004, 0.004]) == (0.0, pytest.approx(0.002))
    # A fit that would give a step a negative price gives it none.
    assert fit_step_prices([1, 4], [0.001, 0.008]) == (0.0, pytest.approx(0.009 / 5))
    assert fit_step_prices([], []) == (0.0, 0.0)
