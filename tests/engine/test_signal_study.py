"""The Delta_t study (``growpage eval signal``) on traces the tiny model records: what it
measures at each boundary and that its growth advantage is the engine's own counterfactual."""

from __future__ import annotations

import pytest
import torch
from llm_helpers import prompt, tiny_llm, tiny_model

from growpage.core.trace_set import TraceSet
from growpage.engine.counterfactual import reference
from growpage.engine.sampling_params import SamplingParams
from growpage.errors import ConfigError
from growpage.eval.signal_study import (
    Horizon,
    StudySettings,
    config_for,
    horizons,
    report_markdown,
    run_study,
    scaled_beta_long,
    trace_boundaries,
)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def traces(model, tmp_path_factory):
    out = tmp_path_factory.mktemp("traces") / "set"
    llm = tiny_llm(model, record_traces=out)
    llm.generate(
        [prompt(9, 61), prompt(14, 62), prompt(6, 63)],
        SamplingParams(max_tokens=48, ignore_eos=True),
        use_tqdm=False,
    )
    return out


def test_scaled_horizon_keeps_the_papers_share_of_the_answer():
    assert scaled_beta_long(8000) == pytest.approx(0.999)
    assert scaled_beta_long(800) == pytest.approx(0.99)
    assert [h.label for h in horizons(["paper", "scaled"], 800)] == ["paper", "scaled"]
    assert horizons(["scaled"], 800)[0] == Horizon("scaled", 0.99, "average")
    with pytest.raises(ConfigError, match="unknown horizon"):
        horizons(["long"], 800)


def test_each_boundary_carries_delta_demand_change_and_growpages_selection(model, traces):
    trace = TraceSet(traces).read(0)
    rows, own = trace_boundaries(trace, config_for(8, Horizon("paper")))
    assert rows and own.records
    b = 8
    for row in rows:
        t = row["position"]
        assert t % b == 0 and row["kept"].shape[-1] == t - b
        kept = row["kept"]
        assert (kept[..., 1:] > kept[..., :-1]).all() and int(kept.max()) < t
        assert (kept[..., -2:] == torch.tensor([t - 2, t - 1])).all()  # the recent window


def test_the_study_reports_fig6_fig7_and_the_replay_column(model, traces):
    settings = StudySettings(page_sizes=(4, 8), horizons=("paper", "scaled"), bootstrap=20)
    report = run_study(traces, model, settings, progress=False, log=lambda _: None)
    assert set(report["cells"]) == {"b4-paper", "b4-scaled", "b8-paper", "b8-scaled"}
    trace_set = TraceSet(traces)
    for key, cell in report["cells"].items():
        b = cell["page_size"]
        expected = 0
        for trace in trace_set:
            rows, _ = trace_boundaries(trace, config_for(b, Horizon(**cell["horizon"])))
            expected += sum(row["position"] + b < trace.num_tokens for row in rows)
        fig7 = cell["fig7_nll"]
        assert fig7["num_boundaries"] == expected > 0, key
        assert sum(bk["count"] for bk in fig7["buckets"]) == expected
        assert -1 <= fig7["spearman"] <= 1
    # The scaled horizon remembers less: a different Delta_t at some boundary.
    paper, scaled = report["cells"]["b4-paper"], report["cells"]["b4-scaled"]
    assert paper["fig6"]["spearman"] != scaled["fig6"]["spearman"]
    text = report_markdown(report)
    assert "| 4 | paper (beta_L 0.999, first) |" in text and "by Delta_t" in text


def test_one_advantage_is_the_reference_nll_difference(model, traces):
    """A_t of the first boundary, recomputed from its parts."""
    trace = TraceSet(traces).read(1)
    rows, _ = trace_boundaries(trace, config_for(4, Horizon("paper")))
    row = rows[0]
    ref = reference(model, list(trace.header.token_ids))
    t = row["position"]
    compress = ref.nll_kept(t, row["kept"], 4).mean()
    grow = ref.nlls[t : t + 4].mean()
    assert float(compress - grow) != 0.0
    everything = torch.arange(t).expand_as(row["kept"][..., :1].expand(-1, -1, t))
    torch.testing.assert_close(ref.nll_kept(t, everything, 4).mean(), grow, rtol=1e-4, atol=1e-4)


def test_traces_without_every_layer_are_refused(model, tmp_path):
    llm = tiny_llm(model, record_traces=tmp_path / "set", record_layers=[0])
    llm.generate([prompt(9, 1)], SamplingParams(max_tokens=20, ignore_eos=True), use_tqdm=False)
    with pytest.raises(ConfigError, match="record all 2"):
        run_study(tmp_path / "set", model, StudySettings(page_sizes=(4,)), progress=False)


def test_a_study_cut_short_resumes_from_its_stored_items(model, traces, tmp_path, monkeypatch):
    """Each (trace, page size, horizon) is stored as it finishes; a resumed run measures only
    what is missing and reports what one uninterrupted run reports."""
    import growpage.eval.signal_study as study

    settings = StudySettings(page_sizes=(4, 8), horizons=("paper",), bootstrap=20)
    whole = run_study(traces, model, settings, progress=False, log=lambda _: None)
    items = tmp_path / "items"
    real, calls = study.trace_boundaries, []

    def dies_on_the_fourth(*args, **kwargs):
        calls.append(args[1].page_size)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(study, "trace_boundaries", dies_on_the_fourth)
    with pytest.raises(KeyboardInterrupt):
        run_study(traces, model, settings, progress=False, log=lambda _: None, items=items)
    assert len(list(items.glob("*.pkl"))) == 3
    with pytest.raises(ConfigError, match="--resume"):
        run_study(traces, model, settings, progress=False, log=lambda _: None, items=items)
    calls.clear()
    monkeypatch.setattr(
        study, "trace_boundaries", lambda *a, **k: (calls.append(1), real(*a, **k))[1]
    )
    resumed = run_study(
        traces, model, settings, progress=False, log=lambda _: None, items=items, resume=True
    )
    assert len(calls) == 6 - 3
    assert resumed["cells"] == whole["cells"]
    # Other settings do not reuse an item: the same files measured with fewer fidelity
    # queries are measured again.
    calls.clear()
    other = StudySettings(page_sizes=(4, 8), horizons=("paper",), bootstrap=20, fidelity_queries=4)
    run_study(traces, model, other, progress=False, log=lambda _: None, items=items, resume=True)
    assert len(calls) == 6
