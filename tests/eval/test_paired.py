"""``growpage eval paired``: two rows of an accuracy table compared problem by problem, with
McNemar's exact test checked against its binomial tails written out by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from growpage.cli import main
from growpage.errors import ConfigError
from growpage.eval.paired import mcnemar_exact, pair


@pytest.mark.parametrize(
    ("b", "c", "p"),
    [
        (0, 0, 1.0),  # no discordant problem: no evidence either way
        (0, 5, 2 / 32),  # 2 * P(X <= 0), X ~ Bin(5, 1/2)
        (1, 4, 2 * 6 / 32),  # 2 * (1 + 5) / 32
        (4, 1, 2 * 6 / 32),  # symmetric
        (3, 3, 1.0),  # 2 * 42 / 64 > 1: capped
        (2, 10, 2 * (1 + 12 + 66) / 4096),
    ],
)
def test_mcnemar_exact_is_twice_the_smaller_binomial_tail(b, c, p) -> None:
    assert mcnemar_exact(b, c) == pytest.approx(p, rel=1e-12)


def test_negative_counts_are_refused() -> None:
    with pytest.raises(ValueError, match="discordant counts must be >= 0"):
        mcnemar_exact(-1, 3)


def write_row(out: Path, label: str, correct: list[bool], ids: list[str] | None = None) -> None:
    (out / "outputs").mkdir(parents=True, exist_ok=True)
    ids = ids or [f"q{i}" for i in range(len(correct))]
    lines = [
        json.dumps({"id": i, "correct": ok, "output": ""})
        for i, ok in zip(ids, correct, strict=True)
    ]
    (out / "outputs" / f"{label}.jsonl").write_text("\n".join(lines) + "\n")


def test_a_pair_counts_agreements_and_disagreements(tmp_path) -> None:
    write_row(tmp_path, "mine", [True, True, False, True, False, True])
    write_row(tmp_path, "fixed-256", [True, False, False, False, True, False])
    got = pair(tmp_path, "mine", "fixed-256")
    assert (got.both, got.only_row, got.only_other, got.num_problems) == (1, 3, 1, 6)
    assert got.difference == pytest.approx(2 / 6)
    assert got.p_value == pytest.approx(2 * (1 + 4) / 16)


def test_rows_of_other_problems_or_missing_rows_are_refused(tmp_path) -> None:
    write_row(tmp_path, "a", [True, False])
    write_row(tmp_path, "b", [True, False], ids=["q0", "other"])
    with pytest.raises(ConfigError, match="did not answer the same problems"):
        pair(tmp_path, "a", "b")
    with pytest.raises(ConfigError, match="no outputs of row 'nope'"):
        pair(tmp_path, "a", "nope")


def test_the_command_prints_a_table_or_json(tmp_path, capsys) -> None:
    write_row(tmp_path, "gp", [True, True, False])
    write_row(tmp_path, "fixed", [False, True, False])
    write_row(tmp_path, "fullkv", [True, True, True])
    assert main(["eval", "paired", str(tmp_path), "gp", "fixed", "fullkv"]) == 0
    text = capsys.readouterr().out
    assert "| gp | fixed | +0.333 | 1 | 1 | 0 | 1.0000 |" in text
    assert "| gp | fullkv | -0.333 | 2 | 0 | 1 | 1.0000 |" in text
    assert main(["eval", "paired", str(tmp_path), "gp", "fixed", "--json"]) == 0
    [row] = json.loads(capsys.readouterr().out)
    assert (row["row"], row["other"], row["only_row"], row["only_other"]) == ("gp", "fixed", 1, 0)
