"""Real SmolLM2 traces (``data/traces/smollm2``) and their analysis (``sim.realtrace``,
``benchmarks/real_traces.py``): the committed set is valid, the analysis runs on it with sane
numbers, and the recorder writes a valid annotated trace from a tiny random model."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from benchmark_scripts import load_benchmark
from safetensors import safe_open

from growpage.core.trace_set import read_trace_set
from growpage.core.traces import read_trace
from growpage.errors import ConfigError
from growpage.sim.realtrace import RealTraceSettings, analyze, grow_ratio, subset_trace
from growpage.sim.signal import signal_quality

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "data" / "traces" / "smollm2"


def _script():
    return load_benchmark("real_traces")


@pytest.fixture(scope="module")
def committed():
    return read_trace_set(COMMITTED)


def test_committed_set_is_small_valid_and_real(committed):
    files = list(COMMITTED.iterdir())
    assert sum(f.stat().st_size for f in files) <= 20 * 2**20
    assert len(committed) >= 2
    for entry in committed.index:
        trace = read_trace(COMMITTED / entry.file, dtype=torch.float16)  # validates on load
        h = trace.header
        assert h.model.lower().startswith("smollm2") and h.num_layers == 30
        assert (h.num_q_heads, h.num_kv_heads, h.head_dim) == (9, 3, 64)
        assert trace.num_generated >= 1024 and h.layer_ids == (19,) and h.has_values
        assert h.meta["policy"] == "fullkv"
        assert h.meta["sampling"]["ignore_eos"] is True
        assert entry.num_tokens == trace.num_tokens and "real" in entry.tags
        with safe_open(COMMITTED / entry.file, "pt") as f:
            assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F16"}
    ids = [e.request_id for e in committed.index]
    assert len(set(ids)) == len(ids)


def test_analysis_on_two_real_traces(committed):
    traces = [subset_trace(committed.read(i), max_generated=384) for i in range(2)]
    settings = RealTraceSettings(page_size=64, fidelity_queries=4, budgets=(256,), bootstrap=20)
    a = analyze(traces, settings, progress=False)
    assert a.trace_ids == [t.request_id for t in traces]
    labels = [r["policy"] for r in a.rows]
    assert labels[:3] == ["growpage", "fullkv", "fixed-256"]
    assert {"inverse", "shrink", "entropy", "streamingllm-256", "h2o-256"} <= set(labels)
    boundaries = {r["boundaries"] for r in a.rows}
    assert len(boundaries) == 1  # every policy meets every page boundary
    for row in a.rows:
        assert row["grow"] + row["compress"] + row["shrink"] == row["boundaries"]
        assert row["fallback"] == 0 and 0 <= row["grow_ratio"] <= 1
        assert 0 <= row["mass_min"] <= row["mass_mean"] <= 1 + 1e-6
    by = {r["policy"]: r for r in a.rows}
    assert by["fullkv"]["mass_min"] == pytest.approx(1.0)
    assert by["fullkv"]["compress"] == 0 and by["fixed-256"]["avg_budget"] <= 256
    q = grow_ratio(a.results["growpage"])
    assert any(r["policy"] == f"random (q={q:.2f})" for r in a.rows)
    for sig in a.signals.values():  # growpage and fullkv
        assert -1 <= sig["spearman"] <= 1 and 0 <= sig["sign_agreement"] <= 1
        assert sum(b["count"] for b in sig["buckets"]) <= sig["num_boundaries"] + len(traces)
        assert sig["num_boundaries"] == len(sig["pairs"]) > 0
        lo, hi = sig["spearman_ci95"]
        assert -1 <= lo <= hi <= 1
        assert len(sig["bucket_ci95"]) == len(sig["buckets"])
        for ci, bucket in zip(sig["bucket_ci95"], sig["buckets"], strict=True):
            if ci["mean_advantage"] is not None:
                assert bucket["count"] >= 2
                assert ci["mean_advantage"][0] <= ci["mean_advantage"][1]
        split = sig["split"]  # the traces carry meta["first_eos"]
        assert (
            split["before"]["num_boundaries"] + split["after"]["num_boundaries"]
            == sig["num_boundaries"]
        )
        levels = sig["levels"]
        assert levels["num_boundaries"] == sig["num_boundaries"]
        assert all(-1 <= levels[k] <= 1 for k in levels if k.startswith("spearman"))


def test_advantage_plot_shows_how_many_boundaries_each_bar_holds(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    figures, close = [], plt.close
    monkeypatch.setattr(plt, "close", figures.append)  # keep the figure to look at its bars
    buckets = [
        {
            "low": -math.inf,
            "high": 0.0,
            "count": 2,
            "mean_advantage": 0.02,
            "mean_advantage_error": 0.05,
        },
        {
            "low": 0.0,
            "high": math.inf,
            "count": 150,
            "mean_advantage": 0.01,
            "mean_advantage_error": None,
        },
    ]
    _script().plot_advantage({"growpage": {"buckets": buckets}}, tmp_path / "a.png")
    [fig] = figures
    for ax in fig.axes:
        assert [t.get_text() for t in ax.texts] == ["2", "150"]  # n on each bar
        assert [bar.get_alpha() for bar in ax.patches] == [0.35, 1.0]  # n = 2 drawn pale
    close(fig)


def test_no_rank_correlation_is_reported_over_a_few_boundaries():
    sig = {
        "num_boundaries": 2,
        "spearman": 1.0,
        "spearman_ci95": [1.0, 1.0],
        "sign_agreement": 1.0,
        "persistence_spearman": -1.0,
        "persistence_pairs": 1,
        "spearman_delta_advantage": 1.0,
        "delta_mean": 0.1,
        "delta_std": 0.1,
        "future_change_std": 0.1,
        "split": {
            "before": {"num_boundaries": 2, "spearman": 1.0, "sign_agreement": 1.0},
            "after": {"num_boundaries": 0},
        },
        "levels": {
            "num_boundaries": 2,
            "spearman_current_level": 1.0,
            "spearman_next_level": -1.0,
            "spearman_current_level_vs_change": 1.0,
        },
    }
    text = _script().signal_text("growpage", sig, 64)
    assert "1.000" not in text and "interval" not in text and "ρ = n/a (< 10 pairs)" in text
    sig.update(num_boundaries=267, persistence_pairs=251)
    text = _script().signal_text("growpage", sig, 64)
    assert "future demand change) = 1.000 (95% trace-bootstrap interval 1.000 to 1.000)" in text


def test_subset_trace_cuts_layers_values_and_tokens(make_trace):
    trace = make_trace(num_tokens=20, prompt_len=5)
    cut = subset_trace(trace, layer_ids=[3], values=False, max_generated=6)
    assert cut.header.layer_ids == (3,) and cut.values is None and not cut.header.has_values
    assert cut.num_tokens == 11 and cut.header.meta["last_token_id"] == trace.header.token_ids[11]
    assert torch.equal(cut.keys[0], trace.keys[1, :11])
    with pytest.raises(ConfigError, match="not recorded"):
        subset_trace(trace, layer_ids=[0])


def test_recorder_writes_an_annotated_trace_from_a_tiny_model(tmp_path):
    from growpage.core.rope import RopeConfig
    from growpage.engine.llm import LLM
    from growpage.engine.loading.loader import build_model, meta_shapes
    from growpage.engine.modeling.model import ModelConfig

    cfg = ModelConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_layers=3,
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=8,
        rms_eps=1e-6,
        arch="llama",
        tie_word_embeddings=False,
        qk_norm=False,
        rope=RopeConfig(head_dim=8),
        bos_token_id=1,
        eos_token_ids=(2,),
        name="tiny-llama",
    )
    gen = torch.Generator().manual_seed(0)
    shapes = meta_shapes(cfg)
    model = build_model(cfg, {k: torch.randn(s, generator=gen) * 0.3 for k, s in shapes.items()})
    script = _script()
    out = tmp_path / "set"
    llm = LLM(
        model,
        policy="fullkv",
        record_traces=out,
        record_layers=[0, 2],
        page_size=4,
        recent_window=1,
        kv_pages=64,
    )
    params = script.sampling_params(2, 24, seed=7, temperature=0.7, top_p=0.95)
    script.record_with(llm, [[5, 6, 7, 8, 9], [10, 11, 12]], params, out, chat=False)
    traces = read_trace_set(out)
    assert len(traces) == 2
    for trace, prompt_len in zip(traces, (5, 3), strict=True):
        h = trace.header
        assert h.layer_ids == (0, 2) and h.has_values and h.prompt_len == prompt_len
        assert trace.num_generated == 23  # the last token is never fed back
        assert h.meta["sampling"] == {
            "temperature": 0.7,
            "top_p": 0.95,
            "seed": h.meta["sampling"]["seed"],
            "ignore_eos": True,
            "max_tokens": 24,
            "chat": False,
            "record_wall_s": h.meta["sampling"]["record_wall_s"],
        }
        first = h.meta["first_eos"]
        generated = list(h.token_ids[prompt_len:]) + [h.meta["last_token_id"]]
        assert first == next((i for i, t in enumerate(generated) if t == 2), None)
        assert torch.isfinite(trace.queries).all() and not math.isnan(h.softmax_scale)
    assert [t.header.meta["sampling"]["seed"] for t in traces] == [7, 8]


def test_bucket_intervals_resample_whole_traces():
    from growpage.sim.realtrace import _bootstrap_buckets
    from growpage.sim.records import BoundaryRecord

    def rec(delta: float, adv: float) -> BoundaryRecord:
        return BoundaryRecord(
            position=64,
            action="grow",
            decision="grow",
            fallback=False,
            pages_before=1,
            pages_after=2,
            tokens_after=65,
            delta=delta,
            advantage=adv,
            advantage_error=2 * adv,
        )

    # Bucket [0.05, inf): trace a says 0.01, trace b says 0.03; bucket [-inf, -0.05): trace a only.
    per_trace = [[rec(0.1, 0.01), rec(0.2, 0.01), rec(-0.1, 0.5)], [rec(0.3, 0.03)]]
    cis = _bootstrap_buckets(per_trace, num=400, seed=0)
    assert len(cis) == len(signal_quality([]).buckets)
    lo, hi = cis[-1]["mean_advantage"]
    assert lo == pytest.approx(0.01) and hi == pytest.approx(0.03)  # all-a and all-b resamples
    lo, hi = cis[-1]["mean_advantage_error"]
    assert lo == pytest.approx(0.02) and hi == pytest.approx(0.06)
    assert cis[0] == {"mean_advantage": None, "mean_advantage_error": None}  # one trace only
    assert all(ci["mean_advantage"] is None for ci in cis[1:-1])  # no boundaries
    assert _bootstrap_buckets(per_trace, num=0, seed=0)[-1]["mean_advantage"] is None


def test_advantage_plot_draws_the_bucket_intervals(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    figures, close = [], plt.close
    monkeypatch.setattr(plt, "close", figures.append)
    buckets = [
        {
            "low": -math.inf,
            "high": 0.0,
            "count": 20,
            "mean_advantage": 0.02,
            "mean_advantage_error": 0.05,
        },
        {
            "low": 0.0,
            "high": math.inf,
            "count": 150,
            "mean_advantage": 0.01,
            "mean_advantage_error": 0.04,
        },
    ]
    cis = [
        {"mean_advantage": (0.015, 0.03), "mean_advantage_error": None},
        {"mean_advantage": (0.005, 0.012), "mean_advantage_error": (0.03, 0.05)},
    ]
    _script().plot_advantage(
        {"growpage": {"buckets": buckets, "bucket_ci95": cis}}, tmp_path / "a.png"
    )
    [fig] = figures
    mass_ax, err_ax = fig.axes
    [mass_bars] = [c for c in mass_ax.containers if getattr(c, "errorbar", None) is not None]
    segments = mass_bars.errorbar.lines[2][0].get_segments()
    assert [(s[0][1], s[1][1]) for s in segments] == [
        pytest.approx((0.015, 0.03)),
        pytest.approx((0.005, 0.012)),
    ]
    [err_bars] = [c for c in err_ax.containers if getattr(c, "errorbar", None) is not None]
    segments = err_bars.errorbar.lines[2][0].get_segments()
    assert [(s[0][1], s[1][1]) for s in segments] == [
        pytest.approx((0.05, 0.05)),
        pytest.approx((0.03, 0.05)),
    ]
    assert "95%" in mass_ax.get_title()
    close(fig)


def test_bucket_table_prints_each_interval():
    sig = {
        "buckets": [
            {
                "low": 0.0,
                "high": 0.01,
                "count": 3,
                "mean_advantage": 0.01,
                "mean_advantage_error": 0.02,
            }
        ],
        "bucket_ci95": [{"mean_advantage": [0.005, 0.02], "mean_advantage_error": None}],
    }
    [row] = _script()._bucket_rows(sig)
    assert row["adv_ci"] == "0.0050 to 0.0200" and row["adv_err_ci"] is None


def test_the_committed_set_and_a_full_set_report_to_different_places(tmp_path):
    script = _script()
    committed = script.default_out(script.COMMITTED)
    assert committed == script.ROOT / "results" / "real_traces" / "committed"
    assert script.default_out(tmp_path / "full") == script.ROOT / "results" / "real_traces"
