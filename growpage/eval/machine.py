"""One line describing the machine a benchmark ran on, for its report."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def cpu_name() -> str:
    """The CPU model from /proc/cpuinfo, else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def describe_machine() -> str:
    """``"<cpu>, <n> cores, load average <x> at start"``."""
    return f"{cpu_name()}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at start"
