"""The accuracy table: which runs it plans from growpage's row, that each row scores the outputs
it stores, and that a table cut short resumes without running a finished row again."""

from __future__ import annotations

import json
import re

import attrs
import pytest

from growpage import CapacityPolicy, Decision
from growpage.errors import ConfigError
from growpage.eval import accuracy
from growpage.eval.accuracy import AccuracySettings, plan, plan_rows, run_table
from growpage.eval.maths import generate_problems, is_correct

GROWPAGE_ROW = {"avg_budget": 100.0, "decided_grow": 3, "decided_compress": 9}


@attrs.define(slots=False)
class GrowWhileShort(CapacityPolicy):
    """A policy author's own: grows while the capacity is below ``limit`` tokens."""

    name = "grow_while_short"
    limit: int = 16

    def decide(self, ctx):
        return Decision.GROW if ctx.capacity < self.limit else Decision.COMPRESS


def test_plan_matches_the_baselines_to_growpage_s_row() -> None:
    s = AccuracySettings(page_size=16)
    assert [r.label for r in plan(s, None)] == ["fullkv", "growpage"]
    runs = {r.label: r for r in plan(s, GROWPAGE_ROW)}
    # 100 tokens -> 6 pages of 16 = 96; half 48 (3 pages); twice 192.
    assert [k for k in runs if k.startswith("fixed")] == ["fixed-96", "fixed-48", "fixed-192"]
    assert runs["fixed-48"].kwargs == {"budget_tokens": 48}
    assert runs["random-q0.25"].kwargs == {"grow_prob": 0.25, "seed": 0}
    assert runs["shrink"].kwargs == {"min_capacity_tokens": 48}
    for name in ("streamingllm", "h2o", "snapkv"):
        assert runs[f"{name}-96"].kwargs == {"budget_tokens": 96}
    assert list(runs) == [
        "fullkv",
        "growpage",
        "fixed-96",
        "h2o-96",
        "snapkv-96",
        "random-q0.25",
        "fixed-48",
        "fixed-192",
        "streamingllm-96",
        "inverse",
        "shrink",
    ]


def test_plan_keeps_budgets_of_at_least_two_pages_and_only_wanted_policies() -> None:
    s = AccuracySettings(page_size=16, policies=("fullkv", "growpage", "fixed"))
    runs = plan(s, {"avg_budget": 20.0, "decided_grow": 0, "decided_compress": 0})
    assert [r.label for r in runs] == ["fullkv", "growpage", "fixed-32", "fixed-64"]


