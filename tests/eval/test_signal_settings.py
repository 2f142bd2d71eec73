"""``growpage eval signal`` on bad input: its settings refused by name (flags and Python API
alike), and a study refused before or after its model loads leaves nothing in --out."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from growpage.cli import main
from growpage.errors import ConfigError
from growpage.eval.signal_study import StudySettings, summarize


@pytest.mark.parametrize(
    "bad",
    [
        {"bootstrap": -1},
        {"max_traces": 0},
        {"max_traces": -1},  # entries[:-1] would drop the last trace
        {"page_sizes": (16, 0)},
        {"horizons": ("paper", "nope")},
        {"fidelity_queries": -1},
        {"seed": 1.5},
    ],
)
def test_bad_study_settings_are_refused(bad: dict) -> None:
    [(field, value)] = bad.items()
    with pytest.raises(ConfigError, match=re.escape(f"StudySettings.{field} must be")):
        StudySettings(**bad)


def test_a_horizon_or_page_size_named_twice_is_measured_once() -> None:
    settings = StudySettings(page_sizes=[32, 16, 32], horizons=["scaled", "paper", "scaled"])
    assert (settings.page_sizes, settings.horizons) == ((32, 16), ("scaled", "paper"))


def test_zero_resamples_give_no_intervals() -> None:
    per_trace = [[(0.1, 1.0), (0.2, 2.0)], [(0.3, 1.0), (0.4, 3.0)], [(0.5, 2.0)]]
    assert summarize(per_trace, 0, seed=0)["spearman_ci95"] is None
    assert summarize(per_trace, 50, seed=0)["spearman_ci95"] is not None


@pytest.mark.parametrize(
    "flag, says",
    [
        (["--bootstrap", "-1"], "argument --bootstrap: expected an integer >= 0, got -1"),
        (["--max-traces", "0"], "argument --max-traces: expected an integer >= 1, got 0"),
        (["--page-sizes", "0"], "argument --page-sizes: expected whole numbers >= 1"),
    ],
)
def test_the_command_refuses_bad_counts_naming_the_flag(tmp_path, capsys, flag, says) -> None:
    out = tmp_path / "study"
    args = ["eval", "signal", "--traces", str(tmp_path), "--model", "m", "--out", str(out)]
    with pytest.raises(SystemExit) as e:
        main([*args, *flag])
    assert e.value.code == 2 and says in capsys.readouterr().err
    assert not out.exists()


def test_a_study_refused_after_its_model_loads_leaves_no_folder(tmp_path, capsys) -> None:
    """Traces recorded at one layer of two: refused at the first trace, after the model loaded
    and before anything was measured; --out is not made. A file as --out is refused first."""
    from growpage.engine.llm import LLM
    from growpage.engine.sampling_params import SamplingParams

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
    from server_helpers import write_tiny_model

    model_dir = write_tiny_model(tmp_path / "tiny")
    traces = tmp_path / "traces"
    llm = LLM(
        str(model_dir),
        "fullkv",
        page_size=4,
        recent_window=2,
        kv_pages=64,
        record_traces=traces,
        record_layers=[0],
    )
    llm.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=12, ignore_eos=True))
    out = tmp_path / "study"
    args = ["eval", "signal", "--traces", str(traces), "--model", str(model_dir)]
    args += ["--page-sizes", "4", "--horizons", "paper", "--bootstrap", "0"]
    assert main([*args, "--out", str(out)]) == 2
    assert "record all 2" in capsys.readouterr().err
    assert not out.exists()
    (tmp_path / "file").write_text("x")
    assert main([*args, "--out", str(tmp_path / "file")]) == 2
    assert "is a file, not a folder" in capsys.readouterr().err
