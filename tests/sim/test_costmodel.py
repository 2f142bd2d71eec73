"""Cost models: closed-form decode pricing, roofline presets, fitting and calibration."""

from __future__ import annotations

import json
import re
from pathlib import Path

import attrs
import numpy as np
import pytest

from growpage.cli import main
from growpage.commands.calibrate import measure_engine
from growpage.errors import ConfigError
from growpage.sim.calibrate import (
    COLUMNS,
    fit_linear,
    fit_warnings,
    load_measurements,
)
from growpage.sim.costmodel import (
    CostModel,
    LinearCostModel,
    PiecewiseCostModel,
    RooflineCostModel,
    load_cost_model,
)
from growpage.sim.hardware import A100_80GB, PRESETS, QWEN3_8B


def test_roofline_preset_pool_and_memory_bound_decode():
    cost = load_cost_model("a100-qwen3-8b")
    assert isinstance(cost, RooflineCostModel) and set(PRESETS) >= {
        "a100-qwen3-8b",
        "a100-r1-llama-8b",
    }
    assert QWEN3_8B.kv_bytes_per_token == 2 * 36 * 8 * 128 * 2  # 144 KiB per token
    assert cost.kv_pages(256) == 1500
    # Decode of 120 requests x 3442 tokens is memory bound: (weights + KV) / (0.8 * 2.039 TB/s).
    kv = 120 * 3442
    expected = 0.002 + (QWEN3_8B.weight_bytes + kv * QWEN3_8B.kv_bytes_per_token) / (
        0.8 * A100_80GB.memory_bandwidth
    )
    assert cost.step_time(120, kv) == pytest.approx(expected)
    # Prefill is compute bound: 2 * params FLOPs per token at 50% of 312 TFLOP/s.
    assert cost.prefill_time(10000) == pytest.approx(0.002 + 2 * 8.19e9 * 1e4 / (0.5 * 312e12))


@pytest.mark.parametrize(
    "cost",
    [
        load_cost_model("a100-qwen3-8b"),
        load_cost_model("a100-r1-llama-8b"),
        RooflineCostModel(hardware=A100_80GB, model=QWEN3_8B, mfu=0.02, mbu=1.0),  # crosses over
        LinearCostModel(base_s=0.01, per_seq_s=1e-3, per_kv_token_s=2e-7, per_prefill_token_s=1e-4),
        PiecewiseCostModel(
            batch_sizes=(0, 1, 16, 64),
            batch_s=(0.05, 0.01, 0.008, 0.02),
            per_kv_token_s=2e-7,
            per_prefill_token_s=1e-4,
        ),
    ],
)
@pytest.mark.parametrize(
    "batch, kv, steps", [(1, 10, 1), (64, 50000, 300), (256, 10**6, 7), (200, 0, 3000)]
)
def test_closed_form_decode_time_equals_the_sum_of_steps(cost, batch, kv, steps):
    per_step = cost.decode_times(batch, kv, steps)
    assert per_step.shape == (steps,)
    assert cost.decode_time(batch, kv, steps) == pytest.approx(float(per_step.sum()), rel=1e-9)


def test_linear_fit_recovers_coefficients_and_round_trips(tmp_path):
    truth = LinearCostModel(
        base_s=0.004, per_seq_s=2e-4, per_kv_token_s=3e-8, per_prefill_token_s=5e-5
    )
    rng = np.random.default_rng(0)
    x = np.column_stack(
        [rng.integers(1, 64, 50), rng.integers(0, 10**6, 50), rng.integers(0, 4096, 50)]
    ).astype(float)
    y = truth.step_time(x[:, 0], x[:, 1], x[:, 2])
    fitted = fit_linear(np.column_stack([x, y]))
    for name in ("base_s", "per_seq_s", "per_kv_token_s", "per_prefill_token_s"):
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=1e-6)
    path = fitted.save(tmp_path / "m.json")
    assert LinearCostModel.load(path) == fitted == load_cost_model(str(path))


