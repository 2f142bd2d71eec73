"""Point functions for the executor tests (module level, so that workers find them).

Each writes a file per run under ``shared["runs"]``, so that a test counts how often every
point ran, in whichever process ran it.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from pathlib import Path

from growpage.executors import worker_state


def _ran(shared: dict, item: int) -> None:
    runs = Path(shared["runs"])
    (runs / f"{item}-{os.getpid()}-{uuid.uuid4().hex[:8]}").touch()


def runs_of(shared: dict, item: int) -> int:
    """How many times point ``item`` started."""
    return len(list(Path(shared["runs"]).glob(f"{item}-*")))


def square(item: int, shared: dict) -> dict:
    """The oracle's row: ``item`` and its square (after ``shared["sleep_s"][item]``)."""
    _ran(shared, item)
    time.sleep(shared.get("sleep_s", {}).get(item, 0.0))
    return {"item": item, "square": item * item, "tag": shared.get("tag")}


def square_or_raise(item: int, shared: dict) -> dict:
    if item in shared["bad"]:
        _ran(shared, item)
        raise ValueError(f"point {item} is bad")
    return square(item, shared)


def square_or_die(item: int, shared: dict) -> dict:
    """``square``, but the worker running ``item`` in ``shared["killers"]`` is killed (SIGKILL)
    on that point's first run, or on every run for ``shared["always"]``."""
    first = runs_of(shared, item) == 0
    if item in shared["always"] or (item in shared["killers"] and first):
        _ran(shared, item)
        os.kill(os.getpid(), signal.SIGKILL)
    return square(item, shared)


def square_or_interrupt(item: int, shared: dict) -> dict:
    """``square``, but point ``shared["stop_at"]`` is Ctrl-C while ``shared["stop_file"]``
    exists."""
    if item == shared["stop_at"] and Path(shared["stop_file"]).exists():
        raise KeyboardInterrupt
    return square(item, shared)


def _build(shared: dict) -> dict:
    (Path(shared["builds"]) / f"{os.getpid()}-{uuid.uuid4().hex[:8]}").touch()
    return {"pid": os.getpid()}


def built_once(item: int, shared: dict) -> dict:
    """``square`` on this worker's state (``worker_state``), whose every build leaves a file
    under ``shared["builds"]``; the row names the worker."""
    state = worker_state("test-state", lambda: _build(shared))
    row = square(item, shared)
    return {**row, "pid": state["pid"]}


def builds_by_pid(shared: dict) -> dict[int, int]:
    counts: dict[int, int] = {}
    for path in Path(shared["builds"]).iterdir():
        pid = int(path.name.split("-")[0])
        counts[pid] = counts.get(pid, 0) + 1
    return counts


def pid_of(item: int, shared: dict) -> dict:
    return {"item": item, "pid": os.getpid()}


class FakeBench:
    """``benchmarks/policies_engine.Bench`` without a model: rows that depend only on the run,
    and a file under ``args.builds`` for every one built (one engine per worker)."""

    def __init__(self, args) -> None:
        _build({"builds": args.builds})
        self.kv_pages, self.full_pages, self.sample_text, self.items = 24, 39, "text", []

    def references(self) -> tuple[dict, list, list, list]:
        gen = {"tps": 50.0, "avg_resident": 2.0, "preemptions": 0}
        return gen, [[1, 2, 3], [4, 5]], [], []

    def run_policy(self, label: str, policy: str, kwargs: dict, conts, rconts, spans) -> dict:
        size = sum(map(len, conts)) + len(label) + len(kwargs)
        return {
            **self.time_again({"policy": policy, "kwargs": kwargs}, conts),
            "label": label,
            "policy": policy,
            "kwargs": kwargs,
            "avg_resident": 2.0,
            "avg_budget": 64.0 + size,
            "decided_grow": 3,
            "decided_compress": 1,
            "nll": 1.0 + size / 100,
            "boundary_s": 0.0,
            "trajectories": [[(3, 1, "grow"), (8, 2, "grow")]],
            "prompt_lens": [3],
            "wall_s": 1.0,
        }

    def time_again(self, row: dict, conts) -> dict:
        tps = 100.0 + len(row["policy"]) + len(row["kwargs"])
        events = dict(grow=3, compress=1, shrink=0, fallback=0, preemptions=0)
        return {"tps": tps, "tpot_ms": 1000 / tps, "total_s": 10 / tps, **events}
