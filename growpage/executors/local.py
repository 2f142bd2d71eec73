"""The local executor: the points in ``jobs`` processes of this machine (1: in this process).

A worker process that dies (killed, out of memory) breaks Python's process pool, and with it
every point running at that moment, so the pool is built again and those points run again.
Which of them killed the worker is not known, so they first run again *alone*, one at a time:
a point that dies alone is the culprit, and after ``max_retries`` such deaths it is a failed
row, while the others finish normally. A point is never run twice once it has a row.
"""

from __future__ import annotations

import multiprocessing
import os
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from growpage.errors import describe_error
from growpage.executors.base import (
    Completion,
    Executor,
    PointFn,
    Task,
    died_row,
    timed_point,
)
from growpage.validators import at_least


def _set_worker_env(envs: Any) -> None:
    """Pool initializer: this worker takes the next environment of the queue (its GPU)."""
    os.environ.update(envs.get())


class LocalExecutor(Executor):
    """``jobs`` worker processes (1: the points run in this process, one after another).

    ``worker_env``: one environment per worker, set before the worker runs anything, e.g.
    ``[{"CUDA_VISIBLE_DEVICES": "0"}, {"CUDA_VISIBLE_DEVICES": "1"}]`` for one GPU per engine
    (``jobs`` is then at most its length, and the workers are spawned, not forked, so that no
    CUDA state of this process is inherited).
    """

    kind = "local"

    def __init__(
        self,
        jobs: int = 1,
        *,
        worker_env: Sequence[dict[str, str]] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        at_least(1).require("--jobs", jobs)
        self.worker_env = list(worker_env or [])
        self.jobs = min(jobs, len(self.worker_env)) if self.worker_env else jobs
        self._context = multiprocessing.get_context("spawn" if self.worker_env else None)
        self._pool: ProcessPoolExecutor | None = None

    def _new_pool(self) -> ProcessPoolExecutor:
        if not self.worker_env:
            return ProcessPoolExecutor(max_workers=self.jobs, mp_context=self._context)
        envs = self._context.Queue()
        for env in self.worker_env[: self.jobs]:
            envs.put(env)
        return ProcessPoolExecutor(
            max_workers=self.jobs,
            mp_context=self._context,
            initializer=_set_worker_env,
            initargs=(envs,),
        )

    def _completions(self, fn: PointFn, tasks: list[Task], shared: Any) -> Iterator[Completion]:
        if self.jobs == 1 and not self.worker_env:
            for t in tasks:
                yield t.index, *timed_point(fn, t.item, shared, t.identity)
            return
        pending, alone = deque(tasks), deque[Task]()
        deaths: dict[int, int] = {}  # point -> times it died running alone
        running: dict[Future, Task] = {}
        while pending or alone or running:
            if self._pool is None:
                self._pool = self._new_pool()
            source, limit = (alone, 1) if alone else (pending, self.jobs)
            while source and len(running) < limit:
                t = source.popleft()
                running[self._pool.submit(timed_point, fn, t.item, shared, t.identity)] = t
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            if any(isinstance(f.exception(), BrokenProcessPool) for f in done):
                wait(running)  # the pool is broken: every running future ends now
                done = set(running)
            lost = []
            for future in done:
                t = running.pop(future)
                error = future.exception()
                if isinstance(error, BrokenProcessPool):
                    lost.append(t)
                elif error is not None:  # the row did not pickle, say
                    yield t.index, {**t.identity, "error": describe_error(error)}, None
                else:
                    yield t.index, *future.result()
            if lost:
                self._drop_pool()
                yield from self._retry(lost, alone, deaths)

    def _retry(
        self, lost: list[Task], alone: deque[Task], deaths: dict[int, int]
    ) -> Iterator[Completion]:
        """Queue the points of a dead worker to run again alone; a point that died alone
        ``max_retries + 1`` times gets its failed row."""
        if len(lost) > 1:
            alone.extend(lost)
            return
        t = lost[0]
        deaths[t.index] = deaths.get(t.index, 0) + 1
        if deaths[t.index] > self.max_retries:
            yield t.index, died_row(t.identity, deaths[t.index]), None
        else:
            alone.appendleft(t)

    def _drop_pool(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def _interrupt(self) -> None:
        if self._pool is None:
            return
        # NOTE: a worker may be deep in a long point; Ctrl-C reaches it (same process group)
        # only from a terminal, so the workers are ended here. Python >= 3.14 has
        # ProcessPoolExecutor.terminate_workers(); before it, the pool's process table.
        terminate = getattr(self._pool, "terminate_workers", None)
        if terminate is not None:
            terminate()
        else:
            for process in list(getattr(self._pool, "_processes", {}).values()):
                process.terminate()
        self._drop_pool()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
