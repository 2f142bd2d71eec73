"""growpage.validators: each validator against a table of accepted and refused values, and the
one message shape (``<Class>.<field> must be <what>, got <value!r, cut at 80>``)."""

from __future__ import annotations

import re

import attrs
import pytest

from growpage import validators as v
from growpage.errors import ConfigError, WorkloadError

NAN, INF = float("nan"), float("inf")
HUGE = 10**400  # an int no float holds
# Never numbers, whatever the validator: bools, text, containers, None, non-finite floats.
NOT_NUMBERS = [True, False, "1", "false", b"1", None, [1], (1,), NAN, INF, -INF, HUGE, -HUGE]

TABLE = [
    # (validator, accepted, refused)
    (v.integer, [0, -3, 7, 2**70, HUGE], [True, False, 1.0, "1", None, NAN, 2.5]),
    (v.positive_int, [1, 5, 2**70], [0, -1, 1.0, 2.5, *NOT_NUMBERS[:-2]]),
    (v.non_negative_int, [0, 1, 2**70], [-1, 0.0, -0.0, 1.5, *NOT_NUMBERS[:-2]]),
    (v.at_least(2), [2, 3, 2**70], [1, 0, -2, 2.0, 2.5, *NOT_NUMBERS[:-2]]),
    (v.positive_number, [1, 0.5, 1e-300, 2**70, 1e308], [0, 0.0, -0.0, -1, -1e-300, *NOT_NUMBERS]),
    (v.non_negative_number, [0, 0.0, -0.0, 3, 2.5, 1e308], [-1, -1e-300, *NOT_NUMBERS]),
    (v.flag, [True, False], [0, 1, 0.0, "false", "True", "", None, [True]]),
    (v.non_empty_str, ["a", " "], ["", None, 1, b"a", ["a"]]),
    (v.in_range(0, 1), [0, 0.0, -0.0, 0.5, 1, 1.0], [-1e-9, 1.0000001, *NOT_NUMBERS]),
    (v.in_range(0, 1, lo_open=True), [1e-300, 0.5, 1], [0, 0.0, -0.0, 1.5, *NOT_NUMBERS]),
    (v.in_range(0, 1, hi_open=True), [0, 0.999], [1, 1.0, -0.1, *NOT_NUMBERS]),
    (v.in_range(-1, 1, lo_open=True, hi_open=True), [-0.5, 0, 0.5], [-1, 1, *NOT_NUMBERS]),
    (v.one_of(("a", "b")), ["a", "b"], ["c", "A", "", None, 1, ("a",)]),
    (v.one_of((1, 2, 3)), [1, 2, 3, 2.0], [True, 0, 4, "1", None]),
    (v.one_of((True, 0)), [True, 0], [False, 1]),
    (v.instance_of(int), [0, True], [0.0, "0", None]),
    (v.optional(v.positive_int), [None, 1, 9], [0, -1, 1.5, True, "1", NAN]),
    (v.optional(v.flag), [None, True, False], [0, 1, "false", ""]),
    (v.items(v.positive_int), [(1,), (1, 2, 3)], [(), (0,), (1, True), [1, 2], (1.0,), "12", None]),
]


@attrs.frozen
class Holder:
    field: object


@pytest.mark.parametrize(
    ("check", "accepted", "refused"), TABLE, ids=lambda x: getattr(x, "what", "")
)
def test_each_validator_accepts_and_refuses(check, accepted, refused):
    field = attrs.fields(Holder).field
    for value in accepted:
        assert check.accepts(value), value
        check(Holder(value), field, value)  # raises nothing
    for value in refused:
        assert not check.accepts(value), value
        with pytest.raises(ConfigError) as e:
            check(Holder(value), field, value)
        assert str(e.value) == f"Holder.field must be {check.what}, got {value!r:.80}"


