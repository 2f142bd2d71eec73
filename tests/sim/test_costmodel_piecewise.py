"""The piecewise cost model (a measured fixed cost per batch size), the non-negative least
squares both fits use, and ``growpage calibrate --kind piecewise``."""

from __future__ import annotations

import argparse
import json
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from growpage._argtypes import size_list
from growpage.cli import main
from growpage.errors import ConfigError
from growpage.sim.calibrate import fit_linear, fit_piecewise, fit_warnings, nnls
from growpage.sim.costmodel import LinearCostModel, PiecewiseCostModel, load_cost_model

CPU_LIKE = PiecewiseCostModel(
    batch_sizes=(0, 1, 4, 15, 16),
    batch_s=(0.06, 0.05, 0.09, 0.16, 0.11),
    per_kv_token_s=2e-5,
    per_prefill_token_s=2e-3,
)


def test_batch_time_is_the_table_between_and_its_outer_segments_beyond():
    c = CPU_LIKE
    assert c.batch_time(15) == pytest.approx(0.16) and c.batch_time(16) == pytest.approx(0.11)
    assert c.batch_time(2) == pytest.approx(0.05 + (0.09 - 0.05) / 3)
    # Past the last size: the least-squares slope of the decode sizes 1, 4, 15, 16, not the
    # 15 -> 16 segment's (-0.05 per sequence, which would reach 0 at 18 sequences).
    trend = np.polyfit([1, 4, 15, 16], [0.05, 0.09, 0.16, 0.11], 1)[0]
    assert c.trend_s == pytest.approx(trend) and trend > 0
    assert c.batch_time(40) == pytest.approx(0.11 + 24 * trend)
    # Below the first size: the same slope, down to 0 at most.
    low = PiecewiseCostModel(batch_sizes=(4, 8), batch_s=(0.04, 0.06))
    assert low.trend_s == pytest.approx(0.005)
    assert low.batch_time(2) == pytest.approx(0.03) and low.batch_time(0) == pytest.approx(0.02)
    assert PiecewiseCostModel(batch_sizes=(8,), batch_s=(0.07,)).batch_time(3) == 0.07
    falling = PiecewiseCostModel(batch_sizes=(2, 4), batch_s=(0.05, 0.01))
    assert falling.trend_s == 0.0 and falling.batch_time(9) == pytest.approx(0.01)
    # Arrays broadcast, and a step adds its KV and prompt tokens.
    assert np.allclose(c.batch_time(np.array([1, 15, 16])), [0.05, 0.16, 0.11])
    assert c.step_time(15, 1000, 0) == pytest.approx(0.16 + 1000 * 2e-5)
    assert c.prefill_time(100, 50) == pytest.approx(0.06 + 100 * 2e-3 + 50 * 2e-5)


def test_fit_piecewise_recovers_a_cost_that_is_not_linear_in_the_batch_size(tmp_path):
    rows = np.array(
        [
            [n, n * ctx, 0, CPU_LIKE.step_time(n, n * ctx)]
            for n in (1, 4, 15, 16)
            for ctx in (64, 250)
        ]
        + [[0, 0, p, CPU_LIKE.prefill_time(p)] for p in (57, 909)]
    )
    fitted = fit_piecewise(rows)
    assert fitted.batch_sizes == (0, 1, 4, 15, 16)
    assert np.allclose(fitted.batch_s, CPU_LIKE.batch_s, rtol=1e-6)
    assert fitted.per_kv_token_s == pytest.approx(2e-5, rel=1e-6)
    assert fitted.per_prefill_token_s == pytest.approx(2e-3, rel=1e-6)
    assert fit_warnings(rows, "piecewise") == []
    # The linear model cannot: a line through these sizes misprices 15 and 16 sequences.
    linear = fit_linear(rows)
    assert abs(linear.step_time(15, 15 * 250) / CPU_LIKE.step_time(15, 15 * 250) - 1) > 0.1
    path = fitted.save(tmp_path / "p.json")
    assert json.loads(path.read_text())["kind"] == "piecewise"
    assert PiecewiseCostModel.load(path) == fitted == load_cost_model(str(path))


