"""argparse ``type=`` functions shared by the ``growpage`` subcommands."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """An integer >= 1 (argparse reports anything else as a usage error naming the flag)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value
