"""``attrs`` converters with concrete types, for fields that hold tuples.

``attrs.field(converter=tuple)`` converts as well at run time, but a type checker gives the
generated ``__init__`` the parameter of ``tuple``'s constructor with its type variable unsolved
(``Iterable[_T_co]``), which no argument matches: ``TraceHeader(layer_ids=[0, 1], ...)`` would be
an error in user code. These do the same conversion with the element type spelled out.
"""

from __future__ import annotations

from collections.abc import Iterable


def int_tuple(values: Iterable[int]) -> tuple[int, ...]:
    return tuple(values)


def str_tuple(values: Iterable[str]) -> tuple[str, ...]:
    return tuple(values)