def test_piecewise_warns_of_what_the_measurements_cannot_fit():
    one_context = np.array([[1, 64, 0, 0.05], [4, 256, 0, 0.09], [0, 0, 57, 0.2], [0, 0, 900, 1.8]])
    assert fit_warnings(one_context, "piecewise") == [
        "kv_tokens never changes within one num_seqs, so per_kv_token_s is not fitted (a "
        "piecewise model gives each num_seqs its own fixed cost); measure each num_seqs at two "
        "or more kv_tokens"
    ]
    no_prefill = np.array(
        [[1, 64, 0, 0.05], [1, 128, 0, 0.06], [4, 256, 0, 0.09], [4, 512, 0, 0.1]]
    )
    assert fit_warnings(no_prefill, "piecewise") == [
        "prefill_tokens is 0 in every measurement, so per_prefill_token_s is fitted as 0 (free "
        "in the simulator); measure steps with other prefill_tokens"
    ]
    with pytest.raises(
        ConfigError,
        match=r"measurement 2: a piecewise cost model needs a whole "
        r"number of sequences \(num_seqs\), got 1\.5",
    ):
        fit_piecewise(np.array([[1, 64, 0, 0.05]] * 2 + [[1.5, 64, 0, 0.05]] * 2))
    with pytest.raises(ConfigError, match="unknown cost model kind 'Piecewise'"):
        fit_warnings(no_prefill, "Piecewise")
    # kv_tokens and prefill_tokens move together within each batch size.
    together = np.array([[1, 64, 0, 0.05], [1, 128, 5, 0.06], [2, 64, 0, 0.07], [2, 128, 5, 0.1]])
    assert fit_warnings(together, "piecewise") == [
        "these 4 measurements do not determine every coefficient (2 fixed costs, one per "
        "num_seqs, and the costs per KV token and per prefill token): vary kv_tokens and "
        "prefill_tokens independently within the batch sizes"
    ]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"batch_sizes": (), "batch_s": ()}, "batch_sizes must be one or more increasing"),
        ({"batch_sizes": (4, 2), "batch_s": (0.1, 0.1)}, "increasing"),
        ({"batch_sizes": (-1, 2), "batch_s": (0.1, 0.1)}, ">= 0"),
        ({"batch_sizes": (1.5,), "batch_s": (0.1,)}, "whole numbers"),
        ({"batch_sizes": (1, 2), "batch_s": (0.1,)}, "one value per batch size"),
        ({"batch_sizes": 4, "batch_s": (0.1,)}, "one or more increasing whole numbers"),
        ({"batch_sizes": (4,), "batch_s": 0.1}, "must be a list of seconds"),
        ({"batch_sizes": (1, 2), "batch_s": (0.1, float("nan"))}, "finite numbers >= 0"),
        ({"batch_sizes": (1,), "batch_s": (0.1,), "per_kv_token_s": -1.0}, "per_kv_token_s"),
        (
            {"batch_sizes": (1,), "batch_s": (0.1,), "padded_kv": 1},
            "padded_kv must be True or False, got 1",
        ),
    ],
)
def test_bad_piecewise_models_are_config_errors(kwargs, match):
    with pytest.raises(ConfigError, match=re.escape(match)):
        PiecewiseCostModel(**kwargs)


def test_cost_model_files_are_read_by_their_kind(tmp_path):
    path = tmp_path / "m.json"
    path.write_text(json.dumps({"kind": "cubic", "base_s": 1.0}))
    with pytest.raises(
        ConfigError,
        match=r"unknown cost model kind 'cubic' \(expected 'linear' "
        r"or 'piecewise'\)",
    ):
        load_cost_model(str(path))
    path.write_text(json.dumps({"kind": "piecewise", "batch_sizes": [1, 2]}))
    with pytest.raises(ConfigError, match="lacks batch_s, per_kv_token_s, per_prefill_token_s"):
        load_cost_model(str(path))
    path.write_text(
        json.dumps(
            {
                "kind": "piecewise",
                "batch_sizes": [1, 2],
                "batch_s": [0.1, -2],
                "per_kv_token_s": 0,
                "per_prefill_token_s": 0,
            }
        )
    )
    with pytest.raises(ConfigError, match=re.escape(f"{path}: PiecewiseCostModel.batch_s must")):
        load_cost_model(str(path))
    path.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="not a cost model"):
        load_cost_model(str(path))
    CPU_LIKE.save(path)
    with pytest.raises(ConfigError, match="not a linear cost model"):
        LinearCostModel.load(path)


