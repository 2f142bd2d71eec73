"""Composable attrs validators, each raising one message shape::

    <Class>.<field> must be <what>, got <value>

(a ``ConfigError`` unless ``raising`` names another error; the value's repr cut at 80
characters). A config class's checks read as its field declarations::

    page_size: int = attrs.field(default=256, validator=positive_int)
    top_p: float = attrs.field(default=0.99, validator=in_range(0, 1, lo_open=True, hi_open=True))
    kv_pages: int | None = attrs.field(default=None, validator=optional(positive_int))

and an argument or a command-line flag in one line: ``at_least(1).require("--jobs", jobs)``
raises ``--jobs must be an integer >= 1, got 0``.

A bool is never a number here (``True`` is no page size), an integer is an ``int`` and a number
an ``int`` or ``float`` (numpy scalars are a converter's business), and a number is finite as a
float. A flag is exactly True or False: a string such as ``"false"`` would read as on.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any, TypeGuard

import attrs

from growpage.errors import ConfigError, GrowPageError


def is_int(value: object) -> TypeGuard[int]:
    """An ``int`` that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_finite(value: Any) -> bool:
    """``math.isfinite(float(value))``, False (not OverflowError) for an int too large for a
    float."""
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False


def is_number(value: object) -> TypeGuard[float]:
    """An ``int`` or ``float``, not a bool, finite as a float."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and is_finite(value)


def lone_surrogate(text: str) -> str | None:
    """``"'\\ud800' at character 3 is a lone surrogate"``: the first character of ``text`` that
    UTF-8 cannot encode (as a command-line argument of undecodable bytes or a JSON ``"\\ud800"``
    gives), for an error message; None when there is none."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"{text[exc.start]!r} at character {exc.start} is a lone surrogate"
    return None


def is_text(value: object) -> bool:
    """A ``str`` that UTF-8 can encode (tokenizers refuse lone surrogates)."""
    return isinstance(value, str) and lone_surrogate(value) is None


def message(name: str, what: str, value: object) -> str:
    """The one message shape: ``"<name> must be <what>, got <value!r:.80>"``, ``name`` being
    ``<Class>.<field>`` for a config class."""
    return f"{name} must be {what}, got {value!r:.80}"


def check(
    inst: object, field: str, ok: bool, what: str, error: type[GrowPageError] = ConfigError
) -> None:
    """Raise ``error`` saying that ``inst.<field>`` must be ``what`` unless ``ok`` (a check
    across fields, in ``__attrs_post_init__``)."""
    if not ok:
        raise error(message(f"{type(inst).__name__}.{field}", what, getattr(inst, field)))


@attrs.frozen
class Check:
    """An attrs validator: a value that ``accepts`` refuses raises ``error`` saying that the
    field must be ``what``."""

    what: str
    accepts: Callable[[Any], bool]
    error: type[GrowPageError] = ConfigError

    def __call__(self, inst: object, attribute: attrs.Attribute, value: object) -> None:
        self.require(f"{type(inst).__name__}.{attribute.name}", value)

    def require(self, name: str, value: object) -> None:
        """Raise ``error`` saying ``"<name> must be <what>, got <value>"`` unless this check
        accepts ``value`` (outside an attrs class: an argument, a command-line flag)."""
        if not self.accepts(value):
            raise self.error(message(name, self.what, value))

    def raising(self, error: type[GrowPageError]) -> Check:
        """This check raising ``error`` instead."""
        return attrs.evolve(self, error=error)


integer = Check("an integer", is_int)
positive_int = Check("a positive integer", lambda v: is_int(v) and v > 0)
non_negative_int = Check("an integer >= 0", lambda v: is_int(v) and v >= 0)
positive_number = Check("a finite number > 0", lambda v: is_number(v) and v > 0)
non_negative_number = Check("a finite number >= 0", lambda v: is_number(v) and v >= 0)
flag = Check("True or False", lambda v: isinstance(v, bool))
non_empty_str = Check("a non-empty string", lambda v: isinstance(v, str) and v != "")


def at_least(low: int) -> Check:
    """An integer ``>= low`` (``at_least(0)`` is ``non_negative_int``)."""
    return Check(f"an integer >= {low}", lambda v: is_int(v) and v >= low)


def _bound(x: float) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def in_range(lo: float, hi: float, *, lo_open: bool = False, hi_open: bool = False) -> Check:
    """A number in ``[lo, hi]``, either end open on request: ``in_range(0, 1, hi_open=True)``
    is ``[0, 1)``."""

    def accepts(v: Any) -> bool:
        return (
            is_number(v) and (lo < v if lo_open else lo <= v) and (v < hi if hi_open else v <= hi)
        )

    span = f"{'(' if lo_open else '['}{_bound(lo)}, {_bound(hi)}{')' if hi_open else ']'}"
    return Check(f"a number in {span}", accepts)


def one_of(choices: Iterable[object]) -> Check:
    """One of ``choices`` (a bool matches only a bool: ``True`` is not the choice ``1``)."""
    options = tuple(choices)

    def accepts(v: Any) -> bool:
        return any(isinstance(v, bool) == isinstance(c, bool) and v == c for c in options)

    return Check(f"one of {', '.join(map(repr, options))}", accepts)


def instance_of(kind: type) -> Check:
    """An instance of ``kind`` (or of a subclass)."""
    return Check(f"a {kind.__name__}", lambda v: isinstance(v, kind))


def optional(inner: Check) -> Check:
    """``inner``, or None."""
    return Check(f"{inner.what} or None", lambda v: v is None or inner.accepts(v), inner.error)


def items(inner: Check) -> Check:
    """A non-empty tuple whose every item ``inner`` accepts."""
    return Check(
        f"a non-empty tuple, each item {inner.what}",
        lambda v: isinstance(v, tuple) and len(v) > 0 and all(map(inner.accepts, v)),
        inner.error,
    )