@pytest.mark.parametrize(
    "bad",
    [
        {"num_problems": 0},
        {"pool_fraction": 0.0},
        {"pool_fraction": 1.5},
        {"policies": ("fullkv", "nope")},
        {"difficulty": 4},
        {"dtype": "float16"},
    ],
)
def test_bad_settings_are_refused(bad: dict) -> None:
    [(field, value)] = bad.items()
    with pytest.raises(ConfigError, match=re.escape(f"AccuracySettings.{field} must be")) as e:
        AccuracySettings(**bad)
    assert str(e.value).endswith(f"got {value!r}")


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_a_table_on_smollm2_scores_what_it_stores_and_resumes(tmp_path, monkeypatch) -> None:
    settings = AccuracySettings(
        model=None,  # the default real model, SmolLM2
        num_problems=2,
        max_tokens=6,
        page_size=8,
        max_num_seqs=2,
        pool_fraction=0.5,
        policies=("fullkv", "growpage", "random"),
    )
    calls: list[str] = []
    real_run = accuracy.AccuracyRunner.run

    def run_then_stop(self, run, progress=True):
        calls.append(run.label)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_run(self, run, progress)

    monkeypatch.setattr(accuracy.AccuracyRunner, "run", run_then_stop)
    with pytest.raises(KeyboardInterrupt):
        run_table(settings, tmp_path, progress=False, log=lambda _: None)
    stored = json.loads((tmp_path / "results.json").read_text())
    assert [r["label"] for r in stored["rows"]] == ["fullkv"]
    with pytest.raises(ConfigError, match="resume"):
        run_table(settings, tmp_path, progress=False, log=lambda _: None)
    other = AccuracySettings(**{**settings.to_dict(), "seed": 1, "model": None})
    with pytest.raises(ConfigError, match="other settings"):
        run_table(other, tmp_path, resume=True, progress=False, log=lambda _: None)

    report = run_table(settings, tmp_path, resume=True, progress=False, log=lambda _: None)
    labels = [r["label"] for r in report["rows"]]
    assert labels[:2] == ["fullkv", "growpage"] and calls.count("fullkv") == 1
    assert {lab for lab in labels[2:]} == {r.label for r in plan(settings, report["rows"][1])[2:]}
    problems = generate_problems(2, seed=0)
    for row in report["rows"]:
        lines = (tmp_path / "outputs" / f"{row['label']}.jsonl").read_text().splitlines()
        outputs = [json.loads(line) for line in lines]
        assert [o["id"] for o in outputs] == [p.id for p in problems]
        correct = [is_correct(p, o["output"]) for p, o in zip(problems, outputs, strict=True)]
        assert [o["correct"] for o in outputs] == correct
        assert row["num_correct"] == sum(correct) and row["num_problems"] == 2
        assert row["mean_tokens"] == sum(o["num_tokens"] for o in outputs) / 2
        assert 0 < row["mean_tokens"] <= 6 and row["tps"] > 0
        # one token per request per decode step at most; the loads are the machine's
        assert row["steps"] >= max(o["num_tokens"] for o in outputs)
        assert len(row["load_avg"]) == 2 and all(x >= 0 for x in row["load_avg"])
    # A resumed table may ask for another policy: only its row runs, the others are kept, and
    # the stored settings name every policy of the table.
    more = AccuracySettings(**{**settings.to_dict(), "policies": ["inverse"], "model": None})
    calls.clear()
    report = run_table(more, tmp_path, resume=True, progress=False, log=lambda _: None)
    assert calls == ["inverse"] and [r["label"] for r in report["rows"]] == [*labels, "inverse"]
    stored = json.loads((tmp_path / "results.json").read_text())
    assert stored["settings"]["policies"] == ["fullkv", "growpage", "random", "inverse"]
    labels.append("inverse")
    table = (tmp_path / "table.md").read_text()
    assert all(f"| {lab} |" in table for lab in labels)
    assert "| truncated | load |" in table and "at like loads" in table
    assert (tmp_path / "accuracy.png").stat().st_size > 0


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_rows_of_any_policy_run_in_one_table_and_record_their_regime(tmp_path) -> None:
    """A policy class of this test file in a table beside built-ins, with the prompt protected,
    a row's own floor and horizon, and a baseline matched to its budget (SmolLM2, 2 problems)."""
    here = f"{__file__}:GrowWhileShort"
    settings = AccuracySettings(
        model=None,
        num_problems=2,
        max_tokens=24,
        page_size=8,
        max_num_seqs=2,
        pool_fraction=1.0,
        protect_prompt=True,
        rows=(
            f"mine={here}:limit=24",
            "gp-f8=growpage:floor_tokens=8,beta_long=0.95,summary_start=average",
            "h2o=h2o:budget_tokens=@mine.budget",
        ),
    )
    report = run_table(settings, tmp_path, progress=False, log=lambda _: None)
    rows = {r["label"]: r for r in report["rows"]}
    assert list(rows) == ["mine", "gp-f8", "h2o"]
    mine, gp, h2o = rows["mine"], rows["gp-f8"], rows["h2o"]
    assert (mine["policy"], mine["kwargs"], mine["config"]) == (here, {"limit": 24}, {})
    assert gp["config"] == {"floor_tokens": 8, "beta_long": 0.95, "summary_start": "average"}
    assert (gp["floor_tokens"], gp["beta_long"], gp["summary_start"]) == (8, 0.95, "average")
    assert all(r["protect_prompt"] for r in rows.values())
    assert mine["floor_tokens"] is None and mine["beta_long"] == 0.999
    budget = max(2, round(mine["avg_budget"] / 8)) * 8
    assert h2o["kwargs"] == {"budget_tokens": budget}
    for r in rows.values():
        assert 0 <= r["avg_above_prompt"] <= r["avg_budget"]
    table = (tmp_path / "table.md").read_text()
    assert "| mine | P |" in table and "| gp-f8 | P f8 bL0.95 average |" in table
    # A resumed table takes one more row; a label given again must mean the same row.
    more = AccuracySettings(**{**settings.to_dict(), "rows": ["fullkv=fullkv"], "model": None})
    report = run_table(more, tmp_path, resume=True, progress=False, log=lambda _: None)
    assert [r["label"] for r in report["rows"]] == ["mine", "gp-f8", "h2o", "fullkv"]
    clash = AccuracySettings(**{**settings.to_dict(), "rows": ["mine=fullkv"], "model": None})
    with pytest.raises(ConfigError, match="labelled 'mine' given as"):
        run_table(clash, tmp_path, resume=True, progress=False, log=lambda _: None)


