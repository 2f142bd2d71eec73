"""argparse ``type=`` functions shared by the ``growpage`` subcommands."""

from __future__ import annotations

import argparse
from pathlib import Path


def _int_at_least(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {value}")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1 (argparse reports anything else as a usage error naming the flag)."""
    return _int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    """An integer >= 0."""
    return _int_at_least(text, 0)


#: The most values ``size_list`` expands to: each is a shape measured on the engine.
MAX_SIZES = 1024


def size_list(text: str) -> tuple[int, ...]:
    """Whole numbers >= 1 as ``1,2,4`` or ranges ``1-16`` (``1-8,12,16`` mixes them); sorted,
    each once; at most ``MAX_SIZES`` of them."""
    values: set[int] = set()
    for part in text.split(","):
        lo, dash, hi = part.strip().partition("-")
        try:
            first, last = int(lo), int(hi) if dash else int(lo)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected whole numbers >= 1 such as 1,2,4 or 1-16, got {text!r}"
            ) from None
        if first < 1 or last < first:
            raise argparse.ArgumentTypeError(
                f"expected whole numbers >= 1 and ranges low-high, got {part.strip()!r}"
            )
        if last - first + 1 + len(values) > MAX_SIZES:
            raise argparse.ArgumentTypeError(
                f"{text!r} holds more than {MAX_SIZES} values, each a shape to measure; give "
                "fewer (a list such as 128,512,2048 for contexts)"
            )
        values.update(range(first, last + 1))
    return tuple(sorted(values))


def path_text(text: str) -> str:
    """A file or directory name: not empty (``--out ""`` would write into the current
    directory, ``--traces ""`` read it)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("expected a name or path, got an empty string")
    return text


def path_arg(text: str) -> Path:
    """``path_text`` as a ``Path``."""
    return Path(path_text(text))