def test_what_each_validator_says():
    assert v.positive_int.what == "a positive integer"
    assert v.non_negative_int.what == "an integer >= 0" == v.at_least(0).what
    assert v.at_least(3).what == "an integer >= 3"
    assert v.positive_number.what == "a finite number > 0"
    assert v.non_negative_number.what == "a finite number >= 0"
    assert v.flag.what == "True or False"
    assert v.in_range(0, 1).what == "a number in [0, 1]"
    assert v.in_range(-1.0, 0.5, lo_open=True, hi_open=True).what == "a number in (-1, 0.5)"
    assert v.in_range(1e-9, 1).what == "a number in [1e-09, 1]"
    assert v.one_of(("x", 2)).what == "one of 'x', 2"
    assert v.optional(v.positive_int).what == "a positive integer or None"
    assert v.items(v.flag).what == "a non-empty tuple, each item True or False"
    assert v.instance_of(Holder).what == "a Holder"


@attrs.frozen(kw_only=True)
class Settings:
    """A config class whose checks are its field declarations."""

    pages: int = attrs.field(default=4, validator=v.positive_int)
    share: float = attrs.field(default=0.5, validator=v.in_range(0, 1, hi_open=True))
    on: bool = attrs.field(default=True, validator=v.flag)
    limit: int | None = attrs.field(default=None, validator=v.optional(v.non_negative_int))

    def __attrs_post_init__(self) -> None:
        v.check(self, "limit", self.limit is None or self.limit <= self.pages, "<= pages")


@attrs.frozen
class Child(Settings):
    pass


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"pages": 0}, "Settings.pages must be a positive integer, got 0"),
        ({"pages": True}, "Settings.pages must be a positive integer, got True"),
        ({"share": 1}, "Settings.share must be a number in [0, 1), got 1"),
        ({"share": NAN}, "Settings.share must be a number in [0, 1), got nan"),
        ({"on": "false"}, "Settings.on must be True or False, got 'false'"),
        ({"limit": -1}, "Settings.limit must be an integer >= 0 or None, got -1"),
        ({"limit": 5}, "Settings.limit must be <= pages, got 5"),
    ],
)
def test_the_message_names_the_class_the_field_and_the_value(changes, message):
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        Settings(**changes)
    subclass = message.replace("Settings.", "Child.")
    with pytest.raises(ConfigError, match=f"^{re.escape(subclass)}$"):
        Child(**changes)  # the class is the instance's own


def test_a_long_value_is_cut_at_80_characters():
    value = "x" * 500
    with pytest.raises(ConfigError) as e:
        Settings(on=value)  # type: ignore[arg-type]
    text = str(e.value)
    assert text == "Settings.on must be True or False, got " + repr(value)[:80]
    assert len(text) == len("Settings.on must be True or False, got ") + 80


def test_raising_another_error_keeps_the_message():
    check = v.positive_number.raising(WorkloadError)
    assert check.what == v.positive_number.what and v.positive_number.error is ConfigError
    with pytest.raises(WorkloadError, match=r"^Holder\.field must be a finite number > 0, got -1$"):
        check(Holder(-1), attrs.fields(Holder).field, -1)
    assert v.optional(check).error is WorkloadError and v.items(check).error is WorkloadError


def test_require_checks_a_value_outside_an_attrs_class():
    v.positive_int.require("--jobs", 3)  # raises nothing
    with pytest.raises(ConfigError, match=r"^--jobs must be a positive integer, got 0$"):
        v.positive_int.require("--jobs", 0)
    with pytest.raises(WorkloadError, match=r"^n must be an integer >= 1, got 'x'$"):
        v.at_least(1).raising(WorkloadError).require("n", "x")


def test_validators_run_on_evolve():
    ok = Settings()
    with pytest.raises(ConfigError, match="Settings.pages"):
        attrs.evolve(ok, pages=-2)


def test_predicates():
    assert v.is_int(3) and not v.is_int(True) and not v.is_int(3.0)
    assert v.is_number(2.5) and v.is_number(-7) and not v.is_number(False)
    assert not v.is_number(HUGE) and not v.is_number(NAN) and not v.is_number("1")
    assert v.is_finite(1) and v.is_finite(-0.0) and not v.is_finite(HUGE) and not v.is_finite(INF)