def test_the_fixed_frontier_reads_a_row_against_fixed_budgets() -> None:
    def row(label, policy, budget, acc, config=None):
        return {
            "label": label,
            "policy": policy,
            "avg_budget": budget,
            "accuracy": acc,
            "config": config or {},
        }

    rows = [
        row("fixed-128", "fixed", 120.0, 0.2),
        row("fixed-256", "fixed", 220.0, 0.6),
        row("fixed-f", "fixed", 150.0, 0.9, {"floor_tokens": 64}),  # a row of its own: not on it
        row("gp", "growpage", 170.0, 0.5),
        row("small", "growpage", 100.0, 0.5),
    ]
    frontier = accuracy.fixed_frontier(rows)
    assert frontier == [(120.0, 0.2), (220.0, 0.6)]
    assert accuracy.frontier_gap(rows[3], frontier) == pytest.approx(0.5 - 0.4)
    assert accuracy.frontier_gap(rows[4], frontier) is None  # below the frontier's budgets
    assert accuracy.frontier_gap(rows[0], frontier) is None
    assert accuracy.frontier_gap(rows[2], frontier) == pytest.approx(0.9 - (0.2 + 0.4 * 0.3))


def _stale_table(folder) -> None:
    """A one-row table of two problems whose outputs an older reader scored wrong: the first
    holds the right answer boxed, the second a wrong one."""
    settings = AccuracySettings(num_problems=2, rows=("a=fullkv",))
    problems = generate_problems(2, seed=0)
    texts = [f"so \\boxed{{{problems[0].answer}}}", "#### 1e9 apples"]
    (folder / "outputs").mkdir()
    stale = [
        {"id": p.id, "template": p.template, "correct": False, "output": t, "num_tokens": 5}
        for p, t in zip(problems, texts, strict=True)
    ]
    (folder / "outputs" / "a.jsonl").write_text("".join(json.dumps(o) + "\n" for o in stale))
    row = {
        "label": "a",
        "policy": "fullkv",
        "kwargs": {},
        "config": {},
        "accuracy": 0.0,
        "interval": [0.0, 0.5],
        "num_correct": 0,
        "num_problems": 2,
        "avg_budget": 10.0,
        "mean_tokens": 5,
        "tps": 1.0,
        "avg_resident": 1.0,
        "grow": 0,
        "compress": 0,
        "fallback": 0,
        "preemptions": 0,
        "num_no_answer": 2,
        "num_truncated": 0,
    }
    report = {
        "settings": settings.to_dict(),
        "kv_pages": 8,
        "date": "d",
        "commit": "c",
        "rows": [row],
    }
    (folder / "results.json").write_text(json.dumps(report))


def test_rescore_reads_the_stored_outputs_again(tmp_path) -> None:
    """A table whose outputs were scored by an older reader: rescoring rewrites the verdicts,
    the row and the table from the outputs alone (no model)."""
    _stale_table(tmp_path)
    new, changed = accuracy.rescore(tmp_path)
    assert changed == {"a": 1}
    [r] = new["rows"]
    assert (r["num_correct"], r["accuracy"], r["num_boxed"]) == (1, 0.5, 1)
    lines = (tmp_path / "outputs" / "a.jsonl").read_text().splitlines()
    assert [json.loads(line)["correct"] for line in lines] == [True, False]
    assert json.loads((tmp_path / "results.json").read_text())["rows"][0]["num_correct"] == 1
    assert "| a | - | 0.500" in (tmp_path / "table.md").read_text()
    with pytest.raises(ConfigError, match="no accuracy table"):
        accuracy.rescore(tmp_path / "nothing")