def _kkt_holds(a: np.ndarray, b: np.ndarray, x: np.ndarray) -> bool:
    """Optimality of ``x`` for ``min ||a x - b||, x >= 0``: the gradient of the residual is 0
    where ``x > 0`` and points outwards (``<= 0``) where ``x == 0`` (columns scaled)."""
    norms = np.maximum(np.linalg.norm(a, axis=0), 1e-300)
    gradient = (a.T @ (b - a @ x)) / norms / max(np.linalg.norm(b), 1e-300)
    return bool(
        (x >= 0).all() and (gradient <= 1e-7).all() and np.allclose(gradient[x > 0], 0, atol=1e-7)
    )


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 5), st.integers(1, 12), st.integers(0, 2**32 - 1))
def test_nnls_finds_the_constrained_optimum(n, extra, seed):
    rng = np.random.default_rng(seed)
    a = rng.normal(size=(n + extra, n)) * rng.uniform(1e-3, 1e3, n)  # columns of mixed scale
    b = rng.normal(size=n + extra)
    assert _kkt_holds(a, b, nnls(a, b))


def test_fit_linear_is_a_true_non_negative_least_squares():
    # Dropping the most negative coefficient of the unconstrained fit and refitting (the old
    # fit) kept per_seq_s and left the residual at 21.3; the optimum drops it (16.9).
    rows = np.array(
        [[2, 4, 0, 9], [3, 4, 4, 6], [3, 9, 9, 9], [4, 1, 6, 1], [2, 4, 3, 5]], dtype=float
    )
    fitted = fit_linear(rows)
    predicted = fitted.step_time(rows[:, 0], rows[:, 1], rows[:, 2])
    assert float(np.sum((predicted - rows[:, 3]) ** 2)) == pytest.approx(16.8916, abs=1e-3)
    x = np.column_stack([np.ones(5), rows[:, :3]])
    coef = np.array(
        [fitted.base_s, fitted.per_seq_s, fitted.per_kv_token_s, fitted.per_prefill_token_s]
    )
    assert _kkt_holds(x, rows[:, 3], coef)


