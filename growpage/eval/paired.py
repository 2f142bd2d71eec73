"""Paired comparison of two rows of an accuracy table: the same problems answered under two
policies, so the question is on how many problems they disagree, and which way.

McNemar's exact test: of the ``b + c`` problems that exactly one row answers right, the first
row alone has ``b``; if neither row is better, ``b`` is Binomial(b + c, 1/2), and the two-sided
p-value is twice the smaller tail (at most 1). The problems both rows answer alike say nothing
about which is better, which is why a paired test separates rows whose intervals overlap.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import attrs

from growpage.errors import ConfigError
from growpage.eval.accuracy import read_outputs


@attrs.frozen
class Paired:
    """``row`` against ``other`` on the same problems."""

    row: str
    other: str
    num_problems: int
    both: int  # both right
    only_row: int  # b: ``row`` right, ``other`` wrong
    only_other: int  # c
    p_value: float

    @property
    def difference(self) -> float:
        """``row``'s accuracy minus ``other``'s."""
        return (self.only_row - self.only_other) / self.num_problems


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value for ``b`` and ``c`` discordant pairs."""
    if b < 0 or c < 0:
        raise ValueError(f"discordant counts must be >= 0, got {b} and {c}")
    n = b + c
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(b, c) + 1)) / 2**n
    return min(1.0, 2.0 * tail)


def pair(out: Path, row: str, other: str) -> Paired:
    """``row`` against ``other`` in the table stored in ``out``."""
    mine, theirs = read_outputs(out, row), read_outputs(out, other)
    if [o["id"] for o in mine] != [o["id"] for o in theirs]:
        raise ConfigError(f"rows {row!r} and {other!r} of {out} did not answer the same problems")
    right = [(bool(a["correct"]), bool(b["correct"])) for a, b in zip(mine, theirs, strict=True)]
    b = sum(x and not y for x, y in right)
    c = sum(y and not x for x, y in right)
    return Paired(
        row=row,
        other=other,
        num_problems=len(right),
        both=sum(x and y for x, y in right),
        only_row=b,
        only_other=c,
        p_value=mcnemar_exact(b, c),
    )


def to_markdown(results: list[Paired], out: Path) -> str:
    lines = [
        f"Paired comparisons in {out} (exact McNemar, two-sided).",
        "",
        "| row | against | difference | both right | only row | only against | p |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r.row} | {r.other} | {r.difference:+.3f} | {r.both} | {r.only_row} "
            f"| {r.only_other} | {r.p_value:.4f} |"
        )
    return "\n".join(lines) + "\n"


def to_dict(results: list[Paired]) -> list[dict[str, Any]]:
    return [{**attrs.asdict(r), "difference": r.difference} for r in results]