def test_negative_coefficients_are_clamped_to_zero():
    # Step time falls with num_seqs here: the fit must not go negative.
    rows = np.array(
        [
            [1, 0, 0, 0.010],
            [2, 0, 0, 0.009],
            [4, 0, 0, 0.008],
            [8, 0, 0, 0.007],
            [1, 1000, 0, 0.011],
        ]
    )
    fitted = fit_linear(rows)
    assert fitted.per_seq_s == 0.0 and fitted.base_s > 0 and fitted.per_kv_token_s > 0


def test_calibrate_cli_fits_a_csv_and_the_model_loads(tmp_path, capsys):
    truth = LinearCostModel(base_s=0.01, per_seq_s=1e-3, per_kv_token_s=1e-6)
    lines = ["num_seqs,kv_tokens,prefill_tokens,step_s"]
    for s, kv, p in [(1, 100, 0), (4, 800, 0), (8, 3000, 0), (2, 50, 500), (16, 9000, 0)]:
        lines.append(f"{s},{kv},{p},{truth.step_time(s, kv, p)}")
    (tmp_path / "m.csv").write_text("\n".join(lines) + "\n")
    out = tmp_path / "model.json"
    assert main(["calibrate", "--measurements", str(tmp_path / "m.csv"), "--out", str(out)]) == 0
    assert "rms error" in capsys.readouterr().out
    model = load_cost_model(str(out))
    assert model.per_kv_token_s == pytest.approx(1e-6, rel=1e-6)


def test_calibrate_warns_of_what_the_measurements_cannot_fit(tmp_path, capsys):
    path = tmp_path / "m.csv"
    path.write_text(
        "num_seqs,kv_tokens,prefill_tokens,step_s\n1,100,0,0.01\n2,200,0,0.02\n"
        "4,900,0,0.03\n8,800,0,0.05\n"
    )
    assert main(["calibrate", "--measurements", str(path), "--out", str(tmp_path / "m.json")]) == 0
    assert load_cost_model(str(tmp_path / "m.json")).per_prefill_token_s == 0
    captured = capsys.readouterr()
    assert captured.err == (
        "growpage: warning: prefill_tokens is 0 in every measurement, so "
        "per_prefill_token_s is fitted as 0 (free in the simulator); measure "
        "steps with other prefill_tokens\n"
    )
    rows = np.array([[1, 100, 5, 0.01], [1, 200, 0, 0.02], [1, 300, 9, 0.03], [1, 50, 1, 0.04]])
    assert fit_warnings(rows) == [
        "num_seqs is 1 in every measurement, so per_seq_s cannot be "
        "told apart from base_s (only their sum is fitted); measure "
        "steps with other num_seqs"
    ]
    rows[:, 0] = [1, 2, 3, 4]
    rows[:, 1] = 1e5 * rows[:, 0]  # kv_tokens follows num_seqs
    assert "depend linearly on each other" in fit_warnings(rows)[0]
    rows[:, 1] = [100, 900, 300, 50]
    assert fit_warnings(rows) == []


