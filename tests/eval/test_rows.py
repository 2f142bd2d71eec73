"""Rows of an accuracy table given by the user: parsing, the split between a policy's
hyperparameters and the row's capacity settings, references to earlier rows."""

from __future__ import annotations

import attrs
import pytest

from growpage import CapacityPolicy, Decision
from growpage.core.config import GrowPageConfig
from growpage.errors import ConfigError, PolicyError
from growpage.eval.rows import (
    Reference,
    RowSpec,
    check_buildable,
    check_rows,
    parse_row,
    resolved,
)


@attrs.define(slots=False)
class HalfWay(CapacityPolicy):
    """Grows while the capacity is below ``limit`` tokens (a policy of this test file)."""

    limit: int = 64

    def decide(self, ctx):
        return Decision.GROW if ctx.capacity < self.limit else Decision.COMPRESS


def test_a_builtin_row_splits_hyperparameters_from_capacity_settings():
    row = parse_row("gp-f64=growpage:floor_tokens=64,beta_long=0.99,tau=0.01")
    assert row == RowSpec(
        "gp-f64", "growpage", {"tau": 0.01}, {"floor_tokens": 64, "beta_long": 0.99}
    )
    assert parse_row("fullkv=fullkv") == RowSpec("fullkv", "fullkv")
    assert parse_row(" fixed-256 = fixed : budget_tokens = 256 ").params == {"budget_tokens": 256}


def test_a_policy_class_named_by_module_or_file_takes_its_own_fields(tmp_path):
    row = parse_row(f"mine={__name__}:HalfWay:limit=96,protect_prompt=true")
    assert (row.policy, row.params, row.config) == (
        f"{__name__}:HalfWay",
        {"limit": 96},
        {"protect_prompt": True},
    )
    assert parse_row(f"plain={__name__}:HalfWay").params == {}
    policy_file = tmp_path / "pol.py"
    policy_file.write_text(
        "from growpage import CapacityPolicy, Decision\n"
        "class Always(CapacityPolicy):\n"
        "    def __init__(self, action='grow'):\n"
        "        self.action = action\n"
        "    def decide(self, ctx):\n"
        "        return Decision(self.action)\n"
    )
    row = parse_row(f"always={policy_file}:Always:action=compress")
    assert row.params == {"action": "compress"} and row.policy == f"{policy_file}:Always"
    assert row.to_text() == f"always={policy_file}:Always:action=compress"


def test_references_are_read_from_earlier_rows():
    rows = [
        parse_row("gp=growpage:floor_tokens=32"),
        parse_row("h2o=h2o:budget_tokens=@gp.budget"),
        parse_row("random=random:grow_prob=@gp.grow_ratio"),
    ]
    check_rows(rows)
    assert rows[1].references == [Reference("gp", "budget")]
    done = {"gp": {"avg_budget": 171.0, "decided_grow": 3, "decided_compress": 9}}
    assert resolved(rows[1], done, 16).params == {"budget_tokens": 176}  # 11 pages of 16
    assert resolved(rows[2], done, 16).params == {"grow_prob": 0.25}
    assert rows[1].to_text() == "h2o=h2o:budget_tokens=@gp.budget"
    with pytest.raises(KeyError):
        resolved(rows[1], {}, 16)


@pytest.mark.parametrize(
    "text, says",
    [
        ("growpage", "expected LABEL=POLICY"),
        ("=growpage", "expected LABEL=POLICY"),
        ("a b=growpage", "a label is letters"),
        ("x=nope", "unknown policy 'nope'"),
        ("x=fixed:budget=3", "'budget' is neither a hyperparameter of fixed"),
        ("x=fixed:page_size=32", "page_size is the table's"),
        ("x=fixed:budget_tokens=3,budget_tokens=4", "budget_tokens given twice"),
        ("x=fixed:budget_tokens", "expected key=value after fixed:, got 'budget_tokens'"),
        ("x=h2o:budget_tokens=@gp.size", "reads 'size' of a row"),
    ],
)
def test_bad_rows_are_refused_naming_the_problem(text, says):
    with pytest.raises((ConfigError, PolicyError), match=says):
        parse_row(text)


def test_duplicate_labels_and_forward_references_are_refused():
    with pytest.raises(ConfigError, match="two rows are labelled 'a'"):
        check_rows([parse_row("a=fullkv"), parse_row("a=growpage")])
    with pytest.raises(ConfigError, match="reads @gp.budget of a row that is not given before"):
        check_rows([parse_row("h=h2o:budget_tokens=@gp.budget"), parse_row("gp=growpage")])


def test_a_row_is_built_whole_or_its_literal_values_alone(tmp_path):
    """A row of literal values is built as its run builds it; one reading another row's results
    has each literal value checked against its own field, and a class that is not attrs checks
    its arguments only when built whole."""
    table = GrowPageConfig(page_size=16, recent_window=4)
    check_buildable(parse_row(f"mine={__name__}:HalfWay:limit=96,floor_tokens=32"), table)
    with pytest.raises(ConfigError, match=r"row 'x=growpage:k_loc=17': GrowPageConfig.k_loc"):
        check_buildable(parse_row("x=growpage:k_loc=17"), table)  # > page_size 16
    with pytest.raises(ConfigError, match="ShrinkPolicy.min_capacity_tokens must be a positive"):
        check_buildable(parse_row("x=shrink:tau=@gp.grow_ratio,min_capacity_tokens=0"), table)
    policy_file = tmp_path / "pol.py"
    policy_file.write_text(
        "from growpage import CapacityPolicy, Decision\n"
        "class Limited(CapacityPolicy):\n"
        "    def __init__(self, limit=64, scale=1.0):\n"
        "        if limit < 1:\n"
        "            raise ValueError(f'limit must be >= 1, got {limit}')\n"
        "    def decide(self, ctx):\n"
        "        return Decision.GROW\n"
    )
    with pytest.raises(ConfigError, match="limit must be >= 1, got 0"):
        check_buildable(parse_row(f"x={policy_file}:Limited:limit=0"), table)
    check_buildable(parse_row(f"x={policy_file}:Limited:limit=0,scale=@gp.grow_ratio"), table)