def test_the_rescore_command_prints_the_table_and_the_changed_verdicts(tmp_path, capsys) -> None:
    from growpage.cli import main

    _stale_table(tmp_path)
    assert main(["eval", "rescore", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| a | - | 0.500" in out
    assert "[rescore] a: 1 verdict(s) changed" in out
    assert main(["eval", "rescore", str(tmp_path)]) == 0  # nothing left to change
    assert "[rescore] a: 0 verdict(s) changed" in capsys.readouterr().out
    assert main(["eval", "rescore", str(tmp_path / "nothing")]) != 0
    assert "no accuracy table" in capsys.readouterr().err


def test_a_resumed_table_runs_its_rows_in_the_order_the_command_names_them(tmp_path) -> None:
    """The stored rows the command does not name keep their place after the named ones; a
    finished row is never planned again."""
    from growpage.eval.accuracy import load_results

    settings = AccuracySettings(
        model=None, rows=("a=fullkv", "b=fixed:budget_tokens=64", "c=fixed:budget_tokens=32")
    )
    stored = {"settings": settings.to_dict(), "rows": [{"label": "a"}]}
    (tmp_path / "results.json").write_text(json.dumps(stored))
    again = AccuracySettings(
        model=None, rows=("c=fixed:budget_tokens=32", "d=fixed:budget_tokens=16")
    )
    rows, merged = load_results(tmp_path, again)
    assert rows == [{"label": "a"}]
    assert list(merged.rows) == [
        "c=fixed:budget_tokens=32",
        "d=fixed:budget_tokens=16",
        "a=fullkv",
        "b=fixed:budget_tokens=64",
    ]
    assert [r.label for r in plan_rows(merged, rows) if r.label != "a"] == ["c", "d", "b"]


def test_the_commit_a_row_records_says_when_the_package_differs_from_it(tmp_path) -> None:
    import subprocess

    def git(*args: str) -> str:
        done = subprocess.run(
            ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            check=True,
        )
        return done.stdout.strip()

    package = tmp_path / "pkg"
    package.mkdir()
    (package / "a.py").write_text("x = 1\n")
    (tmp_path / "results.json").write_text("{}\n")
    git("init", "-q")
    git("add", ".")
    git("commit", "-q", "-m", "one")
    head = git("rev-parse", "--short", "HEAD")
    assert accuracy._commit(package) == head
    (tmp_path / "results.json").write_text('{"rows": []}\n')  # a table written beside: no change
    (package / "new.py").write_text("")  # untracked: not what a commit names either
    assert accuracy._commit(package) == head
    (package / "a.py").write_text("x = 2\n")
    assert accuracy._commit(package) == head + "+changes"
    assert accuracy._commit(tmp_path.parent) == "unknown"  # no checkout


@pytest.fixture
def no_model(monkeypatch) -> list[str]:
    """``AccuracyRunner`` replaced by one that fails the test if it is built (it loads the
    model); the list records the attempts."""
    loads: list[str] = []

    def load(settings, threads=None):
        loads.append(settings.model)
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(accuracy, "AccuracyRunner", load)
    return loads


@pytest.mark.parametrize(
    "row, says",
    [
        (
            "b=fixed:budget_tokens=-1",
            "row 'b=fixed:budget_tokens=-1': cannot build policy 'fixed': "
            "FixedBudgetPolicy.budget_tokens must be a positive integer, got -1",
        ),
        ("b=growpage:beta_long=2", "row 'b=growpage:beta_long=2': GrowPageConfig.beta_long"),
        ("b=growpage:recent_window=16", "recent_window must be < page_size (16), got 16"),
        ("b=growpage:beta_short=0.99,beta_long=0.9", "beta_short must be < beta_long (0.9)"),
        # a row reading another row's results: its literal values are checked alone
        ("b=h2o:budget_tokens=@a.budget,beta_long=2", "GrowPageConfig.beta_long must be"),
        ("b=random:grow_prob=@a.grow_ratio,seed=1.5", "RandomPolicy.seed must be an integer"),
        # ... and a part without a reference is built whole
        ("b=h2o:budget_tokens=@a.budget,recent_window=16", "recent_window must be < page_size"),
    ],
)
def test_every_row_is_built_before_the_table_runs(row: str, says: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(says)):
        AccuracySettings(rows=("a=fullkv", row))


def test_a_rows_check_across_fields_waits_for_the_value_it_reads() -> None:
    """beta_short < beta_long cannot be checked until @a.grow_ratio is known: not refused."""
    rows = ("a=fullkv", "b=growpage:beta_short=@a.grow_ratio,beta_long=0.5")
    assert AccuracySettings(rows=rows).rows == rows


def test_a_bad_row_fails_the_command_before_the_model_loads_and_writes_nothing(
    tmp_path, capsys, no_model
) -> None:
    from growpage.cli import main

    rows = ["--row", "a=fullkv", "--row", "b=fixed:budget_tokens=-1"]
    new, empty = tmp_path / "new", tmp_path / "empty"
    empty.mkdir()
    for out in (new, empty):
        assert main(["eval", "accuracy", *rows, "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert "growpage: error: row 'b=fixed:budget_tokens=-1'" in err and "got -1" in err
    assert not no_model and not new.exists() and list(empty.iterdir()) == []


def test_a_table_refused_at_its_model_or_its_policies_writes_nothing(tmp_path, no_model) -> None:
    settings = AccuracySettings(num_problems=2, rows=("a=fullkv",))
    with pytest.raises(AssertionError, match="the model was loaded"):
        run_table(settings, tmp_path / "new", progress=False, log=lambda _: None)
    assert not (tmp_path / "new").exists()  # made when the first row is stored
    # Baselines matched to growpage's row never run without it: refused, not skipped.
    alone = AccuracySettings(num_problems=2, policies=("fullkv", "h2o"))
    with pytest.raises(ConfigError, match="policies h2o run at growpage's budget"):
        run_table(alone, tmp_path / "new", progress=False, log=lambda _: None)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="is a file, not a folder"):
        run_table(settings, tmp_path / "file", progress=False, log=lambda _: None)
    assert len(no_model) == 1 and sorted(p.name for p in tmp_path.iterdir()) == ["file"]


@pytest.mark.parametrize(
    "text, says",
    [
        ("{bad", "results.json: not JSON (Expecting property name"),
        ("[1]", "results.json: not an accuracy table's results"),
        ('{"settings": {}, "rows": [{"no": "label"}]}', "not an accuracy table's results"),
        ('{"settings": {"policies": 5}, "rows": []}', "its settings are not an accuracy table's"),
    ],
)
def test_a_results_file_that_is_not_a_table_is_refused_as_it_is(
    tmp_path, capsys, no_model, text: str, says: str
) -> None:
    from growpage.cli import main

    (tmp_path / "results.json").write_text(text)
    assert main(["eval", "rescore", str(tmp_path)]) == 2
    assert f"growpage: error: {tmp_path / 'results.json'}" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=re.escape(says)):
        accuracy.rescore(tmp_path)
    if "settings are not" not in says:  # resume reads the file before the settings
        with pytest.raises(ConfigError, match=re.escape(says) + ".*move it away"):
            run_table(AccuracySettings(), tmp_path, resume=True, log=lambda _: None)
    assert [p.name for p in tmp_path.iterdir()] == ["results.json"]
    assert (tmp_path / "results.json").read_text() == text


def test_rescore_rewrites_nothing_when_a_row_cannot_be_read(tmp_path) -> None:
    _stale_table(tmp_path)
    report = json.loads((tmp_path / "results.json").read_text())
    report["rows"].append({**report["rows"][0], "label": "b"})  # no outputs/b.jsonl
    (tmp_path / "results.json").write_text(json.dumps(report))
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    with pytest.raises(ConfigError, match="no outputs of row 'b'"):
        accuracy.rescore(tmp_path)
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
    (tmp_path / "outputs" / "b.jsonl").write_text('["not", "an", "output"]\n')
    with pytest.raises(ConfigError, match=r"b.jsonl, line 1: not a stored output"):
        accuracy.rescore(tmp_path)