def test_size_list_reads_lists_and_ranges():
    assert size_list("1-4,8,16") == (1, 2, 3, 4, 8, 16)
    assert size_list("16, 4,4") == (4, 16)
    for bad in ("0", "4-2", "x", "1,,2", "-3"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected"):
            size_list(bad)
    assert len(size_list("1-1024")) == 1024
    for too_many in ("1-1025", "1-1000,2000-2100", "1-1000000000"):
        with pytest.raises(argparse.ArgumentTypeError, match="more than 1024 values"):
            size_list(too_many)


def test_calibrate_piecewise_measures_every_batch_size(tmp_path, monkeypatch, capsys):
    import growpage.engine.profiling.profile as profile

    asked = {}

    def measure(**kw):
        asked.update(kw)
        return [
            {
                "num_seqs": n,
                "kv_tokens": n * ctx,
                "prefill_tokens": 0,
                "step_s": float(CPU_LIKE.step_time(n, n * ctx)),
            }
            for n in kw["batch_sizes"]
            for ctx in kw.get("contexts", (128, 512))
        ] + [
            {
                "num_seqs": 0,
                "kv_tokens": 0,
                "prefill_tokens": p,
                "step_s": float(CPU_LIKE.prefill_time(p)),
            }
            for p in (64, 256)
        ]

    monkeypatch.setattr(profile, "measure_step_times", measure)
    out = tmp_path / "p.json"
    assert main(["calibrate", "--kind", "piecewise", "--no-boundaries", "--out", str(out)]) == 0
    assert asked == {"batch_sizes": tuple(range(1, 17))}
    model = load_cost_model(str(out))
    assert isinstance(model, PiecewiseCostModel) and model.batch_sizes == tuple(range(17))
    assert model.padded_kv  # the local engine's torch backend pads decode KV to the longest
    assert model.batch_time(15) == pytest.approx(0.16, rel=1e-6)
    printed = capsys.readouterr().out
    assert "batch_sizes          0, 1, 2, 3" in printed and "rms error" in printed
    assert (
        main(
            [
                "calibrate",
                "--batch-sizes",
                "2-3",
                "--contexts",
                "10,20",
                "--no-boundaries",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert asked == {"batch_sizes": (2, 3), "contexts": (10, 20)}
    assert isinstance(load_cost_model(str(out)), LinearCostModel)


def test_serving_past_the_measured_batch_sizes_warns_once(tmp_path, capsys):
    path = CPU_LIKE.save(tmp_path / "cpu.json")
    serve = [
        "sim",
        "serve",
        "--workload",
        "tiny",
        "--policy",
        "fixed",
        "--cost",
        str(path),
        "--page-size",
        "64",
        "--json",
    ]
    assert main([*serve, "--max-num-seqs", "16"]) == 0
    assert "extrapolation" not in capsys.readouterr().err
    # tiny has 12 requests: no step can hold more than the 16 measured, whatever the seats.
    assert main(serve) == 0
    assert "extrapolation" not in capsys.readouterr().err
    small = PiecewiseCostModel(
        batch_sizes=(0, 1, 4, 8),
        batch_s=(0.06, 0.05, 0.09, 0.1),
        per_kv_token_s=2e-5,
        per_prefill_token_s=2e-3,
    ).save(path)
    assert main([*serve, "--max-num-seqs", "32"]) == 0
    err = capsys.readouterr().err
    assert err.count("growpage: warning:") == 1
    assert (
        f"{small} measured decode steps of up to 8 sequences; steps of more (up to 12: "
        "--max-num-seqs 32, 12 requests) are priced by extrapolation"
    ) in err
    assert (
        main(
            [
                "sim",
                "sweep",
                "--workload",
                "tiny",
                "--points",
                "fixed",
                "--cost",
                str(path),
                "--page-size",
                "64",
                "--max-num-seqs",
                "32",
                "--arrival-rate",
                "1",
                "2",
                "--fidelity-traces",
                "0",
                "--jobs",
                "1",
                "--json",
            ]
        )
        == 0
    )
    assert capsys.readouterr().err.count("priced by extrapolation") == 1


def test_numpy_values_and_ranges_are_taken_as_plain_numbers():
    model = PiecewiseCostModel(
        batch_sizes=np.array([1, 4, 16]), batch_s=np.float32([1, 2, 3]), padded_kv=np.True_
    )
    assert model.batch_sizes == (1, 4, 16) and model.batch_s == (1.0, 2.0, 3.0)
    assert all(type(b) is int for b in model.batch_sizes) and model.padded_kv is True
    assert PiecewiseCostModel(batch_sizes=range(1, 4), batch_s=[0.1] * 3).batch_sizes == (1, 2, 3)
    assert LinearCostModel(padded_kv=np.False_).padded_kv is False


def test_decode_sizes_do_not_interpolate_towards_the_prefill_cost():
    # Measured: prefill-only steps (size 0) and decode steps of 4 and 8 sequences. A decode
    # step of 2 follows the decode sizes' line, not a line from the prefill cost at 0.
    c = PiecewiseCostModel(batch_sizes=(0, 4, 8), batch_s=(0.2, 0.04, 0.06))
    assert c.batch_time(0) == pytest.approx(0.2)
    assert c.batch_time(2) == pytest.approx(0.03) and c.batch_time(1) == pytest.approx(0.025)
    assert np.allclose(c.batch_time(np.array([0, 2, 6, 10])), [0.2, 0.03, 0.05, 0.07])
    # Without a size-0 measurement a prefill-only step takes the decode line down to 0.
    assert PiecewiseCostModel(batch_sizes=(4, 8), batch_s=(0.04, 0.06)).batch_time(
        0
    ) == pytest.approx(0.02)
    assert PiecewiseCostModel(batch_sizes=(0,), batch_s=(0.3,)).batch_time(5) == 0.3


@pytest.mark.parametrize(
    "content",
    [
        {"kind": ["linear"]},
        {"kind": {"piecewise": 1}},
        {"kind": None},
    ],
)
def test_a_cost_model_file_of_no_known_kind_is_a_config_error(tmp_path, content):
    path = tmp_path / "m.json"
    path.write_text(json.dumps(content))
    with pytest.raises(ConfigError, match="unknown cost model kind"):
        load_cost_model(str(path))


@pytest.mark.parametrize(
    "field, value",
    [("batch_s", [0.01, 10**400]), ("batch_sizes", [1, 10**400]), ("per_kv_token_s", 10**400)],
)
def test_numbers_too_large_for_a_float_are_config_errors(tmp_path, field, value):
    fields = {
        "kind": "piecewise",
        "batch_sizes": [1, 2],
        "batch_s": [0.01, 0.02],
        "per_kv_token_s": 0,
        "per_prefill_token_s": 0,
        field: value,
    }
    path = tmp_path / "big.json"
    path.write_text(json.dumps(fields))
    with pytest.raises(ConfigError, match=f"PiecewiseCostModel.{field} must"):
        load_cost_model(str(path))
    with pytest.raises(ConfigError, match="base_s must be a finite number"):
        LinearCostModel(base_s=10**400)


def test_measurements_refuse_bools_and_numbers_too_large_for_a_float(tmp_path):
    from growpage.sim.calibrate import load_measurements

    good = {"num_seqs": 1, "kv_tokens": 10, "prefill_tokens": 0, "step_s": 0.1}
    for bad in ({"num_seqs": True}, {"kv_tokens": 10**400}):
        path = tmp_path / "m.json"
        path.write_text(json.dumps([good] * 3 + [{**good, **bad}]))
        with pytest.raises(ConfigError, match="measurement 3: measurement fields must be numbers"):
            load_measurements(path)


def test_nnls_scales_with_its_inputs_and_refuses_non_finite_ones():
    a = np.array([[1.0, 2.0], [3.0, 1.0], [0.5, 4.0]])
    b = np.array([1.0, 2.0, 3.0])
    x = nnls(a, b)
    for scale in (1e-16, 1e-8, 1e12):
        assert np.allclose(nnls(a, b * scale), x * scale, rtol=1e-9)
    assert nnls([[1e200], [1e200]], [1e200, 1e200]) == pytest.approx([1.0])
    assert nnls([[1e-170], [2e-170]], [1.0, 2.0]) == pytest.approx([1e170])
    assert (nnls(a, np.zeros(3)) == 0).all() and (nnls(np.zeros((3, 2)), b) == 0).all()
    for bad_a, bad_b in ((a, [1.0, np.nan, 0.0]), ([[np.inf, 1.0]] * 3, b)):
        with pytest.raises(ValueError, match="finite"):
            nnls(bad_a, bad_b)


def test_calibrate_piecewise_from_a_file_names_it_and_pads_only_when_asked(tmp_path, capsys):
    path = tmp_path / "m.csv"
    rows = "1,100,0,0.01\n2,200,0,0.02\n{num_seqs},900,8,0.03\n8,800,0,0.05\n"
    path.write_text("num_seqs,kv_tokens,prefill_tokens,step_s\n" + rows.format(num_seqs=1.5))
    out = tmp_path / "m.json"
    assert (
        main(["calibrate", "--measurements", str(path), "--kind", "piecewise", "--out", str(out)])
        == 2
    )
    assert (
        f"{path}, measurement 2: a piecewise cost model needs a whole number of sequences"
        in capsys.readouterr().err
    )
    path.write_text("num_seqs,kv_tokens,prefill_tokens,step_s\n" + rows.format(num_seqs=4))
    assert (
        main(["calibrate", "--measurements", str(path), "--kind", "piecewise", "--out", str(out)])
        == 0
    )
    model = load_cost_model(str(out))
    assert isinstance(model, PiecewiseCostModel) and not model.padded_kv
    assert main(["calibrate", "--measurements", str(path), "--padded-kv", "--out", str(out)]) == 0
    assert load_cost_model(str(out)).padded_kv
    assert "padded_kv            true" in capsys.readouterr().out
