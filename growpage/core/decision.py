"""What a policy decides at a capacity boundary, and what the controller finally did."""

from __future__ import annotations

import enum


class Decision(enum.Enum):
    """A policy's answer at a capacity boundary (docs/architecture.md, "Capacity semantics")."""

    GROW = "grow"  # append one page from the pool
    COMPRESS = "compress"  # Compress & Hold: keep (P-1)*b tokens in the same P pages
    SHRINK = "shrink"  # keep (P-2)*b tokens and release one page


class Action(enum.Enum):
    """What the controller executed. PREEMPT: nothing could make room; the caller preempts."""

    GROW = "grow"
    COMPRESS = "compress"
    SHRINK = "shrink"
    PREEMPT = "preempt"
