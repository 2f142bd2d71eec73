"""The executor interface: ``fn(item, shared)`` for every item of a grid, rows in order.

    with LocalExecutor(jobs=2, store=RowStore(out / "finished-points", resume=True)) as ex:
        rows = ex.run(fn, items, shared, identities, desc="sweep")

``fn`` is a module-level function (a worker finds it by name, or Ray ships it), ``items`` and
``shared`` pickle, and ``fn`` returns a row: a dict of JSON values. What differs between
executors is only where the points run (``_completions``); everything a user sees is here:

- rows come back in the order of ``items``, whichever worker ran each point and when;
- a point that raises gives a *failed row*, ``{**identity, "error": "Type: message (where)"}``,
  and the grid goes on; a point whose worker died (killed, out of memory) is run again, up to
  ``max_retries`` times, then it is a failed row too; every point gives exactly one row;
- with a ``RowStore``, a point whose row is stored is not run again, and every finished row is
  stored the moment it arrives, so that Ctrl-C (or a crash) loses no finished point;
- a progress bar over the points, with the count of failed ones.
"""

from __future__ import annotations

import abc
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from types import TracebackType
from typing import Any, TypeVar

import attrs
from tqdm import tqdm

from growpage.errors import ConfigError, GrowPageError, describe_error
from growpage.executors.store import Row, RowStore, fingerprint, point_key
from growpage.validators import non_negative_int

PointFn = Callable[[Any, Any], Row]
E = TypeVar("E", bound="Executor")
T = TypeVar("T")
DEFAULT_RETRIES = 3  # runs of a point after its worker died, before it is a failed row


class GridError(GrowPageError):
    """Points of a grid failed; the others ran and their rows were kept."""


@attrs.frozen
class Task:
    """One point to run: its place in the grid, its item and what its failed row carries."""

    index: int
    item: Any
    identity: Row


def call_point(fn: PointFn, item: Any, shared: Any, identity: Row) -> Row:
    """``fn(item, shared)``, or the failed row when it raises or returns no dict.

    NOTE: the error is described where the point ran: a worker's traceback does not survive
    the trip back, and the exception itself may not pickle."""
    try:
        row = fn(item, shared)
    except Exception as exc:  # noqa: BLE001 - whatever the point raised; the grid goes on
        return {**identity, "error": describe_error(exc)}
    if not isinstance(row, dict):
        return {
            **identity,
            "error": f"TypeError: the point returned {type(row).__name__}, not a row",
        }
    return row


_WORKER_STATE: dict[str, Any] = {}  # this process's state, under its key (one at a time)


def worker_state(key: str, build: Callable[[], T]) -> T:
    """This worker process's state, ``build()`` on first use and kept for the next points of
    every grid run here (an engine built once per worker); a new ``key`` replaces it.

    NOTE: it lives in this importable module, not the point function's: Ray ships a function
    of a script by value, with a fresh copy of its module's globals for every point."""
    if key not in _WORKER_STATE:
        _WORKER_STATE.clear()  # the old state (an engine's memory) goes before the new one
        _WORKER_STATE[key] = build()
    state: T = _WORKER_STATE[key]
    return state


def timed_point(fn: PointFn, item: Any, shared: Any, identity: Row) -> tuple[Row, float]:
    """``call_point`` and the seconds it took, measured where it ran."""
    start = time.perf_counter()
    row = call_point(fn, item, shared, identity)
    return row, time.perf_counter() - start


Completion = tuple[int, Row, float | None]  # (index, row, seconds; None: no run finished)


def died_row(identity: Row, runs: int, why: str = "") -> Row:
    """The failed row of a point whose worker died every time it ran."""
    times = "once" if runs == 1 else f"{runs} times"
    return {
        **identity,
        "error": f"WorkerDied: the worker running this point died {times} (killed, or out of "
        f"memory){': ' + why if why else ''}",
    }


class Executor(abc.ABC):
    """Runs grids of points; see the module docstring. Use it as a context manager: its
    workers (processes, Ray actors) live until ``close``, so that a worker's state (an engine
    built once) serves every grid run on it."""

    kind: str = ""

    def __init__(
        self,
        *,
        store: RowStore | None = None,
        progress: bool = True,
        max_retries: int = DEFAULT_RETRIES,
    ) -> None:
        non_negative_int.require("max_retries", max_retries)
        self.store, self.progress, self.max_retries = store, progress, max_retries
        self.point_s: list[float | None] = []  # the last grid's seconds per point (ran here)

    def run(
        self,
        fn: PointFn,
        items: Sequence[Any],
        shared: Any = None,
        identities: Sequence[Row] | None = None,
        desc: str = "grid",
        unit: str = "point",
        progress: bool | None = None,
    ) -> list[Row]:
        """One row per item, in the order of ``items`` (see the module docstring);
        ``identities[i]`` is what item i's row says when it failed (default ``{"point": i}``);
        ``progress`` overrides the executor's for this grid."""
        items = list(items)
        idents = [{"point": i} for i in range(len(items))] if identities is None else identities
        if len(idents) != len(items):
            raise ConfigError(f"{len(idents)} identities for {len(items)} points")
        keys = self._keys(fn, items, shared)
        rows: dict[int, Row] = {}
        self.point_s = [None] * len(items)
        if self.store is not None:
            for i, key in enumerate(keys):
                row = self.store.get(key)
                if row is not None:
                    rows[i] = row
        todo = [Task(i, items[i], dict(idents[i])) for i in range(len(items)) if i not in rows]
        with tqdm(
            total=len(items),
            initial=len(rows),
            desc=desc,
            unit=unit,
            disable=not (self.progress if progress is None else progress),
        ) as bar:
            failed = 0
            try:
                for i, row, seconds in self._completions(fn, todo, shared):
                    if i in rows:  # NOTE: one row per point, even if a retry ran it twice
                        continue
                    rows[i], self.point_s[i] = row, seconds
                    if "error" in row:
                        failed += 1
                        bar.set_postfix_str(f"{failed} failed", refresh=False)
                    elif self.store is not None:
                        self.store.put(keys[i], row, seconds)
                    bar.update()
            except KeyboardInterrupt:
                self._interrupt()
                bar.close()
                self._say_interrupted(sum("error" not in r for r in rows.values()), len(items))
                raise
        missing = [i for i in range(len(items)) if i not in rows]
        if missing:  # an executor that lost a point is a bug, not a row to make up
            raise RuntimeError(f"{self.kind} executor returned no row for points {missing}")
        return [rows[i] for i in range(len(items))]

    def _keys(self, fn: PointFn, items: list[Any], shared: Any) -> list[str]:
        if self.store is None:
            return []
        digest = fingerprint(shared)
        return [point_key(fn, item, digest) for item in items]

    def _say_interrupted(self, done: int, total: int) -> None:
        where = (
            f"; their rows are in {self.store.directory}/ and --resume runs the rest"
            if self.store is not None
            else ""
        )
        print(f"growpage: interrupted: {done} of {total} points finished{where}", file=sys.stderr)

    @abc.abstractmethod
    def _completions(self, fn: PointFn, tasks: list[Task], shared: Any) -> Iterator[Completion]:
        """Run ``tasks`` (``timed_point``); yield ``(task.index, row, seconds)`` as each
        finishes, in any order, exactly once per task (a failed row for a point whose worker
        died past its retries)."""

    def _interrupt(self) -> None:  # noqa: B027 - optional hook
        """Stop the running points at once (Ctrl-C); ``close`` still follows."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release the workers."""

    def __enter__(self: E) -> E:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
