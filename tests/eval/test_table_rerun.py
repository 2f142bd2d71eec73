"""``benchmarks/table_rerun.py``: reruns a stored accuracy table's rows with its settings and
says whether each output is the stored one, and the rows record the commit they ran at."""

from __future__ import annotations

import json

import pytest
from benchmark_scripts import load_benchmark

from growpage.errors import ConfigError
from growpage.eval.accuracy import AccuracySettings, outputs_path, read_outputs, run_table

rerun = load_benchmark("table_rerun")


def stored_table(rows: list[str], done: list[str]) -> dict:
    settings = AccuracySettings(model=None, rows=tuple(rows)).to_dict()
    return {"settings": settings, "rows": [{"label": label} for label in done]}


def test_only_finished_rows_rerun_and_a_row_brings_the_rows_it_reads() -> None:
    rows = ["gp=growpage", "h2o=h2o:budget_tokens=@gp.budget", "fk=fullkv"]
    stored = stored_table(rows, ["gp", "h2o"])
    settings = rerun.rerun_settings(stored, ["h2o", "gp"])
    assert settings.rows == (rows[0], rows[1]) and settings.model is None  # the table's order
    with pytest.raises(ConfigError, match="'fk' is not a finished row"):
        rerun.rerun_settings(stored, ["fk"])
    with pytest.raises(ConfigError, match="'h2o' reads row\\(s\\) gp: rerun them with it"):
        rerun.rerun_settings(stored, ["h2o"])


def test_compare_counts_outputs_with_the_same_text_and_tokens() -> None:
    old = [{"id": "a", "output": "x", "num_tokens": 3}, {"id": "b", "output": "y", "num_tokens": 2}]
    assert rerun.compare(old, [dict(o) for o in old]) == (2, [])
    assert rerun.compare(old, [old[0], {**old[1], "num_tokens": 4}]) == (1, ["b"])
    with pytest.raises(ConfigError, match="not the stored table's"):
        rerun.compare(old, old[::-1])


def test_the_report_names_the_code_its_rows_ran_not_the_checkout_at_writing() -> None:
    report = {"commit": "c9", "rows": [{"label": "a", "commit": "c1"}, {"label": "b"}]}
    assert rerun.ran_at(report) == "c1, c9"  # b recorded none: the report's own
    assert rerun.ran_at({"commit": "c9", "rows": [{"commit": "c1"}, {"commit": "c1"}]}) == "c1"


@pytest.mark.slow
def test_a_rerun_of_a_smollm2_table_finds_its_outputs_and_a_changed_one(tmp_path) -> None:
    table = tmp_path / "table"
    settings = AccuracySettings(
        model=None,  # SmolLM2
        num_problems=2,
        max_tokens=8,
        page_size=8,
        max_num_seqs=2,
        pool_fraction=1.0,
        protect_prompt=True,
        rows=("fullkv=fullkv", "gp=growpage:floor_tokens=0"),
    )
    report = run_table(settings, table, progress=False, log=lambda _: None)
    commits = {r["commit"] for r in report["rows"]}
    assert len(commits) == 1 and all(commits)
    assert f"Rows ran at {next(iter(commits))}: fullkv, gp." in (table / "table.md").read_text()

    out = tmp_path / "reruns"
    args = [str(table), "--rows", "gp", "fullkv", "--out", str(out), "--threads", "1"]
    assert rerun.main(args) == 0
    text = (out / "table" / "report.md").read_text()
    assert f"| gp | 2 of 2 | {commits.pop()} |" in text and "| fullkv | 2 of 2 |" in text
    assert "TPS now against fullkv's, same run: gp" in text

    # A stored output that the code no longer gives is found and named.
    outputs = read_outputs(table, "gp")
    outputs[1]["output"] += " changed"
    outputs_path(table, "gp").write_text("".join(json.dumps(o) + "\n" for o in outputs))
    assert rerun.main([*args, "--resume"]) == 1
    found = json.loads((out / "table" / "report.json").read_text())["rows"]
    assert found["gp"] == {"identical": 1, "differ": [outputs[1]["id"]]}
    assert found["fullkv"] == {"identical": 2, "differ": []}


def test_a_table_whose_results_are_not_json_is_named(tmp_path, capsys) -> None:
    (tmp_path / "results.json").write_text("{bad")
    assert rerun.run_main(lambda: rerun.main([str(tmp_path), "--rows", "a"])) == 2
    err = capsys.readouterr().err
    assert f"error: {tmp_path / 'results.json'}: not JSON" in err
    assert rerun.run_main(lambda: rerun.main([str(tmp_path / "none"), "--rows", "a"])) == 2
    assert "results.json: no accuracy table" in capsys.readouterr().err