@pytest.mark.parametrize(
    "flag, value", [("--boundary-policy", "fixed"), ("--batch-sizes", "1-4"), ("--contexts", "64")]
)
def test_calibrate_refuses_engine_settings_it_would_not_use(tmp_path, capsys, flag, value):
    path = tmp_path / "m.csv"
    path.write_text(
        "num_seqs,kv_tokens,prefill_tokens,step_s\n1,100,0,0.01\n2,200,0,0.02\n"
        "4,900,8,0.03\n8,800,0,0.05\n"
    )
    out = tmp_path / "m.json"
    assert main(["calibrate", "--measurements", str(path), flag, value, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{flag} set how the local engine is measured" in err and "--measurements" in err
    assert not out.exists()
    # The hint about prices measured elsewhere is for --boundary-policy alone.
    assert ("--boundary-ms" in err) == (flag == "--boundary-policy")


@pytest.mark.parametrize(
    "argv, priced", [([], "growpage"), (["--boundary-policy", "fixed"], "fixed")]
)
def test_calibrate_prices_the_boundary_policy_on_the_engine(
    tmp_path, monkeypatch, capsys, argv, priced
):
    import growpage.engine.profiling.profile as profile

    rows = [
        {"num_seqs": s, "kv_tokens": kv, "prefill_tokens": p, "step_s": t}
        for s, kv, p, t in [
            (1, 100, 0, 0.01),
            (2, 200, 0, 0.02),
            (4, 900, 8, 0.03),
            (8, 800, 0, 0.05),
        ]
    ]
    seen = []
    monkeypatch.setattr(profile, "measure_step_times", lambda **kw: rows)
    monkeypatch.setattr(
        profile,
        "measure_boundary_costs",
        lambda policy: (
            seen.append(policy)
            or {"boundary_s": 0.002, "compaction_s": 0.003, "decided": 4, "compactions": 2}
        ),
    )
    out = tmp_path / "m.json"
    assert main(["calibrate", *argv, "--out", str(out)]) == 0
    assert seen == [priced]
    assert load_cost_model(str(out)).boundary_time(1, 1) == pytest.approx(0.005)


@pytest.mark.parametrize(
    "content, match",
    [
        ("num_seqs,kv_tokens\n1,2\n", "exactly the fields"),
        ("num_seqs,kv_tokens,prefill_tokens,step_s\n1,2,3,x\n", "numbers"),
        ("num_seqs,kv_tokens,prefill_tokens,step_s\n1,2,3,-1\n", ">= 0"),
        ("num_seqs,kv_tokens,prefill_tokens,step_s\n1,2,3,4\n", "at least 4"),
    ],
)
def test_bad_measurements_are_config_errors(tmp_path, content, match):
    path = tmp_path / "m.csv"
    path.write_text(content)
    with pytest.raises(ConfigError, match=match):
        load_measurements(path)
    bad_json = tmp_path / "m.json"
    bad_json.write_text(json.dumps({"rows": []}))
    with pytest.raises(ConfigError, match="JSON list"):
        load_measurements(bad_json)


def test_engine_measurement_goes_through_the_engine_profiler(monkeypatch):
    import growpage.engine.profiling.profile as profile

    rows = [{"num_seqs": 2, "kv_tokens": 100, "prefill_tokens": 0, "step_s": 0.5}]
    monkeypatch.setattr(profile, "measure_step_times", lambda **kw: rows)
    assert measure_engine().tolist() == [[2.0, 100.0, 0.0, 0.5]]
    monkeypatch.setattr(profile, "measure_step_times", lambda **kw: [{"num_seqs": 1}])
    with pytest.raises(ConfigError, match="exactly the fields"):
        measure_engine()


def test_unknown_cost_model_and_bad_specs():
    with pytest.raises(ConfigError, match="unknown cost model"):
        load_cost_model("h100-something")
    with pytest.raises(ConfigError, match="mfu"):
        RooflineCostModel(hardware=A100_80GB, model=QWEN3_8B, mfu=0.0)
    with pytest.raises(ConfigError, match="per_kv_token_s"):
        LinearCostModel(per_kv_token_s=-1.0)


def test_a_cost_model_file_must_hold_every_step_coefficient(tmp_path):
    path = tmp_path / "cm.json"
    path.write_text(json.dumps({"kind": "linear", "base_s": 0.01}))
    with pytest.raises(ConfigError, match="lacks per_seq_s, per_kv_token_s, per_prefill_token_s"):
        LinearCostModel.load(path)


@pytest.mark.parametrize(
    "field, value", [("base_s", -1.0), ("per_kv_token_s", "fast"), ("compaction_s", None)]
)
def test_a_bad_cost_model_file_is_named_in_the_error(tmp_path, capsys, field, value):
    path = tmp_path / "neg.json"
    fields = {
        "kind": "linear",
        "base_s": 0.01,
        "per_seq_s": 0.0,
        "per_kv_token_s": 1e-8,
        "per_prefill_token_s": 0.0,
    }
    path.write_text(json.dumps({**fields, field: value}))
    message = f"{path}: LinearCostModel.{field} must be a finite number >= 0"
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_cost_model(str(path))
    assert main(["sim", "serve", "--workload", "tiny", "--cost", str(path)]) == 2
    assert message in capsys.readouterr().err


def test_serving_refuses_a_cost_model_whose_decode_steps_are_free(capsys, tmp_path):
    from growpage.core.config import GrowPageConfig
    from growpage.sim.serving import SimConfig, simulate
    from growpage.sim.workloads import resolve_workload

    free = LinearCostModel(per_prefill_token_s=1e-4)
    with pytest.raises(ConfigError, match="decode step at 0 s"):
        simulate(resolve_workload("tiny"), "fullkv", GrowPageConfig(), SimConfig(), free)
    path = free.save(tmp_path / "free.json")
    assert main(["sim", "serve", "--workload", "tiny", "--cost", str(path)]) == 2
    assert "decode step at 0 s" in capsys.readouterr().err


def test_describe_works_for_a_cost_model_that_is_not_an_attrs_class():
    # describe() used to call attrs.asdict on any CostModel, so a plain subclass (only
    # step_time, as docs/simulator.md's interface asks) raised NotAnAttrsClassError.
    class Flat(CostModel):
        def step_time(self, num_seqs, kv_tokens, prefill_tokens=0):
            return 0.01

    assert Flat().describe() == {"kind": "Flat"}
    linear = LinearCostModel(base_s=0.01).describe()
    assert linear["kind"] == "LinearCostModel" and linear["base_s"] == 0.01
    roofline = load_cost_model("a100-qwen3-8b").describe()
    assert roofline["kind"] == "RooflineCostModel" and roofline["hardware"]["name"]


def test_calibrate_warns_of_dependent_columns_beside_a_constant_one():
    # Decode steps at one context each: kv_tokens = 100 * num_seqs, and prefill_tokens is 0
    # throughout. The fit cannot split the cost between per_seq_s and per_kv_token_s (it put it
    # all on per_seq_s, pricing KV as free), yet only the constant column was warned of: the
    # dependency check ran only when no column was constant.
    rows = np.array(
        [[1, 100, 0, 0.011], [2, 200, 0, 0.012], [4, 400, 0, 0.014], [8, 800, 0, 0.018]]
    )
    assert fit_warnings(rows) == [
        "prefill_tokens is 0 in every measurement, so per_prefill_token_s is fitted as 0 (free "
        "in the simulator); measure steps with other prefill_tokens",
        "num_seqs, kv_tokens depend linearly on each other in these measurements, so their "
        "coefficients are not fitted separately; vary them independently",
    ]
    # A constant column of another value is warned of alone: the others are independent.
    rows[:, 1] = [100, 900, 300, 50]
    rows[:, 2] = 7
    assert [w.split(" is ")[0] for w in fit_warnings(rows)] == ["prefill_tokens"]


@pytest.mark.parametrize("same", ["m.csv", "./m.csv", "link.csv"])
def test_calibrate_refuses_to_write_the_model_over_its_measurements(
    tmp_path, monkeypatch, capsys, same
):
    # --out naming the measurements file (a slip of the shell's history) wrote the model over
    # the measurements, which were then lost.
    monkeypatch.chdir(tmp_path)
    text = (
        "num_seqs,kv_tokens,prefill_tokens,step_s\n1,100,0,0.01\n2,200,0,0.02\n"
        "4,900,8,0.03\n8,800,0,0.05\n"
    )
    (tmp_path / "m.csv").write_text(text)
    (tmp_path / "link.csv").symlink_to(tmp_path / "m.csv")
    assert main(["calibrate", "--measurements", "m.csv", "--out", same]) == 2
    assert (
        f"--out {same}: is the measurements file m.csv; give another name for the model"
        in capsys.readouterr().err
    )
    assert (tmp_path / "m.csv").read_text() == text


def test_a_step_measured_at_0_seconds_is_a_config_error(tmp_path, monkeypatch):
    # A step takes time: step_s 0 is a measurement gone wrong (or seconds rounded to 0). All
    # such rows fitted a model that priced every step at 0 s, which calibrate wrote without a
    # word and sim serve then refused; some of them pulled the fit down unseen.
    path = tmp_path / "m.csv"
    path.write_text(
        "num_seqs,kv_tokens,prefill_tokens,step_s\n1,100,0,0.01\n2,200,0,0.000\n"
        "4,900,8,0.03\n8,800,0,0.05\n"
    )
    with pytest.raises(
        ConfigError,
        match=re.escape(
            f"{path}, measurement 1 (line 3): step_s must be > 0 (seconds a step took), got 0.0"
        ),
    ):
        load_measurements(path)
    import growpage.engine.profiling.profile as profile

    monkeypatch.setattr(
        profile,
        "measure_step_times",
        lambda **kw: [{"num_seqs": 1, "kv_tokens": 100, "prefill_tokens": 0, "step_s": 0}],
    )
    with pytest.raises(ConfigError, match="row 0: step_s must be > 0"):
        measure_engine()


@pytest.mark.parametrize("suffix", [".csv", ".json"])
def test_measurements_written_with_a_byte_order_mark_are_read(tmp_path, suffix):
    # Spreadsheets write "CSV UTF-8" with a byte order mark: the first field was read as
    # "\ufeffnum_seqs", and the file refused as lacking num_seqs, a field its header shows.
    rows = [(1, 100, 0, 0.01), (2, 200, 0, 0.02), (4, 900, 8, 0.03), (8, 800, 0, 0.05)]
    if suffix == ".csv":
        text = (
            "\r\n".join(
                ["num_seqs,kv_tokens,prefill_tokens,step_s"] + [",".join(map(str, r)) for r in rows]
            )
            + "\r\n"
        )
    else:
        text = json.dumps(
            [
                dict(zip(("num_seqs", "kv_tokens", "prefill_tokens", "step_s"), r, strict=True))
                for r in rows
            ]
        )
    path = tmp_path / f"m{suffix}"
    path.write_bytes(b"\xef\xbb\xbf" + text.encode())
    assert load_measurements(path).tolist() == [list(map(float, r)) for r in rows]


def test_measurements_with_other_fields_are_refused_naming_them(tmp_path):
    path = tmp_path / "m.csv"
    path.write_text("num_seqs, kv_tokens,prefill_tokens,seconds\n1,100,0,0.01\n")
    with pytest.raises(
        ConfigError,
        match=re.escape(
            f"{path}, measurement 0 (line 2): a measurement needs exactly the fields num_seqs, "
            "kv_tokens, prefill_tokens, step_s (lacks kv_tokens, step_s; has ' kv_tokens', 'seconds')"
        ),
    ):
        load_measurements(path)


@pytest.mark.parametrize("spec", ["", "  "])
def test_an_empty_cost_model_spec_is_refused_as_such(capsys, spec):
    # "" named the current directory (Path("") is "."): the error read ": cannot read a cost
    # model ([Errno 21] Is a directory: '.')".
    message = (
        f"unknown cost model {spec!r}: give a preset (a100-qwen3-8b, a100-r1-llama-8b) "
        "or a JSON file written by `growpage calibrate`"
    )
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_cost_model(spec)
    assert main(["sim", "serve", "--workload", "tiny", "--cost", spec]) == 2
    assert message in capsys.readouterr().err


def test_numpy_scalars_are_taken_as_plain_numbers():
    # A price computed with numpy (np.float32, np.int64: not float or int subclasses) was
    # refused as "must be a finite number >= 0, got np.float32(0.002)", which it is; the
    # piecewise model's lists took numpy values all along.
    from growpage.sim.costmodel import with_boundary_costs

    linear = LinearCostModel(
        base_s=np.float32(0.5), per_seq_s=np.int64(0), per_kv_token_s=np.float64(1e-6)
    )
    assert (linear.base_s, linear.per_seq_s) == (0.5, 0)
    assert type(linear.base_s) is float and type(linear.per_seq_s) is int
    priced = with_boundary_costs(linear, np.float32(0.25), np.int32(1))
    assert priced.boundary_time(2, 1) == pytest.approx(1.5)
    roofline = RooflineCostModel(
        hardware=A100_80GB, model=QWEN3_8B, mfu=np.float32(0.5), overhead_s=np.float32(0.25)
    )
    assert type(roofline.mfu) is float and roofline.overhead_s == 0.25
    piecewise = PiecewiseCostModel(batch_sizes=(1,), batch_s=(0.1,), per_kv_token_s=np.float32(0.5))
    assert piecewise.per_kv_token_s == 0.5
    for bad in (np.float32("nan"), np.float64(-1.0), np.True_):
        with pytest.raises(ConfigError, match="base_s must be a finite number >= 0"):
            LinearCostModel(base_s=bad)


@pytest.mark.parametrize("fit", ["linear", "piecewise"])
def test_fits_refuse_rows_that_are_not_measurements(fit):
    # fit_linear and fit_piecewise took any array: a negative or zero step time was fitted
    # unseen (four rows with one at -1 s fitted a linear model that priced every step at 0 s),
    # no rows fitted a free model, and NaN failed deep in nnls without naming the row.
    from growpage.sim.calibrate import FITS

    good = [[1, 100, 0, 0.01], [2, 200, 0, 0.02], [4, 900, 8, 0.03], [8, 800, 0, 0.05]]
    for bad, match in (
        (-1.0, "measurement 2: measurement fields must be finite and >= 0"),
        (0.0, "measurement 2: step_s must be > 0"),
        (float("nan"), "measurement 2: measurement fields must be finite"),
    ):
        rows = np.array(good)
        rows[2, 3] = bad
        with pytest.raises(ConfigError, match=match):
            FITS[fit](rows)
        with pytest.raises(ConfigError, match=match):
            fit_warnings(rows, fit)
    for shape in ((0, 4), (4, 3), (4,)):
        with pytest.raises(
            ConfigError,
            match=re.escape(
                f"measurements must be rows of {', '.join(COLUMNS)}, got an array of shape {shape}"
            ),
        ):
            FITS[fit](np.zeros(shape))


@pytest.mark.parametrize(
    "model",
    [
        LinearCostModel(base_s=0.01, per_seq_s=0.001),
        PiecewiseCostModel(batch_sizes=(1, 4), batch_s=(0.01, 0.02), per_kv_token_s=1e-6),
    ],
    ids=["linear", "piecewise"],
)
def test_a_save_that_fails_leaves_the_old_model(tmp_path, monkeypatch, model):
    """Until 2026-12 save truncated the file, then wrote: a full disk lost the old model."""
    path = model.save(tmp_path / "model.json")
    before = path.read_text()
    real = Path.write_text

    def half_then_full(self, text, *args, **kwargs):
        real(self, text[: len(text) // 2], *args, **kwargs)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_text", half_then_full)
    with pytest.raises(OSError, match="No space left"):
        attrs.evolve(model).save(path)
    monkeypatch.undo()
    assert path.read_text() == before
    assert type(model).load(path) == model
    assert [p.name for p in tmp_path.iterdir()] == ["model.json"]  # no temporary left behind


def test_a_csv_measurement_is_named_with_its_line(tmp_path):
    """Measurements count from 0, as fit_piecewise names them; a CSV's also give the line an
    editor shows, blank lines counted (until 2026-12 "measurement 2" of this file was all)."""
    path = tmp_path / "m.csv"
    path.write_text(
        "num_seqs,kv_tokens,prefill_tokens,step_s\n1,100,0,0.01\n\n"
        "2,200,0,0.02\n4,-900,8,0.03\n8,800,0,0.05\n"
    )
    with pytest.raises(ConfigError, match=re.escape(f"{path}, measurement 2 (line 5): ")):
        load_measurements(path)
